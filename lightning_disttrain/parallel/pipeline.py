"""Pipeline parallel: split a model's blocks into stages, keep each rank's stages, run
``torch.distributed.pipelining``'s schedules. Plain torch, no Lightning.

How a model is split (``PipelinePlan``): its blocks, an ``nn.ModuleDict`` keyed by layer index,
are cut into contiguous ranges, one per stage; the first stage also holds the modules named in
``plan.first`` (the embeddings), the last those in ``plan.last`` (final norm, head). Each rank
deletes every block and edge module it does not hold from the model *in place*, so the model that
stays (and the LightningModule around it) names its parameters exactly as the unsplit model does:
``blocks.5.attn.wq.weight`` is that on whichever rank holds block 5. That is what lets a DCP
checkpoint move between pp=1, 2 and 4, and ``export`` write one state dict whatever the layout.

A rank holding several stages (looped schedules: stages r, r + pp, ...; V-shaped: r and
2·pp - 1 - r) runs each through a *view*: a module of the model's class that shares the kept
model's submodules but lists only that stage's blocks and edges, so the model's own ``forward``
runs one stage. With one stage per rank the kept model itself is the stage.

The stage's ``forward`` contract: without its first-stage modules it takes the previous stage's
output (hidden states) instead of the model input; without its last-stage modules it returns its
hidden states. ``GPT.forward`` is written that way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from lightning_disttrain import _torch_compat as torch_compat

SINGLE_STAGE = ("GPipe", "1F1B")
"""Schedules with one stage per rank."""
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
"""Several stages per rank, assigned round-robin: rank r holds stages r, r + pp, r + 2·pp, ..."""
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
"""Two stages per rank in a V: rank r holds stages r and 2·pp - 1 - r."""
SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED


def schedule_name(name: str) -> str:
    """The canonical spelling of a schedule name (case-insensitive), or a ValueError listing them."""
    for known in SCHEDULES:
        if known.lower() == str(name).lower():
            return known
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


@dataclass
class PipelinePlan:
    """What a model tells the pipeline split (a field of ``ParallelPlan``)."""

    module: nn.Module
    """The module that is split: its blocks (``ParallelPlan.blocks``, an ``nn.ModuleDict``) are a
    direct child, and its ``forward`` runs any stage (see the module docstring)."""
    first: tuple[str, ...] = ()
    """Names of ``module``'s children only the first stage holds (token / position embeddings)."""
    last: tuple[str, ...] = ()
    """Names of ``module``'s children only the last stage holds (final norm, head)."""


