"""Where the test suite's time goes: start-up per process, and the processes a suite run starts.

    python benchmarks/bench_suite_time.py imports [--repeats 5]
        ``import lightning_disttrain.cli`` in a fresh interpreter, as the suite's processes start,
        with and without tests/startup (torchmetrics' optional transformers/matplotlib imports off),
        alternated, each repeat side by side: wall and user+sys CPU seconds, median and spread.

    python benchmarks/bench_suite_time.py exits [--repeats 5]
        A fresh interpreter that imports ``lightning_disttrain.cli`` (with tests/startup) and exits,
        as it is, and with ``gc.freeze()`` as its script's last line (tests/startup does it in the
        last atexit handler of the suite's own scripts; this process has no other handler of note):
        the whole process's user+sys CPU (``os.wait4``), alternated, median and spread.

    python benchmarks/bench_suite_time.py suite [-- PYTEST ARGS]
        Runs ``python -m pytest -q`` (the README's command; extra arguments after ``--``) with every
        Python process it starts logging, at exit, its start, end and CPU seconds; then prints the
        processes by script with their count and CPU, and the cores the children kept busy in each
        30 s of the run, and the suite's timeline (tests/conftest.py's ``LDT_SUITE_TIMELINE``: when
        each shared launch and background fixture started and ended, when each order of tests
        began). A process killed by a signal or ended by ``os._exit`` writes no record: the counts
        are a lower bound.

Results: docs/benchmarks.md sections 25 and 26.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STARTUP = REPO / "tests" / "startup"

_LOGGER = '''
import atexit, json, os, sys, time
def _record(t0=time.time(), path={path!r}):
    times = os.times()
    with open(path, "a") as f:
        f.write(json.dumps([os.getpid(), t0, time.time(), times[0] + times[1], sys.argv[:4]]) + "\\n")
atexit.register(_record)
import importlib.util as _u
_s = _u.spec_from_file_location("ldt_test_startup", {startup!r})
_s.loader.exec_module(_u.module_from_spec(_s))
'''


def _one_import(startup: bool) -> tuple[float, float]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if startup:
        env["PYTHONPATH"] = str(STARTUP)
    code = ("import os, time, lightning_disttrain.cli, sys; t = os.times(); "
            "assert ('transformers' in sys.modules) != %r; print(t[0] + t[1])" % startup)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - start, float(out.stdout.split()[-1])


def _alternated(measure, repeats: int) -> dict[bool, list]:
    """``measure(False)`` and ``measure(True)`` alternated ``repeats`` times (each pair side by side)."""
    rows = {False: [], True: []}
    for _ in range(repeats):
        for arm in (False, True):
            rows[arm].append(measure(arm))
    return rows


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):5.2f} s  [{min(values):.2f}-{max(values):.2f}]"


def _saved(before: list[float], after: list[float]) -> None:
    saved = [a - b for a, b in zip(before, after)]
    print(f"  cpu saved per process (pairs): median {statistics.median(saved):.2f} s [{min(saved):.2f}-{max(saved):.2f}]")


def imports(repeats: int) -> None:
    rows = _alternated(_one_import, repeats)
    print(f"import lightning_disttrain.cli, fresh interpreter, {repeats} alternated repeats ({sys.executable})")
    for startup, label in ((False, "as installed"), (True, "tests/startup")):
        wall, cpu = zip(*rows[startup])
        print(f"  {label:14s} wall {_spread(wall)}   cpu {_spread(cpu)}")
    _saved([c for _, c in rows[False]], [c for _, c in rows[True]])


def _one_exit(freeze: bool) -> float:
    env = dict(os.environ, PYTHONPATH=str(STARTUP))
    code = "import lightning_disttrain.cli" + ("; import gc; gc.freeze()" if freeze else "")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return usage.ru_utime + usage.ru_stime


def exits(repeats: int) -> None:
    rows = _alternated(_one_exit, repeats)
    print(f"import lightning_disttrain.cli and exit, whole process CPU, {repeats} alternated repeats ({sys.executable})")
    for freeze, label in ((False, "as it is"), (True, "gc.freeze() last")):
        print(f"  {label:16s} cpu {_spread(rows[freeze])}")
    _saved(rows[False], rows[True])


def suite(pytest_args: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "processes.jsonl"
        (Path(tmp) / "sitecustomize.py").write_text(
            _LOGGER.format(path=str(log), startup=str(STARTUP / "sitecustomize.py")))
        timeline = Path(tmp) / "timeline.txt"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   LDT_SUITE_TIMELINE=str(timeline))
        start = time.time()
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", *pytest_args], cwd=REPO, env=env).returncode
        wall = time.time() - start
        records = {}
        for line in log.read_text().splitlines():
            pid, t0, t1, cpu, argv = json.loads(line)
            records[pid] = (t0, t1, cpu, argv)
        events = timeline.read_text().splitlines() if timeline.exists() else []
    pytest_pid = min(records, key=lambda p: records[p][0])
    children = {p: r for p, r in records.items() if p != pytest_pid}
    print(f"suite: rc {rc}, {wall:.0f} s wall; pytest process {records[pytest_pid][2]:.0f} s CPU; "
          f"{len(children)} other processes recorded, {sum(r[2] for r in children.values()):.0f} s CPU")
    count, cpu = Counter(), Counter()
    for t0, t1, c, argv in children.values():
        key = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv[:2]))[:60]
        count[key] += 1
        cpu[key] += c
    for key, c in cpu.most_common(25):
        print(f"  {c:7.1f} s CPU  {count[key]:3d} x  {key}")
    print("cores the recorded children kept busy (CPU spread evenly over each process's life), per 30 s:")
    for b in range(int(wall // 30) + 1):
        lo, hi = start + 30 * b, start + 30 * (b + 1)
        busy = sum(c * max(0.0, min(t1, hi) - max(t0, lo)) / max(t1 - t0, 1e-3) for t0, t1, c, _ in children.values())
        print(f"  {30 * b:5d} s  {busy / 30:4.2f}")
    print("timeline (s since pytest's session started):")
    for line in events:
        print("  " + line.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("imports").add_argument("--repeats", type=int, default=5)
    sub.add_parser("exits").add_argument("--repeats", type=int, default=5)
    sub.add_parser("suite")
    args, rest = parser.parse_known_args()
    if args.what == "imports":
        imports(args.repeats)
    elif args.what == "exits":
        exits(args.repeats)
    else:
        suite([a for a in rest if a != "--"])


if __name__ == "__main__":
    main()
