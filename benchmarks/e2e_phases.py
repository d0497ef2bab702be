"""Phase timestamps of a ``lightning-disttrain fit`` run, for ``bench_end_to_end.py``.

``PhaseTimestamps`` is a Lightning callback (``trainer.callbacks: - class_path:
e2e_phases.PhaseTimestamps`` with ``benchmarks/`` on ``PYTHONPATH``). It prints one line per
event to stderr, ``@@e2e <event> <time.monotonic()>`` (the system-wide monotonic clock, so the
parent that spawned the process can place the events on its own clock), keeps every training
step's start and end in memory, and at ``teardown`` prints them with the validation intervals,
the checkpoint saves and the final losses as one ``@@e2e-json {...}`` line.

Importing this module also wraps, for timestamps only (each wrapper calls the original with the
same arguments and returns its result), the methods no callback hook brackets: when
``lightning_disttrain`` is loaded (under ``fit``; ``e2e_lightning.py`` does not load its Lightning
layer) ``TokenDataModule.prepare_data`` / ``.setup`` (data preparation) and
``GPTModule.configure_model`` (the model build inside the strategy's setup); always
``Trainer.fit`` (its entry, after the CLI has parsed the YAML and built the Trainer) and
``Trainer.save_checkpoint`` (a checkpoint save, from the callbacks' state to the file on disk). An ``atexit`` handler marks the start of interpreter
shutdown. Nothing in the package is changed.
"""

from __future__ import annotations

import atexit
import functools
import json
import sys
import time

import lightning as L
import torch

EVENT = "@@e2e"
SUMMARY = "@@e2e-json"


def mark(name: str, t: float | None = None) -> float:
    t = time.monotonic() if t is None else t
    sys.stderr.write(f"{EVENT} {name} {t:.6f}\n")
    sys.stderr.flush()
    return t


_checkpoints: list[list[float]] = []  # [start, end] of each Trainer.save_checkpoint
_first: set[str] = set()


def _bracket(cls, name: str, label: str, first_only: bool = False, record=None) -> None:
    """Wrap ``cls.name`` to mark ``<label>_start`` / ``<label>_end`` around it (its first call only
    with ``first_only``), or append [start, end] to ``record``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if first_only and label in _first:
            return original(*args, **kwargs)
        _first.add(label)
        t0 = time.monotonic() if record is not None else mark(f"{label}_start")
        try:
            return original(*args, **kwargs)
        finally:
            if record is not None:
                record.append([t0, time.monotonic()])
            else:
                mark(f"{label}_end")

    setattr(cls, name, wrapper)


ldt = sys.modules.get("lightning_disttrain")
if getattr(ldt, "GPTModule", None) is not None:  # under `fit` (the CLI imported the package); not e2e_lightning.py's
    _bracket(ldt.TokenDataModule, "prepare_data", "prepare_data", first_only=True)
    _bracket(ldt.TokenDataModule, "setup", "dm_setup", first_only=True)
    _bracket(ldt.GPTModule, "configure_model", "configure_model", first_only=True)
_bracket(L.Trainer, "fit", "trainer_fit", first_only=True)
_bracket(L.Trainer, "save_checkpoint", "save_checkpoint", record=_checkpoints)
mark("phases_imported")
atexit.register(lambda: mark("atexit"))


class PhaseTimestamps(L.Callback):
    """Marks: ``callback_init`` (the CLI instantiating the configured classes), ``setup``,
    ``fit_start`` (model built, strategy set up, optimizers made), ``sanity_start`` / ``sanity_end``,
    ``train_start``, ``train_end`` (after the last step's validation and checkpoint), ``fit_end``,
    ``teardown``; per step start and end, validation intervals and checkpoint saves in the JSON."""

    def __init__(self) -> None:
        mark("callback_init")
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.val: list[list[float]] = []
        self.val_losses: list[float] = []
        self.train_losses: list[list[float]] = []  # [step, loss] every 10 steps and the last
        self._val_start: float | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        mark("setup")

    def on_fit_start(self, trainer, pl_module) -> None:
        mark("fit_start")

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        mark("sanity_start")

    def on_sanity_check_end(self, trainer, pl_module) -> None:
        mark("sanity_end")

    def on_train_start(self, trainer, pl_module) -> None:
        mark("train_start")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.monotonic())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.monotonic())
        step = len(self.ends)
        if step % 10 == 0 or step == trainer.max_steps:
            self.train_losses.append([step, float(outputs["loss"])])

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._val_start = time.monotonic()

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self._val_start is None:
            return
        self.val.append([self._val_start, time.monotonic()])
        loss = trainer.callback_metrics.get("val/loss")
        self.val_losses.append(float(loss) if loss is not None else float("nan"))

    def on_train_end(self, trainer, pl_module) -> None:
        mark("train_end")

    def on_fit_end(self, trainer, pl_module) -> None:
        mark("fit_end")

    def teardown(self, trainer, pl_module, stage) -> None:
        mark("teardown")
        summary = {"step_starts": self.starts, "step_ends": self.ends, "val": self.val,
                   "val_losses": self.val_losses, "train_losses": self.train_losses, "checkpoints": _checkpoints,
                   "global_step": trainer.global_step, "threads": torch.get_num_threads(),
                   "strategy": type(trainer.strategy).__name__}
        sys.stderr.write(f"{SUMMARY} {json.dumps(summary)}\n")
        sys.stderr.flush()
