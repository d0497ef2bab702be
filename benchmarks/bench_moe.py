"""Mixture of experts: quality and speed against a dense GPT of equal active parameters, load
balance with and without the balancing bias, and the share of the step spent in expert-parallel
all-to-all (docs/benchmarks.md, section "Mixture of experts").

    python benchmarks/bench_moe.py quality [--steps 300]   # one process, the three models in lockstep
    python benchmarks/bench_moe.py a2a                     # 2 ranks (ep=2) and 4 ranks (ep=2, ep=4)

``quality``: the embedded corpus (the standard library's sources) as bytes, windows of 128, batch
16; three 4-block models trained side by side, one step each in turn, same data and seed:
``dense`` (SwiGLU MLP of width 512), ``moe`` (8 experts of width 256, top-2: the same active FFN
parameters, plus an 8-wide router; DeepSeek-V3 bias balancing at speed 1e-3) and ``moe_nobias``
(speed 0). Reports the held-out loss at the end, tokens/s from each model's step times (median
and spread) and the max/mean expert load per layer along training.

``a2a``: ``tiny-moe`` (8 experts) under ``NDParallelStrategy(ep=E)``; steps 4-9 profiled with
``torch.profiler``; the all-to-all time is the self CPU time of the functional all-to-all ops
and of their waits (gradient clipping off, so no other functional collective runs), against the
wall time of the profiled steps.

``quality --record FILE`` writes the quality run as ``cpu_figures.py`` reads it (``record``);
``--plot DIR`` draws ``cpu-moe`` from that record.
"""

from __future__ import annotations

import json
import statistics
import time

from bench_common import OUT_ROOT, WORLD, launch, parser, random_tokens, report, trainer
from record import add_record_options, provenance, record_path, wants_record, write_record

OUT = OUT_ROOT / "moe"
SEQ, BATCH = 128, 16
BIAS_SPEED = 1e-3
"""``moe``'s balancing bias update speed."""


