"""Lightning strategies. Importing this package registers the names ``fsdp2``, ``fsdp2_zero2`` and
``hsdp`` with Lightning's ``StrategyRegistry``, so ``Trainer(strategy="fsdp2")`` and
``trainer.strategy: fsdp2`` in a LightningCLI YAML work."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_disttrain.strategies.fsdp2 import FSDP2Strategy
from lightning_disttrain.strategies.nd_parallel import NDParallelStrategy

FSDP2Strategy.register_strategies(StrategyRegistry)

__all__ = ["FSDP2Strategy", "NDParallelStrategy"]
