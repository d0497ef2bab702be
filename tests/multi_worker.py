"""Training runs of several test workers in one launch: one process per rank.

    python multi_worker.py OUT_DIR DEVICES WORKER:RUN [WORKER:RUN ...]

Each WORKER is a module in tests/strategies, tests/callbacks or tests/planning with ``fit_run(run, devices) ->
dict`` (fsdp2_worker, tp_worker, pp_worker, callbacks_worker, ...). ``L.Trainer(devices=DEVICES)``
in the first run re-launches this script on the other ranks (Lightning's subprocess launcher); every later run reuses those
processes and their process group, so the suite pays Python's and Lightning's start-up once per
set of runs (tests/conftest.py starts a new set every ``_RUNS_PER_PROCESS`` runs) instead of once
per run. Each rank writes ``OUT_DIR/WORKER.RUN.rankR.json``; runs
find ``OUT_DIR`` in ``LDT_LAUNCH_OUT`` for files every rank shares.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE), str(HERE / "strategies"), str(HERE / "callbacks"),
                 str(HERE / "planning")]
import torch.distributed as dist  # noqa: E402

from dist_utils import write_rank_json  # noqa: E402


def main() -> None:
    faulthandler.enable()  # a rank that dies in native code (segfault, abort) still prints where
    out_dir, devices, jobs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    os.environ["LDT_LAUNCH_OUT"] = str(Path(out_dir).resolve())  # a directory every rank of the launch shares
    for job in jobs:
        # Each run starts as in a launch of its own: a seed_everything() of an earlier run leaves
        # PL_GLOBAL_SEED set, and the strategies' setup re-seeds from it (reset_seed), which changed
        # the weights a later run built in configure_model (runs that seed call seed_everything
        # themselves, on every rank).
        os.environ.pop("PL_GLOBAL_SEED", None)
        worker, run = job.split(":")
        start = time.perf_counter()
        try:
            result = importlib.import_module(worker).fit_run(run, devices)
        except BaseException:
            # Which run failed on which rank, whole, for the test's message: the launch's output
            # interleaves every rank and keeps only its tail, often the *other* rank's
            # "connection reset" instead of the first error.
            rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", "0"))
            (Path(out_dir) / f"FAILED.{job.replace(':', '.')}.rank{rank}.txt").write_text(traceback.format_exc())
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        write_rank_json(out_dir, f"{worker}.{run}", rank, result)
        if rank == 0:  # where the launch's time goes (the suite's budget)
            with open(Path(out_dir) / "TIMES.rank0.txt", "a") as f:
                f.write(f"{time.perf_counter() - start:8.2f} s  {job}\n")


if __name__ == "__main__":
    main()
