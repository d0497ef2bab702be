"""How often to checkpoint, from arithmetic: the Young/Daly interval.

With a checkpoint costing C seconds of training time and a mean time between failures M of the
whole job, checkpointing every sqrt(2·C·M) seconds minimises the expected waste (C per checkpoint
plus half an interval of lost work per failure; Young 1974, Daly 2006).

- C: the time a save stops training. For an async save that is its blocking part (staging to CPU
  memory), not the whole write; the whole write bounds the interval from below, because a save
  waits for the previous one (``CheckpointWriter.timings`` records both per save).
- M: failures arrive at the sum of their rates. Each device fails independently (per-device MTBF
  hours / device count); spot instances add their preemption rate; a preemption that is announced
  (SIGTERM, metadata notice) costs no lost work with ``PreemptionCheckpoint``, only the save.

``planning.throughput`` (the ``plan`` command) uses the same formula (``lightning_disttrain.young_daly``)
before a run; this module turns measured costs into ``every_n_train_steps`` during one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_disttrain.young_daly import young_daly_interval


def job_mtbf_seconds(device_mtbf_hours: float | None = None, devices: int = 1,
                     preemptions_per_hour: float = 0.0) -> float:
    """The whole job's mean time between failures: 1 / (devices / device MTBF + preemption rate)."""
    if devices < 1:
        raise ValueError(f"devices={devices}: count the devices of the job (>= 1)")
    if device_mtbf_hours is not None and device_mtbf_hours <= 0:
        raise ValueError(f"device_mtbf_hours={device_mtbf_hours} must be > 0 (e.g. 50000, Llama 3's fleet)")
    if preemptions_per_hour < 0:
        raise ValueError(f"preemptions_per_hour={preemptions_per_hour} must be >= 0 (e.g. 0.05: one per 20 h)")
    rate_per_hour = (devices / device_mtbf_hours if device_mtbf_hours else 0.0) + preemptions_per_hour
    if rate_per_hour == 0:
        raise ValueError("no failure rate: give device_mtbf_hours (per device) and/or preemptions_per_hour")
    return 3600.0 / rate_per_hour


@dataclass(frozen=True)
class Cadence:
    """A checkpoint interval and what it came from."""

    interval_s: float
    """Seconds between checkpoints: Young/Daly, but never below ``write_s``."""
    cost_s: float
    mtbf_s: float
    write_s: float
    every_n_steps: int | None = None
    """The interval in optimizer steps (None without a step time)."""
    step_s: float | None = None

    @property
    def expected_overhead(self) -> float:
        """Fraction of the run spent saving and redoing lost work: C/interval + interval/(2M)."""
        return self.cost_s / self.interval_s + self.interval_s / (2 * self.mtbf_s)

    def describe(self) -> str:
        steps = f" = every {self.every_n_steps} steps at {self.step_s:.3g} s/step" if self.every_n_steps else ""
        return (f"checkpoint every {self.interval_s:.0f} s{steps} (Young/Daly sqrt(2 x cost {self.cost_s:.3g} s x "
                f"job MTBF {self.mtbf_s / 3600:.3g} h); expected overhead {self.expected_overhead:.2%}")


def checkpoint_cadence(cost_s: float, mtbf_s: float, write_s: float = 0.0, step_s: float | None = None) -> Cadence:
    """The Young/Daly interval for a save that stops training ``cost_s`` and takes ``write_s`` in
    all, with job MTBF ``mtbf_s``; in steps too when the step time ``step_s`` is known."""
    if write_s < 0:
        raise ValueError(f"write_s={write_s} must be >= 0")
    if step_s is not None and step_s <= 0:
        raise ValueError(f"step_s={step_s} must be > 0 (seconds per optimizer step)")
    interval = max(young_daly_interval(cost_s, mtbf_s), write_s)
    steps = None if step_s is None else max(1, math.floor(interval / step_s + 0.5))
    return Cadence(interval, cost_s, mtbf_s, write_s, steps, step_s)
