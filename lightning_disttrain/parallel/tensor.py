"""Tensor parallel (TP) with sequence parallel (SP) and loss parallel: ``parallelize_module`` from the
model's plan. Plain torch (+ torchao for float8 styles), no Lightning.

Stage 3 of ``recipe.parallelize``: after the float8 swap (the plan's styles become torchao's float8
styles for the converted Linears), before activation checkpointing (which then checkpoints the
sharded blocks, collectives included), compile and FSDP (which shards the TP-sharded parameters
again over the data-parallel ranks: 2-D).

A model's plan (``ParallelPlan.tp_block_plan`` / ``tp_root_plan``) maps module names to
``ParallelStyle``s, or is a function of ``TensorParallelOptions`` returning that mapping (the
styles differ with sequence and loss parallel). Block plan names are relative to each block; root
plan names to the module whose ``parallel_plan()`` gave the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Union

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain.parallel.materialize import retie_parameters, tied_parameters
from lightning_disttrain.parallel.plan import ParallelPlan

TPPlan = Union[Mapping[str, ParallelStyle], Callable[["TensorParallelOptions"], Mapping[str, ParallelStyle]]]


@dataclass(frozen=True)
class TensorParallelOptions:
    """How tensor parallel runs; passed to a model's plan functions."""

    sequence_parallel: bool = True
    """Shard the activations between attention and MLP (norms, residual stream, dropout) on the
    sequence dimension: each rank holds 1/tp of them, at the price of an all-gather before and a
    reduce-scatter after each attention / MLP instead of one all-reduce. Needs the sequence
    length divisible by tp."""
    loss_parallel: bool = True
    """Keep the head's output sharded on the vocabulary and compute the cross-entropy on the
    shards (``torch.distributed.tensor.parallel.loss_parallel``) instead of gathering
    batch x seq x vocab logits on every rank."""
    async_tp: bool = False
    """Fuse TP collectives with the matmuls (inductor's micro-pipeline TP over symmetric memory):
    CUDA only, and only in compiled blocks."""


def resolve(plan: TPPlan | None, options: TensorParallelOptions) -> dict[str, ParallelStyle] | None:
    if plan is None:
        return None
    return dict(plan(options) if callable(plan) else plan)


def check_plan(module: nn.Module, plan: ParallelPlan) -> None:
    """Refuse tensor parallel for a model that does not say how (before any collective)."""
    if plan.tp_block_plan is None:
        raise ValueError(
            f"tp > 1 needs a tensor-parallel plan, and {type(module).__name__} has none: define "
            f"parallel_plan() returning ParallelPlan(blocks=..., tp_block_plan={{name in a block: "
            f"ParallelStyle}}, tp_root_plan={{name in the module: ParallelStyle}}) (GPTModule.parallel_plan "
            f"shows one), or set tp=1")


def apply_tp(module: nn.Module, plan: ParallelPlan, tp_mesh, options: TensorParallelOptions,
             float8_fqns: list[str] | None = None) -> None:
    """Shard every block with the block plan and the rest with the root plan, on ``tp_mesh``.

    ``float8_fqns``: Linears already swapped for torchao ``Float8Linear`` with tensorwise scales
    (FQNs relative to ``module``); their styles become torchao's float8 styles, so activations are
    cast before the all-gather and gathered in float8. Only where the backend can carry float8
    (NCCL): gloo has no float8 type, so on CPU, as for rowwise scales, the Float8Linears keep the
    plain styles (float8 matmuls, activations gathered in their own dtype).
    """
    check_plan(module, plan)
    block_plan = resolve(plan.tp_block_plan, options)
    root_plan = resolve(plan.tp_root_plan, options) or {}
    # A pipeline stage holds only some of the root's modules (embeddings first, head last).
    root_plan = {k: v for k, v in root_plan.items() if _present(module, k)}
    float8 = set(float8_fqns or []) if tp_mesh.device_type != "cpu" else set()
    ties = tied_parameters(module)
    names = {id(m): n for n, m in module.named_modules()}
    for block in plan.block_list:
        prefix = names[id(block)]
        parallelize_module(block, tp_mesh, _float8_styles(block_plan, prefix, float8))
    if root_plan:
        parallelize_module(module, tp_mesh, _float8_styles(root_plan, "", float8))
    # parallelize_module gives each module its own new DTensor parameter: a tied embedding and
    # head are shared again (both are sharded on the vocabulary, Shard(0): the same layout).
    for names_ in ties:
        layouts = {str(_layout(module.get_parameter(n))) for n in names_}
        if len(layouts) > 1:
            raise ValueError(f"tied parameters {names_} got different tensor-parallel layouts {sorted(layouts)}; "
                             f"give them the same (e.g. embedding RowwiseParallel and head ColwiseParallel, "
                             f"both Shard(0) on the vocabulary), or untie them")
    retie_parameters(module, ties)
    if options.sequence_parallel:
        module.register_forward_pre_hook(partial(_check_sequence_length, tp_mesh.size()))


