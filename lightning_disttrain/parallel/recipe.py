"""The one place where a model is parallelized: every transform, in its fixed order.

``parallelize`` is what ``NDParallelStrategy`` runs once the model is built (and, for a
meta-device build on the host, materialised). Read it top to bottom to see where each
parallelism is applied and why there; tensor, pipeline and expert parallel add their lines here.
Callbacks contribute transforms at a stage through the strategy's ``TransformRegistry``
(float8's Linear swap at ``dtype``, activation checkpointing at ``activation_checkpointing``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_disttrain.parallel.fsdp import apply_fsdp, check_tied_units, fsdp_root
from lightning_disttrain.parallel.materialize import check_ties, tied_parameters
from lightning_disttrain.parallel.plan import ParallelPlan, find_parallel_plan
from lightning_disttrain.parallel.tensor import TensorParallelOptions, apply_tp
from lightning_disttrain.parallel.transforms import TransformContext, TransformRegistry


@dataclass
class FSDPSettings:
    """How the last stage shards (see ``apply_fsdp``)."""

    mesh: Any
    """1-D (FSDP) or 2-D (HSDP: replicate, shard) ``DeviceMesh``."""
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    reshard_after_forward: bool | int = True
    cpu_offload: bool = False


@dataclass
class TPSettings:
    """How stage 3 shards (see ``tensor.apply_tp``)."""

    mesh: Any
    """The 1-D ``tp`` mesh."""
    options: TensorParallelOptions = field(default_factory=TensorParallelOptions)


@dataclass
class EPSettings:
    """How stage 4 shards (see ``parallel.expert``)."""

    mesh: Any
    """The 1-D ``ep`` mesh: each MoE layer's routed experts are split over it."""
    expert_fsdp_mesh: Any
    """The ``efsdp`` mesh: FSDP shards each rank's experts over it."""
    grad_divide_factor: float
    """Data-parallel ranks: the experts' gradient sums are divided by it, as the dense ones."""


@dataclass
class PipelineSettings:
    """What stage 2 did (``parallel.pipeline.split_model``, run by the strategy before the weights
    are materialised, so that no rank allocates the blocks it does not hold)."""

    stages: list
    """The modules this rank runs as pipeline stages: each becomes its own FSDP root."""
    summary: str = ""


@dataclass
class Parallelized:
    """What ``parallelize`` did."""

    steps: list[str] = field(default_factory=list)
    """The stages that changed the model, in order, with what ran there."""
    fsdp_root: nn.Module | None = None
    """The module FSDP wrapped as its root unit (None when FSDP did not run)."""


