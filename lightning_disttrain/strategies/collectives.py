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
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from typing_extensions import override

from lightning_disttrain import comm

_OP_NAMES = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min",
             ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min", ReduceOp.AVG: "mean"}



def _op_name(reduce_op: Optional[Union[ReduceOp, str]]) -> str:
    if reduce_op is None:
        return "sum"
    name = _OP_NAMES.get(reduce_op.lower() if isinstance(reduce_op, str) else reduce_op)
    if name is None:
        raise ValueError(f"reduce_op={reduce_op!r}: use 'mean', 'sum', 'max' or 'min'")
    return name


class CollectivesMixin:
    """Mixed into ``NDParallelStrategy`` before Lightning's ``ParallelStrategy``; reads
    ``parallel_dims`` and ``root_device``. Every collective goes through ``lightning_disttrain.comm``,
    which puts each tensor on the device its group's backend carries."""

    @property
    def dp_process_group(self) -> Optional[dist.ProcessGroup]:
        """The group of data-parallel and context-parallel ranks (None: every rank, i.e. no other
        parallelism)."""
        dims = getattr(self, "_parallel_dims", None)
        if dims is None or not comm.is_distributed() or dims.dp_size * dims.cp == dims.world_size:
            return None
        # With context parallel the cp ranks hold different tokens of the same samples: losses,
        # metrics and MoE loads are averaged / summed over them too.
        return dims.get_mesh("dp_cp" if dims.cp > 1 else "dp").get_group()

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        comm.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return comm.broadcast_object(obj, group_src=src)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        """In place over ``group`` (default: the data-parallel ranks), as Lightning's ``_sync_ddp``:
        ``"mean"`` sums and divides by the group's size (integers: the quotient, cast back)."""
        if not isinstance(tensor, torch.Tensor) or not comm.is_distributed():
            return tensor
        group = group if group is not None else self.dp_process_group
        name = _op_name(reduce_op)
        comm.all_reduce(tensor, "sum" if name == "mean" else name, group=group)
        if name != "mean":
            return tensor
        size = comm.world_size(group)
        if not torch.is_floating_point(tensor):
            return tensor.copy_(tensor / size)
        return tensor.div_(size)
