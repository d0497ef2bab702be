"""The Young/Daly checkpoint interval (Young 1974, Daly 2006), shared by the planner
(``planning.throughput``, before a run) and the checkpoint cadence (``checkpoint.cadence``, during
one). It lives here, at the bottom of the package, so that both import it downward.

With a checkpoint costing C seconds and a mean time between failures M of the whole job,
checkpointing every sqrt(2·C·M) seconds minimises the expected waste (C per checkpoint plus half
an interval of lost work per failure).
"""

from __future__ import annotations

import math


def young_daly_interval(checkpoint_seconds: float, mtbf_seconds: float) -> float:
    """The checkpoint interval that minimises expected waste: sqrt(2·C·M)."""
    if checkpoint_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError(f"checkpoint cost ({checkpoint_seconds} s) and MTBF ({mtbf_seconds} s) must be > 0")
    return math.sqrt(2 * checkpoint_seconds * mtbf_seconds)