@dataclass
class PipelineOptions:
    """How the pipeline runs. Validated on construction (names, stages per rank) and by
    ``validate`` against the pipeline degree, the model's blocks and the batch size."""

    schedule: str = "1F1B"
    """One of ``SCHEDULES`` (case-insensitive), the schedules ``torch.distributed.pipelining`` ships."""
    microbatches: int | None = None
    """Micro-batches per batch; None: as many as there are stages (the fewest that fill the pipeline;
    more shrink the bubble, (p - 1) / (m + p - 1) for GPipe / 1F1B)."""
    stages_per_rank: int | None = None
    """None: 1 for GPipe / 1F1B, 2 for the looped and V-shaped schedules (V-shaped: exactly 2)."""
    split_points: list[int] | None = None
    """Index of the first block of every stage but the first (e.g. ``[3]`` for 2 stages: blocks
    0-2 | 3-...). None: balanced by cost (see ``edge_cost``)."""
    edge_cost: float = 0.0
    """How many blocks the first stage's embeddings and the last stage's head each cost when
    balancing: at GPT-2's vocabulary the head's matmul and the loss cost about a block, so 1.0
    gives the first and last stages one block fewer. 0: balanced by block count."""

    def __post_init__(self) -> None:
        self.schedule = schedule_name(self.schedule)
        spr = self.stages_per_rank
        if spr is not None and (not isinstance(spr, int) or spr < 1):
            raise ValueError(f"pp_stages_per_rank={spr!r} must be a positive int")
        if self.schedule in SINGLE_STAGE and spr not in (None, 1):
            raise ValueError(f"pp_schedule={self.schedule!r} runs one stage per rank, but pp_stages_per_rank={spr}; "
                             f"use a looped schedule ({', '.join(LOOPED)}) for several, or pp_stages_per_rank=1")
        if self.schedule in LOOPED and spr == 1:
            raise ValueError(f"pp_schedule={self.schedule!r} interleaves several stages per rank, but "
                             f"pp_stages_per_rank=1; use pp_stages_per_rank>=2, or a single-stage schedule "
                             f"({', '.join(SINGLE_STAGE)})")
        if self.schedule in V_SHAPED and spr not in (None, 2):
            raise ValueError(f"pp_schedule={self.schedule!r} places exactly 2 stages per rank (a V); "
                             f"pp_stages_per_rank={spr}: use 2 (or leave it unset)")
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ValueError(f"pp_microbatches={self.microbatches!r} must be a positive int")
        if self.edge_cost < 0:
            raise ValueError(f"pp_edge_cost={self.edge_cost} must be >= 0 (blocks an embedding or head costs)")

    @property
    def local_stages(self) -> int:
        """Stages each rank holds (``stages_per_rank`` resolved)."""
        return self.stages_per_rank or (1 if self.schedule in SINGLE_STAGE else 2)

    def num_stages(self, pp: int) -> int:
        return pp * self.local_stages

    def num_microbatches(self, pp: int) -> int:
        return self.microbatches or self.num_stages(pp)

    def validate(self, pp: int, n_blocks: int | None = None, batch_size: int | None = None) -> None:
        """Everything that would otherwise hang or fail inside a schedule, as a ValueError naming the fix."""
        stages, m = self.num_stages(pp), self.num_microbatches(pp)
        if m < stages and self.schedule != "GPipe":
            # torchtitan's #775: fewer micro-batches than stages hangs some schedules.
            raise ValueError(f"pp_microbatches={m} is fewer than the {stages} pipeline stages (pp={pp} x "
                             f"{self.local_stages} per rank); use pp_microbatches>={stages}")
        if self.schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % pp:
            raise ValueError(f"pp_schedule={self.schedule!r} runs micro-batches in rounds of pp={pp}; "
                             f"pp_microbatches={m} is not a multiple of {pp}: use {m + (-m) % pp}")
        if n_blocks is not None:
            if stages > n_blocks:
                raise ValueError(f"{stages} pipeline stages (pp={pp} x {self.local_stages} per rank) but the "
                                 f"model has {n_blocks} blocks; every stage needs at least one: lower pp or "
                                 f"pp_stages_per_rank")
            split_blocks(n_blocks, stages, self.split_points, self.edge_cost)
        if batch_size is not None and batch_size % m:
            raise ValueError(f"the batch of {batch_size} samples does not split into pp_microbatches={m}; use a "
                             f"batch size divisible by {m} (e.g. {batch_size + (-batch_size) % m}) or another "
                             f"pp_microbatches")


def split_blocks(n_blocks: int, n_stages: int, split_points: Sequence[int] | None = None,
                 edge_cost: float = 0.0) -> list[range]:
    """The block range of each stage. Explicit ``split_points`` are checked; otherwise the split
    minimises the most expensive stage, a block costing 1 and the first and last stages
    ``edge_cost`` more (ties: earlier stages take more blocks)."""
    if split_points is not None:
        points = list(split_points)
        bounds = [0, *points, n_blocks]
        if len(points) != n_stages - 1 or any(b >= e for b, e in zip(bounds, bounds[1:])):
            raise ValueError(f"pp_split_points={points} must be {n_stages - 1} increasing block indices in "
                             f"1..{n_blocks - 1} (the first block of stages 1..{n_stages - 1}), every stage "
                             f"keeping at least one of the {n_blocks} blocks")
        return [range(b, e) for b, e in zip(bounds, bounds[1:])]
    if n_stages > n_blocks:
        raise ValueError(f"{n_stages} stages for {n_blocks} blocks: every stage needs at least one block")

    def cost(stage: int, n: int) -> float:
        return n + edge_cost * ((stage == 0) + (stage == n_stages - 1))

    # best[s][i]: the smallest possible maximum stage cost for stages s.. given blocks i.. remain.
    inf = float("inf")
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    take = [[0] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[n_stages][n_blocks] = 0.0
    for s in range(n_stages - 1, -1, -1):
        for i in range(n_blocks):
            for n in range(n_blocks - i - (n_stages - s - 1), 0, -1):  # leave a block per later stage
                value = max(cost(s, n), best[s + 1][i + n])
                if value < best[s][i] - 1e-9:
                    best[s][i], take[s][i] = value, n
    ranges, i = [], 0
    for s in range(n_stages):
        ranges.append(range(i, i + take[s][i]))
        i += take[s][i]
    return ranges


def stage_ids(pp_rank: int, pp: int, options: PipelineOptions) -> list[int]:
    """The stages rank ``pp_rank`` of the pipeline holds, in execution order."""
    if options.schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(options.local_stages)]


