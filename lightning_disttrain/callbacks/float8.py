"""Float8Training: float8 matmuls for a LightningModule's Linears (torchao), under any strategy.

Where it applies itself (DESIGN.md: callbacks that change the model):

- Under a lightning-disttrain strategy (one with a ``transforms`` ``TransformRegistry``), ``setup``
  registers the swap at stage ``"dtype"``; the strategy runs it right after ``configure_model``,
  before tensor parallel and FSDP, and before it builds the optimizers. When parameters are
  sharded and the recipe is ``tensorwise`` the weights are all-gathered in float8
  (``ctx.extras["float8_fsdp_all_gather"] = True`` tells later stages).
- Under any other strategy (single device, DDP) it applies itself in ``on_fit_start``.
  Lightning's ``Trainer._run`` calls callbacks' ``setup`` before ``configure_model``, so a model
  built there (GPTModule's) does not exist in ``setup``; ``on_fit_start`` is the first hook after
  it. The optimizer was built just before (``strategy.setup``); that is fine because torchao's
  swap moves the very same weight and bias ``Parameter`` objects into the new ``Float8Linear``
  (checked below, so a torchao change cannot silently leave the optimizer on stale tensors), and
  DDP's reducer holds those same objects too. Models that are already sharded at that point
  (Lightning's FSDP / ModelParallel strategies) cannot be swapped any more: we say so.

After every optimizer step with float8 all-gather, ``on_train_batch_end`` precomputes the next
all-gather's scales (one all-reduce for all weights). Not ``on_before_zero_grad``: Lightning's
automatic loop zeroes gradients inside the *next* step's closure, after its forward, i.e. after
the all-gather that needs the scales. ``on_train_batch_end`` runs after the step and before any
further forward (validation runs after it too); a step happened iff ``global_step`` advanced,
which also handles gradient accumulation and manual optimization.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_disttrain.parallel.float8 import (
    DEFAULT_EXCLUDED_NAMES,
    Float8Options,
    ModuleFilter,
    convert_to_float8,
    float8_fqns,
    float8_transform,
    precompute_fsdp_scales,
    uses_float8_all_gather,
)
from lightning_disttrain.parallel.transforms import TransformRegistry

STAGE = "dtype"


class Float8Training(Callback):
    """Train the model's eligible ``nn.Linear`` layers with float8 matmuls (torchao).

    Args:
        recipe: ``"tensorwise"`` (fastest; float8 FSDP all-gather), ``"rowwise"`` or
            ``"rowwise_with_gw_hp"`` (more accurate, somewhat slower).
        exclude_first_last_blocks: keep the first and last transformer block in high precision.
        module_filter: ``(module, fqn) -> bool``; a Linear is converted only if this also returns
            True (in a YAML: the import path of a function).
        exclude_names: names of Linears never converted, matched against each Linear's own name
            (the last FQN component: ``encoder.layer.0.output.dense`` is ``dense``); default:
            heads (``lm_head``, ``output``, ``head``) and MoE routers (``router``, ``gate``).
            Embeddings and norms are never Linears, a head tied to the embedding is recognised by
            its weight, and Linears with a dimension not divisible by 16 are always skipped.
        fsdp_float8_all_gather: None (default): on for ``tensorwise`` when the strategy shards
            parameters with FSDP2. Needs a lightning-disttrain strategy.
        precompute_scales: with float8 all-gather, compute all weights' scales in one all-reduce
            after each optimizer step (torchtitan's default).
        emulate: None: emulated float8 matmuls on CPU (for tests), real ones on CUDA.

    The weights stay in their dtype (fp32 master weights under ``precision="bf16-mixed"``); use
    ``bf16-mixed``, not ``bf16-true``, to keep them so. On a CUDA GPU without float8 support
    (compute capability < 8.9, e.g. A100) it fails at the start of ``fit`` with the fix.
    """

    def __init__(
        self,
        recipe: str = "tensorwise",
        exclude_first_last_blocks: bool = False,
        module_filter: ModuleFilter | None = None,
        exclude_names: tuple[str, ...] | list[str] = DEFAULT_EXCLUDED_NAMES,
        fsdp_float8_all_gather: bool | None = None,
        precompute_scales: bool = True,
        emulate: bool | None = None,
    ) -> None:
        # Validates now, so a bad YAML fails at parse time rather than after the model is built.
        self.options = Float8Options(recipe=recipe, exclude_first_last_blocks=exclude_first_last_blocks,
                                     exclude_names=tuple(exclude_names), module_filter=module_filter,
                                     fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
        self.precompute_scales = precompute_scales
        self.converted: list[str] = []
        """FQNs (relative to the LightningModule) of the Linears now in float8."""
        self.fsdp_float8_all_gather = False
        """Whether FSDP all-gathers this run's float8 weights in float8."""
        self._registered = False
        self._applied = False
        self._last_global_step: int | None = None

    @property
    def recipe(self) -> str:
        return self.options.recipe

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        registry = getattr(trainer.strategy, "transforms", None)
        if isinstance(registry, TransformRegistry):
            # Idempotent by name: a second fit's setup does not register (or apply) twice.
            registry.register(STAGE, float8_transform(self.options, self._on_applied), name=type(self).__name__,
                              owner=self)
            self._registered = True

    def _on_applied(self, converted: list[str], all_gather: bool) -> None:
        self.converted, self.fsdp_float8_all_gather, self._applied = converted, all_gather, True
        self._report()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_global_step = trainer.global_step
        if self._applied:
            return
        existing = float8_fqns(pl_module)
        if existing:  # a second fit on the same module (strategies do not re-run their stages)
            # Its weights may still carry the last precomputed scales: keep precomputing them.
            self.converted, self._applied = existing, True
            self.fsdp_float8_all_gather = uses_float8_all_gather(pl_module)
            return
        if self._registered:
            raise RuntimeError(f"{type(trainer.strategy).__name__} has a transform registry but did not "
                               f"run the {STAGE!r} stage before fit; Float8Training cannot swap Linears "
                               f"of a model it may already have sharded")
        self._apply_in_place(trainer, pl_module)

    def _apply_in_place(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.options.fsdp_float8_all_gather:
            raise ValueError("fsdp_float8_all_gather=True needs a lightning-disttrain strategy that shards "
                             "with FSDP2 (strategy='fsdp2'); leave it None here")
        if _is_sharded(pl_module):
            raise ValueError(
                f"{type(trainer.strategy).__name__} sharded the model before on_fit_start, after which "
                f"Linears cannot be swapped; use strategy='fsdp2' (lightning-disttrain runs float8 before "
                f"sharding) or call convert_to_float8 in configure_model before fully_shard")
        before = {n: p for n, p in pl_module.named_parameters()}
        self.converted = convert_to_float8(pl_module, self.options, device=pl_module.device)
        after = dict(pl_module.named_parameters())
        stale = [n for n, p in before.items() if after.get(n) is not p]
        if stale:
            raise RuntimeError(f"the float8 swap replaced parameter objects {stale[:3]} after the optimizer "
                               f"was built; this torchao version needs the swap before configure_optimizers")
        self._applied = True
        self._report()

    def _report(self) -> None:
        gather = ", float8 FSDP all-gather" if self.fsdp_float8_all_gather else ""
        if not self.converted:
            rank_zero_warn(f"Float8Training (recipe={self.recipe!r}): 0 Linear layers converted, nothing "
                           f"runs in float8. Only torch.nn.Linear modules are converted (not other matmul "
                           f"modules such as Hugging Face GPT-2's Conv1D), and only those with both "
                           f"dimensions divisible by 16, not named in exclude_names {self.options.exclude_names} "
                           f"and not tied to an embedding; remove the callback or adapt the model")
            return
        rank_zero_info(f"Float8Training (recipe={self.recipe!r}{gather}): {len(self.converted)} Linear "
                       f"layers in float8")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        stepped = trainer.global_step != self._last_global_step
        self._last_global_step = trainer.global_step
        if stepped and self.fsdp_float8_all_gather and self.precompute_scales:
            precompute_fsdp_scales(pl_module)

    def state_dict(self) -> dict[str, Any]:
        # What was converted, for a resumed run to check against (the options live in the config).
        return {"recipe": self.recipe, "converted": list(self.converted)}


def _is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) or type(p).__name__ == "FlatParameter" for p in module.parameters())
