"""How ``NDParallelStrategy`` gives the model its initial weights: the device ``configure_model``
builds on (``empty_init``, by default the meta device whenever more than one rank shares the
model), the materialisation of a meta-device build, shard by shard, or the broadcast of the
weights a rank built, and the move of the sharded model to its device.

Reads ``empty_init``, ``root_device``, ``cpu_offload``, ``world_size``, ``parallel_dims``,
``device_mesh``, ``lightning_module`` and ``model`` of the strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_disttrain import comm
from lightning_disttrain.models.param_init import init_settings, layout_independent_init
from lightning_disttrain.parallel.fsdp import offload_safe_to_device
from lightning_disttrain.parallel.materialize import (
    broadcast_module_,
    dtensor_rng_supported,
    has_own_init,
    materialize_,
    materialize_sharded_,
    refuse_real_values_on_meta,
)
from lightning_disttrain.parallel.rng import agreed_seed


def auto_empty_init(module: nn.Module | None, world_size: int) -> bool:
    """What ``empty_init=None`` means for ``configure_model``: the meta device when the module's
    initialisation is layout independent (``GPT``, ``GPTModule``: the same weights as an eager build,
    for free), so that no rank ever allocates the whole model before sharding (70B in fp32: 280 GB per
    GPU). Any other module is built eagerly, as under Lightning's strategies, whatever the world
    size: on the meta device its ``reset_parameters()`` would draw other numbers than its eager
    constructors did (per submodule name, the same under every layout), and a memory option never
    changes a run's numbers unasked. ``empty_init=True`` opts such a module in
    (``parallel.materialize.materialize_sharded_``: one initialiser's parameters in flight at a time).

    Not for a module that already holds real parameters (built in ``__init__``; its
    ``configure_model`` only parallelizes it, as under ``ModelParallelStrategy``: a meta default
    device would only break the tensors that sharding allocates), nor outside ``configure_model``
    (``trainer.init_module()``, ``module`` None: the whole LightningModule, metrics included, would
    be built without memory)."""
    if module is None or any(not p.is_meta for p in module.parameters()):
        return False
    return layout_independent_init(module)


class InitialWeightsMixin:
    """Mixed into ``NDParallelStrategy`` before Lightning's ``ParallelStrategy``."""

    _init_seed: int | None = None

    def _agreed_init_seed(self) -> int:
        """Rank 0's seed on every rank (collective on first use): what initialisation derives from."""
        if self._init_seed is None:
            self._init_seed = agreed_seed()
        return self._init_seed

    @contextlib.contextmanager
    def _build_device(self, empty_init: bool | None = None) -> Iterator[None]:
        """The device ``tensor_init_context`` builds on: the meta device when ``empty_init`` (the
        argument, else the strategy's) is True, the root device when False, ``auto_empty_init``
        when both are None. An automatic meta build of a module whose initialisation is not layout
        independent refuses to copy real values into it (a checkpoint or pretrained weights loaded
        in ``configure_model`` would vanish at materialisation)."""
        chosen = self.empty_init if empty_init is None else empty_init
        module = self.lightning_module
        meta = auto_empty_init(module, self.world_size) if chosen is None else bool(chosen)
        guard = (refuse_real_values_on_meta(type(module).__name__)
                 if meta and chosen is None and not layout_independent_init(module) else contextlib.nullcontext())
        with torch.device("meta") if meta else self.root_device, guard:
            yield

    def _materialize(self, module: nn.Module) -> None:
        """Allocate meta tensors and initialise them (``parallel.materialize.init_weights``: the
        module's ``init_weights()``, else every submodule's initialiser, and a check that none
        was left uninitialised).

        Initialisation runs with the seed the ranks agreed on and draws on the root device, where
        an eager build would have drawn (``models.param_init.init_settings``). A module whose
        initialisation is layout independent (GPT, GPTModule) is initialised after sharding:
        each rank draws each full parameter and keeps its shard, so the model equals, gathered,
        the eager one-process build under every layout, and nothing is broadcast. Any other module
        sharded by then (its initialisers run per submodule: ``reset_parameters()``...) is
        initialised one submodule at a time, each full tensor broadcast from the stage's rank 0
        and sliced (``parallel.materialize.materialize_sharded_``): the weights of ``materialize_``
        on one process, replicas bitwise rank 0's. A module with an ``init_weights()`` of its own
        that is not layout independent is materialised whole before sharding (its initialiser
        writes everything at once), then rank 0's weights are broadcast one tensor at a time (on
        CUDA meshes DTensor's RNG initialises its shards instead). With CPU offload the shards
        live on the host.
        """
        sharded = any(isinstance(p, DTensor) for p in module.parameters())
        device = torch.device("cpu") if (sharded and self.cpu_offload) else self.root_device
        independent = layout_independent_init(module)
        with init_settings(seed=self._agreed_init_seed(), draw_device=self.root_device):
            if sharded and not independent and not (has_own_init(module) and dtensor_rng_supported(self.device_mesh)):
                materialize_sharded_(module, device, buffer_device=self.root_device, draw_device=self.root_device,
                                     group=self._stage_group())
                return
            materialize_(module, device=device, buffer_device=self.root_device)
        if not sharded and not independent:
            self._sync_initial_weights(module)

    def _stage_group(self):
        """The ranks that hold the same pipeline stage(s) (the whole world when pp = 1), or None
        on one process."""
        if not (comm.is_distributed() and self.world_size > 1):
            return None
        return self.parallel_dims.get_mesh("stage").get_group()

    def _sync_initial_weights(self, module: nn.Module) -> None:
        # Like DDP: rank 0's initial weights win. Unseeded ranks would otherwise build different
        # models, and HSDP replicas (or TP ranks) would train different weights without noticing.
        # comm stages each tensor on the group's device (a module built in __init__ is on the host).
        group = self._stage_group()
        if group is not None:
            broadcast_module_(module, group_src=0, group=group)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        offload_safe_to_device(self.model, self.root_device, self.cpu_offload)
