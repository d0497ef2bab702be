"""Float8 training: which ``nn.Linear``s to swap, and the swap itself (stage 1, ``dtype``). Plain
torch + torchao, no Lightning. (The loss-gap comparison with a high-precision baseline is a
benchmark: ``benchmarks/float8_compare.py``.)

What float8 changes and what it does not (torchao ``Float8Linear``): the inputs, weights and
output gradients of the swapped matmuls are cast to float8 with dynamic scales (tensorwise or
rowwise) right before the matmul. The weight ``Parameter`` stays what it was (fp32 master weights
under ``bf16-mixed``), gradients come out in that dtype, and accumulation / optimizer state never
see float8. Everything that is not a swapped Linear (attention, norms, embedding, head, loss)
runs as before.

Why the default exclusions: the embedding is a lookup, not a matmul; the LM head sees the
logits' full dynamic range (its error goes straight into the loss) and a tied head shares its
weight with the embedding; norms are not matmuls; an MoE router's small scores decide which
experts run, so a quantisation flip changes the routing; float8 GEMMs need both dimensions
divisible by 16.

On CPU the swap uses torchao's ``emulate=True``: the same float8 casts and scales, then the
matmul on the dequantised values in fp32. CPU ``torch._scaled_mm`` exists but is a reference
kernel about 100x slower than an fp32 matmul, too slow even for tests.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain.parallel.transforms import Transform, TransformContext

RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
DEFAULT_EXCLUDED_NAMES: tuple[str, ...] = ("lm_head", "output", "head", "router", "gate")
"""Names of Linears never converted: output heads and MoE routers/gates. Matched exactly against
the Linear's own name, the last FQN component (``linear_name``), not against its parents: HF
BERT's FFN output projection ``encoder.layer.0.output.dense`` is named ``dense`` and converted,
while torchtitan's head ``output``, HF's ``lm_head``, an MoE gate (Mixtral
``block_sparse_moe.gate``, torchtitan ``moe.router.gate``) are not. LLaMA's MLP projection
``gate_proj`` is not ``gate`` and is converted. A router whose Linear has a name of its own
(DBRX's ``router.layer``) needs ``exclude_names`` or ``module_filter``."""
FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability with float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x)."""

ModuleFilter = Callable[[nn.Module, str], bool]
"""``(module, fqn) -> bool``: True to convert (torchao's ``module_filter_fn`` signature)."""


@dataclass(frozen=True)
class Float8Options:
    """How to convert a model to float8 training."""

    recipe: str = "tensorwise"
    """``tensorwise`` (fastest, one scale per tensor), ``rowwise`` (one scale per row, power-of-2
    scales: more accurate), ``rowwise_with_gw_hp`` (rowwise, weight gradient in high precision:
    the most accurate)."""
    exclude_first_last_blocks: bool = False
    """Also keep every Linear of the first and the last block in high precision (they are the
    most sensitive to quantisation in deep models)."""
    exclude_names: tuple[str, ...] = DEFAULT_EXCLUDED_NAMES
    """Linear names (the last FQN component) never converted (see ``DEFAULT_EXCLUDED_NAMES``)."""
    module_filter: ModuleFilter | None = None
    """A user filter AND-ed with the defaults: a Linear is converted only if it returns True."""
    fsdp_float8_all_gather: bool | None = None
    """All-gather FSDP2 weights in float8 (half the bytes of bf16). None: on for ``tensorwise``
    whenever parameters are sharded; only ``tensorwise`` supports it."""
    emulate: bool | None = None
    """Emulated float8 matmuls (fp32 on dequantised values). None: on CPU only."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown float8 recipe {self.recipe!r}; use one of {RECIPES}")
        if self.fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(f"fsdp_float8_all_gather=True needs recipe='tensorwise' (torchao all-gathers "
                             f"only tensorwise-scaled weights); got recipe={self.recipe!r}. Set "
                             f"fsdp_float8_all_gather=None/False or use recipe='tensorwise'")
        object.__setattr__(self, "exclude_names", tuple(self.exclude_names))


def check_float8_support(device: torch.device | str, capability: tuple[int, int] | None = None) -> None:
    """Fail with the fix when ``device`` cannot run float8 matmuls. ``capability`` defaults to the
    CUDA device's own (pass it to check a device you are not on)."""
    device = torch.device(device)
    if device.type == "cpu":
        return  # emulated: correct numerics, fine for tests, not for speed
    if device.type != "cuda":
        raise ValueError(f"float8 training runs on CUDA GPUs (and emulated on CPU), not on {device.type!r}; "
                         f"remove Float8Training for this accelerator")
    if torch.version.hip:
        return  # ROCm: torchao picks the fnuz float8 types of MI300 itself
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
    else:
        name = f"a GPU of compute capability {capability[0]}.{capability[1]}"
    if tuple(capability) < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"float8 training needs compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
            f"(Ada L4/L40S, Hopper H100/H200, Blackwell B200); {name} has "
            f"{capability[0]}.{capability[1]} and no float8 tensor cores. Remove Float8Training "
            f"(train with precision='bf16-mixed') or run on an fp8-capable GPU")


def _edge_block_prefixes(model: nn.Module) -> tuple[str, str]:
    """FQN prefixes (with a trailing dot) of the first and the last repeated block of ``model``."""
    from lightning_disttrain.parallel.plan import find_blocks

    blocks = find_blocks(model)
    for name, sub in model.named_modules():
        if sub is blocks:
            keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else [str(i) for i in range(len(blocks))]
            # A pipeline stage holds some blocks: the model's edges are the unsplit model's first and last.
            keys = getattr(blocks, "_ldt_all_keys", keys)
            dot = f"{name}." if name else ""
            return f"{dot}{keys[0]}.", f"{dot}{keys[-1]}."
    raise ValueError("the blocks returned by parallel_plan() are not a submodule of the model")


