"""How ``NDParallelStrategy`` gives the model its initial weights: materialise a meta-device build,
or broadcast the weights a rank built, and move the sharded model to its device.

Reads ``root_device``, ``cpu_offload``, ``world_size``, ``parallel_dims`` and ``model`` of the strategy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_disttrain.parallel.fsdp import offload_safe_to_device
from lightning_disttrain.parallel.materialize import broadcast_module_, collective_device, materialize_


class InitialWeightsMixin:
    """Mixed into ``NDParallelStrategy`` before Lightning's ``ParallelStrategy``."""

    def _materialize(self, module: nn.Module) -> None:
        """Allocate meta tensors and initialise them (``parallel.materialize.init_weights``: the
        module's ``init_weights()``, else every submodule's initialiser, and a check that none
        was left uninitialised).

        Before sharding (CPU meshes) every rank initialises the full model from the same RNG state,
        so with a seed the result equals a single-process meta build followed by ``init_weights``;
        rank 0's weights are broadcast anyway so that replicas agree even without a seed. After
        sharding (CUDA) each rank initialises its shards through DTensor's distributed RNG; with
        CPU offload those shards are allocated on the host, where FSDP expects them.
        """
        sharded = any(isinstance(p, DTensor) for p in module.parameters())
        device = torch.device("cpu") if (sharded and self.cpu_offload) else self.root_device
        materialize_(module, device=device, buffer_device=self.root_device)
        if not sharded:
            self._sync_initial_weights(module)

    def _sync_initial_weights(self, module: nn.Module) -> None:
        # Like DDP: rank 0's initial weights win. Unseeded ranks would otherwise build different
        # models, and HSDP replicas (or TP ranks) would train different weights without noticing.
        # NCCL carries only device tensors, and a module built in __init__ is still on the host.
        if not (_distributed_is_initialized() and self.world_size > 1):
            return
        # Over the ranks that hold the same pipeline stage(s): the whole world when pp = 1.
        group = self.parallel_dims.get_mesh("stage").get_group()
        broadcast_module_(module, src=dist.get_global_rank(group, 0), group=group,
                          device=collective_device(dist.get_backend(), self.root_device))

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        offload_safe_to_device(self.model, self.root_device, self.cpu_offload)
