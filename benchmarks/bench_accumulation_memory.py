"""Gradient accumulation under FSDP2 on 2 CPU ranks, measured against planned (docs section 23).

    python benchmarks/bench_accumulation_memory.py [--record FILE] [--plot DIR]

Runs the two runs of ``tests/planning/accumulation_memory_worker.py`` (sharded accumulation, the
default, and ``accumulate_unsharded_grads=True``) in one 2-rank launch of ``tests/multi_worker.py``:
``GPTModule("tiny", vocab_size=257)``, sequence 64, micro-batch 4 per rank, accumulation 4, fp32,
AdamW, the last step's window measured by the worker's ``LiveTensorBytes`` (bytes of live tensor
storages). Prints, per mode, rank 0's measured peak and bytes held between micro-batches beside
``planning/memory.py``'s plan for the same shape and layout (``test_accumulation_memory.planned``),
and the two modes' difference. ``--record FILE`` writes them as ``cpu_figures.py`` reads them
(``record``); ``--plot DIR`` draws ``cpu-accumulation-memory`` from that record.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "planning"), str(ROOT / "benchmarks")]

from dist_utils import read_ranks, run_lightning_script  # noqa: E402
from record import add_record_options, provenance, record_path, wants_record, write_record  # noqa: E402
from test_accumulation_memory import RUNS, planned  # noqa: E402

SETTING = ('GPTModule("tiny", vocab 257), seq 64, micro-batch 4 per rank, accumulation 4, fp32, AdamW, clipping 1.0, '
           "2 steps, 2 gloo ranks, the last step's window; rank 0; planned by planning/memory.py for the same shape")


def record(results: dict[str, dict]) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-accumulation-memory`` from: per mode (sharded first), rank
    0's measured peak and most bytes held between micro-batches (``results``: run -> rank 0's worker
    output) beside the plan's peak and states, and the two modes' differences (unsharded - default)."""
    rows = []
    for r in sorted(results.values(), key=lambda r: r["accumulate_unsharded_grads"]):
        plan = planned(r["accumulate_unsharded_grads"])
        rows.append({"mode": ("accumulate_unsharded_grads=True" if r["accumulate_unsharded_grads"]
                              else "default (reduce-scatter every micro-batch)"),
                     "measured_peak": r["peak"], "planned_peak": round(plan.total), "ratio": round(r["peak"] / plan.total, 3),
                     "held_between": max(r["between"]), "planned_states": round(plan.state)})
    default, unsharded = rows
    return provenance("bench_accumulation_memory", "bench_accumulation_memory.py", "2 gloo ranks") | {
        "setting": SETTING, "unit": "bytes per rank", "rows": rows,
        "differences": {"measured_peak": unsharded["measured_peak"] - default["measured_peak"],
                        "held_between": unsharded["held_between"] - default["held_between"],
                        "planned": round(planned(True).grads - planned(False).grads)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_record_options(p, "cpu-accumulation-memory")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as out:
        run_lightning_script(ROOT / "tests" / "multi_worker.py", out, "2",
                             *(f"accumulation_memory_worker:{run}" for run in RUNS), timeout=600)
        results = {run: read_ranks(out, f"accumulation_memory_worker.{run}", 2)[0] for run in RUNS}
    print(f"{'mode':38} {'peak':>12} {'planned':>12} {'ratio':>6} {'between':>12} {'planned':>12}")
    for run, r in results.items():
        plan = planned(r["accumulate_unsharded_grads"])
        mode = "accumulate_unsharded_grads=True" if r["accumulate_unsharded_grads"] else "default (sharded)"
        print(f"{mode:38} {r['peak']:>12,} {plan.total:>12,.0f} {r['peak'] / plan.total:>6.3f} "
              f"{max(r['between']):>12,} {plan.state:>12,.0f}")
    sharded, unsharded = (results[run] for run in sorted(RUNS, key=lambda k: results[k]["accumulate_unsharded_grads"]))
    print(f"difference: peak {unsharded['peak'] - sharded['peak']:,} B, between "
          f"{max(unsharded['between']) - max(sharded['between']):,} B, planned "
          f"{planned(True).grads - planned(False).grads:,.0f} B")
    if wants_record(args):
        write_record(record(results), record_path(args, "bench_accumulation_memory.json"), args.plot, args.format)


if __name__ == "__main__":
    main()
