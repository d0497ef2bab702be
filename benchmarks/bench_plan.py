"""`lightning-disttrain plan` against measurements: peak memory per rank on CPU, planned vs measured.

For each preset (``tiny``, ``small``) and activation checkpointing policy (``none``, ``selective``,
``full``): ``GPTModule`` trained by ``L.Trainer`` under ``FSDP2Strategy`` (ZeRO-3) on 2 gloo ranks,
fp32, AdamW, clipping 1.0, ``--mem-steps`` steps, in fresh processes. Measured (``memory_meter.py``'s
``ProcessMeter``: malloc bytes in use in every thread, counted by ``memcount.c`` preloaded with
``LD_PRELOAD``; the same meter and hooks as ``bench_fsdp.py --part memory``): rank 0's level after
the last optimizer step (``rest``) and the peak over the last step (forward, backward, clipping,
AdamW), both relative to the level just before ``fit``. Planned (computed, not measured):
``planning.memory_per_gpu`` for ``Layout(dp_shard=2, zero=3, ac=policy)`` with the same sequence,
micro batch and fp32, on a ``cpu`` cluster (no CUDA allowance): the state (16 B/param / 2), and the
peak = state + activations + logits + buffers.

    python benchmarks/bench_plan.py                        # tiny and small, none/selective/full
    python benchmarks/bench_plan.py --presets tiny --acs none

Ranks are started with env:// variables (``bench_common.launch``). Results: printed; JSON under
benchmarks/out/plan/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone

from bench_common import HERE, MIB, dataset, launch, load1, phase_probe, step_peak, trainer
from bench_common import RANK as _RANK

OUT = HERE / "out" / "plan"
SHAPES = {"tiny": (256, 8), "small": (512, 4)}
"""Preset -> (sequence length, micro batch per rank)."""


def worker(args) -> None:
    import lightning as L
    import torch.distributed as dist
    from memory_meter import ProcessMeter, self_check
    from torch.utils.data import DataLoader

    from lightning_disttrain import GPTModule
    from lightning_disttrain.callbacks import SelectiveActivationCheckpointing
    from lightning_disttrain.strategies import FSDP2Strategy

    check = self_check(ProcessMeter())
    dist.init_process_group("gloo")  # before the baseline: its connections are not the step's memory
    args.seq, args.batch = SHAPES[args.preset]
    loader = DataLoader(dataset(args, args.mem_steps * args.batch * args.nprocs), batch_size=args.batch)
    meter = ProcessMeter()
    L.seed_everything(0)
    module = GPTModule(args.preset, vocab_size=args.vocab, model_overrides={"block_size": args.seq})
    callbacks = [phase_probe(meter)]
    if args.ac != "none":
        callbacks.append(SelectiveActivationCheckpointing(policy=args.ac))
    fit = trainer(FSDP2Strategy(), args.mem_steps, callbacks)
    meter.start()
    fit.fit(module, loader)
    meter.stop()
    k = args.mem_steps - 1
    record = {"levels": meter.levels, "peaks": meter.peaks, "check_mib": check, "step": k}
    peak, phase = step_peak(record, k)
    record |= {"peak": peak, "phase": phase, "rest": meter.levels[f"step{k}.opt:end"]}
    (OUT / f"{args.preset}_{args.ac}_rank{_RANK}.json").write_text(json.dumps(record))


def planned(preset: str, ac: str, vocab: int, nprocs: int):
    from lightning_disttrain.planning import Cluster, Layout, Workload, config_for, memory_per_gpu, shape_of

    seq, batch = SHAPES[preset]
    shape = shape_of(config_for(preset, {"vocab_size": vocab, "block_size": seq}), seq, preset)
    return memory_per_gpu(shape, Layout(dp_shard=nprocs, zero=3, ac=ac),
                          Workload(seq, global_batch=batch * nprocs, micro_batch=batch, precision="fp32"),
                          Cluster("cpu", gpus_per_node=nprocs, memory_gb=64))


def report(presets, acs, vocab: int, nprocs: int) -> str:
    def mib(b: float) -> str:
        return f"{b / MIB:8.2f}"

    lines = ["planned = planning.memory_per_gpu (computed); measured = malloc bytes in use on rank 0 (memcount),",
             "relative to the level before fit, last step. rest: after the optimizer step. peak: the most in use",
             "during the step. MiB.",
             f"{'preset':6} {'AC':9} | {'planned':>8} {'measured':>8} {'ratio':>6} | {'planned':>8} {'planned':>8}"
             f" {'planned':>8} {'planned':>8} {'planned':>8} {'measured':>8} {'ratio':>6} {'in':>3}",
             f"{'':6} {'':9} | {'state':>8} {'rest':>8} {'':>6} | {'activ.':>8} {'logits':>8} {'buffers':>8}"
             f" {'fwd-bwd':>8} {'peak':>8} {'peak':>8} {'':>6} {'':>3}"]
    for preset in presets:
        for ac in acs:
            ranks = [json.loads((OUT / f"{preset}_{ac}_rank{r}.json").read_text()) for r in range(nprocs)]
            r0 = ranks[0]
            m = planned(preset, ac, vocab, nprocs)
            transient = m.activations + m.logits + m.buffers
            lines.append(f"{preset:6} {ac:9} | {mib(m.state)} {mib(r0['rest'])} {r0['rest'] / m.state:6.3f} |"
                         f" {mib(m.activations)} {mib(m.logits)} {mib(m.buffers)} {mib(transient)} {mib(m.total)}"
                         f" {mib(r0['peak'])} {r0['peak'] / m.total:6.3f} {r0['phase']:>3}")
            spread = max(x["peak"] for x in ranks) - min(x["peak"] for x in ranks)
            lines.append(f"{'':6} {'':9}   ranks' peaks differ by {spread / MIB:.2f} MiB")
    checks = [json.loads((OUT / f"{p}_{a}_rank{r}.json").read_text())["check_mib"]
              for p in presets for a in acs for r in range(nprocs)]
    lines.append(f"method check ({len(checks)} processes): a 100 MiB tensor measured "
                 f"{min(c['alive'] for c in checks):.2f}-{max(c['alive'] for c in checks):.2f} MiB alive, peak "
                 f"{min(c['peak'] for c in checks):.2f}-{max(c['peak'] for c in checks):.2f} MiB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--acs", default="none,selective,full")
    p.add_argument("--vocab", type=int, default=257, help="257: the byte tokenizer")
    p.add_argument("--mem-steps", type=int, default=3, help="steps; the last one is reported")
    p.add_argument("--report-only", action="store_true", help="print the table from earlier JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--ac", help=argparse.SUPPRESS)
    p.add_argument("--nprocs", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args)
    presets, acs = args.presets.split(","), args.acs.split(",")
    print(f"# bench_plan {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, gloo, 2 ranks, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}")
    print(f"# {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"# 1-min load average at start: {load1():.2f}\n", flush=True)
    t0 = time.perf_counter()
    if not args.report_only:
        from memory_meter import build_memcount

        memcount = build_memcount(OUT)
        if memcount is None:
            raise SystemExit("needs a C compiler (cc) to build benchmarks/memcount.c")
        env = {"LD_PRELOAD": memcount, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
        for preset in presets:
            for ac in acs:
                launch(__file__, OUT, 2, f"{preset}_{ac}", ["--worker", "--preset", preset, "--ac", ac, "--vocab",
                                                           str(args.vocab), "--mem-steps", str(args.mem_steps)],
                       extra_env=env)
    print(report(presets, acs, args.vocab, 2))
    print(f"# {time.perf_counter() - t0:.0f} s, 1-min load average at end: {load1():.2f}")


if __name__ == "__main__":
    main()
