"""Muon on the routed experts' stacks: each expert's matrix orthogonalised on its own, where it lives.

A mixture of experts keeps each weight of its routed experts as one ``(experts, rows, cols)``
stack (``models.moe``). Muon is defined per matrix, so each expert's ``rows x cols`` slice is one
matrix: its momentum, its Newton-Schulz iteration, its update, exactly as ``torch.optim.Muon``
treats a 2-D parameter of that shape (the same iteration, ``parallel.muon.newton_schulz``; the
learning rate adjusted for ``rows x cols``). ``torch.optim.Muon`` itself takes only 2-D parameters.

Expert parallel and FSDP2 split a stack along its experts (dim 0: ``Shard(0)``, or FSDP2's
``_StridedShard(0)`` over expert parallel), never inside a matrix, so every rank holds whole expert
matrices, possibly none: each rank orthogonalises its own experts, with no communication, and the
work divides over the ranks that split the experts. A stack split inside its matrices (dim 1 or 2)
or with a pending reduction is refused (``expert_layout_problem``); ``optim.build_optimizer`` then
leaves the experts to AdamW, with a warning.

State: ``momentum_buffer`` per stack, like the gradient (a DTensor under a mesh), the key
``torch.optim.Muon`` uses.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Replicate

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain.parallel.muon import NS_DTYPE, _local, adjusted_lr, closure_loss, momentum_update, newton_schulz

DEFAULTS = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315),
                eps=1e-7, ns_steps=5, adjust_lr_fn=None)
"""``torch.optim.Muon``'s defaults (tests/parallel/test_expert_muon.py checks they are still torch's)."""


def expert_layout_problem(param: torch.Tensor) -> str | None:
    """Why ``ExpertMuon`` cannot take ``param`` (None: it can)."""
    if param.dim() != 3:
        return f"expert Muon takes (experts, rows, cols) stacks; this parameter has shape {tuple(param.shape)}"
    if not isinstance(param, DTensor):
        return None
    strided = torch_compat.strided_shard_type()
    for placement in param.placements:
        if isinstance(placement, Replicate):
            continue
        if (placement.is_shard() or isinstance(placement, strided)) and placement.dim == 0:
            continue
        return (f"placements {tuple(param.placements)} over mesh dimensions {param.device_mesh.mesh_dim_names}: "
                f"expert Muon takes stacks split along their experts only (Shard(0), _StridedShard(0)), not {placement}")
    return None


class ExpertMuon(torch.optim.Optimizer):
    """Muon on ``(experts, rows, cols)`` stacks, each expert's matrix on its own (module docstring).
    Hyperparameters as ``torch.optim.Muon``'s; ``ns_dtype`` as ``ShardedMuon``'s (torch's bf16, or
    float32 for the iteration and nothing else)."""

    def __init__(self, params: Iterable, *, ns_dtype: torch.dtype = NS_DTYPE, **hyper):
        unknown = set(hyper) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"ExpertMuon got unexpected arguments {sorted(unknown)}; it takes {sorted(DEFAULTS)}")
        defaults = {**DEFAULTS, **hyper}
        if defaults["adjust_lr_fn"] not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {defaults['adjust_lr_fn']} is not supported")
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                problem = expert_layout_problem(p)
                if problem:
                    raise ValueError(f"ExpertMuon: a parameter of shape {tuple(p.shape)}: {problem}")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, wd = float(group["lr"]), group["weight_decay"]
            ns = (group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = momentum_update(self.state[p], p.grad, group["momentum"], group["nesterov"])
                local = _local(p)
                step = adjusted_lr(lr, group["adjust_lr_fn"], p.shape[1:])
                # this rank's experts (possibly none), each a matrix: one iteration per expert, as
                # torch's Muon would run it (a batched iteration would be faster, not bitwise the same)
                for e in range(local.size(0)):
                    local[e].mul_(1 - lr * wd)
                    local[e].add_(newton_schulz(update[e], *ns), alpha=-step)
        return loss