def stage_to_rank(stage: int, pp: int, options: PipelineOptions) -> int:
    if options.schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def blocks_attribute(module: nn.Module, blocks: nn.Module) -> str:
    """The name under which ``blocks`` is a direct child of ``module``."""
    for name, child in module.named_children():
        if child is blocks:
            return name
    raise ValueError(f"pipeline parallel needs the blocks to be a direct child of {type(module).__name__} "
                     f"(PipelinePlan.module); move them there or point PipelinePlan.module at their parent")


def _view(model: nn.Module, blocks_name: str, blocks: nn.ModuleDict, keys: list[str], first: bool, last: bool,
          plan: PipelinePlan) -> nn.Module:
    """A module of ``model``'s class sharing its submodules, with only these blocks and edges.
    Neither runs its class's ``__init__``; each has hooks of its own (FSDP's root hooks on one view
    stay off the others)."""
    held = dict(blocks.items())  # a ModuleDict's slots, in order
    children: dict[str, nn.Module | None] = {
        blocks_name: torch_compat.module_view(blocks, {k: held[k] for k in keys}, share=False)}
    for name in () if first else plan.first:
        children[name] = None
    for name in () if last else plan.last:
        children[name] = None
    return torch_compat.module_view(model, children)


def split_model(plan: PipelinePlan, blocks: nn.Module, ranges: list[range], local: list[int]) -> list[nn.Module]:
    """Delete from ``plan.module``, in place, every block and edge module no local stage holds;
    return one module per local stage (the model itself when there is one)."""
    model = plan.module
    if not isinstance(blocks, nn.ModuleDict):
        raise ValueError(f"pipeline parallel needs the blocks in an nn.ModuleDict keyed by layer index (names then "
                         f"survive the split), not {type(blocks).__name__}; build them as "
                         f"nn.ModuleDict({{str(i): Block(...) for i in range(n_layer)}}) and iterate .values()")
    name = blocks_attribute(model, blocks)
    slots = torch_compat.child_slots(model)
    for attr in (*plan.first, *plan.last):
        if attr not in slots:
            raise ValueError(f"PipelinePlan names {attr!r}, which is not a child module of {type(model).__name__}")
    keys = list(blocks.keys())
    object.__setattr__(blocks, "_ldt_all_keys", keys)  # the unsplit model's layers (float8's edge blocks, logs)
    n_stages = len(ranges)
    kept = {keys[i] for s in local for i in ranges[s]}
    for key in keys:
        if key not in kept:
            del blocks[key]
    for attr in () if 0 in local else plan.first:
        setattr(model, attr, None)
    for attr in () if n_stages - 1 in local else plan.last:
        setattr(model, attr, None)
    if len(local) == 1:
        return [model]
    return [_view(model, name, blocks, [keys[i] for i in ranges[s]], s == 0, s == n_stages - 1, plan) for s in local]


