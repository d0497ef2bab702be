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
    python benchmarks/bench_plan.py --layouts tp pp ep --acs none   # the other parallelisms only

``--layouts`` (default ``fsdp2``) adds, on the same 2 ranks, no activation checkpointing unless
``--acs`` says otherwise, each against ``memory_per_gpu`` of the same layout:

- ``tp``: ``NDParallelStrategy(tp=2)`` (dp_shard=1, FSDP over that one rank; sequence and loss
  parallel) for the presets; planned as ``Layout(dp_shard=1, tp=2, zero=3)``, the layout ``plan`` lists;
- ``pp``: ``NDParallelStrategy(pp=2, pp_microbatches=4)`` (1F1B, dp_shard=1, fp32: no FSDP) for the
  presets with ``tie_embeddings=False``; planned as ``Layout(dp_shard=1, pp=2, zero=3)`` with the
  pipeline micro-batch (batch / 4) as the workload's micro batch;
- ``ep``: ``NDParallelStrategy(ep=2)`` (dp_shard=2; each rank holds 2 of the 4 experts) for
  ``tiny-moe``; planned as ``Layout(dp_shard=2, ep=2, zero=3)``.

Under tp and pp the ranks hold different things (pp: rank 0 the first stage, rank 1 the last) and
the planner gives the most loaded rank, so these rows compare the larger of the two ranks.

