"""CheckpointCadence: log the Young/Daly checkpoint interval, and optionally apply it.

At the start of training it logs the job MTBF and the formula (with ``checkpoint_cost_s`` when
given). Once a save has been measured (the DCP strategies' ``CheckpointWriter.timings``: the
blocking time is the cost, the whole write a lower bound on the interval) and the step time is
known, it logs the interval in seconds and in steps; with ``apply=True`` it sets every
``ModelCheckpoint``'s ``every_n_train_steps`` to it.

Ranks measure different times, and every rank must save at the same steps: the measurement is
made at one agreed step (the step after the first save, or ``decide_at_step``) and its maximum
over the ranks taken with one all-reduce, so every rank computes the same number.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_disttrain import comm
from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain.checkpoint.cadence import (
    Cadence,
    checkpoint_cadence,
    job_mtbf_seconds,
)

log = logging.getLogger(__name__)


class CheckpointCadence(Callback):
    """Log the Young/Daly checkpoint interval (in seconds and in steps), and optionally apply it.

    Args:
        device_mtbf_hours: mean time between failures of one device (50,000 h: Llama 3's fleet).
        preemptions_per_hour: spot preemptions per hour for the whole job (0: on-demand).
        devices: devices of the job; default: the trainer's world size.
        checkpoint_cost_s: the cost of one save if known; default: measured from the first save.
        apply: set ``every_n_train_steps`` of every ModelCheckpoint to the interval.
        decide_at_step: the global step at which to measure and decide; default: the step after
            the first ModelCheckpoint save.
    """

    def __init__(self, device_mtbf_hours: float | None = 50_000.0, preemptions_per_hour: float = 0.0,
                 devices: int | None = None, checkpoint_cost_s: float | None = None, apply: bool = False,
                 decide_at_step: int | None = None) -> None:
        if checkpoint_cost_s is not None and checkpoint_cost_s <= 0:
            raise ValueError(f"checkpoint_cost_s={checkpoint_cost_s} must be > 0, or None to measure it")
        if decide_at_step is not None and decide_at_step < 1:
            raise ValueError(f"decide_at_step={decide_at_step} must be >= 1")
        job_mtbf_seconds(device_mtbf_hours, devices or 1, preemptions_per_hour)  # validates now
        self.device_mtbf_hours, self.preemptions_per_hour = device_mtbf_hours, preemptions_per_hour
        self.devices, self.checkpoint_cost_s, self.apply = devices, checkpoint_cost_s, apply
        self.decide_at_step = decide_at_step
        self.cadence: Cadence | None = None
        """The decision, once made (the same on every rank)."""
        self._step_times: list[float] = []
        self._last_end: float | None = None
        self._last_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.mtbf_s = job_mtbf_seconds(self.device_mtbf_hours, self.devices or trainer.world_size,
                                       self.preemptions_per_hour)
        if self.decide_at_step is None:
            every = [compat.every_n_train_steps(cb) for cb in trainer.checkpoint_callbacks
                     if isinstance(cb, ModelCheckpoint) and compat.every_n_train_steps(cb) > 0]
            self.decide_at_step = (min(every) if every else 1) + 1
        cost = (f"cost {self.checkpoint_cost_s:.3g} s" if self.checkpoint_cost_s
                else f"cost measured at step {self.decide_at_step}")
        if trainer.is_global_zero:
            log.warning("checkpoint cadence: job MTBF %.3g h (%s devices, device MTBF %s h, %s preemptions/h); "
                        "Young/Daly interval sqrt(2 x %s x MTBF)", self.mtbf_s / 3600,
                        self.devices or trainer.world_size, self.device_mtbf_hours, self.preemptions_per_hour, cost)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step, now = trainer.global_step, time.perf_counter()
        if step == self._last_step:
            return  # accumulating: not an optimizer step yet
        if self._last_end is not None:
            self._step_times.append(now - self._last_end)
        self._last_step, self._last_end = step, now
        if self.cadence is None and step == self.decide_at_step:
            self._decide(trainer)
            self._last_end = time.perf_counter()  # the decision's collective is not a step

    def _decide(self, trainer: pl.Trainer) -> None:
        timings = [t for t in getattr(getattr(trainer.strategy, "_dcp_writer", None), "timings", [])]
        cost = self.checkpoint_cost_s or (timings[0].blocking_s if timings else None)
        if cost is None:
            if trainer.is_global_zero:
                log.warning("checkpoint cadence: no save measured by step %d (this strategy does not time its saves, "
                            "or no save happened); pass checkpoint_cost_s", trainer.global_step)
            self.cadence = None
            return
        write = max((t.total_s or t.blocking_s for t in timings), default=cost)
        # The step that saved is not a training step's time: take the fastest recent step.
        step_s = min(self._step_times[-3:]) if self._step_times else None
        cost, write, step_s = _max_over_ranks(trainer, cost, write, step_s or 0.0)
        self.cadence = checkpoint_cadence(cost, self.mtbf_s, write, step_s or None)
        if self.apply and self.cadence.every_n_steps:
            for cb in trainer.checkpoint_callbacks:
                if isinstance(cb, ModelCheckpoint) and compat.every_n_train_steps(cb) > 0:
                    compat.set_every_n_train_steps(cb, self.cadence.every_n_steps)
        if trainer.is_global_zero:
            log.warning("checkpoint cadence: %s%s", self.cadence.describe(),
                        "; applied to ModelCheckpoint(every_n_train_steps)" if self.apply else "")


def _max_over_ranks(trainer: pl.Trainer, *values: float) -> list[float]:
    if not comm.is_distributed() or trainer.world_size == 1:
        return list(values)
    return comm.all_reduce(torch.tensor(values, dtype=torch.float64), op="max").tolist()
