"""Handing checkpoint evaluation to ``lightning-disttrain eval`` in a separate process.

``CheckpointEval(mode="subprocess")`` uses this on rank 0: once a checkpoint is complete (an async
save has its manifest), an eval process starts on it with the suite's settings and writes its
results to a JSON file; training goes on meanwhile. At most one eval process runs at a time (the
others queue, oldest first), so a slow eval never piles up processes. The launcher's environment
variables (rank, world size, master port) are removed from the child's environment: it is a new
job, not another rank of this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_disttrain.evals.results import checkpoint_complete
from lightning_disttrain.evals.suite import EvalResults, EvalSuite

_LAUNCHER_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS", "TORCHELASTIC_RUN_ID")


@dataclass
class EvalJob:
    ckpt: Path
    step: int
    epoch: int | None
    output: Path
    log: Path
    process: subprocess.Popen | None = None


@dataclass
class EvalHandoff:
    """Queue of checkpoints to evaluate in separate processes, and the one running."""

    suite: EvalSuite
    tokenizer: str
    devices: int = 1
    accelerator: str = "cpu"
    env: dict[str, str] = field(default_factory=dict)
    heldout_file: str | None = None
    """The held-out windows as a ``.pt`` file (``heldout="val"`` has no data module in the child)."""
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ldt-evals-")))
    queue: list[EvalJob] = field(default_factory=list)
    running: EvalJob | None = None

    def submit(self, ckpt: str | os.PathLike, step: int, epoch: int | None) -> None:
        name = f"step{step}-{len(self.queue)}-{Path(ckpt).name}"
        self.queue.append(EvalJob(Path(ckpt), step, epoch, self.workdir / f"{name}.json", self.workdir / f"{name}.log"))

    def command(self, job: EvalJob) -> list[str]:
        s = self.suite
        cmd = [sys.executable, "-m", "lightning_disttrain.cli", "eval", str(job.ckpt), "--tasks", ",".join(s.tasks),
               "--output", str(job.output), "--tokenizer", self.tokenizer, "--batch-size", str(s.batch_size),
               "--devices", str(self.devices), "--accelerator", self.accelerator]
        for flag, value in (("--data-dir", s.data_dir), ("--limit", s.limit), ("--max-length", s.max_length),
                            ("--heldout", self.heldout_file or s.heldout), ("--heldout-windows", s.heldout_windows),
                            ("--heldout-seq-len", s.heldout_seq_len)):
            if value is not None:
                cmd += [flag, str(value)]
        return cmd

    def _start(self, job: EvalJob) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
        env.update(self.env)
        with open(job.log, "w") as log:
            job.process = subprocess.Popen(self.command(job), stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True)
        self.running = job

    def poll(self, wait: bool = False) -> list[tuple[EvalJob, EvalResults | None, str]]:
        """Start what can start, collect what finished: ``(job, results or None, error text)``.
        With ``wait``, run the whole queue to the end (the checkpoints must be complete by then)."""
        done = []
        while True:
            if self.running is not None:
                proc = self.running.process
                if wait:
                    proc.wait()
                if proc.poll() is None:
                    return done
                done.append(self._collect(self.running))
                self.running = None
            ready = next((j for j in self.queue if checkpoint_complete(j.ckpt)), None)
            if ready is None and wait and self.queue:
                job = self.queue.pop(0)
                done.append((job, None, f"{job.ckpt} never became a complete checkpoint (no manifest)"))
                continue
            if ready is None:
                return done
            self.queue.remove(ready)
            self._start(ready)

    def _collect(self, job: EvalJob) -> tuple[EvalJob, EvalResults | None, str]:
        if job.process.returncode == 0 and job.output.is_file():
            raw: dict[str, Any] = json.loads(job.output.read_text())
            return job, EvalResults.from_dict(raw), ""
        tail = job.log.read_text()[-3000:] if job.log.is_file() else ""
        return job, None, f"the eval process for {job.ckpt} exited with {job.process.returncode}:\n{tail}"

    def close(self) -> None:
        if self.running is not None and self.running.process.poll() is None:
            self.running.process.kill()
            self.running.process.wait()
        self.running = None
