"""Clocks that mark points of a training step now and tell the seconds between two marks later.

``mark()`` never waits: on a GPU it records a CUDA event in the current stream, so the mark is the
moment the device reaches that point of the queued work, not the moment the host enqueued it.
``seconds(start, end)`` is the only call that may wait (for ``end`` to have happened). A callback
that marks every step and reads seconds only at the steps it reports synchronises with the device
only there; the steps in between run as they would without it.

``HostClock`` is ``time.perf_counter``: exact on CPU, where the host does the work; on a GPU it
times the host's enqueueing, which runs ahead of the device between synchronising calls.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class HostClock:
    """Marks are ``time.perf_counter()`` values."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """Marks are timing CUDA events recorded in ``device``'s current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # waits for this one event (and so for start, earlier in the stream)
        return start.elapsed_time(end) / 1e3


def clock_for(device: torch.device, device_timeline: bool = True) -> Any:
    """The device's own timeline where it has one (CUDA), else the host's."""
    if device_timeline and device.type == "cuda":
        return CudaClock(device)
    return HostClock()
