"""The collectives Lightning asks a strategy for (barrier, broadcast, reduce), over the right ranks.

Reductions for logging and metrics run over the data-parallel ranks only (DESIGN.md): tensor-
and pipeline-parallel ranks of one replica hold the same batch, so a sum over every rank
would count it once per TP rank. ``self.log(..., sync_dist=True)`` and ``trainer.strategy.reduce``
reduce over the ``dp`` mesh; torchmetrics states are synced over the same group
(``dp_process_group``), which GPTModule passes to its metrics.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from typing_extensions import override


class CollectivesMixin:
    """Mixed into ``NDParallelStrategy`` before Lightning's ``ParallelStrategy``; reads
    ``parallel_dims`` and ``root_device``."""

    @property
    def dp_process_group(self) -> Optional[dist.ProcessGroup]:
        """The group of data-parallel ranks (None: every rank, i.e. no other parallelism)."""
        dims = getattr(self, "_parallel_dims", None)
        if dims is None or not _distributed_is_initialized() or dims.dp_size == dims.world_size:
            return None
        return dims.get_mesh("dp").get_group()

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        objs = [obj]
        dist.broadcast_object_list(objs, src, group=_group.WORLD)
        return objs[0]

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group if group is not None else self.dp_process_group,
                                          reduce_op=reduce_op)
        return tensor