def corpus(split: str, max_docs: int):
    import torch

    from lightning_disttrain.data.embedded import embedded_documents

    text = "\n".join(embedded_documents(split, max_docs=max_docs))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def batches(tokens, n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        start = torch.randint(0, tokens.numel() - SEQ - 1, (BATCH,), generator=g)
        window = torch.stack([tokens[s:s + SEQ + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def quality(steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from lightning_disttrain.models.gpt import GPT, GPTConfig
    from lightning_disttrain.models.moe import moe_layers, update_moe_biases

    torch.set_num_threads(1)
    base = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=128, block_size=SEQ, mlp="swiglu", dropout=0.0)
    configs = {
        "dense": GPTConfig(**base, mlp_hidden=512),
        "moe": GPTConfig(**base, mlp_hidden=512, moe_num_experts=8, moe_top_k=2, moe_hidden=256,
                         moe_bias_update_speed=BIAS_SPEED),
        "moe_nobias": GPTConfig(**base, mlp_hidden=512, moe_num_experts=8, moe_top_k=2, moe_hidden=256,
                                moe_bias_update_speed=0.0),
    }
    models, opts = {}, {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        models[name] = GPT(cfg)
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=3e-3, weight_decay=0.1)
    train, val = corpus("train", 400), corpus("val", 100)
    times = {name: [] for name in models}
    load = {name: [] for name in models if name != "dense"}
    for step, (x, y) in enumerate(batches(train, steps, seed=0)):
        for name, model in models.items():
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            aux = model.moe_aux_loss
            (loss + aux if aux is not None else loss).backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            layers = moe_layers(model)
            update_moe_biases(layers.values())
            times[name].append(time.perf_counter() - t0)
            if name in load and (step % 25 == 0 or step == steps - 1):
                load[name].append({"step": step, "max_mean": [round(float(m.step_load.max() / m.step_load.mean()), 3)
                                                              for m in layers.values()]})
    val_loss = {}
    with torch.no_grad():
        for name, model in models.items():
            model.eval()
            losses = [float(F.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in batches(val, 20, seed=1)]
            val_loss[name] = statistics.mean(losses)
    report = {"steps": steps, "tokens_per_step": BATCH * SEQ, "val_loss": val_loss, "load": load,
              "params": {n: {"total": m.num_params(), "active": m.num_params(active=True)} for n, m in models.items()},
              "tok_per_s": {}}
    for name, ts in times.items():
        rates = [BATCH * SEQ / t for t in ts[10:]]
        qs = statistics.quantiles(rates, n=10)
        report["tok_per_s"][name] = {"median": round(statistics.median(rates)), "p10": round(qs[0]), "p90": round(qs[-1])}
    return report


def record(result: dict) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-moe`` from: ``quality``'s report per model (parameters,
    held-out loss, tokens/s median, p10, p90 and the median over dense's) and the max/mean expert
    load per block at each recorded step, with and without the bias."""
    names = {"dense": "dense", "moe": f"moe (bias {BIAS_SPEED:.0e})".replace("e-0", "e-"), "moe_nobias": "moe_nobias"}
    dense = result["tok_per_s"]["dense"]["median"]
    models = [{"model": names[n], "params": result["params"][n]["total"], "active_params": result["params"][n]["active"],
               "val_loss": result["val_loss"][n], "tok_per_s_median": t["median"], "tok_per_s_p10": t["p10"],
               "tok_per_s_p90": t["p90"], "vs_dense": t["median"] / dense} for n, t in result["tok_per_s"].items()]
    with_bias, without = result["load"]["moe"], result["load"]["moe_nobias"]
    return provenance("bench_moe_quality", "bench_moe.py", "one thread (the quality run is one process)") | {
        "setting": f"embedded corpus as bytes, windows of {SEQ}, batch {BATCH} ({result['tokens_per_step']:,} tokens per "
                   f"step), AdamW lr 3e-3, {result['steps']} steps, fp32, seed 0, plain training loop; 4-block GPTs, "
                   f"n_embd 128, 4 heads, SwiGLU: dense (MLP width 512), moe (8 experts of width 256, top-2, bias "
                   f"balancing at speed {BIAS_SPEED:g}), moe_nobias (speed 0)",
        "steps": result["steps"], "models": models, "experts": 8, "blocks": len(with_bias[0]["max_mean"]),
        "load_rows": [{"step": a["step"], "with_bias": a["max_mean"], "without_bias": b["max_mean"]}
                      for a, b in zip(with_bias, without, strict=True)]}


def a2a_worker(ep: int) -> None:
    import lightning as L
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.data import DataLoader

    from lightning_disttrain.module import GPTModule
    from lightning_disttrain.strategies import NDParallelStrategy

    ds = random_tokens(4 * 12 * WORLD, SEQ, 256)
    first, last = 4, 10
    marks, prof_box = {}, {}

    class Profile(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == first:
                prof_box["p"] = profile(activities=[ProfilerActivity.CPU])
                prof_box["p"].__enter__()
                marks["start"] = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == last - 1:
                marks["end"] = time.perf_counter()
                prof_box["p"].__exit__(None, None, None)

    class Module(GPTModule):
        def train_dataloader(self):
            return DataLoader(ds, batch_size=4, shuffle=False,
                              sampler=torch.utils.data.DistributedSampler(ds, shuffle=False))

    L.seed_everything(0)
    module = Module("tiny-moe", vocab_size=256, model_overrides={"moe_num_experts": 8}, lr=3e-3, warmup_steps=0)
    # no clipping: no functional collective runs but the all-to-alls
    trainer(NDParallelStrategy(ep=ep), last, [Profile()], gradient_clip_val=None).fit(module)
    events = prof_box["p"].key_averages()
    a2a = sum(e.self_cpu_time_total for e in events if "all_to_all" in e.key) / 1e6
    wait = sum(e.self_cpu_time_total for e in events if "wait_tensor" in e.key) / 1e6
    gloo = {e.key: round(e.self_cpu_time_total / 1e6, 4) for e in events if "gloo" in e.key.lower()}
    wall = marks["end"] - marks["start"]
    result = {"ep": ep, "world": WORLD, "steps": last - first, "wall_s": wall, "a2a_launch_s": a2a,
              "a2a_wait_s": wait, "share": (a2a + wait) / wall, "gloo_events": gloo}
    rank = torch.distributed.get_rank()
    (OUT / f"moe_a2a_w{WORLD}_ep{ep}_rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    p = parser(__doc__, steps=(300, "quality: training steps"))
    p.add_argument("what", choices=["quality", "a2a", "a2a-worker"])
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--nprocs", type=int, default=1)
    add_record_options(p, "cpu-moe (quality)")
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.what == "quality":
        result = quality(args.steps)
        report("moe_quality", result, json.dumps(result, indent=1), out=OUT / "moe_quality.json", indent=1)
        if wants_record(args):
            write_record(record(result), record_path(args, OUT / "bench_moe_quality.json"), args.plot, args.format)
    elif args.what == "a2a-worker":
        a2a_worker(args.ep)
    else:
        for world, ep in ((2, 2), (4, 2), (4, 4)):
            launch(__file__, OUT, world, f"moe_w{world}_ep{ep}", ["a2a-worker", "--ep", str(ep)])
            ranks = [json.loads((OUT / f"moe_a2a_w{world}_ep{ep}_rank{r}.json").read_text()) for r in range(world)]
            shares = [r["share"] for r in ranks]
            print(f"world {world} ep={ep}: all-to-all share of step time per rank "
                  f"{[round(s, 3) for s in shares]} (wall {ranks[0]['wall_s']:.2f} s for {ranks[0]['steps']} steps; "
                  f"launch {ranks[0]['a2a_launch_s']:.3f} s + wait {ranks[0]['a2a_wait_s']:.3f} s on rank 0)", flush=True)


if __name__ == "__main__":
    main()
