"""How a model tells the strategy how to parallelize it (DESIGN.md, "How a model tells...").

A LightningModule (or any nn.Module) may define ``parallel_plan() -> ParallelPlan``. Without one,
the strategy still finds the repeated blocks: the largest ``nn.ModuleList`` whose children are all
of one type. Tensor/pipeline/expert parallel need a plan and say so when it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn


@dataclass
class ParallelPlan:
    """What a model exposes to the parallelisms. Fields later parallelisms need default to None."""

    blocks: nn.ModuleList
    """The repeated blocks: the unit of FSDP wrapping, checkpointing, compile and pipeline splits."""
    fsdp_groups: list[list[nn.Module]] = field(default_factory=list)
    """Non-block modules to shard as their own FSDP units, each list one unit (e.g. the untied
    head with the final norm). Whatever is left belongs to the root unit (tied weights must stay
    together in one unit)."""
    tp_block_plan: dict | None = None
    """``parallelize_module`` plan applied to each block (filled by the tensor-parallel issue)."""
    tp_root_plan: dict | None = None
    """``parallelize_module`` plan for the root: embedding, final norm, head."""
    moe_layers: list[nn.Module] | None = None
    """Mixture-of-experts layers, for expert parallel."""


def find_parallel_plan(module: nn.Module) -> ParallelPlan:
    """The module's own plan, else one whose blocks are its largest ModuleList of identical blocks."""
    plan_fn = getattr(module, "parallel_plan", None)
    if callable(plan_fn):
        plan = plan_fn()
        if plan is not None:
            return plan
    return ParallelPlan(blocks=find_blocks(module))


def find_blocks(module: nn.Module) -> nn.ModuleList:
    """The largest ModuleList whose children all share one type (ties: the first found)."""
    plan_fn = getattr(module, "parallel_plan", None)
    if callable(plan_fn) and (plan := plan_fn()) is not None:
        return plan.blocks
    best: nn.ModuleList | None = None
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) > 0 and len({type(m) for m in sub}) == 1:
            if best is None or len(sub) > len(best):
                best = sub
    if best is None:
        raise ValueError(
            f"{type(module).__name__} has no nn.ModuleList of identical blocks to wrap; keep the "
            f"repeated layers in one nn.ModuleList or define parallel_plan() returning a ParallelPlan")
    return best


def init_weights(module: nn.Module) -> None:
    """(Re)initialise ``module`` in place, e.g. after ``to_empty``: its own ``init_weights()`` when
    it has one (GPTModule, GPT), else ``reset_parameters()`` of every submodule that has it.

    Buffers that no ``reset_parameters`` recomputes stay uninitialised in the fallback: models
    with such buffers (RoPE tables) should define ``init_weights``.
    """
    init = getattr(module, "init_weights", None)
    if callable(init):
        init()
        return
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
