"""Time the training dataloader's ``next()`` through the Trainer's profiler (for MFUMonitor).

Lightning 2.6 times exactly that call, and nothing else, as the profiler action
``[_TrainingEpochLoop].train_dataloader_next``. There is no callback or module hook right before
or after it: the epoch loop hands the action to its data fetcher's private ``_start_profiler`` /
``_stop_profiler``, and ``on_train_batch_start`` comes only after the batch transfer and other
callbacks' hooks. So the monitor wraps the Trainer's profiler, delegating everything to it.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch.profilers import Profiler

FETCH_ACTION = "train_dataloader_next"


class WrappedProfiler(Profiler):
    """The Trainer's profiler, unchanged: every call and attribute goes to ``inner``. Subclasses
    add to ``start`` / ``stop`` (calling ``super()``)."""

    def __init__(self, inner: Profiler) -> None:
        # No Profiler.__init__: files, streams and state stay the wrapped profiler's.
        self.inner = inner

    def start(self, action_name: str) -> None:
        self.inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)

    def summary(self) -> str:
        return self.inner.summary()

    def describe(self) -> None:
        self.inner.describe()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self.inner.setup(stage, local_rank=local_rank, log_dir=log_dir)

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)

    def __getattr__(self, name: str) -> Any:  # dirpath, filename, ... of the wrapped profiler
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __del__(self) -> None:
        pass  # the wrapped profiler tears itself down


class FetchTimingProfiler(WrappedProfiler):
    """The Trainer's profiler, unchanged, plus a clock on the training dataloader's ``next()``."""

    def __init__(self, inner: Profiler) -> None:
        super().__init__(inner)
        self.fetch_s = 0.0
        self._t0: float | None = None

    def start(self, action_name: str) -> None:
        if action_name.endswith(FETCH_ACTION):
            self._t0 = time.perf_counter()
        super().start(action_name)

    def stop(self, action_name: str) -> None:
        super().stop(action_name)
        if action_name.endswith(FETCH_ACTION) and self._t0 is not None:
            self.fetch_s += time.perf_counter() - self._t0
            self._t0 = None
