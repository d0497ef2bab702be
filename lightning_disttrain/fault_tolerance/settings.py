"""What a fault-tolerant run needs to know: which replica group this launch is, how many there
can be, where the lighthouse is, and how few may train on.

Plain Python. ``NDParallelStrategy(fault_tolerance=FaultTolerance(...))`` (or the same keys under
``fault_tolerance:`` in a LightningCLI YAML) validates it at construction, before any process or
connection exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

REPLICA_ID_ENV = "LDT_FT_REPLICA_ID"
"""Read when ``replica_id`` is not given: ``lightning-disttrain ft-local`` sets it per replica group."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's own variable for the lighthouse address, read when ``lighthouse`` is not given."""


@dataclass
class FaultTolerance:
    """Opt-in fault tolerance across data-parallel replica groups (torchft).

    Each replica group is its own launch (``lightning-disttrain fit`` / ``torchrun``) with its own
    ranks; FSDP2 / TP / PP / CP / EP run inside it as without fault tolerance. Across groups the
    gradients are averaged over the *live* groups only, a step is applied only when the quorum
    committed it, and a group that (re)joins copies the model, optimizer, LR schedulers, loop
    counters and data position from a live group before it trains.

    Args:
        num_replica_groups: how many replica groups the run may have (the data is split over this
            many; a missing group's share of each global batch is skipped, not redistributed).
        replica_id: this launch's group, 0 .. num_replica_groups - 1 (default: ``$LDT_FT_REPLICA_ID``).
        lighthouse: the torchft lighthouse, ``http://host:port`` (default: ``$TORCHFT_LIGHTHOUSE``).
        min_replicas: fewest live groups that may train; below it the run saves a checkpoint and stops.
        timeout_s: cross-group collectives, commits and state transfers.
        quorum_timeout_s: waiting for a quorum.
        connect_timeout_s: reaching the lighthouse at start (an unreachable one fails the run
            after this long, with the address in the message).
        average_after_backward: False (default): each FSDP unit's gradient is averaged over the
            groups as soon as its reduce-scatter is done, inside the backward (FSDP's all-reduce
            hook), overlapped with the rest of it. Every group must then reduce the same units in
            the same order: a model with parameters that some steps leave without a gradient
            (as DDP's ``find_unused_parameters``) needs True: the whole gradient is averaged after
            the backward, in buckets, exposed. Gradient accumulation with sharded gradients (the
            default) averages after the backward too (once per step instead of once per micro-batch).
    """

    num_replica_groups: int = 2
    replica_id: Optional[int] = None
    lighthouse: Optional[str] = None
    min_replicas: int = 1
    timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    average_after_backward: bool = False

    def __post_init__(self) -> None:
        n = self.num_replica_groups
        if not _is_int(n) or n < 1:
            raise ValueError(f"fault_tolerance.num_replica_groups={n!r}: give the number of replica groups the run "
                             f"may have (an int >= 1)")
        if self.replica_id is None and os.environ.get(REPLICA_ID_ENV, "").strip():
            raw = os.environ[REPLICA_ID_ENV].strip()
            if not raw.lstrip("-").isdigit():
                raise ValueError(f"${REPLICA_ID_ENV}={raw!r}: set it to this replica group's index (0 .. {n - 1})")
            self.replica_id = int(raw)
        if self.replica_id is None:
            raise ValueError(f"fault_tolerance.replica_id is not set: give each replica group's launch its index "
                             f"(0 .. {n - 1}) as fault_tolerance.replica_id or ${REPLICA_ID_ENV}")
        if not _is_int(self.replica_id) or not 0 <= self.replica_id < n:
            raise ValueError(f"fault_tolerance.replica_id={self.replica_id!r} is not one of 0 .. {n - 1} "
                             f"(num_replica_groups={n})")
        if not _is_int(self.min_replicas) or not 1 <= self.min_replicas <= n:
            raise ValueError(f"fault_tolerance.min_replicas={self.min_replicas!r}: choose 1 .. {n} (the fewest live "
                             f"replica groups that may train on)")
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"fault_tolerance.{name}={value!r}: a number of seconds > 0")
        if not isinstance(self.average_after_backward, bool):
            raise ValueError(f"fault_tolerance.average_after_backward={self.average_after_backward!r}: true or false")
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "").strip() or None
        if address is None:
            raise ValueError(f"fault_tolerance.lighthouse is not set: start one (lightning-disttrain ft-lighthouse) "
                             f"and pass its address (http://host:port) as fault_tolerance.lighthouse or "
                             f"${LIGHTHOUSE_ENV}")
        self.lighthouse = normalize_address(address)

    @classmethod
    def coerce(cls, value: Any) -> Optional["FaultTolerance"]:
        """None, a ``FaultTolerance``, or its keys as a dict (from a YAML) -> a ``FaultTolerance``."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise ValueError(f"fault_tolerance: unknown key(s) {unknown}; the keys are "
                                 f"{sorted(cls.__dataclass_fields__)}")
            return cls(**value)
        raise TypeError(f"fault_tolerance={value!r}: pass a lightning_disttrain.fault_tolerance.FaultTolerance or "
                        f"a dict of its keys")


def normalize_address(address: str) -> str:
    """``host:port`` or ``http://host:port`` -> ``http://host:port`` (what torchft connects to)."""
    text = str(address).strip()
    rest = text[len("http://"):] if text.startswith("http://") else text
    host, sep, port = rest.rpartition(":")
    if "://" in rest or not sep or not host or not port.isdigit():
        raise ValueError(f"lighthouse address {address!r}: write it as http://host:port (e.g. http://localhost:29510)")
    return f"http://{host}:{port}"


def host_and_port(address: str) -> tuple[str, int]:
    host, _, port = normalize_address(address)[len("http://"):].rpartition(":")
    return host.strip("[]"), int(port)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
