"""Resume the quickstart from one preemption checkpoint, again and again (issue 42, item 1).

A new user saw 1 failure in 6 runs of ``lightning-disttrain fit --config configs/quickstart.yaml
--trainer.max_steps 50 --model.init_args.lr 1e-3`` resuming a preemption checkpoint: rank 1
vanished while rank 0 was in DCP ``load``; 24 later runs passed. This script makes the checkpoint
once (SIGTERM to the command after ``--signal-after`` seconds: the PreemptionCheckpoint saves and
the run exits), then runs the resume ``--repeats`` times, each from a fresh copy of the run
directory, optionally beside ``--load N`` CPU-bound processes, and prints every run's exit code
and time; the output of each failed run is kept under ``--out``.

    python benchmarks/stress_resume.py --repeats 20 --load 2 --out /tmp/stress_resume

``--back-to-back`` is how a user at a terminal does it: each repeat starts the quickstart afresh in
its own directory, sends SIGTERM after a time drawn from ``--signal-between`` (so the checkpoint's
step and what the run was doing vary), alternately to the launching process only (``kill PID``) and
to the whole process group (``timeout``), judges that run as below, and then resumes (from its
preemption checkpoint, or from scratch when the signal came before training).

``--signal-resume`` sends the SIGTERM to the resume itself, at a time drawn from ``--signal-between``
(by default within its start-up: building, sharding, loading the checkpoint), alternately to the
launching process and to the whole group. It is the loop that found the failure: before
``startup_signals``, a signal there killed the process that got it without a word (exit -15), and
with rank 0 gone rank 1 printed, after the shell had its prompt back, "every failing process failed
in communication ... (out of memory?)" from DCP's load. A repeat passes when the run either
finished (exit 0, the signal came after it) or stopped with code 143 and said so, printed nothing
about memory, and left no process behind; a -15 is accepted only before any rank started (Python
still importing) or once the run had finished (the interpreter's own shutdown, where Python has
given the default actions back).

Exit code: 1 if any resume failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ORIGINAL = [sys.executable, "-m", "lightning_disttrain.cli", "fit", "--config", str(REPO / "configs" / "quickstart.yaml")]
COMMAND = ORIGINAL + ["--trainer.max_steps", "50", "--model.init_args.lr", "1e-3"]


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


def _signalled(command: list[str], work: Path, log_name: str, signal_after: float,
               whole_group: bool, signal_on: str | None = None) -> tuple[int, str, list[str], str]:
    """Run ``command`` in ``work`` and SIGTERM it after ``signal_after`` s (counted from the first
    line holding ``signal_on`` when given), to the launching process only or its whole group; wait
    for the launching process, then up to 30 s for the rest of its group.
    Returns (exit code, output, problems, a note on an accepted -15)."""
    with open(work / log_name, "w") as log:
        proc = subprocess.Popen(command, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONFAULTHANDLER="1", PYTHONUNBUFFERED="1"))
        while signal_on is not None and proc.poll() is None and \
                signal_on not in (work / log_name).read_text(errors="replace"):
            time.sleep(0.01)
        try:
            proc.wait(timeout=signal_after)
        except subprocess.TimeoutExpired:
            if whole_group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=300)
    deadline = time.monotonic() + 30  # what the other ranks still print after the launching process exited
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left_behind = _group_alive(proc.pid)
    if left_behind:
        os.killpg(proc.pid, signal.SIGKILL)
    output = (work / log_name).read_text(errors="replace")
    said_stop = "stopped" in output or "Preempted" in output
    # Killed by the signal's default action while nothing had started (Python still importing: no
    # rank launched yet) or after the work was done (the interpreter's own shutdown, where Python
    # has given the default actions back): an honest -15 that loses nothing.
    not_started = "Initializing distributed" not in output
    done = "`Trainer.fit` stopped" in output
    killed_outside = proc.returncode == -signal.SIGTERM and (not_started or done)
    problems = [why for bad, why in [
        (proc.returncode not in (0, 143) and not killed_outside, f"exit {proc.returncode}"),
        (proc.returncode == 143 and not said_stop, "exit 143 without a word"),
        ("out of memory?" in output, "'out of memory?'"),
        (left_behind, "processes still running 30 s after the launching process exited")] if bad]
    note = " (before any rank started)" if killed_outside and not_started else \
        " (the run had finished: its interpreter was exiting)" if killed_outside else ""
    return proc.returncode, output, problems, note


def _back_to_back(work: Path, signal_after: float, whole_group: bool) -> tuple[bool, str]:
    """Preempt a fresh quickstart after ``signal_after`` s, then resume at once; (ok, what happened)."""
    work.mkdir(parents=True)
    code, _, problems, note = _signalled(ORIGINAL, work, "preempted.txt", signal_after, whole_group)
    steps = sorted(p.name for p in (work / "runs" / "quickstart" / "checkpoints").glob("preempted-*"))
    start = time.perf_counter()
    proc = subprocess.run(COMMAND, cwd=work, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    took = time.perf_counter() - start
    (work / "resume.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    said = (proc.stdout + proc.stderr).lower()
    expected = "resuming from" if steps else "starting from scratch"
    if proc.returncode != 0 or expected not in said:
        problems.append(f"resume: exit {proc.returncode}{'' if expected in said else ', not ' + repr(expected)}")
    return not problems, (f"SIGTERM at {signal_after:4.1f} s to {'the group' if whole_group else 'rank 0   '}: "
                          f"exit {code}{note}, {steps[-1] if steps else 'nothing saved'}; resume exit "
                          f"{proc.returncode}, {took:5.1f} s{'; ' + ', '.join(problems) if problems else ''}")


def _signal_resume(work: Path, template: Path, signal_after: float, whole_group: bool,
                   signal_on: str | None = None) -> tuple[bool, str]:
    """The resume, SIGTERMed after ``signal_after`` s; (ok, what happened)."""
    shutil.copytree(template, work, symlinks=True)
    code, _, problems, note = _signalled(COMMAND, work, "resume.txt", signal_after, whole_group, signal_on)
    when = f" after {signal_on!r}" if signal_on else ""
    what = (f"SIGTERM at {signal_after:4.2f} s{when} to {'the group' if whole_group else 'rank 0   '}: exit "
            f"{code}{note}{'; ' + ', '.join(problems) if problems else ''}")
    return not problems, what


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes running beside the resumes")
    parser.add_argument("--signal-after", type=float, default=20.0, help="seconds before the SIGTERM")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "stress_resume")
    parser.add_argument("--back-to-back", action="store_true",
                        help="each repeat: preempt a fresh run, then resume at once (see above)")
    parser.add_argument("--signal-between", type=float, nargs=2, default=(10.0, 30.0), metavar=("MIN", "MAX"),
                        help="--back-to-back, --signal-resume: the SIGTERM comes this many seconds after the "
                             "start (uniform)")
    parser.add_argument("--signal-resume", action="store_true",
                        help="each repeat: SIGTERM the resume itself during its start-up (see above)")
    parser.add_argument("--signal-on", default=None, metavar="TEXT",
                        help="--signal-resume: count --signal-between from the first output line holding TEXT "
                             "(e.g. 'Restoring states': the checkpoint's load)")
    parser.add_argument("--seed", type=int, default=0, help="the draw of the signal times")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    if args.back_to_back:
        _repeat(args, "back-to-back resumes", lambda work, draw, i: _back_to_back(
            work, draw.uniform(*args.signal_between), whole_group=i % 2 == 1))
    template = args.out / "template"
    template.mkdir(parents=True)
    _preempted_run(template, args.signal_after)
    if args.signal_resume:
        _repeat(args, "signalled resumes", lambda work, draw, i: _signal_resume(
            work, template, draw.uniform(*args.signal_between), whole_group=i % 2 == 1, signal_on=args.signal_on))
    else:
        _repeat(args, "resumes", lambda work, draw, i: _plain_resume(work, template))


def _plain_resume(work: Path, template: Path) -> tuple[bool, str]:
    """The resume from a fresh copy of the template, left alone; (ok, what happened)."""
    shutil.copytree(template, work, symlinks=True)
    start = time.perf_counter()
    proc = subprocess.run(COMMAND, cwd=work, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    took = time.perf_counter() - start
    ok = proc.returncode == 0 and "resuming from" in (proc.stdout + proc.stderr).lower()
    if not ok:
        (work / "output.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return ok, f"exit {proc.returncode}, {took:5.1f} s"


def _repeat(args, what: str, one: Callable[[Path, random.Random, int], tuple[bool, str]]) -> None:
    """``one(work, draw, i)`` ``--repeats`` times beside ``--load`` CPU-bound processes; the directory
    of a repeat that passed is removed, a failed one's kept. Exits 1 if any failed."""
    draw = random.Random(args.seed)
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for s in spinners:
        s.start()
    failures = 0
    try:
        for i in range(args.repeats):
            work = args.out / f"run{i:03d}"
            ok, said = one(work, draw, i)
            print(f"repeat {i:3d}: {said}{'' if ok else '  FAILED'}", flush=True)
            if ok:
                shutil.rmtree(work)
            else:
                failures += 1
    finally:
        stop.set()
        for s in spinners:
            s.join(timeout=5)
    print(f"{failures} of {args.repeats} {what} failed (beside {args.load} CPU-bound processes); "
          f"outputs of failures under {args.out}")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
