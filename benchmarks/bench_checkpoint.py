"""Async vs sync checkpointing: how long a save stalls training, on 2 ranks through L.Trainer.

    python benchmarks/bench_checkpoint.py                      # both modes, small GPT, 2 CPU ranks
    python benchmarks/bench_checkpoint.py --config tiny --steps 8

Each mode is a fresh 2-rank run (Lightning's launcher) of the ``small`` GPT preset with GPT-2's
vocabulary (~30M parameters; model + AdamW state ~360 MB per checkpoint) under the project's
strategy (NDParallelStrategy when it carries DCPCheckpointMixin, else a stand-in built from
Lightning's ModelParallelStrategy + the mixin + FSDP2). A callback calls
``trainer.save_checkpoint`` every ``--every`` steps and times:

- ``blocked``: how long ``save_checkpoint`` kept the training loop waiting;
- ``step``: the median of ordinary training steps, and the steps right after a save (an async
  write competes for the same CPU cores);
- ``complete``: save start until its manifest exists (async: finished in the background).

The stall ratio is async ``blocked`` / sync ``blocked``. ``--record FILE`` writes both modes' numbers
as ``cpu_figures.py`` reads them (``record``); ``--plot DIR`` draws ``cpu-checkpoint-stall`` from it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import child_env, parser, random_tokens, report
from record import add_record_options, provenance, record_path, wants_record, write_record


def _strategy(async_save: bool):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_disttrain.strategies.checkpointing import DCPCheckpointMixin

    try:
        from lightning_disttrain.strategies.nd_parallel import NDParallelStrategy

        if issubclass(NDParallelStrategy, DCPCheckpointMixin):
            return NDParallelStrategy(async_save=async_save), False
    except ImportError:
        pass

    class StandIn(DCPCheckpointMixin, ModelParallelStrategy):
        def __init__(self) -> None:
            super().__init__(data_parallel_size=1, tensor_parallel_size=1)
            self.async_save = async_save

        def setup_environment(self) -> None:
            self._data_parallel_size = self.num_processes * self.num_nodes
            super().setup_environment()

    return StandIn(), True


def run_one(args) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_disttrain.checkpoint import MANIFEST_NAME
    from lightning_disttrain.module import GPTModule

    torch.set_num_threads(1)
    strategy, shard_in_module = _strategy(args.mode == "async")

    class Module(GPTModule):
        def configure_model(self) -> None:
            super().configure_model()
            if shard_in_module:
                from torch.distributed.fsdp import FSDPModule, fully_shard

                if not isinstance(self.model, FSDPModule):
                    mesh = self.device_mesh["data_parallel"]
                    for block in self.model.blocks:
                        fully_shard(block, mesh=mesh)
                    fully_shard(self.model, mesh=mesh)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.t_start = 0.0
            self.steps: list[tuple[int, float]] = []
            self.saves: list[dict] = []

        def on_train_batch_start(self, trainer, *_) -> None:
            self.t_start = time.perf_counter()

        def on_train_batch_end(self, trainer, *_) -> None:
            step = trainer.global_step
            self.steps.append((step, time.perf_counter() - self.t_start))
            for s in self.saves:  # note completion times of async saves as they show up
                if s["complete"] is None and (Path(s["path"]) / MANIFEST_NAME).exists():
                    s["complete"] = time.perf_counter() - s["t0"]
            if step % args.every == 0:
                path = Path(args.dir) / f"step={step:04d}.ckpt"
                t0 = time.perf_counter()
                trainer.save_checkpoint(path)
                blocked = time.perf_counter() - t0
                done = (path / MANIFEST_NAME).exists()
                self.saves.append({"step": step, "path": str(path), "t0": t0, "blocked": blocked,
                                   "complete": blocked if done else None})

        def on_train_end(self, trainer, *_) -> None:
            trainer.strategy.wait_for_checkpoint()
            for s in self.saves:
                if s["complete"] is None:
                    s["complete"] = time.perf_counter() - s["t0"]

    data = DataLoader(random_tokens(256, args.seq_len, args.vocab), batch_size=args.batch)
    timer = Timer()
    trainer = L.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=args.steps,
                        callbacks=[timer], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = Module(config=args.config, vocab_size=args.vocab, schedule="constant")
    t0 = time.perf_counter()
    trainer.fit(module, data)
    total = time.perf_counter() - t0
    if trainer.is_global_zero:
        size = sum(f.stat().st_size for f in Path(timer.saves[0]["path"]).rglob("*") if f.is_file())
        Path(args.json).write_text(json.dumps({
            "mode": args.mode, "strategy": type(strategy).__name__, "steps": timer.steps, "saves": timer.saves,
            "total": total, "ckpt_bytes": size}))


def mode_numbers(r: dict) -> dict:
    """One mode's run (``run_one``'s JSON) as the table prints it: the median ordinary step (after
    step 2, not a save's step or the one after it), the median step after a save, each save's
    blocking time and their median, the median save start to complete, the fit's total (s)."""
    saved = {s["step"] for s in r["saves"]}
    plain = [t for step, t in r["steps"] if step > 2 and step not in saved and step - 1 not in saved]
    after = [t for step, t in r["steps"] if step - 1 in saved]
    blocked = [s["blocked"] for s in r["saves"]]
    return {"step_s": statistics.median(plain), "step_after_save_s": statistics.median(after),
            "blocked_median_s": statistics.median(blocked), "blocked_s": blocked,
            "complete_after_s": statistics.median(s["complete"] for s in r["saves"]), "fit_total_s": r["total"]}


def summarize(results: dict[str, dict], every: int) -> str:
    lines = []
    for mode, r in results.items():
        n = mode_numbers(r)
        lines.append(
            f"{mode:5s}  step {n['step_s']:6.3f}s  step after save {n['step_after_save_s']:6.3f}s  "
            f"save blocks {n['blocked_median_s']:6.3f}s (each: {', '.join(f'{b:.3f}' for b in n['blocked_s'])})  "
            f"complete after {n['complete_after_s']:6.3f}s  fit total {r['total']:6.1f}s")
    first = next(iter(results.values()))
    head = (f"checkpoint {first['ckpt_bytes'] / 2**20:.0f} MiB per save, every {every} steps, "
            f"strategy {first['strategy']}")
    out = [head, *lines]
    if {"sync", "async"} <= results.keys():
        s, a = (mode_numbers(results[m])["blocked_median_s"] for m in ("sync", "async"))
        out.append(f"stall ratio (async blocked / sync blocked): {a / s:.3f}  ({s / a:.1f}x less blocking)")
    return "\n".join(out)


def record(results: dict[str, dict], args) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-checkpoint-stall`` from: per mode (sync, async) the
    numbers of ``mode_numbers``, the checkpoint's size, and the stall ratio (async blocked / sync
    blocked, medians) and its inverse as printed. ``results``: mode -> ``run_one``'s JSON."""
    first = results["sync"]
    mib = first["ckpt_bytes"] / 2**20
    modes = [{"mode": m} | mode_numbers(results[m]) for m in ("sync", "async")]
    ratio = modes[1]["blocked_median_s"] / modes[0]["blocked_median_s"]
    return provenance("bench_checkpoint", "bench_checkpoint.py", "2 ranks (Lightning's launcher)") | {
        "setting": f"{args.config} GPT, vocabulary {args.vocab}, seq {args.seq_len}, batch {args.batch}, a checkpoint "
                   f"of {mib:.0f} MiB per save (model + AdamW state) every {args.every} steps, {args.steps} steps, "
                   f"strategy {first['strategy']}",
        "ckpt_mib": round(mib), "every": args.every, "strategy": first["strategy"], "modes": modes,
        "stall_ratio": ratio, "less_blocking": round(1 / ratio, 1)}  # as the summary prints it


def main() -> None:
    p = parser(__doc__, full_doc=True, steps=12)
    p.add_argument("--mode", choices=("both", "sync", "async"), default="both")
    p.add_argument("--config", default="small")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--json", default=None, help="one mode: where its results go; both: the results of both "
                   "(default: benchmarks/out/checkpoint.json)")
    add_record_options(p, "cpu-checkpoint-stall")
    args = p.parse_args()
    if args.mode != "both":
        run_one(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async"):
            out = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, __file__, "--mode", mode, "--config", args.config, "--vocab", str(args.vocab),
                   "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--steps", str(args.steps),
                   "--every", str(args.every), "--dir", str(Path(args.dir or tmp) / mode), "--json", str(out)]
            subprocess.run(cmd, env=child_env(), check=True, stdout=subprocess.DEVNULL)
            results[mode] = json.loads(out.read_text())
    text = summarize(results, args.every)
    report("checkpoint", results, text, out=args.json)
    if wants_record(args):
        write_record(record(results, args), record_path(args, "bench_checkpoint.json"), args.plot, args.format)


if __name__ == "__main__":
    main()
