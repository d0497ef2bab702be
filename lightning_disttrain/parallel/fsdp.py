"""FSDP2 (``fully_shard``): ZeRO-2/3 and HSDP per block, plus gradient-norm clipping over DTensors.

Plain torch, no Lightning: the strategy calls ``apply_fsdp`` as the last model transform (the
``fsdp`` stage, outermost so its hooks stay outside compiled code) and ``clip_grad_norm_`` from
Lightning's clipping hook.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain import comm
from lightning_disttrain import _lightning_compat as compat
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
    """The smallest submodule that holds every parameter of ``module`` (``module`` itself if none).

    FSDP's root unit must own all parameters no block claimed (embedding, final norm, tied head)
    and must be *called*: its forward pre-hook all-gathers them. In a LightningModule that keeps
    its network in one attribute (``self.model``) that attribute is the root, and the
    LightningModule's own ``training_step`` stays outside FSDP's hooks.

    A child is only the root if no other child refers to any parameter at all, shared ones
    included: in Hugging Face's ``GPT2LMHeadModel`` the ``transformer`` child holds every
    parameter, but ``lm_head`` refers to its embedding; sharding ``transformer`` alone would swap
    the embedding for a sharded one under ``transformer`` and leave ``lm_head`` on the old tensor.
    """
    root = module
    while True:
        if next(root.parameters(recurse=False), None) is not None:
            return root
        holders = [c for c in root.children() if next(c.parameters(), None) is not None]
        if len(holders) != 1:
            return root
        root = holders[0]


def already_parallelized(module: nn.Module) -> bool:
    """Whether ``module`` was sharded or tensor-parallelized already (e.g. by its own
    ``configure_model``, as with Lightning's ``ModelParallelStrategy``)."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters())


def check_tied_units(root: nn.Module, plan: ParallelPlan, groups: list[list[str]]) -> None:
    """Refuse a plan that puts the names of one shared parameter into different FSDP units:
    each unit would shard its own copy and the tie would silently break."""
    units: dict[int, str] = {}
    for i, (name, block) in enumerate(_named_units(plan)):
        for m in block.modules():
            units.setdefault(id(m), name)
    for names in groups:
        owners = {n: units.get(id(root.get_submodule(n.rpartition(".")[0])), "the root unit") for n in names}
        if len(set(owners.values())) > 1:
            where = ", ".join(f"{n} in {u}" for n, u in owners.items())
            raise ValueError(f"these names share one parameter but would be sharded in different FSDP units: "
                             f"{where}; keep the modules that share it in one unit (leave them out of "
                             f"ParallelPlan.fsdp_groups so the root holds them, or group them together)")


def _named_units(plan: ParallelPlan) -> list[tuple[str, nn.Module]]:
    named = [(f"block {i}", b) for i, b in enumerate(plan.block_list)]
    for j, group in enumerate(plan.fsdp_groups):
        named += [(f"fsdp_groups[{j}]", m) for m in group]
    return named


def apply_fsdp(
    module: nn.Module,
    plan: ParallelPlan,
    mesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int = True,
    cpu_offload: bool = False,
    expert_mesh=None,
    expert_grad_divide_factor: float | None = None,
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
        expert_mesh: under expert parallel, the ``efsdp`` mesh: each block's expert-parallel
            experts (``parallel.expert``) become a unit of their own, sharded over it, before the
            block's unit takes the rest.
        expert_grad_divide_factor: those units divide their gradient sum by this instead of
            their mesh size (the data-parallel size: an expert's gradient already sums the tokens
            of every ep rank).
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    offload: OffloadPolicy = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
                              if cpu_offload else OffloadPolicy())
    common: dict[str, Any] = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}
    blocks = plan.block_list
    # The unit whose forward runs last is the first one backward needs: resharding it after
    # forward would only buy an immediate second all-gather, so it keeps its parameters (as
    # torchtitan does). That is the last plan group (final norm + untied head) when there is one,
    # else the last block (the root, which then holds the tied head, is never resharded).
    head_group = plan.fsdp_groups[-1] if plan.fsdp_groups else None
    for i, block in enumerate(blocks):
        last = head_group is None and i == len(blocks) - 1
        reshard = False if (last and reshard_after_forward is not False) else reshard_after_forward
        if expert_mesh is not None:
            for experts in expert_parallel_modules(block):
                fully_shard(experts, reshard_after_forward=reshard, **dict(common, mesh=expert_mesh))
                if expert_grad_divide_factor is not None:
                    experts.set_gradient_divide_factor(expert_grad_divide_factor)
                    if expert_mesh.size() > 1 and dist.get_backend(expert_mesh.get_group()) != "nccl":
                        # A divisor other than the mesh size is NCCL's PREMUL_SUM, which gloo lacks:
                        # sum, then divide (one more kernel over the shard). Not on a 1-rank mesh:
                        # there FSDP (torch 2.13) divides in its copy and would divide again after.
                        experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, reshard_after_forward=reshard, **common)
    for group in plan.fsdp_groups:
        # A list is one unit: one all-gather / reduce-scatter for its modules together.
        reshard = False if group is head_group else reshard_after_forward
        fully_shard(group[0] if len(group) == 1 else list(group), reshard_after_forward=reshard, **common)
    # The root: None lets FSDP keep the root's parameters after forward, for the same reason.
    fully_shard(module, reshard_after_forward=None, **common)
    # torch warns when a unit returns a view (an in-place op on it would skip the unit's
    # pre-backward all-gather). The root returns one for any model ending in a biased nn.Linear
    # on (batch, seq, dim) input (linear is addmm(...).view(...) there): harmless for the root,
    # whose parameters stay gathered from forward to backward (above), and whose reduce-scatter
    # FSDP's final backward callback runs anyway. Blocks still warn.
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \({re.escape(type(module).__name__)}\) "
                            "returned a view tensor", category=UserWarning)


