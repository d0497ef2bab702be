"""Replica groups of a fault-tolerant run as separate launches, for the tests and the benchmark.

A torchft lighthouse in this process; each group is ``ft_replica.py`` started in a session of its
own (so a SIGKILL of the session ends the group and every rank Lightning launched for it), its
output in ``OUT/RUN.g<G>.launch<N>.log``. ``records(g)`` reads what the group's rank wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse (in this process) logs every quorum at INFO
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from dist_utils import _env  # noqa: E402

WORKER = HERE / "ft_replica.py"


class ReplicaGroups:
    def __init__(self, out: Path, data: Path, run: str, *, groups: int = 2, devices: int = 1, steps: int = 8,
                 sleep: float = 0.0, min_replicas: int = 1, lighthouse_min_replicas: int = 1,
                 heartbeat_timeout_ms: int = 1000, gated: bool = False, extra: list[str] | None = None) -> None:
        from lightning_disttrain.fault_tolerance.lighthouse import start_lighthouse

        self.out, self.data, self.run, self.groups, self.devices = Path(out), Path(data), run, groups, devices
        self.steps, self.sleep, self.min_replicas, self.extra = steps, sleep, min_replicas, list(extra or [])
        self.lighthouse = start_lighthouse(0, min_replicas=lighthouse_min_replicas, join_timeout_ms=1000,
                                           quorum_tick_ms=100, heartbeat_timeout_ms=heartbeat_timeout_ms)
        self.address = f"http://localhost:{self.lighthouse.address().rpartition(':')[2]}"
        self.procs: dict[int, list[subprocess.Popen]] = {g: [] for g in range(groups)}
        self.extra_for: dict[int, list[str]] = {}
        """More arguments for one group's launches."""
        self.gate = self.out / f"{run}.gate" if gated else None
        if self.gate is not None:
            self.gate.mkdir(parents=True, exist_ok=True)

    def go(self) -> None:
        (self.gate / "go").touch()

    def hold(self, on: bool) -> None:
        path = self.gate / "hold"
        path.touch() if on else path.unlink(missing_ok=True)

    def launch(self, g: int) -> subprocess.Popen:
        n = len(self.procs[g])
        cmd = [sys.executable, str(WORKER), str(self.out), str(self.data), self.run, "--devices", str(self.devices),
               "--replica-id", str(g), "--groups", str(self.groups), "--lighthouse", self.address,
               "--min-replicas", str(self.min_replicas), "--steps", str(self.steps), "--sleep", str(self.sleep),
               *(["--gate", str(self.gate)] if self.gate is not None else []), *self.extra,
               *self.extra_for.get(g, [])]
        log = open(self.out / f"{self.run}.g{g}.launch{n}.log", "w")
        env = _env({"RUST_LOG": "warn"})
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[g].append(proc)
        return proc

    def start_and_kill(self, victim: int, after_step: int, delay: float = 0.0) -> float:
        """Launch every group, release them together once all have started (``gated``), and SIGKILL
        group ``victim`` ``delay`` s after it recorded step ``after_step``; return the kill time."""
        for g in range(self.groups):
            self.launch(g)
        self.wait_until(lambda: all(self.records(g, event="start") for g in range(self.groups)), 120,
                        "every group started")
        self.go()
        self.wait_until(lambda: any(r["step"] >= after_step for r in self.records(victim)), 120,
                        f"group {victim}'s step {after_step}")
        time.sleep(delay)
        killed = time.time()
        self.kill(victim)
        return killed

    def run_all(self, timeout: float) -> dict[int, int]:
        """Launch every group, wait for each to exit (at most ``timeout`` s in all) and return the
        exit codes; every process is gone afterwards."""
        try:
            for g in range(self.groups):
                self.launch(g)
            return self.wait_all(timeout)
        finally:
            self.close()

    def kill(self, g: int) -> None:
        """SIGKILL group ``g``'s launch and every rank it started."""
        proc = self.procs[g][-1]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def records(self, g: int, rank: int = 0, event: str | None = "step") -> list[dict]:
        path = self.out / f"{self.run}.g{g}.rank{rank}.jsonl"
        if not path.exists():
            return []
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
        return [r for r in lines if event is None or r.get("event") == event]

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{self.logs()}")
            for g, procs in self.procs.items():
                if procs and procs[-1].poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"group {g} exited with {procs[-1].returncode}\n{self.logs()}")
            time.sleep(0.05)

    def wait_all(self, timeout: float) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for g, procs in self.procs.items():
            try:
                codes[g] = procs[-1].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.close()
                raise AssertionError(f"group {g} did not finish within {timeout:g} s\n{self.logs()}") from None
        return codes

    def logs(self) -> str:
        parts = []
        for path in sorted(self.out.glob(f"{self.run}.g*.launch*.log")):
            parts.append(f"--- {path.name}\n{path.read_text()[-4000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(timeout=30)
        self.lighthouse.shutdown()
