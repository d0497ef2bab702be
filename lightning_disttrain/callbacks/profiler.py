"""ProfilerCallback: profile a few training steps and say where their time went.

Steps ``[start_step, start_step + num_steps)`` (optimizer steps, ``trainer.global_step`` counting
from 0) run under ``torch.profiler`` with CPU activity (+ CUDA when the run is on CUDA). Then, on
every rank:

- ``<dirpath>/trace_rank<R>.json``: the Chrome / Perfetto trace (open in ui.perfetto.dev or
  chrome://tracing); gloo's collectives are the ``gloo:*`` events on its worker threads, NCCL's the
  ``ncclDevKernel_*`` kernels;
- ``<dirpath>/breakdown_rank<R>.json``: per step compute, exposed communication, overlapped
  communication, data wait, optimizer and idle seconds (``step_breakdown.py`` says how each is
  found), the wall-clock step time measured beside the profiler, the per-kind collective table
  (count, bytes, seconds) and the diagnosis.

Rank 0 prints the breakdown, the collective table and a one-line diagnosis (compute-,
communication- or dataloader-bound), and logs the mean seconds and shares of each part under
``profiler/*`` to the Trainer's loggers.

How the step is cut: the step boundaries are marks emitted at ``on_train_batch_end`` of the
micro-batch that ended an optimizer step; the optimizer span runs from ``on_before_optimizer_step``
(before gradient clipping) to that ``on_train_batch_end``; the data wait is the training
dataloader's ``next()``, marked through the Trainer's profiler (Lightning times exactly that call as
``train_dataloader_next``; there is no hook around it, see ``fetch_timing.py``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities import rank_zero_warn
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_disttrain.callbacks.fetch_timing import FETCH_ACTION, WrappedProfiler
from lightning_disttrain.callbacks.step_breakdown import (
    BOUNDARY,
    DATA_WAIT,
    OPTIMIZER,
    PARTS,
    Breakdown,
    breakdown,
    events_from_profiler,
)


class _DataWaitMarks(WrappedProfiler):
    """The Trainer's profiler, unchanged, plus a profiler range around the dataloader's ``next()``."""

    def __init__(self, inner: Profiler) -> None:
        super().__init__(inner)
        self.armed = False
        self._range: record_function | None = None

    def start(self, action_name: str) -> None:
        if self.armed and action_name.endswith(FETCH_ACTION):
            self._range = record_function(DATA_WAIT)
            self._range.__enter__()
        super().start(action_name)

    def stop(self, action_name: str) -> None:
        super().stop(action_name)
        if self._range is not None and action_name.endswith(FETCH_ACTION):
            self._range.__exit__(None, None, None)
            self._range = None


class ProfilerCallback(Callback):
    """Profile optimizer steps ``[start_step, start_step + num_steps)``; traces and a breakdown per rank.

    Args:
        start_step: the first profiled optimizer step (skip compilation and warm-up: default 3).
        num_steps: how many steps to profile (each gets its own breakdown).
        dirpath: where traces and breakdowns go; default ``<trainer.log_dir or default_root_dir>/profiler``.
        record_shapes: record operator shapes (the collective table's bytes need them).
        with_stack: record Python stacks too (large traces).
    """

    def __init__(self, start_step: int = 3, num_steps: int = 3, dirpath: str | None = None,
                 record_shapes: bool = True, with_stack: bool = False) -> None:
        if start_step < 0 or num_steps < 1:
            raise ValueError(f"ProfilerCallback(start_step={start_step}, num_steps={num_steps}): use start_step >= 0 "
                             f"and num_steps >= 1")
        self.start_step, self.num_steps, self.dirpath = start_step, num_steps, dirpath
        self.record_shapes, self.with_stack = record_shapes, with_stack
        self.result: Breakdown | None = None
        self.done = False
        self._prof: profile | None = None
        self._marks: _DataWaitMarks | None = None
        self._optim: record_function | None = None
        self._wall: list[float] = []
        self._last_step = -1

    # ---- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"done": self.done, "result": self.result.to_dict() if self.result is not None else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = bool(state_dict.get("done", False))  # a resumed run does not profile the same steps again

    # ---- hooks -----------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._marks = _DataWaitMarks(trainer.profiler)
            trainer.profiler = self._marks

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop(trainer, analyse=False)
        marks, self._marks = self._marks, None
        if marks is None:
            return
        if trainer.profiler is marks:
            trainer.profiler = marks.inner
            return
        outer = trainer.profiler  # another wrapper (MFUMonitor's) went on top: unlink ours beneath it
        while getattr(outer, "inner", None) is not None and outer.inner is not marks:
            outer = outer.inner
        if getattr(outer, "inner", None) is marks:
            outer.inner = marks.inner

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop(trainer, analyse=False)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = trainer.global_step
        if self.start_step == trainer.global_step == 0 and not self.done:
            self._start(trainer)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._prof is not None and self._optim is None:
            self._optim = record_function(OPTIMIZER)
            self._optim.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if self._optim is not None:
            self._optim.__exit__(None, None, None)
            self._optim = None
        step = trainer.global_step
        if step == self._last_step:
            return  # accumulating: not the end of an optimizer step
        self._last_step = step
        if self._prof is not None:
            self._boundary()
            if step >= self.start_step + self.num_steps:
                self._stop(trainer, analyse=True)
        elif step == self.start_step and not self.done:
            self._start(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._prof is not None:
            self._stop(trainer, analyse=len(self._wall) >= 2)
        if not self.done:
            rank_zero_warn(f"ProfilerCallback: training ended at step {trainer.global_step}, before steps "
                           f"[{self.start_step}, {self.start_step + self.num_steps}) were profiled; lower start_step "
                           f"or raise max_steps")

    # ---- profiling -------------------------------------------------------------------------

    def _start(self, trainer: pl.Trainer) -> None:
        activities = [ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # kineto prints "USDT:<time> ... profiler_start" / "profiler_stop" on every rank: its trace
        # points, logged at its level 5. It reads KINETO_LOG_LEVEL when it starts (the first profile
        # of the process); 6 is above them, and above its ERROR (4) too. A user's own value is kept.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof = profile(activities=activities, record_shapes=self.record_shapes, with_stack=self.with_stack)
        self._prof.__enter__()
        if self._marks is not None:
            self._marks.armed = True
        self._wall = []
        self._boundary()

    def _boundary(self) -> None:
        with record_function(BOUNDARY):
            pass
        self._wall.append(time.perf_counter())

    def _stop(self, trainer: pl.Trainer, analyse: bool) -> None:
        if self._prof is None:
            return
        if self._optim is not None:
            self._optim.__exit__(None, None, None)
            self._optim = None
        if self._marks is not None:
            self._marks.armed = False
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        if not analyse:
            return
        out = self._dir(trainer)
        out.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        prof.export_chrome_trace(str(out / f"trace_rank{rank}.json"))
        wall = [b - a for a, b in zip(self._wall, self._wall[1:])]
        self.result = breakdown(events_from_profiler(prof), measured=wall)
        (out / f"breakdown_rank{rank}.json").write_text(json.dumps(self.result.to_dict(), indent=1))
        self.done = True
        if trainer.is_global_zero:
            print(report(self.result, self.start_step, out), flush=True)
            metrics = {f"profiler/{p}_s": self.result.mean(p) for p in (*PARTS, "comm_overlapped")}
            metrics |= {f"profiler/{p}_frac": self.result.mean(p) / self.result.step_seconds for p in PARTS}
            metrics["profiler/step_s"] = self.result.step_seconds
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _dir(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(trainer.log_dir or trainer.default_root_dir) / "profiler"


def report(result: Breakdown, first_step: int, out: Path) -> str:
    """The breakdown table (ms per step), the collective table and the diagnosis, as printed by rank 0."""
    cols = (*PARTS, "comm_overlapped")
    lines = [f"ProfilerCallback: rank 0, {len(result.steps)} steps from step {first_step} ({result.device}); "
             f"traces and breakdowns in {out}",
             f"{'step':>5} {'total ms':>9} {'measured':>9} " + " ".join(f"{c.replace('_', ' '):>14}" for c in cols)]
    for i, s in enumerate(result.steps):
        values = [s.parts[c] for c in PARTS] + [s.comm_overlapped]
        measured = f"{s.measured * 1e3:9.1f}" if s.measured is not None else f"{'-':>9}"
        lines.append(f"{first_step + i:>5} {s.total * 1e3:9.1f} {measured} " + " ".join(f"{v * 1e3:14.1f}" for v in values))
    if result.collectives:
        lines.append(f"{'collective':>16} {'count':>6} {'MB':>10} {'ms':>9}")
        for kind, c in sorted(result.collectives.items()):
            lines.append(f"{kind:>16} {c.count:>6} {c.bytes / 1e6:10.2f} {c.seconds * 1e3:9.1f}")
    lines.append(f"diagnosis: {result.to_dict()['diagnosis']}")
    return "\n".join(lines)
