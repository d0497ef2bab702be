"""How a model tells the strategy how to parallelize it (DESIGN.md, "How a model tells...").

A LightningModule (or any nn.Module) may define ``parallel_plan() -> ParallelPlan``. Without one,
the strategy still finds the repeated blocks: the largest ``nn.ModuleList`` or ``nn.ModuleDict``
whose children are all of one type (torchtitan and Lightning's own Llama examples keep their
layers in a ``ModuleDict`` keyed by layer index, so that names survive a pipeline split).
Tensor/pipeline/expert parallel need a plan and say so when it is missing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Union

import torch.nn as nn

from lightning_disttrain.parallel.pipeline import PipelinePlan

Blocks = Union[nn.ModuleList, nn.ModuleDict]
"""The container of the repeated blocks: its own name and its keys are part of every block FQN."""


@dataclass
class ParallelPlan:
    """What a model exposes to the parallelisms. Fields later parallelisms need default to None."""

    blocks: Blocks
    """The repeated blocks, an ``nn.ModuleList`` or an ``nn.ModuleDict`` (e.g. keyed by layer
    index): the unit of FSDP wrapping, checkpointing, compile and pipeline splits."""
    fsdp_groups: list[list[nn.Module]] = field(default_factory=list)
    """Non-block modules to shard as their own FSDP units, each list one unit, in the order their
    forward runs (the last one, e.g. the final norm with an untied head, runs right before the
    loss, so its backward comes first). Whatever is left belongs to the root unit; modules that
    share a parameter (a tied embedding and head) must stay together in one unit."""
    tp_block_plan: dict | None = None
    """``parallelize_module`` plan applied to each block (filled by the tensor-parallel issue)."""
    tp_root_plan: dict | None = None
    """``parallelize_module`` plan for the root: embedding, final norm, head."""
    moe_layers: list[nn.Module] | None = None
    """Mixture-of-experts layers (``models.moe.MoE``), whose routed experts expert parallel splits;
    None: the strategy finds every ``MoE`` in the model itself."""
    pipeline: PipelinePlan | None = None
    """How the model splits into pipeline stages (``parallel.pipeline.PipelinePlan``); pp > 1 needs it."""

    @property
    def block_list(self) -> list[nn.Module]:
        """The blocks in order, whichever container holds them."""
        return as_block_list(self.blocks)


def as_block_list(blocks: Blocks | Iterable[nn.Module]) -> list[nn.Module]:
    """The modules of a ``ModuleList``, a ``ModuleDict`` (in insertion order) or a plain list."""
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    return list(blocks)


def find_parallel_plan(module: nn.Module) -> ParallelPlan:
    """The module's own plan, else one whose blocks are its largest container of identical blocks."""
    plan_fn = getattr(module, "parallel_plan", None)
    if callable(plan_fn):
        plan = plan_fn()
        if plan is not None:
            return plan
    return ParallelPlan(blocks=find_blocks(module))


def find_blocks(module: nn.Module) -> Blocks:
    """The module's plan's blocks, else the largest ``ModuleList`` / ``ModuleDict`` whose children
    all share one type (ties: the first found)."""
    plan_fn = getattr(module, "parallel_plan", None)
    if callable(plan_fn) and (plan := plan_fn()) is not None:
        return plan.blocks
    best: Blocks | None = None
    for sub in module.modules():
        if isinstance(sub, (nn.ModuleList, nn.ModuleDict)) and len(sub) > 0:
            if len({type(m) for m in as_block_list(sub)}) == 1 and (best is None or len(sub) > len(best)):
                best = sub
    if best is None:
        raise ValueError(
            f"{type(module).__name__} has no nn.ModuleList or nn.ModuleDict of identical blocks to wrap; "
            f"keep the repeated layers in one nn.ModuleList / nn.ModuleDict, or define parallel_plan() "
            f"returning a ParallelPlan")
    return best
