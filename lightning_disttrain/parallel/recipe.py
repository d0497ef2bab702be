"""The one place where a model is parallelized: every step, in its fixed order, with its reason.

``parallelize`` is what ``NDParallelStrategy.setup`` runs once ``configure_model`` has built the
model (on the meta device with ``empty_init``, by default whenever more than one rank shares it): the precision cast, the pipeline split, the
initial weights, every transform (float8 swap, TP, EP, activation checkpointing, compile, FSDP2),
the sharded initialisation and the move to the device. Read it top to bottom; the strategy only
supplies the pieces that need its state (``Host``) and the settings of each parallelism.
Callbacks contribute transforms at a stage through the strategy's ``TransformRegistry``
(float8's Linear swap at ``dtype``, activation checkpointing at ``activation_checkpointing``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from lightning_disttrain.models.param_init import layout_independent_init
from lightning_disttrain.parallel.fsdp import already_parallelized, apply_fsdp, check_tied_units, fsdp_root
from lightning_disttrain.parallel.materialize import (
    check_ties,
    dtensor_rng_supported,
    has_meta_tensors,
    has_own_init,
    tied_parameters,
)
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
class CPSettings:
    """How the context-parallel step shards attention (see ``parallel.context``)."""

    mesh: Any
    """The 1-D ``cp`` mesh: the ranks that share each sequence."""


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
    """What the pipeline split (step 2) did: ``parallel.pipeline.split_model``, run through the
    host before any weight exists, so that no rank allocates the blocks it does not hold."""

    stages: list
    """The modules this rank runs as pipeline stages: each becomes its own FSDP root."""
    summary: str = ""


def _refuse_stage_views_that_miss_state(module: nn.Module, pipeline: PipelineSettings, cp: CPSettings | None) -> None:
    """Several stages on this rank (a looped or V-shaped schedule) run as views of the model made
    at the split, which copy its attributes and buffers then: a buffer materialised later (RoPE's
    tables of a meta build) stays on the meta device in the views, and the context-parallel state
    set on the model later never reaches them (a stage view then takes positions 0..T/cp: silently
    wrong losses). Refused until the views follow the model (issue 43), before any weight exists."""
    if len(pipeline.stages) < 2:  # one stage on this rank: the model itself, no view
        return
    views = pipeline.stages
    if cp is not None:
        raise ValueError("context parallel with a pipeline schedule of several stages per rank (Interleaved1F1B, "
                         "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) is not supported yet (its stage views miss the context-parallel "
                         "state); use pp_schedule='1F1B' or 'GPipe' (one stage per rank), or cp=1")
    late = sorted({name for view in views for name, buf in view.named_buffers(recurse=False) if buf.device.type == "meta"})
    if late:
        raise ValueError(f"a pipeline schedule of several stages per rank with a model built on the meta device "
                         f"whose own buffers ({', '.join(late)}: RoPE's tables) are materialised later is not "
                         f"supported yet (the stage views keep the meta buffers); use pp_schedule='1F1B' or "
                         f"'GPipe', learned positions (pos_emb='learned'), or empty_init=False")


@dataclass
class Host:
    """What ``parallelize`` asks of its caller (the strategy) at fixed points of the order: the
    pieces that need the strategy's own state (its precision plugin, its pipeline runner, the seed
    every rank agreed on, its device). Each may be None (not this run's business)."""

    convert_precision: Callable[[nn.Module], None] | None = None
    """Cast the module to the run's precision (``bf16-true``...)."""
    split_pipeline: Callable[[nn.Module], PipelineSettings] | None = None
    """Keep this rank's pipeline stages (pp > 1), before any weight exists."""
    materialize: Callable[[nn.Module], None] | None = None
    """Allocate and initialise meta-device weights (layout-independent where the model is)."""
    sync_initial_weights: Callable[[nn.Module], None] | None = None
    """Make every rank start from rank 0's eagerly built weights."""
    to_device: Callable[[], None] | None = None
    """Move what is left on the host to the run's device."""


@dataclass
class Parallelized:
    """What ``parallelize`` did."""

    steps: list[str] = field(default_factory=list)
    """The stages that changed the model, in order, with what ran there."""
    fsdp_root: nn.Module | None = None
    """The module FSDP wrapped as its root unit (None when FSDP did not run)."""
    self_sharded: str = ""
    """How the module parallelized itself in ``configure_model``: "" (it did not), "tp" (DTensor
    parameters, no FSDP: TP is skipped here, FSDP still applied) or "fsdp" (both skipped)."""


def parallelize(module: nn.Module, ctx: TransformContext, transforms: TransformRegistry, *,
                host: Host | None = None,
                compile_options: dict[str, Any] | None = None,
                tp: TPSettings | None = None,
                ep: EPSettings | None = None,
                cp: CPSettings | None = None,
                fsdp: FSDPSettings | None = None) -> Parallelized:
    """Apply every parallelism to ``module`` in place: THE order, with the reason for each step.

    ``host``: the strategy's part (precision cast, pipeline split, weight init, device move);
    None runs the transforms only (tests, a module built eagerly on its device).
    ``compile_options``: None skips compilation; a dict (possibly empty) compiles each block.
    ``tp`` / ``ep`` / ``cp`` / ``fsdp``: None skips that parallelism.
    """
    host = host or Host()
    done = Parallelized()
    mesh = ctx.mesh

    def stage(name: str) -> None:
        ran = transforms.apply_stage(name, module, ctx)
        if ran:
            done.steps.append(f"{name}: {', '.join(ran)}")

    # 0. precision cast (bf16-true...): before sharding, so every shard is born in its dtype.
    if host.convert_precision is not None:
        host.convert_precision(module)
    # A module that sharded itself in configure_model (Lightning's ModelParallelStrategy way)
    # keeps its sharding: TP and FSDP would wrap it a second time, and what must come before
    # sharding (a layer swap, the pipeline split, the expert split) can no longer run.
    done.self_sharded = self_parallelized(module)
    if done.self_sharded:
        _refuse_after_self_sharding(module, transforms, host, ep)
        tp = None
        if done.self_sharded == "fsdp":
            fsdp = None
    elif tp is not None and not callable(getattr(module, "parallel_plan", None)):
        raise ValueError(tp_plan_missing(module, tp.mesh.size()))
    # 1. pipeline split: each rank keeps only its blocks, before any weight is allocated or
    #    broadcast, so no rank ever holds the whole model.
    pipeline = host.split_pipeline(module) if host.split_pipeline is not None else None
    if pipeline is not None:
        done.steps.append(pipeline.summary)
        _refuse_stage_views_that_miss_state(module, pipeline, cp)
    # 2. initial weights. A layout-independent initialisation (GPT: a generator per parameter
    #    name) runs after sharding (step 9), each rank drawing only what it keeps, nothing
    #    broadcast; so do initialisers that run per submodule (reset_parameters: one submodule's
    #    full tensors at a time, broadcast and sliced) and initialisers on DTensor shards where
    #    DTensor's RNG makes a shard the slice of one full random tensor (CUDA-like meshes). Only
    #    a module with an init_weights() of its own, which writes everything at once, is
    #    materialised whole first, then sharded; an eagerly built module starts from rank 0's
    #    weights (as DDP does), broadcast one tensor at a time.
    on_meta = has_meta_tensors(module)
    sharded_init = on_meta and (bool(done.self_sharded) or layout_independent_init(module)
                                or not has_own_init(module) or (mesh is not None and dtensor_rng_supported(mesh)))
    if on_meta and not sharded_init and host.materialize is not None:
        host.materialize(module)
    elif not on_meta and not done.self_sharded and host.sync_initial_weights is not None:
        host.sync_initial_weights(module)
    plan = find_parallel_plan(module)
    ties = tied_parameters(module)
    # 3. dtype conversions from callbacks (float8 Linear swap): they must see plain nn.Linear.
    stage("dtype")
    stage("pipeline")
    # 4. tensor / sequence / loss parallel: shards weights before FSDP shards them again (2-D);
    #    float8 Linears (step 3) get torchao's float8 styles.
    if tp is not None:
        tensorwise = ctx.extras.get("float8_recipe") == "tensorwise"  # torchao's float8 TP styles need it
        apply_tp(module, plan, tp.mesh, tp.options,
                 float8_fqns=ctx.extras.get("float8_converted") if tensorwise else None)
        o = tp.options
        done.steps.append(f"tensor_parallel: tp={tp.mesh.size()}, {len(plan.block_list)} blocks + root"
                          f"{', sequence parallel' if o.sequence_parallel else ''}"
                          f"{', loss parallel' if o.loss_parallel else ''}{', async TP' if o.async_tp else ''}")
    stage("tensor_parallel")
    # 5. expert parallel: each MoE layer's routed experts are split over the ep ranks (tokens
    #    reach them by all-to-all); FSDP (step 8) then gives them units of their own.
    if ep is not None:
        from lightning_disttrain.models.moe import moe_layers
        from lightning_disttrain.parallel.expert import shard_experts

        layers = plan.moe_layers if plan.moe_layers is not None else list(moe_layers(module).values())
        shard_experts(layers, ep.mesh)
        shards = ep.expert_fsdp_mesh.size()  # 1: each ep rank holds its experts whole (no "FSDP over 1 ranks")
        done.steps.append(f"expert_parallel: ep={ep.mesh.size()}, {len(layers)} MoE layers, "
                          + (f"experts FSDP over {shards} ranks" if shards > 1 else "experts not FSDP-sharded"))
    stage("expert_parallel")
    # 5b. context parallel: attention runs the ring over the cp ranks (one operator) and positions
    #     follow the rank's shard of each sequence; before checkpointing and compile, so that
    #     both see (keep, and trace) the ring attention.
    if cp is not None:
        from lightning_disttrain.parallel.context import apply_context_parallel

        n = apply_context_parallel(module, cp.mesh)
        done.steps.append(f"context_parallel: cp={cp.mesh.size()}, {n} attention layers run ring attention, "
                          f"load-balanced chunks")
    # 6. activation checkpointing: wraps whole blocks, after TP so its plans see real names.
    stage("activation_checkpointing")
    # 7. per-block torch.compile: after checkpointing, so the policy is traced into the graph.
    if compile_options is not None:
        from lightning_disttrain.parallel.compile import apply_compile  # imports torch._dynamo

        apply_compile(plan.blocks, **compile_options)
        compiled = f"compile: {len(plan.block_list)} blocks"
        compile_loss = getattr(module, "compile_loss", None)  # GPTModule's: the fp32 cross-entropy
        if callable(compile_loss):
            compile_loss(**compile_options)
            compiled += " + the loss"
        done.steps.append(compiled)
    stage("compile")
    # 8. FSDP2 per block, per plan group, then the root: outermost, so its hooks stay outside
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
    # 9. sharded initialisation (step 2's deferred case): every rank draws only what it holds.
    if sharded_init and host.materialize is not None:
        host.materialize(module)
    # 10. the device: what is still on the host (buffers, an eager build) moves last, so no
    #     rank ever held the whole model on the accelerator.
    if host.to_device is not None:
        host.to_device()
    return done


def self_parallelized(module: nn.Module) -> str:
    """"fsdp" when ``configure_model`` applied ``fully_shard``, "tp" when it only made DTensor
    parameters (``parallelize_module``), else ""."""
    if not already_parallelized(module):
        return ""
    return "fsdp" if any(isinstance(m, FSDPModule) for m in module.modules()) else "tp"


def overrides_configure_model(module: Any) -> bool:
    """Whether a LightningModule defines its own ``configure_model`` (where it may parallelize)."""
    own = getattr(type(module), "configure_model", None)
    return own is not None and getattr(own, "__qualname__", "").split(".")[0] not in ("LightningModule", "ModelHooks")


def tp_plan_missing(module: Any, tp: int) -> str:
    return (f"tp={tp} needs a tensor-parallel plan: define {type(module).__name__}.parallel_plan() returning a "
            f"ParallelPlan with tp_block_plan / tp_root_plan, or parallelize the model yourself in configure_model "
            f"(parallelize_module(..., self.device_mesh['tensor_parallel'], plan), as under Lightning's "
            f"ModelParallelStrategy), or set tp=1")


def _refuse_after_self_sharding(module: nn.Module, transforms: TransformRegistry, host: Host,
                                ep: EPSettings | None) -> None:
    name = type(module).__name__
    if transforms.has("dtype"):
        raise ValueError(f"{name} parallelized itself in configure_model, so callbacks that swap layers "
                         f"({transforms.names()}) can no longer run before sharding; convert the layers in "
                         f"configure_model before fully_shard, or leave the sharding to the strategy")
    if ep is not None:
        raise ValueError(f"{name} sharded itself in configure_model; ep > 1 must split its experts first: leave "
                         f"the sharding to the strategy, or set ep=1")
    if host.split_pipeline is not None:
        raise ValueError(f"{name} sharded itself in configure_model; pp > 1 must split it first: leave the "
                         f"sharding to the strategy, or set pp=1")


def stage_plan(plan: ParallelPlan, part: nn.Module) -> ParallelPlan:
    """``plan`` restricted to the blocks and FSDP groups of one pipeline stage."""
    from lightning_disttrain.parallel.pipeline import blocks_attribute

    mine = {id(m) for m in part.modules()}
    blocks = part.get_submodule(blocks_attribute(plan.pipeline.module, plan.blocks))
    groups = [g for g in plan.fsdp_groups if all(id(m) in mine for m in g)]
    return ParallelPlan(blocks=blocks, fsdp_groups=groups)
