"""Helpers for multi-process CPU tests: run a script on N gloo ranks, read what each rank wrote.

Two ways to start ranks:
- ``run_lightning_script``: start the script once; ``L.Trainer(devices=N)`` inside it re-launches
  it N-1 times (Lightning's subprocess launcher), exactly as a user's run does.
- ``run_torch_script``: start N copies with the env:// variables torchrun would set (RANK,
  WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), for plain-torch tests; no torchrun agent process.

Scripts write one JSON file per rank (``rank_json``); a test reads them back with ``read_ranks``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

background_env = threading.local()
"""``background_env.base``: the environment a background thread of tests/conftest.py starts its
processes from (the session's, taken before any test ran), not ``os.environ`` as it is that
moment: a test in the main thread may have a variable monkeypatched."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(getattr(background_env, "base", None) or os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")  # N ranks on few cores: one thread each
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "PL_GLOBAL_SEED"):
        env.pop(key, None)  # a parent's launcher variables would make Lightning think it is a child
    env.update(extra or {})
    return env


def _check(procs: list[tuple[subprocess.Popen, str]], timeout: float) -> None:
    failures = []
    for proc, name in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                kill_tree(p)
            out, _ = proc.communicate()
            failures.append(f"{name}: timed out after {timeout}s\n{out[-6000:]}")
            continue
        if proc.returncode != 0:
            failures.append(f"{name}: exit code {proc.returncode}\n{out[-6000:]}{_rank_tails(out)}")
    if failures:
        raise AssertionError("\n\n".join(failures))


def _rank_tails(out: str) -> str:
    """The last lines torch printed for each rank (``[rankN]:`` prefixes): the ranks' outputs
    interleave, and the overall tail often shows only one rank's echo of another's failure."""
    ranks: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("[rank") and "]:" in line[:12]:
            ranks.setdefault(line[:line.index("]:") + 2], []).append(line)
    if len(ranks) < 2:
        return ""
    return "".join(f"\n\n--- last lines of {r} ---\n" + "\n".join(lines[-25:]) for r, lines in sorted(ranks.items()))


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every rank it launched. Ranks hung in a collective ignore SIGTERM
    (Lightning's handler itself waits on a collective), and Lightning's launcher starts the other
    ranks as children of rank 0, which ``proc.kill()`` alone would leave running; every process
    here is started in a session of its own, so its process group is exactly that tree."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def popen(cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Start a test process (and, through Lightning's launcher, its ranks) in a new session so
    that ``kill_tree`` can end all of them."""
    return subprocess.Popen(cmd, env=env or _env(), cwd=str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)


def run_lightning_script(script: Path, *args: str, timeout: float = 300) -> None:
    """Run ``script`` (which builds ``L.Trainer(devices=N, ...)``); fail with its output if it fails."""
    proc = popen([sys.executable, str(script), *map(str, args)])
    _check([(proc, script.name)], timeout)


def run_torch_script(script: Path, nprocs: int, *args: str, timeout: float = 300) -> None:
    """Run ``nprocs`` ranks of a plain-torch script that calls ``init_process_group("gloo")``."""
    port = str(free_port())
    procs = []
    for rank in range(nprocs):
        env = _env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        proc = popen([sys.executable, str(script), *map(str, args)], env=env)
        procs.append((proc, f"{script.name} rank {rank}"))
    _check(procs, timeout)


def exit_without_teardown(code: int = 0):
    """End a worker process that has destroyed its process groups and written its results, without
    the interpreter's finalisation. There, gloo process groups still referenced (device meshes,
    DTensor's caches) are destroyed with a worker thread still joinable, and now and then a rank
    aborted after its results were written: "terminate called without an active exception", exit
    -6 (seen in this suite's muon_owner_worker rank 1, 2026-12-04, and in a benchmark's cp worker,
    docs/benchmarks.md section 12; torch's atexit fix, pytorch#179291, was abandoned)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_json(out_dir: str | Path, name: str, rank: int) -> Path:
    return Path(out_dir) / f"{name}.rank{rank}.json"


def write_rank_json(out_dir: str | Path, name: str, rank: int, data: dict) -> None:
    path = rank_json(out_dir, name, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def read_ranks(out_dir: str | Path, name: str, world_size: int) -> list[dict]:
    """What each of ``world_size`` ranks wrote under ``name`` (fails naming the missing ranks)."""
    paths = [rank_json(out_dir, name, r) for r in range(world_size)]
    missing = [str(p) for p in paths if not p.exists()]
    assert not missing, f"ranks wrote no result: {missing}"
    return [json.loads(p.read_text()) for p in paths]


def in_this_process(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in the test process (a one-process baseline), keeping the
    ``PL_GLOBAL_SEED`` that ``seed_everything`` sets from leaking into other tests."""
    saved = os.environ.get("PL_GLOBAL_SEED")
    try:
        return fn(*args, **kwargs)
    finally:
        if saved is None:
            os.environ.pop("PL_GLOBAL_SEED", None)
        else:
            os.environ["PL_GLOBAL_SEED"] = saved


def worker_main(fit_run) -> None:
    """A training worker's entry: ``python WORKER.py OUT_DIR DEVICES RUN [RUN ...]`` runs
    ``fit_run(RUN, DEVICES)`` for each RUN and writes its result as this rank's JSON."""
    import torch.distributed as dist

    out_dir, devices, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    for run in runs:
        result = fit_run(run, devices)
        write_rank_json(out_dir, run, dist.get_rank() if dist.is_initialized() else 0, result)


@contextmanager
def lightning_info_lines():
    """The messages Lightning's loggers (``rank_zero_info``, the strategies' layout lines) emit
    inside the block, as a list filled while it runs."""
    lines: list[str] = []

    class Captured(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Captured()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield lines
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