def _present(module: nn.Module, fqn: str) -> bool:
    try:
        return module.get_submodule(fqn) is not None
    except AttributeError:
        return False


def _layout(p: torch.Tensor) -> Any:
    return tuple(p.placements) if isinstance(p, DTensor) else "plain"


def _check_sequence_length(tp: int, module: nn.Module, args: tuple) -> None:
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if x is not None and x.dim() >= 2 and x.size(1) % tp:
        raise ValueError(f"sequence parallel splits the sequence across tp={tp} ranks, but this batch has "
                         f"sequence length {x.size(1)}; use a sequence length divisible by {tp} (e.g. "
                         f"seq_len={x.size(1) + (-x.size(1)) % tp}) or sequence_parallel=False")


def _float8_styles(plan: Mapping[str, ParallelStyle], prefix: str, float8: set[str]) -> dict[str, ParallelStyle]:
    """The plan with torchao's float8 styles for Float8Linears and for inputs that feed them."""
    if not float8:
        return dict(plan)
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    out = {}
    for name, style in plan.items():
        fqn = f"{prefix}.{name}" if prefix else name
        feeds_float8 = any(f.startswith(f"{fqn}.") for f in float8)
        if fqn in float8 and type(style) is ColwiseParallel:
            style = Float8ColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                          use_local_output=style.use_local_output)
        elif fqn in float8 and type(style) is RowwiseParallel:
            style = Float8RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                          use_local_output=style.use_local_output)
        elif feeds_float8 and type(style) is PrepareModuleInput:
            # Cast to float8 before the all-gather: one float8 gather for q, k and v together.
            style = PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                             desired_input_layouts=style.desired_input_layouts,
                                             use_local_output=style.use_local_output)
        out[name] = style
    return out


class ReplicateOnShardedInput(torch_compat.ParallelStyleBase):
    """For a small module with its own weights that runs on activations sharded on ``dim`` (e.g.
    QK-norm on the local attention heads): its parameters become replicated DTensors, so their
    gradients, summed over the shards each rank saw, are all-reduced across the TP ranks. Input
    and output stay local tensors, as the surrounding column-parallel code expects."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def apply_style(self, module: nn.Module, device_mesh) -> nn.Module:
        def replicate(name, mod, mesh):
            for p_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(p_name, nn.Parameter(
                    DTensor.from_local(param, mesh, [Replicate()], run_check=False), requires_grad=param.requires_grad))

        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, [Shard(self.dim)], run_check=False)
                         if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, replicate, to_dtensor, to_local)


def vocabulary_padding_bias(logits: DTensor, vocab_size: int) -> DTensor:
    """0 for real vocabulary columns, -inf for padding ones, laid out like ``logits``' last dim:
    adding it masks the padding of vocabulary-sharded logits without gathering (slicing would)."""
    padded = logits.shape[-1]
    bias = torch.zeros(padded, dtype=logits.dtype, device=logits.device)
    bias[vocab_size:] = float("-inf")
    shard_dim = next(p.dim for p in logits.placements if isinstance(p, Shard))
    placements = [Shard(0) if isinstance(p, Shard) and p.dim in (shard_dim, logits.ndim - 1) else Replicate()
                  for p in logits.placements]
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(bias, logits.device_mesh, placements, src_data_rank=None)


def enable_async_tp(tp_mesh) -> None:
    """Let inductor fuse TP's all-gather / reduce-scatter with the matmuls next to them (CUDA only:
    symmetric memory between the TP ranks, which torch below 2.13 must be told to set up). Takes
    effect in compiled blocks."""
    torch_compat.enable_micro_pipeline_tp()
    torch_compat.enable_symm_mem_for_group(tp_mesh.get_group().group_name)
