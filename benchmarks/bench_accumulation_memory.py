"""Gradient accumulation under FSDP2 on 2 CPU ranks, measured against planned (docs section 23).

    python benchmarks/bench_accumulation_memory.py

Runs the two runs of ``tests/planning/accumulation_memory_worker.py`` (sharded accumulation, the
default, and ``accumulate_unsharded_grads=True``) in one 2-rank launch of ``tests/multi_worker.py``:
``GPTModule("tiny", vocab_size=257)``, sequence 64, micro-batch 4 per rank, accumulation 4, fp32,
AdamW, the last step's window measured by the worker's ``LiveTensorBytes`` (bytes of live tensor
storages). Prints, per mode, rank 0's measured peak and bytes held between micro-batches beside
``planning/memory.py``'s plan for the same shape and layout (``test_accumulation_memory.planned``),
and the two modes' difference.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "planning")]

from dist_utils import read_ranks, run_lightning_script  # noqa: E402
from test_accumulation_memory import RUNS, planned  # noqa: E402


def main() -> None:
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


if __name__ == "__main__":
    main()
