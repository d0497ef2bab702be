"""FSDP2 (``fully_shard``): ZeRO-2/3 and HSDP per block, plus gradient-norm clipping over DTensors.

Plain torch, no Lightning: the strategy calls ``apply_fsdp`` as the last model transform (the
``fsdp`` stage, outermost so its hooks stay outside compiled code) and ``clip_grad_norm_`` from
Lightning's clipping hook.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_disttrain.parallel.plan import ParallelPlan

_PRECISION_DTYPES: dict[str, torch.dtype | None] = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "bf16": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "16": torch.float16,
    "32-true": None,
    "32": None,
    "64-true": None,
    "64": None,
}


def mp_policy_for_precision(precision: str | None) -> MixedPrecisionPolicy:
    """The ``MixedPrecisionPolicy`` matching a Lightning precision string.

    Half precisions compute in 16 bit (parameters are all-gathered in it, halving that traffic)
    but reduce gradients in fp32: a sum over hundreds of ranks in bf16 loses most of its mantissa.
    The sharded parameters the optimizer updates keep their own dtype (fp32 for ``*-mixed``).
    Full precisions (``32-true``, ``64-true``) and None change nothing.
    """
    key = str(precision) if precision is not None else "32-true"
    if key not in _PRECISION_DTYPES:
        raise ValueError(f"no FSDP mixed-precision policy for precision={precision!r}; use one of "
                         f"{sorted(_PRECISION_DTYPES)} or pass mp_policy=MixedPrecisionPolicy(...) explicitly")
    dtype = _PRECISION_DTYPES[key]
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def fsdp_root(module: nn.Module) -> nn.Module:
    """The smallest submodule that owns every parameter of ``module`` (``module`` itself if none).

    FSDP's root unit must own all parameters no block claimed (embedding, final norm, tied head)
    and must be *called*: its forward pre-hook all-gathers them. In a LightningModule that keeps
    its network in one attribute (``self.model``) that attribute is the root, and the
    LightningModule's own ``training_step`` stays outside FSDP's hooks.
    """
    wanted = {id(p) for p in module.parameters()}
    root = module
    while True:
        children = [c for c in root.children() if {id(p) for p in c.parameters()} == wanted]
        if len(children) != 1:
            return root
        root = children[0]


def apply_fsdp(
    module: nn.Module,
    plan: ParallelPlan,
    mesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
) -> None:
    """Shard ``module`` with FSDP2: each block, each plan group, then ``module`` as the root.

    Args:
        module: the root unit; it must be called in forward (see ``fsdp_root``) and contain the blocks.
        plan: ``plan.blocks`` are sharded one unit each, ``plan.fsdp_groups`` one unit per list;
            whatever is left (tied embedding/head, norms) belongs to the root unit.
        mesh: 1-D (shard: FSDP) or 2-D (replicate, shard: HSDP) ``DeviceMesh``.
        mp_policy: parameter / gradient-reduction dtypes (``mp_policy_for_precision``).
        reshard_after_forward: True frees the all-gathered parameters after each block's forward
            and all-gathers them again in backward (ZeRO-3); False keeps them until the backward
            (ZeRO-2: one all-gather per step instead of two, full parameters held meanwhile); an
            int reshards to groups of that many ranks (e.g. one node) so the backward all-gather
            stays on fast links.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory; the
            optimizer step then runs on the CPU.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    offload: OffloadPolicy = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
                              if cpu_offload else OffloadPolicy())
    common: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}
    blocks = list(plan.blocks)
    for i, block in enumerate(blocks):
        # The last block's backward starts right after the forward ends, so resharding it would
        # only buy an immediate second all-gather (torchtitan does the same).
        last = i == len(blocks) - 1
        reshard = False if (last and reshard_after_forward is not False) else reshard_after_forward
        fully_shard(block, reshard_after_forward=reshard, **common)
    for group in plan.fsdp_groups:
        # A list is one unit: one all-gather / reduce-scatter for its modules together.
        fully_shard(group[0] if len(group) == 1 else list(group),
                    reshard_after_forward=reshard_after_forward, **common)
    # The root: None lets FSDP keep the root's parameters after forward (its head is the first
    # thing backward needs), the same reasoning as for the last block.
    fully_shard(module, reshard_after_forward=None, **common)


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def dtensor_rng_supported(mesh) -> bool:
    """Whether DTensor's random ops initialise a shard as the slice of one full random tensor on
    this mesh (CUDA-like devices). Elsewhere each rank would draw its shard from its local RNG."""
    from torch.distributed.tensor._random import is_rng_supported_mesh

    with warnings.catch_warnings():  # it warns on every unsupported mesh; the answer is enough
        warnings.simplefilter("ignore")
        return is_rng_supported_mesh(mesh)


@torch.no_grad()
def broadcast_module_(module: nn.Module, src: int = 0, group=None) -> None:
    """Overwrite every parameter and buffer with rank ``src``'s (before sharding: full tensors)."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        dist.broadcast(t.detach(), src=src, group=group)


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def reshard(module: nn.Module) -> None:
    """Free the parameters that units which do not reshard after forward (the root, the last
    block, ZeRO-2) still hold gathered. Backward normally does that; a forward without backward
    (validation, test, predict) leaves them gathered until the next training step."""
    for m in fsdp_modules(module):
        m.reshard()


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Turn FSDP's gradient reduce-scatter (and HSDP's all-reduce) on or off for every unit.

    Off, backward accumulates unsharded gradients locally; the next backward with it on reduces
    the sum once. Gradient accumulation thus communicates once per optimizer step, at the cost of
    holding a full gradient per unit meanwhile.
    """
    for m in fsdp_modules(module):
        m.set_requires_gradient_sync(enabled, recurse=False)


@torch.no_grad()
def grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0, *,
              error_if_nonfinite: bool = False, foreach: bool | None = None, pp_mesh=None) -> torch.Tensor:
    """Total gradient norm over all ranks, as a plain (replicated) tensor.

    Gradients are grouped by (mesh, placements): each group's norm is one DTensor reduction
    (``torch.nn.utils.get_total_norm``) made whole with ``full_tensor()``, and the groups' norms
    are combined locally. Torch's own ``clip_grad_norm_`` stacks all gradients' norms into one
    tensor, which fails once parameters live on different meshes (FSDP-only parameters next to
    FSDP x TP ones, experts on their own mesh). Pipeline stages hold disjoint parameters, so with
    ``pp_mesh`` their partial norms are summed (max for inf) across stages.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        key = (id(g.device_mesh), g.placements) if isinstance(g, DTensor) else ("local", g.device)
        groups.setdefault(key, []).append(g)
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite, foreach)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type, error_if_nonfinite, foreach)
    if pp_mesh is not None and pp_mesh.size() > 1:
        group = pp_mesh.get_group()
        if norm_type == float("inf"):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = total ** norm_type
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            total = total ** (1.0 / norm_type)
    return total


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0,
                    *, error_if_nonfinite: bool = False, foreach: bool | None = None, pp_mesh=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on any mix of meshes; returns the total norm.

    The scale is applied to each gradient's local shard: scaling is elementwise, so that is the
    same as scaling the whole tensor, whatever its placement.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = grad_norm(params, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach, pp_mesh=pp_mesh)
    clip_coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in local:
        buckets.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), gs in buckets.items():
        torch._foreach_mul_(gs, clip_coef.to(device=device, dtype=dtype))
    return total