def linear_name(fqn: str) -> str:
    """The name a Linear goes by in ``fqn``: its last component, or, when that is an index into a
    container (``moe.router.0``), the container's name."""
    parts = fqn.split(".")
    while len(parts) > 1 and parts[-1].isdigit():
        parts.pop()
    return parts[-1]


def float8_module_filter(model: nn.Module, options: Float8Options) -> ModuleFilter:
    """The filter ``convert_to_float8_training`` gets: defaults, then the options, then the user's."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    edge_prefixes: tuple[str, ...] = ()
    if options.exclude_first_last_blocks:
        edge_prefixes = _edge_block_prefixes(model)
    excluded = set(options.exclude_names)
    from torchao.float8.float8_linear import Float8Linear

    def keep_in_float8(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear):
            return False  # already converted (a second fit on the same module)
        if linear_name(fqn) in excluded:
            return False
        if id(module.weight) in embedding_weights:
            return False  # a head tied to the embedding, whatever its name
        if module.in_features % 16 or module.out_features % 16:
            return False
        if edge_prefixes and f"{fqn}.".startswith(edge_prefixes):
            return False
        return options.module_filter is None or bool(options.module_filter(module, fqn))

    return keep_in_float8


def float8_linear_config(recipe: str, *, fsdp_float8_all_gather: bool = False, emulate: bool = False):
    """torchao's ``Float8LinearConfig`` for ``recipe`` with our two switches."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)


def convert_to_float8(model: nn.Module, options: Float8Options, *, device: torch.device | str,
                      fsdp_float8_all_gather: bool = False) -> list[str]:
    """Swap ``model``'s eligible Linears for ``Float8Linear`` in place; return their FQNs.

    Call before tensor parallel and FSDP (they must see the Float8Linears). Without the FSDP
    all-gather the swapped modules keep the very same weight/bias ``Parameter`` objects, so an
    optimizer built earlier keeps updating them; with it each weight is re-wrapped, so build the
    optimizer afterwards (our strategies do).
    """
    from torchao.float8 import convert_to_float8_training

    device = torch.device(device)
    check_float8_support(device)
    if fsdp_float8_all_gather and options.recipe != "tensorwise":
        raise ValueError("float8 FSDP all-gather needs recipe='tensorwise'")
    emulate = options.emulate if options.emulate is not None else device.type == "cpu"
    config = float8_linear_config(options.recipe, fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
    keep = float8_module_filter(model, options)
    converted: list[str] = []

    def record(module: nn.Module, fqn: str) -> bool:
        ok = keep(module, fqn)
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(model, module_filter_fn=record, config=config)
    return sorted(converted, key=_fqn_order(model))


def _fqn_order(model: nn.Module) -> Callable[[str], int]:
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return lambda fqn: order.get(fqn, len(order))


def float8_fqns(model: nn.Module) -> list[str]:
    """FQNs of the ``Float8Linear`` modules in ``model``, in module order."""
    cls = _float8_linear_class()
    return [] if cls is None else [n for n, m in model.named_modules() if isinstance(m, cls)]


def has_float8(model: nn.Module) -> bool:
    """Whether ``model`` has any ``Float8Linear`` (cheap: never imports torchao itself)."""
    return bool(float8_fqns(model))


def uses_float8_all_gather(model: nn.Module) -> bool:
    """Whether any float8 weight is wrapped for float8 FSDP all-gather (plain or inside a DTensor)."""
    mod = sys.modules.get("torchao.float8.fsdp_utils")
    if mod is None:
        return False
    for fqn in float8_fqns(model):
        weight = model.get_submodule(fqn).weight
        local = torch_compat.local_tensor(weight)
        if isinstance(local, mod.WeightWithDynamicFloat8CastTensor):
            return True
    return False


def _float8_linear_class():
    # No Float8Linear can exist unless torchao.float8 was imported, and importing it costs seconds.
    mod = sys.modules.get("torchao.float8.float8_linear")
    return None if mod is None else mod.Float8Linear


def precompute_fsdp_scales(model: nn.Module) -> None:
    """After each optimizer step with float8 all-gather: one all-reduce of every weight's amax
    instead of one per weight inside the next all-gather. torchao keeps the scale until the next
    call, so this must run after *every* step that changed the weights."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def float8_transform(options: Float8Options, on_applied: Callable[[list[str], bool], None] | None = None
                     ) -> Transform:
    """The ``dtype`` stage: convert, and tell the FSDP stage whether weights are gathered in fp8.

    Leaves ``ctx.extras["float8_fsdp_all_gather"]`` (bool), ``["float8_recipe"]`` and
    ``["float8_converted"]`` (FQNs) for later stages (tensor parallel needs the float8 styles for
    the converted Linears; FSDP2 needs nothing but the weights' subclass, which it calls itself).
    """

    def float8(module: nn.Module, ctx: TransformContext) -> None:
        shards = ctx.dims is not None and getattr(ctx.dims, "fsdp_size", 1) > 1
        all_gather = options.fsdp_float8_all_gather
        if all_gather is None:
            all_gather = shards and options.recipe == "tensorwise"
        elif all_gather and not shards:
            raise ValueError("fsdp_float8_all_gather=True but this run does not shard parameters with "
                             "FSDP (fsdp size 1); leave it None")
        converted = convert_to_float8(module, options, device=ctx.device, fsdp_float8_all_gather=all_gather)
        ctx.extras["float8_fsdp_all_gather"] = all_gather
        ctx.extras["float8_recipe"] = options.recipe
        ctx.extras["float8_converted"] = converted
        if on_applied is not None:
            on_applied(converted, all_gather)

    return float8
