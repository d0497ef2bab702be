"""A state received from another replica group, put on this group's devices and meshes.

torchft's HTTP transport sends every tensor through host memory (CUDA tensors are copied to the
CPU before sending) and unpickles DTensors with a copy of the sender's mesh. Loading that as it
comes would copy CPU shards into CUDA parameters and compare foreign mesh objects in every
optimizer kernel; instead every received tensor is rebuilt on the receiving rank's own tensor:
its device, and for a DTensor its mesh and placements (rank k of every group holds the same
shard, so the local tensor carries over as it is). Plain torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


def like(received: Any, mine: torch.Tensor) -> Any:
    """``received`` as a tensor of this rank, shaped and placed as ``mine``."""
    if not isinstance(received, torch.Tensor):
        return received
    local = received.to_local() if isinstance(received, DTensor) else received
    if isinstance(mine, DTensor):
        target = mine.to_local()
        if local.shape != target.shape:
            raise ValueError(f"a healing replica group received a shard of shape {tuple(local.shape)} where this rank "
                             f"holds {tuple(target.shape)}: every replica group must use the same layout")
        return DTensor.from_local(local.to(device=target.device), mine.device_mesh, mine.placements,
                                  run_check=False, shape=mine.shape, stride=mine.stride())
    return local.to(device=mine.device)


def model_state_here(received: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """A received ``module.state_dict()`` on this rank's tensors (keys it does not have are kept)."""
    mine = module.state_dict()
    return {key: like(value, mine[key]) if key in mine else value for key, value in received.items()}


def optimizer_state_here(received: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A received ``optimizer.state_dict()`` whose per-parameter tensors (moments: a parameter's
    shape) are on this rank's parameters; scalars (Adam's ``step``) stay as they came, where
    ``Optimizer.load_state_dict`` puts them itself. Nested parts (``HybridOptimizer``) part by part."""
    parts = getattr(optimizer, "optimizers", None)
    if "state" not in received and isinstance(received.get("optimizers"), list) and isinstance(parts, list):
        # An optimizer of optimizers (HybridOptimizer: Muon + AdamW) nests its parts' state dicts.
        return dict(received, optimizers=[optimizer_state_here(r, o) for r, o in zip(received["optimizers"], parts)])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, values in received.get("state", {}).items():
        param = params[int(index)] if int(index) < len(params) else None
        state[index] = {name: like(value, param) if param is not None and isinstance(value, torch.Tensor)
                        and value.dim() > 0 and tuple(value.shape) == tuple(param.shape) else value
                        for name, value in values.items()}
    return dict(received, state=state)
