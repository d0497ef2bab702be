"""Peak memory per rank while setting a GPT up under ``fsdp2`` on 2 CPU ranks (issue 38): from just
before ``configure_model`` to just after ``strategy.setup`` (build, shard, materialise; no step).

    python benchmarks/bench_setup_memory.py [--preset gpt2-1558m] [--empty-init auto|true|false]

Two meters over the same window (``tests/strategies/setup_memory_worker.SetupMemory``), in bytes
above the level when it opened:
- ``tensor_peak``: the most bytes of tensor storages alive at once (``LiveTensorBytes``: every
  storage an aten op creates, until it dies);
- ``malloc_peak``: the most bytes glibc's malloc had handed out at once, every thread
  (``memcount.so``, preloaded; ``memory_meter.ProcessMeter``), and the kernel's ``VmHWM`` (RSS).
Against ``bound`` = 1.1 x (half the model's fp32 bytes + its largest parameter), what
``tests/strategies/test_setup_memory.py`` asserts on a small model. ``--empty-init false`` is the
build before issue 38 (every rank builds the whole model, then shards it).

The parent process only builds ``memcount.so`` and restarts itself with it preloaded; Lightning's
launcher then starts rank 1 with the same environment. Needs a C compiler (cc) and, for
gpt2-1558m, ~4 GB per rank (``--empty-init false``: ~10 GB per rank).

``--record FILE`` writes this run's case as ``cpu_figures.py`` reads it (``record``; ``--append``
adds it to the cases in FILE: section 22's figure is two runs); ``--plot DIR`` draws
``cpu-setup-memory`` from that record.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "tests" / "strategies")]
MIB = 2**20

from record import add_record_options, provenance, record_path, wants_record, write_record  # noqa: E402


def child(args) -> None:
    import lightning as L
    import torch

    import setup_memory_worker as worker
    from lightning_disttrain import comm
    from lightning_disttrain.module import GPTModule
    from lightning_disttrain.strategies import FSDP2Strategy
    from memory_meter import ProcessMeter

    empty_init = {"auto": None, "true": True, "false": False}[args.empty_init]
    L.seed_everything(0)
    module = GPTModule(args.preset, vocab_size=50257, schedule="constant", max_steps=1)
    meter = ProcessMeter()
    trainer, probe = worker.setup_only(module, FSDP2Strategy(empty_init=empty_init), devices=2, meter=meter)
    facts = worker.model_facts(module)
    row = {"rank": trainer.global_rank, "tensor_peak": probe.tracker.peak, "tensor_after": probe.tracker.now,
           "malloc_peak": meter.peaks["setup"], "rss_peak": meter.rss_peaks["setup"],
           "model_bytes": facts["model_bytes"], "largest_param_bytes": facts["largest_param_bytes"],
           "steps": trainer.strategy.parallelized_steps}
    rows = comm.all_gather_object(row)
    if trainer.global_rank == 0:
        bound = 1.1 * (facts["model_bytes"] / 2 + facts["largest_param_bytes"])
        print(f"\n{args.preset} under fsdp2 on 2 CPU ranks, empty_init={args.empty_init}: model "
              f"{facts['model_bytes'] / MIB:.0f} MiB fp32, largest parameter {facts['largest_param_bytes'] / MIB:.0f} "
              f"MiB, bound 1.1 x (model/2 + largest) = {bound / MIB:.0f} MiB")
        for r in rows:
            print(f"  rank {r['rank']}: tensors peak {r['tensor_peak'] / MIB:.0f} MiB (held after setup "
                  f"{r['tensor_after'] / MIB:.0f}), malloc peak {r['malloc_peak'] / MIB:.0f} MiB, RSS peak "
                  f"{r['rss_peak'] / MIB:.0f} MiB")
        if args.json:
            Path(args.json).write_text(json.dumps({"preset": args.preset, "empty_init": args.empty_init,
                                                   "bound": bound, "ranks": rows}, indent=1))
        if wants_record(args):
            write_record(record(args.preset, args.empty_init, facts, rows),
                         record_path(args, "bench_setup_memory.json"), args.plot, args.format,
                         append="cases" if args.append else None)
    torch.distributed.barrier()


def record(preset: str, empty_init: str, facts: dict, rows: list[dict]) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-setup-memory`` from: this run as one case, in whole MiB as
    printed: the model's fp32 bytes, its largest parameter, the bound 1.1 x (half + largest), and per
    peak (tensors, malloc, RSS) and the tensors held after setup the largest over the ranks
    (``rows``: every rank's row of ``child``)."""
    build = "eager" if empty_init == "false" else "meta"
    model, largest = facts["model_bytes"], facts["largest_param_bytes"]
    case = {"case": f"{preset}, " + ("empty_init=False" if build == "eager" else f"empty_init={empty_init} (meta build)"),
            "preset": preset, "build": build, "model_fp32": round(model / MIB), "largest_parameter": round(largest / MIB),
            "bound": round(1.1 * (model / 2 + largest) / MIB)}
    for key, source in (("tensor_peak", "tensor_peak"), ("held_after_setup", "tensor_after"),
                        ("malloc_peak", "malloc_peak"), ("rss_peak", "rss_peak")):
        case[key] = round(max(r[source] for r in rows) / MIB)
    return provenance("bench_setup_memory", "bench_setup_memory.py", f"{len(rows)} gloo ranks under fsdp2",
                      argv=[a for a in sys.argv[1:] if a != "--child"]) | {
        "setting": "what one rank holds from just before configure_model to just after strategy.setup (build, shard, "
                   "initialise; no step), 2 gloo ranks under fsdp2; bound asked for by issue 38: 1.1 x (half the "
                   "model's fp32 bytes + its largest parameter); each peak the largest over the ranks",
        "unit": "MiB per rank", "cases": [case]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-1558m")
    parser.add_argument("--empty-init", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_record_options(parser, "cpu-setup-memory", append="case")
    args = parser.parse_args()
    if args.child:
        return child(args)
    from bench_common import memcount_env

    os.environ.setdefault("LDT_LAUNCH_OUT", tempfile.mkdtemp())
    env = {**os.environ, **memcount_env(Path(tempfile.mkdtemp()), needed_by="bench_setup_memory.py")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    sys.exit(subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child"], env=env).returncode)


if __name__ == "__main__":
    main()