def expert_parallel_modules(block: nn.Module) -> list[nn.Module]:
    """The submodules of ``block`` holding expert-parallel weights (DTensors set up by
    ``parallel.expert.shard_experts``, marked ``expert_parallel``)."""
    return [m for m in block.modules() if getattr(m, "expert_parallel", False)]


def offload_safe_to_device(module: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Move ``module`` to ``device`` after sharding; with CPU offload, move only its buffers.

    FSDP2's ``CPUOffloadPolicy`` keeps the sharded parameters on the host (it copies each shard
    to the device for the all-gather itself) and rejects parameters found on the device at the
    first forward; buffers are used beside the activations, so they belong on the device.
    """
    if not cpu_offload:
        module.to(device)
        return
    for sub in module.modules():
        for name, buf in list(sub.named_buffers(recurse=False, remove_duplicate=False)):
            if buf.device != device and (moved := buf.to(device)) is not buf:
                setattr(sub, name, moved)


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

    Off, backward accumulates unsharded gradients locally (in the reduce dtype: fp32 under our
    mixed-precision policies); the next backward with it on reduces the sum once. Gradient
    accumulation thus communicates once per optimizer step, at the cost of holding the whole
    unsharded gradient of every unit meanwhile (``NDParallelStrategy(accumulate_unsharded_grads=True)``).
    """
    for m in fsdp_modules(module):
        m.set_requires_gradient_sync(enabled, recurse=False)


def set_replica_all_reduce(module: nn.Module, enabled: bool) -> None:
    """Turn HSDP's all-reduce across replicas on or off for every unit, keeping the reduce-scatter.

    Off, each backward still reduce-scatters (gradients stay sharded) and FSDP adds the shard into
    a partial sum of its own; the next backward with it on all-reduces that sum once. Sharded
    gradient accumulation thus crosses replicas (nodes, usually) once per optimizer step. No effect
    on units without a replicate dimension.
    """
    for m in fsdp_modules(module):
        m.set_requires_all_reduce(enabled, recurse=False)


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
        if not isinstance(group[0], DTensor) or any(p.is_partial() for p in group[0].placements):
            n = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite, foreach)
            norms.append(n.full_tensor() if isinstance(n, DTensor) else n)  # partial sums: reduce first
            continue
        # Each rank's shards, then one reduction per sharded mesh dimension (replicated dimensions
        # hold the same values): what full_tensor() would do on a 2-D (FSDP x TP) mesh, without its
        # warning about sequential collectives.
        local = torch.nn.utils.get_total_norm([g.to_local() for g in group], norm_type, error_if_nonfinite, foreach)
        inf = norm_type == float("inf")
        value = local if inf else local ** norm_type
        for dim, placement in enumerate(group[0].placements):
            if not placement.is_replicate():  # Shard, and FSDP-over-TP's _StridedShard (not is_shard())
                # comm stages the value on the group's device: CPU-offloaded gradients give a
                # host norm, which NCCL would refuse.
                comm.all_reduce(value, "max" if inf else "sum", group=group[0].device_mesh.get_group(dim))
        norms.append(value if inf else value ** (1.0 / norm_type))
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type, error_if_nonfinite, foreach)
    if pp_mesh is not None and pp_mesh.size() > 1:
        group = pp_mesh.get_group()
        if norm_type == float("inf"):
            comm.all_reduce(total, "max", group=group)
        else:
            total = total ** norm_type
            comm.all_reduce(total, "sum", group=group)
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
        torch_compat.foreach_mul_(gs, clip_coef.to(device=device, dtype=dtype))
    return total


def install_mesh_aware_clipping(precision_plugin: Any, pp_mesh=None) -> None:
    """Make a Lightning precision plugin clip by norm with ``clip_grad_norm_`` below.

    No Lightning hook exists for this: Lightning clips through ``precision_plugin.clip_grad_by_norm``,
    and its accelerator connector picks the plugin's class from the precision string (autocast,
    scaler, isinstance checks). Overriding that one method on the instance keeps all of that and
    swaps only the norm, which must group gradients by mesh (FSDP, TP, experts) and sum across
    pipeline stages.
    """

    def clip_grad_by_norm(optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm_(precision_plugin.main_params(optimizer), clip_val, pp_mesh=pp_mesh)

    compat.install_clip_grad_by_norm(precision_plugin, clip_grad_by_norm)
    compat.clip_fused_optimizers_under_bf16_mixed(precision_plugin)
