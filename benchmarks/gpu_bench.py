"""One-GPU throughput check: MFU of gpt2-124m, and the float8 speedup and loss gap on gpt2-774m.

Sections, in this order (each timed on its own; a failing one is reported and the next still runs;
estimated seconds on one H200 in ``ESTIMATES``, mostly compile; with ``LDT_GPU_DEADLINE`` set (gpu.sh)
a section that no longer fits is skipped and named under ``skipped``):

1. ``mfu``: gpt2-124m, seq 1024, bf16 autocast, per-block ``torch.compile``, fused AdamW,
   synthetic tokens. Step time = wall time of ``--steps`` steps after ``--warmup`` steps, with
   the GPU drained before and after; MFU = ``flops_per_token(1024)`` x tokens/s / the dense bf16
   peak of the device (``lightning_disttrain.peak_flops``).
1b. ``mfu_loss``: the same, with ``GPTModule``'s loss (``fp32_cross_entropy``) eager and then
   compiled (``GPTModule.compile_loss``, which the strategies call when they compile): speedup,
   peak memory and per-step loss gap of the compiled loss (``mfu_loss`` in the JSON).
2. ``mfu_lightning``: the same model through ``Trainer`` + ``GPTModule`` + ``MFUMonitor``: what the
   callback reports, to compare with (1) (Lightning's loop, logging and the callback's per-step
   sync cost a little).
3. ``fp8``: gpt2-774m, same shape and compile, bf16, then Float8Training's swap with the
   tensorwise and the rowwise recipe; speedup = ratio of tokens/s. All runs start from the same
   weights (seed 0) and train on the same batch, so their per-step losses (``losses``: warm-up and
   timed steps) compare step by step: ``fp8`` in the JSON holds the max / mean absolute gap per
   recipe. MFU of every run is given against the *bf16* peak so the rows compare; against the fp8
   peak the float8 runs' MFU would be about half.
4. ``fp8_wide``: the same comparison on four
   blocks of Llama-3-8B's width (``WIDE``: d 4096, 32 heads / 8 KV heads, SwiGLU 14336, RMSNorm,
   RoPE, no biases, untied head; GPT-2's vocabulary), seq 1024: float8's gain depends on the matmul
   sizes, and at gpt2-774m's width (1280) the casts cost about what the fp8 matmuls save.

Prints a compact table; with ``$OUT`` set (or ``--out``) writes ``gpu_bench.json`` there after every
section, so a timeout still leaves what was measured.

    python benchmarks/gpu_bench.py            # on a GPU (see gpu.sh)
    python benchmarks/gpu_bench.py --smoke    # CPU, tiny shapes: exercises every code path
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback
from typing import Any

import torch
import torch.nn.functional as F

from lightning_disttrain.peak_flops import chip_of, measure_cpu_peak_flops
from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.module import fp32_cross_entropy
from lightning_disttrain.parallel.compile import apply_compile
from lightning_disttrain.parallel.float8 import Float8Options, convert_to_float8

try:  # run as a script (benchmarks/ on sys.path) or as benchmarks.gpu_bench
    from gpu_report import deadline_from_env
except ImportError:
    from benchmarks.gpu_report import deadline_from_env

ESTIMATES = {"mfu": 60, "mfu_loss": 30, "mfu_lightning": 40, "fp8": 50, "fp8_wide": 40}

WIDE = dict(n_layer=4, n_embd=4096, n_head=32, n_kv_head=8, mlp="swiglu", mlp_hidden=14336, norm="rmsnorm",
            pos_emb="rope", bias=False, tie_embeddings=False)
"""``fp8_wide``'s model: four blocks of Llama-3-8B's shapes (GPTConfig overrides of gpt2-124m)."""
WIDE_SMOKE = dict(n_layer=2, n_embd=128, n_head=4, n_kv_head=2, mlp="swiglu", mlp_hidden=256, norm="rmsnorm",
                  pos_emb="rope", bias=False, tie_embeddings=False)
"""Section -> estimated seconds on one H200 (fp8: per run; it runs bf16, then each recipe). Mostly
compile: the timed steps take a few seconds. A section that no longer fits the budget is skipped."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_peak(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        chip = chip_of(name)
        if chip is None:
            raise SystemExit(f"{name!r} is not in the peak table; add it to lightning_disttrain/peak_flops.py")
        return chip.bf16, f"{chip.chip} bf16 dense (table)"
    return measure_cpu_peak_flops(), "CPU fp32 matmul (measured)"


