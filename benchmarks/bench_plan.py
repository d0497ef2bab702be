"""`lightning-disttrain plan` against measurements: peak memory per rank on CPU, planned vs measured.

Each case is a preset, a layout and an activation checkpointing policy: ``GPTModule`` trained by
``L.Trainer`` on 2 gloo ranks, fp32, AdamW, clipping 1.0, ``--mem-steps`` steps, in fresh processes.
Measured (``memory_meter.py``'s ``ProcessMeter``: malloc bytes in use in every thread, counted by
``memcount.c`` preloaded with ``LD_PRELOAD``; the same meter and hooks as ``bench_fsdp.py --part
memory``): each rank's level after the last optimizer step (``rest``) and its peak over the last
step (forward, backward, clipping, AdamW), both relative to the level just before ``fit``.
Planned (computed, not measured): ``planning.memory_per_rank`` for the same layout (the strategy's
degrees, ZeRO stage, pipeline schedule and micro-batches, checkpointing policy), the same sequence,
micro batch and fp32, on a ``cpu`` cluster of 2 (no CUDA allowance): state, activations, logits,
buffers, and the peak = their sum, per pipeline rank.

    python benchmarks/bench_plan.py                 # every case below (about 20 minutes on 2 cores)
    python benchmarks/bench_plan.py --layouts fsdp2 --presets tiny --acs none,selective
    python benchmarks/bench_plan.py --report-only --plot docs/img   # the table and its figure again

Writes ``benchmarks/out/plan/report.json`` and ``bench_plan.json`` (the same records with their
date, machine and command, as ``benchmarks/cpu_figures.py`` reads them and ``benchmarks/results/``
keeps them); ``--plot DIR`` draws ``cpu-plan-vs-measured`` from it.

Presets: ``tiny`` (GELU, LayerNorm, learned positions), ``small``, ``tiny-llama`` (``tiny`` with
SwiGLU, RMSNorm, RoPE, no biases and 2 K/V heads of 4: grouped-query attention), ``tiny-moe`` (4
experts of half width, top-2, after one dense block). Layouts (``--layouts``):

- ``fsdp2``: ``FSDP2Strategy()`` (ZeRO-3 over 2 ranks), planned ``Layout(dp_shard=2, zero=3)``;
- ``tp``: ``NDParallelStrategy(tp=2)`` (dp_shard=1, sequence and loss parallel), planned
  ``Layout(dp_shard=1, tp=2, zero=3)``;
- ``pp-1f1b``, ``pp-interleaved``, ``pp-gpipe``: ``NDParallelStrategy(pp=2, pp_schedule=...,
  pp_microbatches=4)`` (1F1B, Interleaved1F1B with 2 stages per rank, GPipe; dp_shard=1, fp32: no
  FSDP), ``tie_embeddings=False``; planned with the same schedule arguments and the pipeline
  micro-batch (batch / 4) as the workload's micro batch;
- ``ep``: ``NDParallelStrategy(ep=2)`` (dp_shard=2, 2 of the 4 experts per rank) for ``tiny-moe``;
- ``cp``: ``NDParallelStrategy(cp=2, dp_shard=1)`` (each sequence split over both ranks, FSDP over
  them), planned ``Layout(dp_shard=1, cp=2, zero=3)``.

The default cases (``--cases default``): fsdp2 x {tiny, small, tiny-llama} x {none, selective,
full, block}; tp x {tiny, tiny-llama} x {none, selective}; each pp layout x {tiny, small} x none;
ep x tiny-moe x {none, selective, full}; cp x {tiny, tiny-llama} x
{none, selective, full}. ``--cases grid`` runs
every ``--layouts`` x ``--presets`` x ``--acs`` combination instead.

Under tp and pp the ranks hold different things (pp: rank 0 the first stage, rank 1 the last):
every rank is compared with its own plan, and the row's ratio is the larger rank's measured peak
over the larger rank's planned peak (what must fit).

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
from record import add_record_options, provenance, record_path, write_record

OUT = OUT_ROOT / "plan"
SHAPES = {"tiny": (256, 8), "small": (512, 4), "tiny-llama": (256, 8), "tiny-moe": (256, 8)}
"""Preset -> (sequence length, micro batch per rank)."""
PRESET_OF = {"tiny-llama": ("tiny", dict(mlp="swiglu", norm="rmsnorm", pos_emb="rope", bias=False, n_kv_head=2))}
"""Bench-only names -> (GPT preset, overrides)."""
PIPELINES = {"pp-1f1b": "1F1B", "pp-interleaved": "Interleaved1F1B", "pp-gpipe": "GPipe"}
LAYOUTS = ("fsdp2", "tp", *PIPELINES, "ep", "cp")
ACS = ("none", "selective", "full", "block")
PP_MICROBATCHES = 4
DEFAULT_CASES = (
    [("fsdp2", p, a) for p in ("tiny", "small", "tiny-llama") for a in ACS]
    + [("tp", p, a) for p in ("tiny", "tiny-llama") for a in ("none", "selective")]
    + [(lay, p, "none") for lay in PIPELINES for p in ("tiny", "small")]
    + [("ep", "tiny-moe", a) for a in ("none", "selective", "full")]
    + [("cp", p, a) for p in ("tiny", "tiny-llama") for a in ("none", "selective", "full")]
)


def tag(layout: str, preset: str, ac: str) -> str:
    return f"{layout}_{preset}_{ac}"


def presets_for(layout: str, presets: list[str]) -> list[str]:
    """ep needs a mixture of experts: tiny-moe; the others: the dense presets asked for."""
    return ["tiny-moe"] if layout == "ep" else [p for p in presets if p != "tiny-moe"]


def model_of(preset: str, layout: str, seq: int) -> tuple[str, dict]:
    """(GPT preset, model overrides) of a bench preset under ``layout``."""
    name, extra = PRESET_OF.get(preset, (preset, {}))
    return name, {"block_size": seq, **extra} | ({"tie_embeddings": False} if layout in PIPELINES else {})


def strategy_args(layout: str) -> dict:
    """``NDParallelStrategy`` arguments of ``layout`` (fsdp2: ``FSDP2Strategy()``)."""
    if layout == "tp":
        return {"tp": 2}
    if layout in PIPELINES:
        return {"pp": 2, "pp_schedule": PIPELINES[layout], "pp_microbatches": PP_MICROBATCHES}
    if layout == "ep":
        return {"ep": 2}
    if layout == "cp":
        return {"cp": 2, "dp_shard": 1}
    return {}


def strategy_for(layout: str):
    from lightning_disttrain.strategies import FSDP2Strategy, NDParallelStrategy

    return FSDP2Strategy() if layout == "fsdp2" else NDParallelStrategy(**strategy_args(layout))


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
    name, overrides = model_of(args.preset, args.layout, args.seq)
    module = GPTModule(name, vocab_size=args.vocab, model_overrides=overrides)
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
    """``planning.memory_per_rank`` of the case (one estimate per pipeline rank)."""
    from lightning_disttrain.planning import (
        Cluster,
        Layout,
        Workload,
        config_for,
        shape_of,
    )
    from lightning_disttrain.planning.memory import memory_per_rank

    seq, batch = SHAPES[preset]
    name, overrides = model_of(preset, layout, seq)
    shape = shape_of(config_for(name, {"vocab_size": vocab} | overrides), seq, preset)
    dp, micro = nprocs, batch
    if layout == "tp":
        dp, lay = 1, Layout(dp_shard=1, tp=nprocs, zero=3, ac=ac)
    elif layout in PIPELINES:
        dp, micro = 1, batch // PP_MICROBATCHES
        lay = Layout(dp_shard=1, pp=nprocs, zero=3, ac=ac, pp_schedule=PIPELINES[layout],
                     pp_microbatches=PP_MICROBATCHES)
    elif layout == "ep":
        lay = Layout(dp_shard=nprocs, ep=nprocs, zero=3, ac=ac)
    elif layout == "cp":  # both ranks load the same sequences and keep half of each
        dp, lay = 1, Layout(dp_shard=1, cp=nprocs, zero=3, ac=ac)
    else:
        lay = Layout(dp_shard=nprocs, zero=3, ac=ac)
    return memory_per_rank(shape, lay, Workload(seq, global_batch=batch * dp, micro_batch=micro, precision="fp32"),
                           Cluster("cpu", gpus_per_node=nprocs, memory_gb=64))


def report(cases, vocab: int, nprocs: int) -> tuple[str, list[dict]]:
    """The table, and one record per case (planned and measured MiB per rank, the ratios)."""
    def mib(b: float) -> str:
        return f"{b / MIB:8.2f}"

    lines = ["planned = planning.memory_per_rank (computed); measured = malloc bytes in use (memcount), relative to",
             "the level before fit, last step. rest: after the optimizer step. peak: the most in use during the",
             "step. Per row the larger rank of each (what must fit); per rank below it. MiB.",
             "fixed = measured rest - planned state (and a pipeline's receive buffers): what the process holds at",
             "rest besides them (Python/C++ objects, gloo, allocator), which the plan does not model; 'w/o fixed' =",
             "(measured peak - fixed) / planned peak: the modelled part alone.",
             f"{'layout':14} {'preset':10} {'AC':9} | {'planned':>8} {'measured':>8} {'fixed':>6} | {'planned':>8}"
             f" {'planned':>8} {'planned':>8} {'planned':>8} {'measured':>8} {'ratio':>6} {'w/o':>6} {'in':>3}",
             f"{'':14} {'':10} {'':9} | {'state':>8} {'rest':>8} {'':>6} | {'activ.':>8} {'logits':>8} {'buffers':>8}"
             f" {'peak':>8} {'peak':>8} {'':>6} {'fixed':>6} {'':>3}"]
    records = []
    for layout, preset, ac in cases:
        ranks = [json.loads((OUT / f"{tag(layout, preset, ac)}_rank{r}.json").read_text()) for r in range(nprocs)]
        plans = planned(preset, ac, vocab, nprocs, layout)
        plan_of = [plans[r] if len(plans) == nprocs else plans[0] for r in range(nprocs)]
        top = max(range(nprocs), key=lambda r: plan_of[r].total)
        m = plan_of[top]
        rest = max(x["rest"] for x in ranks)
        peak, phase = max((x["peak"], x["phase"]) for x in ranks)
        state = max(p.state for p in plan_of)
        fixed = [x["rest"] - plan_of[r].state - plan_of[r].persistent for r, x in enumerate(ranks)]
        top_measured = max(range(nprocs), key=lambda r: ranks[r]["peak"])
        corrected = (peak - fixed[top_measured]) / m.total
        lines.append(f"{layout:14} {preset:10} {ac:9} | {mib(state)} {mib(rest)} {max(fixed) / MIB:6.2f} |"
                     f" {mib(m.activations)} {mib(m.logits)} {mib(m.buffers)} {mib(m.total)}"
                     f" {mib(peak)} {peak / m.total:6.3f} {corrected:6.3f} {phase:>3}")
        per_rank = ", ".join(f"rank {r}: peak {x['peak'] / MIB:.2f} / {plan_of[r].total / MIB:.2f} planned "
                             f"= {x['peak'] / plan_of[r].total:.3f}, w/o fixed {(x['peak'] - fixed[r]) / plan_of[r].total:.3f}"
                             f" ({x['phase']})" for r, x in enumerate(ranks))
        lines.append(f"{'':14} {'':10} {'':9}   {per_rank}")
        records.append({"layout": layout, "preset": preset, "ac": ac, "planned_peak_mib": m.total / MIB,
                        "measured_peak_mib": peak / MIB, "ratio": peak / m.total, "ratio_without_fixed": corrected,
                        "fixed_mib": [f / MIB for f in fixed],
                        "planned_state_mib": state / MIB, "measured_rest_mib": rest / MIB,
                        "per_rank": [{"planned_mib": plan_of[r].total / MIB, "measured_mib": x["peak"] / MIB,
                                      "phase": x["phase"]} for r, x in enumerate(ranks)]})
    for key, what in (("ratio", "peak ratio (measured / planned, larger rank)"),
                      ("ratio_without_fixed", "without the fixed part")):
        ratios = [r[key] for r in records]
        lines.append(f"{what}: min {min(ratios):.3f}, max {max(ratios):.3f} over {len(ratios)} cases; within "
                     f"0.90-1.10: {sum(0.9 <= x <= 1.1 for x in ratios)}")
    checks = [json.loads((OUT / f"{tag(lay, p, a)}_rank{r}.json").read_text())["check_mib"]
              for lay, p, a in cases for r in range(nprocs)]
    lines.append(f"method check ({len(checks)} processes): a 100 MiB tensor measured "
                 f"{min(c['alive'] for c in checks):.2f}-{max(c['alive'] for c in checks):.2f} MiB alive, peak "
                 f"{min(c['peak'] for c in checks):.2f}-{max(c['peak'] for c in checks):.2f} MiB")
    return "\n".join(lines), records


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--cases", default="default", choices=("default", "grid"),
                   help="default: the module docstring's list; grid: --layouts x --presets x --acs")
    p.add_argument("--presets", default="tiny,small,tiny-llama")
    p.add_argument("--acs", default=",".join(ACS))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS,
                   help="with --cases grid, or to filter the default cases")
    p.add_argument("--vocab", type=int, default=257, help="257: the byte tokenizer")
    p.add_argument("--mem-steps", type=int, default=3, help="steps; the last one is reported")
    p.add_argument("--report-only", action="store_true", help="print the table from earlier JSON")
    add_record_options(p, "cpu-plan-vs-measured")  # the record: by default benchmarks/out/plan/bench_plan.json
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
    if args.cases == "grid":
        cases = [(lay, p, a) for lay in args.layouts for p in presets_for(lay, presets) for a in acs]
    else:
        cases = [(lay, p, a) for lay, p, a in DEFAULT_CASES
                 if lay in args.layouts and (p in presets or lay == "ep") and a in acs]
    header("bench_plan", "gloo", "2 ranks", omp_threads())
    with part("plan"):
        if not args.report_only:
            env = memcount_env(OUT, "bench_plan")
            for layout, preset, ac in cases:
                launch(__file__, OUT, 2, tag(layout, preset, ac),
                       ["--worker", "--layout", layout, "--preset", preset, "--ac", ac, "--vocab", str(args.vocab),
                        "--mem-steps", str(args.mem_steps)], extra_env=env)
        text, records = report(cases, args.vocab, 2)
        (OUT / "report.json").write_text(json.dumps(records, indent=1))
        print(text)
    # The same records as benchmarks/cpu_figures.py reads them (what benchmarks/results/ keeps).
    write_record(recorded_results(records, args.report_only), record_path(args, OUT / "bench_plan.json"), args.plot,
                 args.format)


def recorded_results(records: list[dict], report_only: bool) -> dict:
    """``records`` with what ``cpu_figures.py`` needs to say where they come from."""
    from datetime import datetime, timezone

    # When the measurements were made (also under --report-only): the newest per-rank record.
    measured = max((f.stat().st_mtime for f in OUT.glob("*_rank*.json")), default=datetime.now().timestamp())
    return provenance("bench_plan", "bench_plan.py", "gloo, 2 ranks", when=datetime.fromtimestamp(measured, timezone.utc),
                      source=f"{OUT / 'report.json'} as this run " + ("re-read (--report-only)" if report_only
                                                                      else "wrote it")) | {"records": records}

if __name__ == "__main__":
    main()
