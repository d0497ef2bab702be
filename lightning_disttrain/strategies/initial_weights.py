"""How ``NDParallelStrategy`` gives the model its initial weights: materialise a meta-device build,
or broadcast the weights a rank built, and move the sharded model to its device.

Reads ``root_device``, ``cpu_offload``, ``world_size``, ``parallel_dims`` and ``model`` of the strategy.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_disttrain import comm
from lightning_disttrain.models.param_init import init_settings, layout_independent_init
from lightning_disttrain.parallel.fsdp import offload_safe_to_device
from lightning_disttrain.parallel.materialize import broadcast_module_, materialize_
from lightning_disttrain.parallel.rng import agreed_seed



class InitialWeightsMixin:
    """Mixed into ``NDParallelStrategy`` before Lightning's ``ParallelStrategy``."""

    _init_seed: int | None = None

    def _agreed_init_seed(self) -> int:
        """Rank 0's seed on every rank (collective on first use): what initialisation derives from."""
        if self._init_seed is None:
            self._init_seed = agreed_seed()
        return self._init_seed

    def _materialize(self, module: nn.Module) -> None:
        """Allocate meta tensors and initialise them (``parallel.materialize.init_weights``: the
        module's ``init_weights()``, else every submodule's initialiser, and a check that none
        was left uninitialised).

        Initialisation runs with the seed the ranks agreed on and draws on the root device, where
        an eager build would have drawn (``models.param_init.init_settings``). A module whose
        initialisation is layout independent (GPT, GPTModule) is initialised after sharding:
        each rank draws each full parameter and keeps its shard, so the model equals, gathered,
        the eager one-process build under every layout. Any other module is materialised whole
        before sharding (the same weights on every rank of a stage, then rank 0's broadcast so
        replicas agree even without a seed); with CPU offload its shards then move to the host.
        """
        sharded = any(isinstance(p, DTensor) for p in module.parameters())
        device = torch.device("cpu") if (sharded and self.cpu_offload) else self.root_device
        with init_settings(seed=self._agreed_init_seed(), draw_device=self.root_device):
            materialize_(module, device=device, buffer_device=self.root_device)
        if not sharded and not layout_independent_init(module):
            self._sync_initial_weights(module)

    def _sync_initial_weights(self, module: nn.Module) -> None:
        # Like DDP: rank 0's initial weights win. Unseeded ranks would otherwise build different
        # models, and HSDP replicas (or TP ranks) would train different weights without noticing.
        # comm stages each tensor on the group's device (a module built in __init__ is on the host).
        if not (comm.is_distributed() and self.world_size > 1):
            return
        # Over the ranks that hold the same pipeline stage(s): the whole world when pp = 1.
        group = self.parallel_dims.get_mesh("stage").get_group()
        broadcast_module_(module, group_src=0, group=group)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        offload_safe_to_device(self.model, self.root_device, self.cpu_offload)
