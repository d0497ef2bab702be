"""SelectiveActivationCheckpointing: activation checkpointing for any LightningModule's blocks.

Where it applies itself (DESIGN.md: callbacks that change the model):

- Under a lightning-disttrain strategy (one with a ``transforms`` ``TransformRegistry``), ``setup``
  registers the transform at stage ``"activation_checkpointing"``; the strategy runs it after
  ``configure_model`` and tensor parallel, before compile and FSDP.
- Under any other strategy (single device, DDP, Lightning's own) it applies itself in
  ``on_fit_start``. Lightning's ``Trainer._run`` calls, in this order: callbacks' ``setup`` →
  the module's ``setup`` → ``configure_model`` → ``strategy.setup`` (moves the model, wraps DDP,
  builds the optimizers) → ``on_fit_start``. ``setup`` is too early: models built in
  ``configure_model`` (GPTModule's) do not exist yet, and looking for the blocks there would build
  them outside the strategy's init context. ``on_fit_start`` is the first hook after
  ``configure_model`` and before the first forward. That the optimizer already exists is fine:
  checkpointing replaces each block's ``forward`` only, so the parameter objects the optimizer
  holds, and every parameter name, stay as they were.

Checkpointing only matters for training, so validate/test/predict-only runs are not changed.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_disttrain.parallel.activation import (
    ACPolicy,
    ActivationCheckpointConfig,
    MatmulRecompute,
    apply_activation_checkpointing,
    checkpoint_config_of,
)
from lightning_disttrain.parallel.plan import as_block_list, find_blocks
from lightning_disttrain.parallel.transforms import TransformContext, TransformRegistry

STAGE = "activation_checkpointing"


class SelectiveActivationCheckpointing(Callback):
    """Recompute activations in backward instead of keeping them, per transformer block.

    Args:
        policy: ``"selective"`` (default): keep the outputs of matmuls, attention and collectives
            in every block and recompute the cheap ops between them (attention never runs twice).
            ``"block"``: fully recompute every ``every_k``-th block. ``"full"``: fully recompute
            every block. ``"none"``: off (handy to switch from a config).
        every_k: with ``policy="block"``, checkpoint blocks 0, k, 2k, ...
        recompute_matmuls: with ``policy="selective"``, ``"every_other"`` also recomputes every
            second matmul of each block: less memory, more FLOPs.
        preserve_rng_state: replay the RNG in recomputation so dropout masks match; turn off only
            for models without dropout, to skip saving the RNG state per block.

    The blocks are the module's ``parallel_plan().blocks``, else its largest ``nn.ModuleList`` or
    ``nn.ModuleDict`` of identical blocks (``lightning_disttrain.parallel.plan.find_blocks``).
    """

    def __init__(
        self,
        policy: ACPolicy = "selective",
        every_k: int = 2,
        recompute_matmuls: MatmulRecompute = "none",
        preserve_rng_state: bool = True,
    ) -> None:
        # Validates now, so a bad YAML fails at parse time rather than after the model is built.
        self.config = ActivationCheckpointConfig(policy=policy, every_k=every_k,
                                                 recompute_matmuls=recompute_matmuls,
                                                 preserve_rng_state=preserve_rng_state)
        self.checkpointed: list[int] = []
        """Layer indices of the blocks checkpointed on this rank (filled once applied)."""
        self._registered = False
        self._applied = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        registry = getattr(trainer.strategy, "transforms", None)
        if isinstance(registry, TransformRegistry):
            # Registering is idempotent by name: a second fit's setup does not apply twice.
            registry.register(STAGE, self._transform, name=type(self).__name__)
            self._registered = True

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._registered and self._applied:
            return
        if self._registered:
            # The strategy has a registry but never ran our stage. Applying late is still correct
            # (module hooks stay outside the checkpointed forward), so warn rather than fail.
            rank_zero_warn(f"{type(trainer.strategy).__name__} did not run the {STAGE!r} "
                           f"transform stage; applying activation checkpointing in on_fit_start")
        self._apply(pl_module)

    def _transform(self, module, ctx: TransformContext) -> None:
        self._apply(module)

    def _apply(self, module) -> None:
        if self.config.policy == "none":
            self._applied = True
            return
        container = find_blocks(module)
        blocks = as_block_list(container)
        if any(checkpoint_config_of(b) is not None for b in blocks):
            # A second fit() on the same module: it is checkpointed already.
            self._applied = True
            return
        c = self.config
        self.checkpointed = apply_activation_checkpointing(
            container, policy=c.policy, every_k=c.every_k, recompute_matmuls=c.recompute_matmuls,
            preserve_rng_state=c.preserve_rng_state)
        self._applied = True
        detail = f", every_k={c.every_k}" if c.policy == "block" else (
            f", recompute_matmuls={c.recompute_matmuls!r}" if c.policy == "selective" else "")
        rank_zero_info(f"Activation checkpointing (policy={c.policy!r}{detail}): "
                       f"{len(self.checkpointed)}/{len(blocks)} {type(blocks[0]).__name__} blocks")