def parallelize(module: nn.Module, ctx: TransformContext, transforms: TransformRegistry, *,
                compile_options: dict[str, Any] | None = None,
                tp: TPSettings | None = None,
                ep: EPSettings | None = None,
                fsdp: FSDPSettings | None = None,
                pipeline: PipelineSettings | None = None) -> Parallelized:
    """Apply every parallelism to ``module`` in place, in the order DESIGN.md fixes.

    ``compile_options``: None skips compilation; a dict (possibly empty) compiles each block.
    ``tp``: None skips tensor parallel.
    ``ep``: None skips expert parallel.
    ``fsdp``: None skips sharding (e.g. the model sharded itself in ``configure_model``).
    ``pipeline``: the stages this rank keeps (None: no pipeline).
    """
    done = Parallelized()
    plan = find_parallel_plan(module)
    ties = tied_parameters(module)

    def stage(name: str) -> None:
        ran = transforms.apply_stage(name, module, ctx)
        if ran:
            done.steps.append(f"{name}: {', '.join(ran)}")

    # 1. dtype conversions from callbacks (float8 Linear swap): they must see plain nn.Linear.
    stage("dtype")
    # 2. pipeline split: each rank keeps only its blocks (already done: see PipelineSettings).
    if pipeline is not None:
        done.steps.append(pipeline.summary)
    stage("pipeline")
    # 3. tensor / sequence / loss parallel: shards weights before FSDP shards them again (2-D);
    #    float8 Linears (step 1) get torchao's float8 styles.
    if tp is not None:
        tensorwise = ctx.extras.get("float8_recipe") == "tensorwise"  # torchao's float8 TP styles need it
        apply_tp(module, plan, tp.mesh, tp.options,
                 float8_fqns=ctx.extras.get("float8_converted") if tensorwise else None)
        o = tp.options
        done.steps.append(f"tensor_parallel: tp={tp.mesh.size()}, {len(plan.block_list)} blocks + root"
                          f"{', sequence parallel' if o.sequence_parallel else ''}"
                          f"{', loss parallel' if o.loss_parallel else ''}{', async TP' if o.async_tp else ''}")
    stage("tensor_parallel")
    # 4. expert parallel: each MoE layer's routed experts are split over the ep ranks (tokens
    #    reach them by all-to-all); FSDP (step 7) then gives them units of their own.
    if ep is not None:
        from lightning_disttrain.models.moe import moe_layers
        from lightning_disttrain.parallel.expert import shard_experts

        layers = plan.moe_layers if plan.moe_layers is not None else list(moe_layers(module).values())
        shard_experts(layers, ep.mesh)
        done.steps.append(f"expert_parallel: ep={ep.mesh.size()}, {len(layers)} MoE layers, experts FSDP over "
                          f"{ep.expert_fsdp_mesh.size()} ranks")
    stage("expert_parallel")
    # 5. activation checkpointing: wraps whole blocks, after TP so its plans see real names.
    stage("activation_checkpointing")
    # 6. per-block torch.compile: after checkpointing, so the policy is traced into the graph.
    if compile_options is not None:
        from lightning_disttrain.parallel.compile import apply_compile  # imports torch._dynamo

        apply_compile(plan.blocks, **compile_options)
        done.steps.append(f"compile: {len(plan.block_list)} blocks")
    stage("compile")
    # 7. FSDP2 per block, per plan group, then the root: outermost, so its hooks stay outside
    #    compiled and checkpointed code. Modules sharing a parameter must share a unit.
    if fsdp is not None and pipeline is not None:
        # Each stage is a root: the schedule runs it alone and finishes its gradient reduction.
        for part in pipeline.stages:
            apply_fsdp(part, stage_plan(plan, part), fsdp.mesh, mp_policy=fsdp.mp_policy,
                       reshard_after_forward=fsdp.reshard_after_forward, cpu_offload=fsdp.cpu_offload)
        done.steps.append(f"fsdp: {len(plan.block_list)} blocks + {len(pipeline.stages)} stage roots")
    elif fsdp is not None:
        root = fsdp_root(module)
        root_name = type(root).__name__  # before fully_shard renames the class to FSDP<name>
        check_tied_units(root, plan, tied_parameters(root))
        apply_fsdp(root, plan, fsdp.mesh, mp_policy=fsdp.mp_policy,
                   reshard_after_forward=fsdp.reshard_after_forward, cpu_offload=fsdp.cpu_offload,
                   expert_mesh=ep.expert_fsdp_mesh if ep is not None else None,
                   expert_grad_divide_factor=ep.grad_divide_factor if ep is not None else None)
        done.fsdp_root = root
        done.steps.append(f"fsdp: {len(plan.block_list)} blocks + {len(plan.fsdp_groups)} groups + root "
                          f"{root_name}")
    stage("fsdp")
    check_ties(module, ties)
    return done


def stage_plan(plan: ParallelPlan, part: nn.Module) -> ParallelPlan:
    """``plan`` restricted to the blocks and FSDP groups of one pipeline stage."""
    from lightning_disttrain.parallel.pipeline import blocks_attribute

    mine = {id(m) for m in part.modules()}
    blocks = part.get_submodule(blocks_attribute(plan.pipeline.module, plan.blocks))
    groups = [g for g in plan.fsdp_groups if all(id(m) in mine for m in g)]
    return ParallelPlan(blocks=blocks, fsdp_groups=groups)
