"""Fault tolerance across data-parallel replica groups (torchft): settings, the per-step
membership of one group, and the lighthouse. The Lightning side is
``strategies/fault_tolerant_steps.py``; torchft is imported only when a run uses it."""

from .settings import FaultTolerance

__all__ = ["FaultTolerance"]
