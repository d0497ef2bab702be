"""NDParallelStrategy: one Lightning strategy for every combination of FSDP2 / HSDP, tensor and
pipeline parallel (and, as their issues land, EP / CP) over one named ``DeviceMesh``.

What runs when (Lightning 2.6, ``Trainer._run``), and what this strategy does at each point:

1. ``Trainer(...)``: the accelerator connector calls ``set_world_ranks`` -> every degree is
   validated against the world size (``ParallelDims``) before any process exists.
2. ``setup_environment``: the degrees are validated again against the final world size, then the
   process group (gloo on CPU, nccl on CUDA) and the mesh are created; the LightningModule gets
   ``self.device_mesh``.
3. ``setup`` hooks: data module, then **callbacks** (they register their model transforms with
   ``trainer.strategy.transforms`` here), then the LightningModule.
4. ``configure_model`` runs under ``tensor_init_context`` (the meta device with ``empty_init``: by
   default for a module whose initialisation is layout independent, GPTModule).
5. ``setup`` (this strategy): precision conversion, materialisation or rank 0's weights, then
   ``parallel.recipe.parallelize`` (every transform in its fixed order, FSDP last), then the
   optimizers, which must see the sharded parameters.
6. Training: non-final micro-batches of gradient accumulation run inside ``block_backward_sync``,
   which reduce-scatters every micro-batch (HSDP: all-reduces across replicas on the last only),
   or with ``accumulate_unsharded_grads`` turns FSDP's gradient reduction off; gradient clipping
   goes through ``clip_grad_norm_``.

Checkpointing (DCP, ``restore_checkpoint_after_setup``) comes from ``DCPCheckpointMixin``; it reads
``parallel_dims``, ``device_mesh``, ``async_save``, ``optimizers`` and the usual ranks from here.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from typing_extensions import override

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain.models.context_parallel import check_length
from lightning_disttrain.models.param_init import layout_independent_init
from lightning_disttrain.parallel.fsdp import (
    install_mesh_aware_clipping,
    mp_policy_for_precision,
)
from lightning_disttrain.parallel.mesh import ParallelDims
from lightning_disttrain.parallel.pipeline import PipelineOptions
from lightning_disttrain.parallel.recipe import (
    CPSettings,
    EPSettings,
    FSDPSettings,
    Host,
    PipelineSettings,
    TPSettings,
    overrides_configure_model,
    parallelize,
    tp_plan_missing,
)
from lightning_disttrain.parallel.rng import agree_on_streams, declares_training_streams, seed_training_streams
from lightning_disttrain.parallel.tensor import TensorParallelOptions, enable_async_tp
from lightning_disttrain.parallel.transforms import TransformContext, TransformRegistry
from lightning_disttrain.strategies.checkpointing import DCPCheckpointMixin
from lightning_disttrain.strategies.collectives import CollectivesMixin
from lightning_disttrain.fault_tolerance.settings import FaultTolerance
from lightning_disttrain.strategies.context_steps import ContextStepMixin
from lightning_disttrain.strategies.fault_tolerant_steps import FaultTolerantStepMixin
from lightning_disttrain.strategies.initial_weights import InitialWeightsMixin
from lightning_disttrain.strategies.pipeline_steps import PipelineStepMixin
from lightning_disttrain.strategies.steps import StepMixin


class _NDParallelBase(FaultTolerantStepMixin, ContextStepMixin, PipelineStepMixin, StepMixin, CollectivesMixin, InitialWeightsMixin,
                      compat.SubprocessLauncherStrategy, ParallelStrategy):
    """Everything of ``NDParallelStrategy`` but checkpointing. A base class rather than the class
    itself so that ``DCPCheckpointMixin`` sits above these methods in the MRO: its ``teardown``
    (which finishes an async save) reaches ours through ``super()`` instead of being hidden by it."""

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        cp: int = 1,
        reshard_after_forward: Union[bool, int] = True,
        mp_policy: Optional[MixedPrecisionPolicy] = None,
        cpu_offload: bool = False,
        accumulate_unsharded_grads: bool = False,
        async_save: bool = False,
        on_save_error: str = "stop",
        compile: Union[bool, dict[str, Any]] = False,
        empty_init: Optional[bool] = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        async_tp: bool = False,
        pp_schedule: str = "1F1B",
        pp_microbatches: Optional[int] = None,
        pp_stages_per_rank: Optional[int] = None,
        pp_split_points: Optional[list[int]] = None,
        pp_edge_cost: float = 0.0,
        fault_tolerance: Optional[Union[FaultTolerance, dict[str, Any]]] = None,
        release_process_groups_at_teardown: bool = False,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp, "ep": ep, "cp": cp}
        for name, value in self._degrees.items():  # the world size is checked once it is known
            if not isinstance(value, int) or isinstance(value, bool) or not (value >= 1 or (name == "dp_shard"
                                                                                           and value == -1)):
                raise ValueError(f"{type(self).__name__}({name}={value!r}): a parallel degree is an int >= 1"
                                 f"{' (or -1: the ranks the other degrees leave)' if name == 'dp_shard' else ''}; "
                                 f"set {name}=1 to leave that dimension out")
        if isinstance(reshard_after_forward, bool) or (isinstance(reshard_after_forward, int)
                                                       and reshard_after_forward > 1):
            self.reshard_after_forward = reshard_after_forward
        else:
            raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: use True (ZeRO-3), False "
                             f"(ZeRO-2) or an int > 1 (reshard to groups of that many ranks)")
        self.mp_policy = mp_policy
        self.cpu_offload = cpu_offload
        if not isinstance(accumulate_unsharded_grads, bool):
            raise ValueError(f"accumulate_unsharded_grads={accumulate_unsharded_grads!r}: use False (reduce-scatter "
                             f"every micro-batch, gradients stay sharded) or True (one reduce-scatter per step)")
        self.accumulate_unsharded_grads = accumulate_unsharded_grads
        self.async_save = async_save
        if not isinstance(release_process_groups_at_teardown, bool):
            raise ValueError(f"release_process_groups_at_teardown={release_process_groups_at_teardown!r}: use False "
                             f"(keep them for a later fit, validate or test in this process) or True")
        self.release_process_groups_at_teardown = release_process_groups_at_teardown
        if on_save_error not in ("stop", "warn"):
            raise ValueError(f"on_save_error={on_save_error!r}: use 'stop' (a failed checkpoint save ends fit on "
                             f"every rank) or 'warn' (log it and keep training)")
        self.on_save_error = on_save_error
        self.empty_init = empty_init
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.num_nodes = 1
        self._parallel_dims: Optional[ParallelDims] = None
        self._device_mesh = None
        self._root_is_lightning_module = False  # see StepMixin
        self.compile_options: Optional[dict[str, Any]] = (
            None if not compile else {} if compile is True else dict(compile))
        if async_tp and self.compile_options is None:
            raise ValueError("async_tp=True fuses TP collectives into compiled matmuls: also set compile=True")
        self.tp_options = TensorParallelOptions(sequence_parallel, loss_parallel, async_tp)
        self.pp_options = PipelineOptions(pp_schedule, pp_microbatches, pp_stages_per_rank, pp_split_points,
                                          pp_edge_cost)
        self.fault_tolerance = FaultTolerance.coerce(fault_tolerance)
        self.transforms = TransformRegistry()
        """Model transforms by stage; callbacks register theirs in their ``setup`` hook."""
        self.parallelized_steps: list[str] = []
        """What ``parallel.recipe.parallelize`` did to the model, in order (logged at setup)."""
        self._recompile_watcher = None

    # -- degrees and mesh -------------------------------------------------------------------

    def _make_parallel_dims(self, world_size: int) -> ParallelDims:
        """The validated degrees for ``world_size`` ranks (subclasses choose them differently)."""
        return ParallelDims(**self._degrees, world_size=world_size)

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            raise RuntimeError(f"{type(self).__name__}.parallel_dims is known once the Trainer has set "
                               f"the world size (Trainer construction)")
        return self._parallel_dims

    @property
    def device_mesh(self):
        """The world ``DeviceMesh``: the dimensions of ``pp, dp_replicate, dp_shard, cp, tp`` with size > 1,
        plus ``dp_shard`` (``ParallelDims.mesh_dims``); a module that parallelizes itself in
        ``configure_model`` also finds ``tp`` and Lightning's ``data_parallel`` / ``tensor_parallel``
        there, size 1 included. Derived meshes via ``parallel_dims.get_mesh(name)``."""
        if self._device_mesh is None:
            raise RuntimeError("the device mesh exists only after setup_environment (process group init)")
        return self._device_mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # Read by Lightning's connectors: enables the distributed sampler and ``self.log(sync_dist=True)``.
        return True

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Data-parallel rank, not the global one: TP/PP/CP ranks of one replica read the same samples.
        dims = self.parallel_dims
        size, rank = self._ft_data_parallel(dims.dp_size, dims.dp_rank)  # with fault tolerance: every group's
        return {"num_replicas": size, "rank": rank}

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        # Validate here, at Trainer construction, so a bad layout fails before processes are launched.
        if getattr(self.precision_plugin, "precision", None) == "16-mixed":
            # GradScaler's inf check sees only each rank's gradient shards: ranks could disagree on
            # skipping a step and drift apart (Lightning's ModelParallelStrategy refuses it too).
            raise ValueError(f"{type(self).__name__} does not support precision='16-mixed' (a grad scaler over "
                             f"sharded gradients); use precision='bf16-mixed', or '16-true' without loss scaling")
        dims = self._make_parallel_dims(self.world_size)
        self._check_fault_tolerance_layout(dims)
        if dims.ep_enabled:
            others = {name: getattr(dims, name) for name in ("tp", "pp", "dp_replicate", "cp") if getattr(dims, name) > 1}
            if others:
                raise ValueError(f"ep={dims.ep} with {', '.join(f'{k}={v}' for k, v in others.items())} is not supported "
                                 f"yet: expert parallel composes with FSDP2 (dp_shard) only so far; set "
                                 f"{' and '.join(f'{k}=1' for k in others)} (or ep=1)")
        raf = self.reshard_after_forward
        if not isinstance(raf, bool) and (raf >= dims.fsdp_size or dims.fsdp_size % raf):
            raise ValueError(f"reshard_after_forward={raf} must divide the {dims.fsdp_size} ranks parameters are "
                             f"sharded over and be smaller (a group of that many ranks keeps the parameters "
                             f"after forward); choose a proper divisor of {dims.fsdp_size}, or True / False")
        if dims != self._parallel_dims:  # a later validate/test keeps the dims and their meshes
            self._parallel_dims, self._device_mesh = dims, None

    def _validate_model_early(self) -> None:
        # Before the process group exists: a layout the model cannot take fails on every rank at
        # once instead of in a collective some ranks never reach.
        module, dims = self.lightning_module, self.parallel_dims
        config = getattr(module, "config", None) or getattr(getattr(module, "model", None), "config", None)
        if config is not None:
            dims.validate_for_model(config)
        if (dims.tp_enabled and module is not None and not callable(getattr(module, "parallel_plan", None))
                and not overrides_configure_model(module)):
            # A module with its own configure_model may parallelize itself there (Lightning's
            # ModelParallelStrategy way): the recipe checks after it ran (parallelize's step 0).
            raise ValueError(tp_plan_missing(module, dims.tp))
        if dims.pp_enabled and module is not None:
            self._validate_pipeline_early(module, config)
        seq_len = getattr(getattr(compat.trainer_of(module), "datamodule", None), "seq_len", None)
        if dims.cp > 1 and isinstance(seq_len, int):
            check_length(seq_len, dims.cp)  # before any process group: the data module's sequences
        if dims.tp_enabled and self.tp_options.sequence_parallel and isinstance(seq_len, int) and seq_len % dims.tp:
            raise ValueError(f"sequence parallel splits each sequence across tp={dims.tp} ranks, but the data "
                             f"module's seq_len={seq_len} is not divisible by {dims.tp}: use seq_len="
                             f"{seq_len + (-seq_len) % dims.tp}, or sequence_parallel=False")

    @override
    def setup_environment(self) -> None:
        compat.check()  # a Lightning whose privates we use changed: say so before any rank starts
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()  # validates the degrees against the final world size, before the group
        self._validate_model_early()
        if self.tp_options.async_tp and self.root_device.type != "cuda":
            raise ValueError(f"async_tp=True needs CUDA GPUs (symmetric memory between the TP ranks); this run is "
                             f"on {self.root_device.type!r}: set async_tp=False")
        self._process_group_backend = self._process_group_backend or compat.default_process_group_backend(
            self.root_device)
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        compat.init_process_group(self.cluster_environment, self._process_group_backend, **kwargs)
        if self._device_mesh is None:  # a second fit/validate with this strategy keeps its mesh
            self._device_mesh = self.parallel_dims.build_mesh(self.root_device.type, **self._mesh_needs())
            if self.tp_options.async_tp and self.parallel_dims.tp_enabled:
                enable_async_tp(self.parallel_dims.get_mesh("tp"))
        if self.lightning_module is not None:
            compat.set_module_device_mesh(self.lightning_module, self._device_mesh)
            trainer = compat.trainer_of(self.lightning_module)
            if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                # Safe on SIGTERM without asking: a run with no PreemptionCheckpoint gets one that
                # saves nothing but makes every rank agree and exit (callbacks/preemption.py).
                from lightning_disttrain.callbacks.preemption import ensure_signal_safety

                ensure_signal_safety(trainer)
                compat.fix_epoch_description(trainer)  # "Epoch 0/-2" under max_steps (issue 28)

    def _wraps_fsdp(self) -> bool:
        """Whether FSDP2 wraps the model. It runs also over one data-parallel rank: every parameter is
        then a DTensor, as the optimizers' foreach kernels need (TP alone leaves some parameters plain).
        One process, and pipeline stages without TP on one data-parallel rank, in full precision are
        the exception: every parameter stays plain, and FSDP would only copy them in and out (about a
        tenth of the step under pp: docs/benchmarks.md, section 11; 14 ms of 64 ms per step for a
        4-layer, 128-wide GPT on one CPU process: section 18)."""
        dims = self.parallel_dims
        precision = getattr(self.precision_plugin, "precision", None)
        mp_policy = self.mp_policy or mp_policy_for_precision(None if precision is None else str(precision))
        return not ((dims.pp_enabled or dims.world_size == 1) and not dims.tp_enabled and dims.dp_size == 1
                    and dims.cp == 1 and not self.cpu_offload and mp_policy == MixedPrecisionPolicy())

    def _mesh_needs(self) -> dict[str, tuple[str, ...]]:
        """Which size-1 dimensions the world mesh keeps, and which Lightning names it registers.
        ``dp_shard`` always: FSDP wraps over it, and the data-parallel group (loss and metric means,
        ``dp_process_group``) is its slice, one group of this rank alone when no other rank shares
        its data (TP or PP only). A module that parallelizes itself in configure_model gets
        Lightning's ModelParallelStrategy mesh too (``tensor_parallel`` and ``data_parallel``,
        size 1 included)."""
        module = self.lightning_module
        if (module is not None and overrides_configure_model(module) and not layout_independent_init(module)):
            return {"keep": ("dp_shard", "tp"), "aliases": ("data_parallel", "tensor_parallel")}
        return {"keep": ("dp_shard",), "aliases": ()}

    # -- model setup ------------------------------------------------------------------------

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # The meta device or the root device: InitialWeightsMixin._build_device (auto_empty_init).
        with self._build_device(empty_init), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if not getattr(module, "_ldt_parallelized", False):  # a later validate/test reuses it
            # Random streams (parallel/rng.py): a module that declares them (GPTModule) gets dropout
            # independent across data-parallel ranks and pipeline stages, one stream per TP group; any
            # other keeps them as Lightning's strategies leave them, made equal only where the ranks
            # were not seeded alike. A resumed run restores the saved streams after this.
            own_streams = declares_training_streams(module)
            if not own_streams:
                agree_on_streams(self.root_device)
            self._parallelize(module)
            module._ldt_parallelized = True
            if own_streams:
                dims = self.parallel_dims
                seed_training_streams(self._agreed_init_seed(),
                                      self._ft_data_parallel(dims.dp_size, dims.dp_rank)[1], dims.local_rank("pp"))
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            # Fresh optimizers over the sharded parameters (also after a previous stage's setup).
            self.optimizers, self.lr_scheduler_configs = [], []
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._install_grad_clipping()
        if self._pipeline is not None and trainer.state.fn == TrainerFn.FITTING:
            self._guard_zero_grad()
        if trainer.state.fn == TrainerFn.FITTING:
            compat.optimizers_to_device(self.optimizers, self.root_device)
            self._ft_setup(trainer)  # with fault_tolerance: join the replica groups' quorum

    def _parallelize(self, module: pl.LightningModule) -> None:
        """The settings of each parallelism, then ``parallel.recipe.parallelize``: the one
        function that runs every step in its order (precision cast, pipeline split, initial
        weights, float8, TP, EP, activation checkpointing, compile, FSDP2, sharded init)."""
        dims = self.parallel_dims  # checked against the model in _validate_model_early
        precision = getattr(self.precision_plugin, "precision", None)
        ctx = TransformContext(device=self.root_device, mesh=self.device_mesh, dims=dims,
                               precision=None if precision is None else str(precision))
        mp_policy = self.mp_policy or mp_policy_for_precision(ctx.precision)
        no_fsdp = not self._wraps_fsdp()
        fsdp = None if no_fsdp else FSDPSettings(
            mesh=dims.get_mesh("fsdp"), mp_policy=mp_policy,
            # Under pp the schedule runs many micro-batches' forwards before their backwards: the
            # parameters stay gathered from forward to backward (torchtitan does the same).
            reshard_after_forward=False if dims.pp_enabled else self.reshard_after_forward,
            cpu_offload=self.cpu_offload)
        tp = TPSettings(dims.get_mesh("tp"), self.tp_options) if dims.tp_enabled else None
        ep = EPSettings(dims.get_mesh("ep"), dims.get_mesh("efsdp"), grad_divide_factor=dims.fsdp_size) \
            if dims.ep_enabled else None
        cp = CPSettings(dims.get_mesh("cp")) if dims.cp > 1 else None
        host = Host(convert_precision=self.precision_plugin.convert_module,
                    split_pipeline=self._pipeline_settings if dims.pp_enabled else None,
                    materialize=self._materialize, sync_initial_weights=self._sync_initial_weights,
                    to_device=self.model_to_device)
        done = parallelize(module, ctx, self.transforms, host=host, compile_options=self.compile_options,
                           tp=tp, ep=ep, cp=cp, fsdp=fsdp)
        if done.self_sharded:
            rank_zero_info(f"{type(module).__name__} parallelized itself in configure_model ("
                           f"{'fully_shard' if done.self_sharded == 'fsdp' else 'parallelize_module'}): "
                           f"{type(self).__name__} keeps that and skips its own TP"
                           f"{'/FSDP' if done.self_sharded == 'fsdp' else ', then shards it with FSDP2'}")
        elif no_fsdp:
            done.steps.append("no fsdp (one data-parallel rank, full precision: nothing to shard)"
                              if dims.pp_enabled else "no fsdp (one process, full precision: nothing to shard)")
        self.parallelized_steps = done.steps
        self._self_parallelized = done.self_sharded
        self._root_is_lightning_module = (done.fsdp_root is module if done.fsdp_root is not None
                                          else isinstance(module, FSDPModule))
        if self.compile_options is not None:
            from lightning_disttrain.parallel.compile import RecompileWatcher

            self._recompile_watcher = RecompileWatcher()  # warns when shapes change between steps
        rank_zero_info(f"{type(self).__name__} ({dims}): " + "; ".join(done.steps or ["no transforms"]))

    def _pipeline_settings(self, module: torch.nn.Module) -> PipelineSettings:
        summary = self._split_pipeline(module)
        return PipelineSettings(stages=self.pipeline_stage_modules, summary=summary)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._recompile_watcher is not None and self.lightning_module is not None:
            self._recompile_watcher.check(step=self.lightning_module.trainer.global_step)
        super().on_train_batch_start(batch, batch_idx)

    def _install_grad_clipping(self) -> None:
        plugin = self.precision_plugin  # Lightning's default plugin when none was set: keep that instance
        self.precision_plugin = plugin
        pp_mesh = self.parallel_dims.get_mesh("pp") if self.parallel_dims.pp_enabled else None
        install_mesh_aware_clipping(plugin, pp_mesh=pp_mesh)

    def release_process_groups(self) -> None:
        """Destroy the process groups of this strategy's layout (its device mesh's), e.g. in a
        notebook or a sweep that moves on to other layouts. Until then a later fit of the same layout
        in this process reuses them (``parallel.mesh._POOL``): they do not accumulate across fits.
        Afterwards the module this strategy sharded cannot be trained or evaluated again (its
        parameters live on the destroyed mesh); a new module and Trainer can. Every rank calls it."""
        if self._parallel_dims is not None:
            self._parallel_dims.release()
        self._device_mesh = None

    @override
    def teardown(self) -> None:
        # Not Strategy.teardown: moving the sharded module to the CPU would break a later
        # trainer.validate/test with the same module (ModelParallelStrategy does the same).
        assert self.cluster_environment is not None and self.accelerator is not None
        self._ft_teardown()
        if self.release_process_groups_at_teardown:
            self.release_process_groups()
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


class NDParallelStrategy(DCPCheckpointMixin, _NDParallelBase):
    """N-D parallel training over one ``DeviceMesh``: FSDP2 (ZeRO-3/ZeRO-2), HSDP, ...

    Args:
        dp_replicate: data-parallel replicas, each holding a full copy of the (sharded) model:
            HSDP's replicate dimension, gradients all-reduced across it once per step (default 1).
        dp_shard: data-parallel ranks that shard parameters, gradients and optimizer state
            (FSDP2); -1 (default) takes whatever the world size leaves after the other degrees.
        tp: tensor-parallel degree: each layer's weights split over this many consecutive ranks
            (default 1: off).
        pp: pipeline-parallel degree: pipeline stages (default 1: off); see the ``pp_*`` options.
        ep: expert-parallel degree for MoE models: experts split over this many ranks, borrowed
            from dp_shard (default 1: off). Composes with FSDP2, not yet with tp, pp, cp or
            dp_replicate.
        cp: context-parallel degree: each sample's sequence split over this many ranks in
            load-balanced chunks, each attention layer passing K/V around them in a ring (ring
            attention; default 1: off). The degrees multiply to the world size (``ParallelDims``).
        reshard_after_forward: True: ZeRO-3; False: ZeRO-2 (parameters stay gathered from forward
            to backward); int: reshard to groups of that many ranks.
        mp_policy: FSDP ``MixedPrecisionPolicy``; None derives it from the Trainer's precision
            (``bf16-*``: bf16 compute and all-gather, fp32 gradient reduction; ``32-true``: none).
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
        accumulate_unsharded_grads: with ``accumulate_grad_batches`` k > 1. False (default): every
            micro-batch's backward reduce-scatters, so gradients stay sharded (1/shard of the model's
            fp32 gradient per rank) at k times the reduce-scatter traffic (HSDP still all-reduces
            across replicas once per step). True: FSDP skips the reduce-scatter on all but the last
            micro-batch, one per step, but every rank holds the whole unsharded fp32 gradient of its
            part of the model between micro-batches (what ``plan --accumulate-unsharded-grads``
            counts). Choose True only when that fits and communication is the bottleneck.
        async_save: checkpoints are written in the background (used by ``DCPCheckpointMixin``).
        release_process_groups_at_teardown: False (default): the layout's process groups stay for the
            process when ``fit``/``validate``/``test`` ends, so that a later stage with the same module
            (``trainer.test(model)`` after ``fit``) runs on them and a later fit of the same layout
            makes none (``parallel.mesh._POOL``). True: they are destroyed at teardown (with torch's
            caches that hold them: their threads and communicators end once the module is gone), for
            a sweep or notebook that moves through layouts; the module this strategy sharded cannot
            be used by a later stage then. ``release_process_groups()`` does the same on demand.
        on_save_error: a checkpoint that cannot be written (disk full): ``"stop"`` ends ``fit`` on
            every rank with the error, ``"warn"`` logs it and trains on. The previous checkpoints
            stay valid either way.
        compile: ``torch.compile`` each block (True, or a dict of options for ``apply_compile``).
        empty_init: run ``configure_model`` on the meta device and materialise after sharding (see
            ``_materialize``): no rank allocates the whole model. None (default): True for a module
            whose init is layout independent (GPTModule: bitwise the weights of an eager
            single-process build either way), False for any other (built eagerly, as under
            Lightning's strategies: a memory option does not change its numbers unasked); see
            ``strategies.initial_weights.auto_empty_init``. True for such a module: per-submodule
            seeded weights (the same under every layout, not its constructors' draws), initialised
            one initialiser at a time after sharding. False: build real weights on every rank
            (rank 0's are broadcast, one tensor at a time).
        sequence_parallel: with tp > 1: shard the activations between attention and MLP on the
            sequence dimension (1/tp of them per rank; needs the sequence length divisible by tp).
            Default True (``parallel.tensor.TensorParallelOptions``).
        loss_parallel: with tp > 1: compute the cross-entropy on the vocabulary-sharded logits
            instead of gathering them on every rank (default True).
        async_tp: with tp > 1: fuse TP collectives with the matmuls (inductor's micro-pipeline TP);
            CUDA only, and only in compiled blocks (default False).
        pp_schedule: with pp > 1: the pipeline schedule, one of ``parallel.pipeline.SCHEDULES``
            (``"GPipe"``, ``"1F1B"`` (default), ``"Interleaved1F1B"``, ``"LoopedBFS"``,
            ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``; case-insensitive).
            The step contract is in ``strategies/pipeline_steps.py``.
        pp_microbatches: with pp > 1: micro-batches per batch; None: as many as there are stages.
        pp_stages_per_rank: with pp > 1: None: 1 for GPipe / 1F1B, 2 for the looped and V-shaped
            schedules (V-shaped: exactly 2).
        pp_split_points: with pp > 1: index of the first block of every stage but the first
            (e.g. ``[3]``: blocks 0-2 | 3-...); None: balanced by cost (``pp_edge_cost``).
        pp_edge_cost: with pp > 1: how many blocks the embeddings (first stage) and the head
            (last stage) each count for when balancing stages; 0 (default): by block count.
        fault_tolerance: a ``FaultTolerance`` (or its keys as a dict): this launch is one replica
            group of a run whose groups survive each other's failures (torchft; see
            ``strategies/fault_tolerant_steps.py``). Needs dp_replicate=1 (the groups replicate).
        accelerator: as for every Lightning ``ParallelStrategy``; normally filled in by the Trainer.
        parallel_devices: the devices of this node's ranks; normally filled in by the Trainer.
        cluster_environment: Lightning's ``ClusterEnvironment`` (ranks, world size, master
            address); normally filled in by the Trainer.
        checkpoint_io: Lightning's ``CheckpointIO`` plugin; normally filled in by the Trainer.
        precision_plugin: Lightning's ``Precision`` plugin; normally filled in by the Trainer
            from its ``precision``.
        process_group_backend: the ``torch.distributed`` backend; None (default): ``gloo`` on CPU,
            ``nccl`` on CUDA.
        timeout: the process groups' timeout for collectives (default 30 minutes, Lightning's).
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        if self.writes_checkpoints():  # with fault tolerance: one replica group writes
            super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath) -> None:
        if self.writes_checkpoints():
            super().remove_checkpoint(filepath)

    @override
    def on_train_end(self) -> None:
        self._ft_on_train_end()  # below min_replicas: the stop's checkpoint
        super().on_train_end()
