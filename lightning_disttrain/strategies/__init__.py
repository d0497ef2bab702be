"""Lightning strategies. Importing this package registers the names ``fsdp2``, ``fsdp2_zero2``,
``hsdp``, ``fsdp2_tp`` and ``fsdp2_ep`` with Lightning's ``StrategyRegistry``, so ``Trainer(strategy="fsdp2")``
and ``trainer.strategy: fsdp2`` in a LightningCLI YAML work.

``ModelParallelStrategy``, ``FSDPStrategy`` and ``DDPStrategy`` take Lightning's own strategies'
arguments (``strategies/migration.py``), so moving a project over changes one import.

``fsdp2_tp`` is the common 2-D layout: tensor parallel over pairs of neighbouring ranks (tp=2, with
sequence and loss parallel) and FSDP2 over the rest. Other TP degrees: ``NDParallelStrategy(tp=N)``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_disttrain.strategies.fsdp2 import FSDP2Strategy
from lightning_disttrain.strategies.migration import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from lightning_disttrain.strategies.nd_parallel import NDParallelStrategy

FSDP2Strategy.register_strategies(StrategyRegistry)
StrategyRegistry.register("fsdp2_tp", NDParallelStrategy, description="FSDP2 x tensor parallel tp=2, sequence and "
                          "loss parallel (lightning-disttrain)", override=True, tp=2)
StrategyRegistry.register("fsdp2_ep", NDParallelStrategy, description="FSDP2 x expert parallel ep=2: MoE experts "
                          "split over pairs of ranks, tokens by all-to-all (lightning-disttrain)", override=True, ep=2)

__all__ = ["DDPStrategy", "FSDP2Strategy", "FSDPStrategy", "ModelParallelStrategy", "NDParallelStrategy"]