Ranks are started with env:// variables (``bench_common.launch``). Results: printed; JSON under
benchmarks/out/plan/.
"""

from __future__ import annotations

import argparse
import json

from bench_common import (
    MIB,
    OUT_ROOT,
    dataset,
    header,
    launch,
    memcount_env,
    omp_threads,
    parser,
    part,
    phase_probe,
    step_peak,
    trainer,
)
from bench_common import RANK as _RANK

OUT = OUT_ROOT / "plan"
SHAPES = {"tiny": (256, 8), "small": (512, 4), "tiny-moe": (256, 8)}
"""Preset -> (sequence length, micro batch per rank)."""
LAYOUTS = ("fsdp2", "tp", "pp", "ep")
PP_MICROBATCHES = 4


def tag(layout: str, preset: str, ac: str) -> str:
    return f"{preset}_{ac}" if layout == "fsdp2" else f"{layout}_{preset}_{ac}"


def presets_for(layout: str, presets: list[str]) -> list[str]:
    """ep needs a mixture of experts: tiny-moe; the others: the dense presets asked for."""
    return ["tiny-moe"] if layout == "ep" else [p for p in presets if p != "tiny-moe"]


def overrides_for(layout: str, seq: int) -> dict:
    return {"block_size": seq} | ({"tie_embeddings": False} if layout == "pp" else {})


def strategy_for(layout: str):
    from lightning_disttrain.strategies import FSDP2Strategy, NDParallelStrategy

    if layout == "fsdp2":
        return FSDP2Strategy()
    if layout == "tp":
        return NDParallelStrategy(tp=2)
    if layout == "pp":
        return NDParallelStrategy(pp=2, pp_schedule="1F1B", pp_microbatches=PP_MICROBATCHES)
    return NDParallelStrategy(ep=2)


def worker(args) -> None:
    import lightning as L
    import torch.distributed as dist
    from memory_meter import ProcessMeter, self_check
    from torch.utils.data import DataLoader

    from lightning_disttrain import GPTModule
    from lightning_disttrain.callbacks import SelectiveActivationCheckpointing

    check = self_check(ProcessMeter())
    dist.init_process_group("gloo")  # before the baseline: its connections are not the step's memory
    args.seq, args.batch = SHAPES[args.preset]
    loader = DataLoader(dataset(args, args.mem_steps * args.batch * args.nprocs), batch_size=args.batch)
    meter = ProcessMeter()
    L.seed_everything(0)
    module = GPTModule(args.preset, vocab_size=args.vocab, model_overrides=overrides_for(args.layout, args.seq))
    callbacks = [phase_probe(meter)]
    if args.ac != "none":
        callbacks.append(SelectiveActivationCheckpointing(policy=args.ac))
    fit = trainer(strategy_for(args.layout), args.mem_steps, callbacks)
    meter.start()
    fit.fit(module, loader)
    meter.stop()
    k = args.mem_steps - 1
    record = {"levels": meter.levels, "peaks": meter.peaks, "check_mib": check, "step": k}
    peak, phase = step_peak(record, k)
    record |= {"peak": peak, "phase": phase, "rest": meter.levels[f"step{k}.opt:end"]}
    (OUT / f"{tag(args.layout, args.preset, args.ac)}_rank{_RANK}.json").write_text(json.dumps(record))


def planned(preset: str, ac: str, vocab: int, nprocs: int, layout: str = "fsdp2"):
    from lightning_disttrain.planning import Cluster, Layout, Workload, config_for, memory_per_gpu, shape_of

    seq, batch = SHAPES[preset]
    shape = shape_of(config_for(preset, {"vocab_size": vocab} | overrides_for(layout, seq)), seq, preset)
    dp, micro = nprocs, batch
    if layout == "tp":
        dp, lay = 1, Layout(dp_shard=1, tp=nprocs, zero=3, ac=ac)
    elif layout == "pp":
        dp, micro, lay = 1, batch // PP_MICROBATCHES, Layout(dp_shard=1, pp=nprocs, zero=3, ac=ac)
    elif layout == "ep":
        lay = Layout(dp_shard=nprocs, ep=nprocs, zero=3, ac=ac)
    else:
        lay = Layout(dp_shard=nprocs, zero=3, ac=ac)
    return memory_per_gpu(shape, lay, Workload(seq, global_batch=batch * dp, micro_batch=micro, precision="fp32"),
                          Cluster("cpu", gpus_per_node=nprocs, memory_gb=64))


def report(cases, vocab: int, nprocs: int) -> str:
    """``cases``: (layout, preset, ac). fsdp2 rows compare rank 0 (the ranks are alike); the other
    layouts compare the larger of the ranks' figures (they hold different parts; the planner gives
    the most loaded rank)."""
    def mib(b: float) -> str:
        return f"{b / MIB:8.2f}"

    lines = ["planned = planning.memory_per_gpu (computed); measured = malloc bytes in use (memcount), relative to",
             "the level before fit, last step; rank 0 for fsdp2, the larger rank otherwise. rest: after the",
             "optimizer step. peak: the most in use during the step. MiB.",
             f"{'layout':6} {'preset':8} {'AC':9} | {'planned':>8} {'measured':>8} {'ratio':>6} | {'planned':>8}"
             f" {'planned':>8} {'planned':>8} {'planned':>8} {'planned':>8} {'measured':>8} {'ratio':>6} {'in':>3}",
             f"{'':6} {'':8} {'':9} | {'state':>8} {'rest':>8} {'':>6} | {'activ.':>8} {'logits':>8} {'buffers':>8}"
             f" {'fwd-bwd':>8} {'peak':>8} {'peak':>8} {'':>6} {'':>3}"]
    for layout, preset, ac in cases:
        ranks = [json.loads((OUT / f"{tag(layout, preset, ac)}_rank{r}.json").read_text()) for r in range(nprocs)]
        if layout == "fsdp2":
            rest, (peak, phase) = ranks[0]["rest"], (ranks[0]["peak"], ranks[0]["phase"])
        else:
            rest, (peak, phase) = max(x["rest"] for x in ranks), max((x["peak"], x["phase"]) for x in ranks)
        m = planned(preset, ac, vocab, nprocs, layout)
        transient = m.activations + m.logits + m.buffers
        lines.append(f"{layout:6} {preset:8} {ac:9} | {mib(m.state)} {mib(rest)} {rest / m.state:6.3f} |"
                     f" {mib(m.activations)} {mib(m.logits)} {mib(m.buffers)} {mib(transient)} {mib(m.total)}"
                     f" {mib(peak)} {peak / m.total:6.3f} {phase:>3}")
        per_rank = ", ".join(f"rank {r}: rest {x['rest'] / MIB:.2f} peak {x['peak'] / MIB:.2f} ({x['phase']})"
                             for r, x in enumerate(ranks))
        lines.append(f"{'':6} {'':8} {'':9}   {per_rank}")
    checks = [json.loads((OUT / f"{tag(lay, p, a)}_rank{r}.json").read_text())["check_mib"]
              for lay, p, a in cases for r in range(nprocs)]
    lines.append(f"method check ({len(checks)} processes): a 100 MiB tensor measured "
                 f"{min(c['alive'] for c in checks):.2f}-{max(c['alive'] for c in checks):.2f} MiB alive, peak "
                 f"{min(c['peak'] for c in checks):.2f}-{max(c['peak'] for c in checks):.2f} MiB")
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--acs", default="none,selective,full")
    p.add_argument("--layouts", nargs="+", default=["fsdp2"], choices=LAYOUTS,
                   help="fsdp2 (default), tp (tp=2), pp (pp=2, 1F1B), ep (ep=2, tiny-moe)")
    p.add_argument("--vocab", type=int, default=257, help="257: the byte tokenizer")
    p.add_argument("--mem-steps", type=int, default=3, help="steps; the last one is reported")
    p.add_argument("--report-only", action="store_true", help="print the table from earlier JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--ac", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="fsdp2", help=argparse.SUPPRESS)
    p.add_argument("--nprocs", type=int, default=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args)
    presets, acs = args.presets.split(","), args.acs.split(",")
    cases = [(lay, p, a) for lay in args.layouts for p in presets_for(lay, presets) for a in acs]
    header("bench_plan", "gloo", "2 ranks", omp_threads())
    with part("plan"):
        if not args.report_only:
            env = memcount_env(OUT, "bench_plan")
            for layout, preset, ac in cases:
                launch(__file__, OUT, 2, tag(layout, preset, ac),
                       ["--worker", "--layout", layout, "--preset", preset, "--ac", ac, "--vocab", str(args.vocab),
                        "--mem-steps", str(args.mem_steps)], extra_env=env)
        print(report(cases, args.vocab, 2))


if __name__ == "__main__":
    main()
