"""FSDP2Strategy: the data-parallel-only face of ``NDParallelStrategy`` (FSDP2 ZeRO-3 / ZeRO-2, HSDP).

Registered names (``Trainer(strategy=...)`` or ``trainer.strategy:`` in a LightningCLI YAML):

``fsdp2``        ZeRO-3: parameters, gradients and optimizer state sharded over all ranks.
``fsdp2_zero2``  ZeRO-2 (``reshard_after_forward=False``): parameters stay gathered from a
                 block's forward to its backward, one all-gather per step instead of two.
``hsdp``         hybrid (``hsdp="auto"``): shard within each node, replicate across nodes; on a
                 single node it is plain FSDP2.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision

from lightning_disttrain.parallel.mesh import ParallelDims
from lightning_disttrain.strategies.nd_parallel import NDParallelStrategy


class FSDP2Strategy(NDParallelStrategy):
    """Fully sharded data parallel (FSDP2) with optional HSDP.

    Args:
        reshard_after_forward: True (ZeRO-3), False (ZeRO-2) or an int (reshard to groups of
            that many ranks).
        hsdp: None: shard over every rank. ``(replicate, shard)``: HSDP with that split (use -1 for
            "the rest" in either place). ``"auto"``: replicate across nodes and shard within each
            node (the shard collectives, which run per block, stay on the fast intra-node links;
            only one all-reduce per step crosses nodes). On a single node ``"auto"`` shards over
            every rank: replicating inside one NVLink domain would hold more copies of every
            parameter and optimizer state for no bandwidth gain.
        mp_policy: FSDP ``MixedPrecisionPolicy``; None derives it from the Trainer's precision
            (as for ``NDParallelStrategy``).
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
        accumulate_unsharded_grads: with ``accumulate_grad_batches`` > 1, True skips the
            reduce-scatter on all but the last micro-batch at the cost of holding unsharded fp32
            gradients (see ``NDParallelStrategy``); False (default) keeps gradients sharded.
        async_save: write checkpoints in the background.
        on_save_error: ``"stop"`` (default) ends ``fit`` on every rank when a checkpoint cannot be
            written; ``"warn"`` logs it and trains on.
        compile: ``torch.compile`` each block (True, or a dict of options for ``apply_compile``).
        empty_init: build the model on the meta device and materialise it after sharding; None
            (default) decides by module (see ``NDParallelStrategy``).
        accelerator: as for every Lightning ``ParallelStrategy``; normally filled in by the Trainer.
        parallel_devices: the devices of this node's ranks; normally filled in by the Trainer.
        cluster_environment: Lightning's ``ClusterEnvironment``; normally filled in by the Trainer.
        checkpoint_io: Lightning's ``CheckpointIO`` plugin; normally filled in by the Trainer.
        precision_plugin: Lightning's ``Precision`` plugin; normally filled in by the Trainer.
        process_group_backend: the ``torch.distributed`` backend; None (default): ``gloo`` on CPU,
            ``nccl`` on CUDA.
        timeout: the process groups' timeout for collectives (default 30 minutes, Lightning's).
    """

    def __init__(
        self,
        reshard_after_forward: Union[bool, int] = True,
        hsdp: Optional[Union[tuple[int, int], Literal["auto"]]] = None,
        mp_policy: Optional[MixedPrecisionPolicy] = None,
        cpu_offload: bool = False,
        accumulate_unsharded_grads: bool = False,
        async_save: bool = False,
        on_save_error: str = "stop",
        compile: Union[bool, dict[str, Any]] = False,
        empty_init: Optional[bool] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        if hsdp is not None and hsdp != "auto":
            if (not isinstance(hsdp, (tuple, list)) or len(hsdp) != 2
                    or not all(isinstance(d, int) and (d >= 1 or d == -1) for d in hsdp) or hsdp == (-1, -1)):
                raise ValueError(f"hsdp={hsdp!r}: use None, 'auto' or (replicate, shard) with ints >= 1, "
                                 f"one of which may be -1 for 'whatever the world size leaves'")
            hsdp = (int(hsdp[0]), int(hsdp[1]))
        self.hsdp = hsdp
        super().__init__(
            reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, cpu_offload=cpu_offload,
            accumulate_unsharded_grads=accumulate_unsharded_grads,
            async_save=async_save, on_save_error=on_save_error, compile=compile, empty_init=empty_init,
            accelerator=accelerator,
            parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout)

    def _make_parallel_dims(self, world_size: int) -> ParallelDims:
        if self.hsdp is None:
            return ParallelDims(dp_replicate=1, dp_shard=-1, world_size=world_size)
        if self.hsdp == "auto":
            return ParallelDims(dp_replicate=self.num_nodes, dp_shard=-1, world_size=world_size)
        replicate, shard = self.hsdp
        if replicate == -1:
            if world_size % shard:
                raise ValueError(f"hsdp=(-1, {shard}): shard={shard} does not divide world_size={world_size}; "
                                 f"choose a shard size among the divisors of {world_size}")
            replicate = world_size // shard
        return ParallelDims(dp_replicate=replicate, dp_shard=shard, world_size=world_size)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        # override=True: these names mean our strategies, also if the module is imported twice.
        strategy_registry.register("fsdp2", cls, description="FSDP2 ZeRO-3 (lightning-disttrain)", override=True)
        strategy_registry.register("fsdp2_zero2", cls, description="FSDP2 ZeRO-2: no reshard after forward "
                                   "(lightning-disttrain)", override=True, reshard_after_forward=False)
        strategy_registry.register("hsdp", cls, description="FSDP2 hybrid sharding: shard within a node, "
                                   "replicate across nodes (lightning-disttrain)", override=True, hsdp="auto")

