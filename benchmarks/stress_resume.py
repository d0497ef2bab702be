"""Resume the quickstart from one preemption checkpoint, again and again (issue 42, item 1).

A new user saw 1 failure in 6 runs of ``lightning-disttrain fit --config configs/quickstart.yaml
--trainer.max_steps 50 --model.init_args.lr 1e-3`` resuming a preemption checkpoint: rank 1
vanished while rank 0 was in DCP ``load``; 24 later runs passed. This script makes the checkpoint
once (SIGTERM to the command after ``--signal-after`` seconds: the PreemptionCheckpoint saves and
the run exits), then runs the resume ``--repeats`` times, each from a fresh copy of the run
directory, optionally beside ``--load N`` CPU-bound processes, and prints every run's exit code
and time; the output of each failed run is kept under ``--out``.

    python benchmarks/stress_resume.py --repeats 20 --load 2 --out /tmp/stress_resume

Exit code: 1 if any resume failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "lightning_disttrain.cli", "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
           "--trainer.max_steps", "50", "--model.init_args.lr", "1e-3"]


def _spin(stop) -> None:  # one CPU-bound process of --load
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _preempted_run(work: Path, signal_after: float) -> None:
    proc = subprocess.Popen(COMMAND, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(signal_after)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    saved = sorted(p.name for p in (work / "runs" / "quickstart" / "checkpoints").glob("*"))
    if not saved:
        raise SystemExit(f"the preempted run saved nothing (exit {proc.returncode}):\n{out[-3000:]}")
    print(f"preempted run: exit {proc.returncode} after SIGTERM at {signal_after:.0f} s; saved {saved}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes running beside the resumes")
    parser.add_argument("--signal-after", type=float, default=20.0, help="seconds before the SIGTERM")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "stress_resume")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    template = args.out / "template"
    template.mkdir(parents=True)
    _preempted_run(template, args.signal_after)
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for s in spinners:
        s.start()
    failures = 0
    try:
        for i in range(args.repeats):
            work = args.out / f"run{i:03d}"
            shutil.copytree(template, work, symlinks=True)
            start = time.perf_counter()
            proc = subprocess.run(COMMAND, cwd=work, capture_output=True, text=True, timeout=600,
                                  env=dict(os.environ, PYTHONFAULTHANDLER="1"))
            took = time.perf_counter() - start
            ok = proc.returncode == 0 and "resuming from" in (proc.stdout + proc.stderr).lower()
            print(f"resume {i:3d}: exit {proc.returncode}, {took:5.1f} s{'' if ok else '  FAILED'}", flush=True)
            if ok:
                shutil.rmtree(work)
            else:
                failures += 1
                (work / "output.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    finally:
        stop.set()
        for s in spinners:
            s.join(timeout=5)
    print(f"{failures} of {args.repeats} resumes failed (beside {args.load} CPU-bound processes); "
          f"outputs of failures under {args.out}")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
