"""Context parallel, the transform: give the model's position-dependent modules their place in the
``cp`` group (``models.context_parallel``). The batch's sequences are sharded by the strategy
(``strategies/context_steps.py``) before each step; FSDP already shards over ``dp_shard x cp``
(``ParallelDims``, the ``fsdp`` mesh), so the gradients are averaged over those ranks too.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from lightning_disttrain.models.context_parallel import ContextParallel


def apply_context_parallel(module: nn.Module, mesh: Any) -> int:
    """Set ``context_parallel`` on every submodule that has the attribute (GPT's attention and its
    position embedding); return how many. A model with none cannot shard its sequences; one whose
    attention has dropout (a float ``dropout`` > 0 beside the attribute) is refused: ring attention
    has none."""
    size = mesh.size()
    found = [m for m in module.modules() if hasattr(m, "context_parallel")]
    if not found:
        raise ValueError(
            f"cp={size} shards each sequence across ranks, which needs attention that attends across the shards "
            f"and positions that follow them: {type(module).__name__} has no module with a `context_parallel` "
            f"attribute (lightning_disttrain's GPT / GPTModule have one; see "
            f"lightning_disttrain/models/context_parallel.py to add it to yours), so use cp=1")
    dropout = sorted({m.dropout for m in found if isinstance(getattr(m, "dropout", None), float) and m.dropout > 0})
    if dropout:
        raise ValueError(f"cp={size} runs ring attention, which has no attention dropout, and the model's attention "
                         f"has dropout={dropout[0]}: set the model's dropout to 0 (pre-training runs use 0) or use cp=1")
    cp = ContextParallel(group=mesh, rank=mesh.get_local_rank(), size=size)
    for m in found:
        m.context_parallel = cp
    return sum(1 for m in found if type(m).__name__ != "GPT")