def train_loop(preset: str, *, device: torch.device, batch: int, seq: int, warmup: int, steps: int,
               float8: str | None, compile: bool, vocab: int | None, peak: float,
               model_overrides: dict[str, Any] | None = None, label: str | None = None,
               loss: str = "plain") -> dict[str, Any]:
    """Build, optionally swap to float8 (``float8``: the recipe, "tensorwise" or "rowwise") and
    compile, then time ``steps`` training steps. Same seed, so the same initial weights and the
    same batch for every run: the per-step losses of two runs compare step by step.

    ``loss``: ``"plain"`` (``F.cross_entropy`` of the fp32 logits, as this benchmark always ran),
    ``"eager"`` (``GPTModule``'s ``fp32_cross_entropy``: the padding columns cut, then fp32) or
    ``"compiled"`` (the same, ``torch.compile``d as ``GPTModule.compile_loss`` does)."""
    torch.manual_seed(0)
    overrides = {"block_size": seq} | ({"vocab_size": vocab} if vocab else {}) | (model_overrides or {})
    cfg = GPTConfig.from_name(preset, **overrides)
    with torch.device(device):
        model = GPT(cfg)
    n_fp8 = len(convert_to_float8(model, Float8Options(recipe=float8), device=device)) if float8 else 0
    if compile:
        apply_compile(model.blocks, dynamic=False)  # stage order: dtype, then compile
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    data_rng = torch.Generator(device).manual_seed(1)  # the data does not depend on what the swap drew
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device, generator=data_rng)
    inputs, targets = x[:, :-1], x[:, 1:]
    use_autocast = device.type == "cuda"

    # Each loss gets the only reference to the logits and rebinds it, so that the 16-bit logits are
    # freed once the fp32 copy exists, as in GPTModule.loss_fn (runs up to 2026-12-04's run 7 held
    # them in step() through the loss: 2 B per logit more at the forward's end).
    if loss == "plain":
        def loss_of(logits):
            logits = logits.float()
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    elif loss == "eager":
        def loss_of(logits):
            logits = logits[..., :cfg.vocab_size].float()  # fp32_cross_entropy's body, inline
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    elif loss == "compiled":
        ce = torch.compile(fp32_cross_entropy, dynamic=False)

        def loss_of(logits):
            return ce(logits, targets, cfg.vocab_size)
    else:
        raise ValueError(f"loss={loss!r}: use 'plain', 'eager' or 'compiled'")

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            out = [model(inputs)]
        value = loss_of(out.pop())
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return value

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses = []  # detached device tensors: read after the timing, no sync per step
    t0 = time.perf_counter()
    losses.append(step().detach())  # compiles
    _sync(device)
    compile_s = time.perf_counter() - t0
    for _ in range(max(warmup - 1, 0)):
        losses.append(step().detach())
    _sync(device)
    graphs = _compiled_graphs()
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(step().detach())
    _sync(device)
    step_s = (time.perf_counter() - t0) / steps
    recompiles = _compiled_graphs() - graphs  # should be 0: a recompile inside the timing is slow
    tokens_per_s = batch * seq / step_s
    tflops = model.flops_per_token(seq) * tokens_per_s / 1e12
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    precision = "bf16" if use_autocast else "fp32"
    if float8:
        precision = f"fp8 {float8}{'' if device.type == 'cuda' else ' (emul.)'}"
    if loss != "plain":
        precision += f", {loss} loss"
    return {"model": label or preset, "precision": precision, "batch": batch, "seq": seq, "recompiles_timed": recompiles,
            "float8_linears": n_fp8, "step_ms": 1e3 * step_s, "tokens_per_s": tokens_per_s,
            "tflops": tflops, "mfu_bf16_peak": tflops * 1e12 / peak, "peak_mem_gib": mem,
            "first_step_s": compile_s, "losses": [float(v) for v in losses], "final_loss": float(losses[-1]),
            "compiled": compile}


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def with_oom_retry(loop, batch: int, **kwargs) -> dict[str, Any]:
    """Run ``loop``; on CUDA OOM halve the batch once (the table then shows the batch used)."""
    try:
        return loop(batch=batch, **kwargs)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return loop(batch=batch // 2, **kwargs)


def lightning_mfu(preset: str, *, device: torch.device, batch: int, seq: int, warmup: int, steps: int,
                  compile: bool, vocab: int | None) -> dict[str, Any]:
    """MFUMonitor's view of the same run, through the Trainer."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_disttrain.callbacks import MFUMonitor
    from lightning_disttrain.module import GPTModule

    class CompileBlocks(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            if compile:  # as the strategies' compile option does: the blocks, then the loss
                apply_compile(pl_module.model.blocks, dynamic=False)
                pl_module.compile_loss(dynamic=False)

    torch.manual_seed(0)
    overrides = {"block_size": seq}
    module = GPTModule(preset, vocab_size=vocab, model_overrides=overrides, warmup_steps=0)
    n = batch * (warmup + steps)
    tokens = torch.randint(0, module.config.vocab_size, (n, seq + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch, pin_memory=device.type == "cuda")
    # One read of the clock, after the last step: no wait for the GPU inside the timed steps, as in train_loop.
    monitor = MFUMonitor(window=steps, warmup_steps=warmup, log_every_n_steps=warmup + steps, warn_below=0.0)
    trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_steps=warmup + steps,
                         precision="bf16-mixed" if device.type == "cuda" else "32-true", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[CompileBlocks(), monitor])
    trainer.fit(module, train_dataloaders=loader)
    m = monitor.metrics
    return {"model": preset, "precision": f"{trainer.precision} (Trainer)", "batch": batch, "seq": seq,
            "step_ms": 1e3 * m["perf/step_time_s"], "tokens_per_s": m["perf/tokens_per_sec"],
            "tflops": m["perf/tflops_per_device"], "mfu_bf16_peak": m.get("perf/mfu", float("nan")),
            "data_wait_frac": m["perf/data_wait_frac"], "peak_source": monitor.peak_source,
            "peak_mem_gib": m.get("perf/peak_mem_gib", float("nan"))}


def fp8_comparison(runs: dict[str | None, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """Per float8 recipe against the bf16 run (key None): speedup and the per-step loss gap."""
    base, out = runs.get(None), {}
    for recipe, r in runs.items():
        if recipe is None or r is None or base is None:
            continue
        gaps = [abs(f - b) for f, b in zip(r["losses"], base["losses"])]
        out[recipe] = {"baseline": base["precision"], "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                       "same_batch": r["batch"] == base["batch"], "steps": len(gaps),
                       "max_abs_loss_gap": max(gaps), "mean_abs_loss_gap": sum(gaps) / len(gaps),
                       "max_rel_loss_gap": max(g / b for g, b in zip(gaps, base["losses"])),
                       "final_loss_gap": r["losses"][-1] - base["losses"][-1]}
    return out


def _row(r: dict[str, Any]) -> str:
    return (f"{r['section']:<14} {r['model']:<11} {r['precision']:<23} {r['batch']:>3}x{r['seq']:<5} "
            f"{r['step_ms']:>9.1f} {r['tokens_per_s']:>12,.0f} {r['tflops']:>8.1f} {100 * r['mfu_bf16_peak']:>7.1f} "
            f"{r['peak_mem_gib']:>8.1f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, few steps: checks the code paths")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_bench.json (default $OUT)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--sections", nargs="+", default=list(ESTIMATES))
    p.add_argument("--fp8-recipes", nargs="+", default=["tensorwise", "rowwise"], choices=["tensorwise", "rowwise"])
    p.add_argument("--reserve", type=float, default=0.0,
                   help="seconds of the LDT_GPU_DEADLINE budget to leave for what runs after this script")
    args = p.parse_args(argv)
    deadline = deadline_from_env()
    deadline = None if deadline is None else deadline - args.reserve

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device; run with --smoke to check the code paths on CPU")
    torch.set_float32_matmul_precision("high")
    if args.smoke:  # the two model slots at CPU size; vocab of the byte tokenizer
        small, large, vocab, seq = "tiny", "tiny", 257, 64
        shape = dict(seq=seq, warmup=2, steps=2)
        batches = {"mfu": 2, "fp8": 2}
    else:
        small, large, vocab, seq = "gpt2-124m", "gpt2-774m", None, 1024
        shape = dict(seq=seq, warmup=10, steps=30)
        batches = {"mfu": 16, "fp8": 16}
    compile = not args.no_compile
    peak, peak_source = bf16_peak(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": name,
                              "torch": torch.__version__, "peak_flops": peak, "peak_source": peak_source,
                              "smoke": args.smoke, "results": [], "errors": {}, "skipped": {}}
    print(f"# gpu_bench {report['date']}  device {name}  torch {torch.__version__}  "
          f"peak {peak / 1e12:.4g} TFLOP/s ({peak_source})  compile {compile}")

    def write() -> None:  # after every section, and once the comparisons are in
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
                json.dump(report, f, indent=1)

    def run(section: str, fn, **kwargs) -> dict[str, Any] | None:
        left = None if deadline is None else deadline - time.time()
        if left is not None and left < ESTIMATES[section]:  # skipped and said so, rather than killed mid-way
            report["skipped"].setdefault(section, []).append(f"{left:.0f} s left, estimate {ESTIMATES[section]} s")
            print(f"# {section}: SKIPPED (time budget: {left:.0f} s left, estimate {ESTIMATES[section]} s)")
            return None
        t0 = time.perf_counter()
        torch._dynamo.reset()  # each section compiles its own graphs, static shapes
        try:
            r = fn(**kwargs)
        except Exception as e:  # report and go on: one broken section must not hide the others
            report["errors"][section] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
            print(f"# {section}: FAILED {type(e).__name__}: {str(e)[:300]}")
            r = None
        else:
            r["section"], r["wall_s"] = section, time.perf_counter() - t0
            report["results"].append(r)
        write()
        return r

    common = dict(device=device, compile=compile, vocab=vocab, peak=peak)
    if "mfu" in args.sections:
        run("mfu", with_oom_retry, loop=train_loop, preset=small, batch=batches["mfu"], float8=None, **shape, **common)
    if "mfu_loss" in args.sections:
        runs = {name: run("mfu_loss", with_oom_retry, loop=train_loop, preset=small, batch=batches["mfu"], float8=None,
                          loss=name, **shape, **common) for name in ("eager", "compiled")}
        report["mfu_loss"] = fp8_comparison({None: runs["eager"], "compiled": runs["compiled"]})
    if "mfu_lightning" in args.sections:
        run("mfu_lightning", lightning_mfu, preset=small, batch=batches["mfu"], device=device, compile=compile,
            vocab=vocab, **shape)
    if "fp8" in args.sections:
        fp8_shape = dict(shape, warmup=min(shape["warmup"], 8), steps=min(shape["steps"], 20))
        fp8 = {recipe: run("fp8", with_oom_retry, loop=train_loop, preset=large, batch=batches["fp8"],
                           float8=recipe, **fp8_shape, **common) for recipe in [None, *args.fp8_recipes]}
        report["fp8"] = fp8_comparison(fp8)
    if "fp8_wide" in args.sections:
        wide_shape = dict(shape, warmup=min(shape["warmup"], 5), steps=min(shape["steps"], 15))
        wide = dict(preset=small, model_overrides=WIDE_SMOKE if args.smoke else WIDE, label="8b-width x4")
        runs = {recipe: run("fp8_wide", with_oom_retry, loop=train_loop, batch=batches["fp8"], float8=recipe,
                            **wide, **wide_shape, **common) for recipe in [None, *args.fp8_recipes]}
        report["fp8_wide"] = fp8_comparison(runs)
    write()

    header = (f"{'section':<14} {'model':<11} {'precision':<23} {'shape':>9} {'step ms':>9} {'tokens/s':>12} "
              f"{'TFLOP/s':>8} {'MFU %':>7} {'mem GiB':>8}")
    print(header)
    print("-" * len(header))
    for r in report["results"]:
        print(_row(r))
    for key, model in (("mfu_loss", small), ("fp8", large), ("fp8_wide", "8b-width x4")):
        for recipe, c in report.get(key, {}).items():
            print(f"# {key} {recipe} vs {c['baseline']} ({model}): speedup {c['speedup']:.3f}x (tokens/s); "
                  f"loss gap over {c['steps']} steps: max {c['max_abs_loss_gap']:.4f}, mean {c['mean_abs_loss_gap']:.4f}, "
                  f"max relative {100 * c['max_rel_loss_gap']:.2f}%")
    print(f"# MFU % against the {peak_source} peak for every row (fp8 rows too, so rows compare); "
          f"first-step (compile) s: " + ", ".join(f"{r['section']}/{r['precision']}: {r.get('first_step_s', 0):.0f}"
                                                 for r in report["results"] if "first_step_s" in r))
    if report["errors"]:
        print(f"# errors in: {', '.join(report['errors'])}")
    return report


if __name__ == "__main__":
    raise SystemExit(1 if main()["errors"] else 0)  # the sections' errors are in the report and printed
