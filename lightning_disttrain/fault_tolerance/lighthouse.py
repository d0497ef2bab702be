"""The torchft lighthouse: where replica groups meet for each step's quorum.

``start_lighthouse`` runs torchft's ``LighthouseServer`` in this process (what
``lightning-disttrain ft-lighthouse`` and ``ft-local`` do); ``check_reachable`` is the first thing a
fault-tolerant run does, so that a wrong address is one clear error instead of a Manager waiting
out its connect timeout inside torchft.
"""

from __future__ import annotations

import socket
import time

from .replicas import require_torchft
from .settings import host_and_port, normalize_address


class LighthouseUnreachable(RuntimeError):
    """No lighthouse answers at the configured address."""


def start_lighthouse(port: int = 0, *, min_replicas: int = 1, join_timeout_ms: int = 1000,
                     quorum_tick_ms: int = 100, heartbeat_timeout_ms: int = 5000):
    """A ``torchft.coordination.LighthouseServer`` bound to every interface at ``port`` (0: any free
    one). ``heartbeat_timeout_ms`` is how long a silent replica group counts as alive: the time the
    survivors wait before their next quorum after a group dies. ``.address()`` is what replica
    groups connect to; ``.shutdown()`` stops it."""
    require_torchft()
    from torchft.coordination import LighthouseServer

    if min_replicas < 1:
        raise ValueError(f"min_replicas={min_replicas}: a quorum needs at least one replica group")
    return LighthouseServer(bind=f"[::]:{int(port)}", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)


def check_reachable(address: str, timeout_s: float) -> None:
    """Raise ``LighthouseUnreachable`` unless a TCP connection to ``address`` opens within ``timeout_s``."""
    address = normalize_address(address)
    host, port = host_and_port(address)
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise LighthouseUnreachable(
        f"the torchft lighthouse at {address} did not answer within {timeout_s:g} s ({last}); start it first "
        f"(lightning-disttrain ft-lighthouse --port {port}) or fix fault_tolerance.lighthouse / $TORCHFT_LIGHTHOUSE")