class AuxLossGrad(torch.autograd.Function):
    """Identity on a stage's output whose backward also differentiates ``aux`` (a scalar computed
    inside the stage, e.g. its MoE layers' balance and z losses) with weight ``weight``: the stage's
    backward then adds ``weight · d aux / d params`` as if ``weight · aux`` were part of the loss,
    although only the last stage's output reaches the loss function (Megatron's
    ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.weight = weight
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux, ctx.weight), None


def attach_aux_loss(output: Any, aux: torch.Tensor, weight: float) -> Any:
    """``output`` (a tensor, or a tuple / list whose first tensor carries it) with ``aux``'s gradient
    attached: see ``AuxLossGrad``."""
    if isinstance(output, torch.Tensor):
        return AuxLossGrad.apply(output, aux, weight)
    if isinstance(output, (tuple, list)):
        items = list(output)
        for i, item in enumerate(items):
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                items[i] = AuxLossGrad.apply(item, aux, weight)
                return type(output)(items)
    raise TypeError(f"a pipeline stage with an auxiliary loss must return a floating-point tensor (or a tuple "
                    f"holding one) to carry its gradient, not {type(output).__name__}")


_STAGE_CLASS: type | None = None


def _stage_class() -> type:
    """``PipelineStage`` with the runner's two additions (see ``PipelineRunner``): micro-batch
    forwards attach the stage's auxiliary loss, and the gradient reduction at the end of a
    schedule step follows ``runner.sync_gradients``."""
    global _STAGE_CLASS
    if _STAGE_CLASS is not None:
        return _STAGE_CLASS
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage

    class RunnerStage(PipelineStage):
        runner: PipelineRunner

        def forward_maybe_with_nosync(self, *args, **kwargs):
            # One micro-batch's forward (the schedule's shape probing calls the module directly).
            self.runner._microbatch_forward_starts()
            return self.runner._after_microbatch(self.submod, super().forward_maybe_with_nosync(*args, **kwargs))

        def perform_reduce_grad(self, grad_scale_factor: int):
            # torch's version turns FSDP's gradient sync on and reduce-scatters the step's
            # gradients at the end of every schedule step; with gradient accumulation only the
            # window's last step may. Otherwise: the same post-backward with sync off, so each unit
            # adds its unsharded gradient to the ones it holds and reshards, without communicating.
            if self.runner.sync_gradients or not isinstance(self.submod, FSDPModule):
                return super().perform_reduce_grad(grad_scale_factor)
            module = self.submod
            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True)
            module.set_requires_gradient_sync(False)
            torch_compat.fsdp_post_backward(module)
            if grad_scale_factor != 1:
                self.scale_grads(grad_scale_factor)

    _STAGE_CLASS = RunnerStage
    return RunnerStage


class PipelineRunner:
    """This rank's stages and the schedules that run them.

    Each (training or evaluation, micro-batch shape) gets its own ``PipelineStage`` objects and
    schedule, built at first use: the stages infer the shapes they send from their first
    micro-batch (torch runs a probing forward and backward under a forked RNG), and evaluation
    must not re-infer the training stages' shapes.
    Losses come from ``loss_fn(output, target)`` on the last stage; gradients are not rescaled by
    the schedule (``scale_grads=False``): ``loss_fn`` returns what to differentiate.

    Auxiliary losses computed inside the stages (a mixture of experts' balance and z losses): with
    ``aux_loss`` set, ``aux_loss(stage_module)`` after each training micro-batch's forward gives
    the stage's auxiliary loss (or None); its gradient, times the ``aux_weight`` of ``run``, joins
    that stage's backward (``AuxLossGrad``), and ``aux_mean`` is the sum over this rank's stages
    of their mean over the step's micro-batches. ``state_guard()`` (optional) snapshots state the
    stages record while training (the MoE loads for the balancing bias) and returns a function
    that restores it: the runner calls it before each training step and restores at the first
    micro-batch, so the shape probing's forward and backward leave no trace.

    Gradient accumulation: ``sync_gradients`` False makes the end of a training step keep FSDP's
    gradients unreduced (accumulated in each unit) instead of reduce-scattering them; set it True
    for the last step before the optimizer step, which then reduces the window's sum once.
    """

    def __init__(self, modules: list[nn.Module], ids: list[int], num_stages: int, options: PipelineOptions,
                 pp: int, group, device: torch.device):
        self.modules, self.ids, self.num_stages = modules, ids, num_stages
        self.options, self.pp, self.group, self.device = options, pp, group, device
        self.microbatches = options.num_microbatches(pp)
        self.has_first = 0 in ids
        self.has_last = num_stages - 1 in ids
        self.last_rank = stage_to_rank(num_stages - 1, pp, options)
        """Rank in the pipeline group that holds the last stage (the losses)."""
        self._schedules: dict[tuple, Any] = {}
        self._loss_fn: Callable | None = None
        self.aux_loss: Callable[[nn.Module], torch.Tensor | None] | None = None
        self.state_guard: Callable[[], Callable[[], None]] | None = None
        self.sync_gradients = True
        self._aux_weight: float | None = None  # set while a training step runs
        self._aux_values: list[torch.Tensor] = []
        self._restore: Callable[[], None] | None = None

    def _call_loss(self, output, target):
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    def _microbatch_forward_starts(self) -> None:
        if self._restore is not None:  # the first micro-batch: undo what the shape probing recorded
            restore, self._restore = self._restore, None
            restore()

    def _after_microbatch(self, module: nn.Module, output: Any) -> Any:
        if self._aux_weight is None or self.aux_loss is None:
            return output
        aux = self.aux_loss(module)
        if aux is None:
            return output
        self._aux_values.append(aux.detach().float())
        if not aux.requires_grad:
            return output
        return attach_aux_loss(output, aux, self._aux_weight)

    @property
    def aux_mean(self) -> torch.Tensor:
        """The last training step's auxiliary losses: per local stage the mean over the micro-batches,
        summed over the stages (a float32 scalar; 0 without any)."""
        if not self._aux_values:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.stack(self._aux_values).sum() / self.microbatches

    def schedule(self, train: bool, microbatch_shape: tuple[int, ...]):
        key = (train, microbatch_shape)
        if key not in self._schedules:
            from torch.distributed.pipelining.schedules import get_schedule_class

            stage_class = _stage_class()
            stages = [stage_class(m, i, self.num_stages, self.device, group=self.group)
                      for m, i in zip(self.modules, self.ids)]
            for stage in stages:
                stage.runner = self
            if self.options.schedule in SINGLE_STAGE:
                cls = get_schedule_class(self.options.schedule)
                schedule = cls(stages[0], n_microbatches=self.microbatches, loss_fn=self._call_loss,
                               scale_grads=False)
            elif train:
                cls = get_schedule_class(self.options.schedule)
                schedule = cls(stages, n_microbatches=self.microbatches, loss_fn=self._call_loss, scale_grads=False)
            else:
                schedule = self._forward_only(stages)
            self._schedules[key] = schedule
        return self._schedules[key]

    def _forward_only(self, stages):
        """Evaluation for several stages per rank: every micro-batch through each local stage in
        order, as a compute-only action list that torch's schedule runtime lowers to sends and
        receives. (The zero-bubble and V schedules' own forward-only mode still steals backward
        inputs and fails in torch 2.13.)"""
        mapping = {s: stage_to_rank(s, self.pp, self.options) for s in range(self.num_stages)}
        actions = {r: [(s, mb) for s in stage_ids(r, self.pp, self.options) for mb in range(self.microbatches)]
                   for r in range(self.pp)}
        return torch_compat.compute_only_schedule(stages, actions, mapping, n_microbatches=self.microbatches,
                                                  loss_fn=self._call_loss, scale_grads=False)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable, train: bool,
            aux_weight: float = 1.0) -> None:
        """One batch through the pipeline: forward and backward of every micro-batch (``train``) or
        forward only. Every rank of the pipeline group calls it with the same batch. ``aux_weight``:
        what each micro-batch's auxiliary loss is multiplied by in the backward (as ``loss_fn``
        scales the loss)."""
        m = self.microbatches
        if inputs.size(0) % m:
            raise ValueError(f"the batch of {inputs.size(0)} samples does not split into pp_microbatches={m}; use a "
                             f"batch size divisible by {m}")
        self._loss_fn = loss_fn
        schedule = self.schedule(train, (inputs.size(0) // m, *inputs.shape[1:]))
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets} if self.has_last else {}
        try:
            if train:
                self._aux_values = []
                self._aux_weight = aux_weight
                self._restore = self.state_guard() if self.state_guard is not None else None
                schedule.step(*args, return_outputs=False, **kwargs)
            else:
                schedule.eval(*args, return_outputs=False, **kwargs)
        finally:
            self._loss_fn = self._aux_weight = self._restore = None
