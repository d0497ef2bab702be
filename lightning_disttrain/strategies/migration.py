"""Lightning's own strategies' arguments, on ours: moving a project over is one changed line.

- ``ModelParallelStrategy(data_parallel_size, tensor_parallel_size, save_distributed_checkpoint,
  process_group_backend, timeout)``: Lightning's FSDP2 x TP strategy, whose users parallelize the
  model themselves in ``configure_model`` from ``self.device_mesh["data_parallel"]`` and
  ``["tensor_parallel"]``. Ours gives the module a mesh with those names (and ours), keeps what
  ``configure_model`` did, applies FSDP2 where it did only TP, and adds the rest (DCP checkpoints
  with manifest, exact resume, preemption, clipping over the mesh, MFU).
- ``FSDPStrategy(sharding_strategy, auto_wrap_policy, activation_checkpointing_policy, cpu_offload,
  state_dict_type, ...)``: Lightning's FSDP1 strategy. Each argument maps to FSDP2 here or is
  refused with what to use instead.
- ``DDPStrategy(...)``: data parallel; here FSDP2 replicates over every rank (``dp_replicate``),
  which is DDP's arithmetic (one all-reduce of the gradients per step).

Random numbers are Lightning's (issue 40): a module that declares none of this package's policies
sees the global generators at every hook (``configure_model``, ``on_fit_start``,
``on_train_start``, the first step) where Lightning's strategy leaves them, on every rank, so an
``init_weights()`` in ``on_train_start`` or in the first step draws the same numbers. Under
``ModelParallelStrategy`` a meta-device build is materialised as Lightning's is (``to_empty``, each
submodule's ``reset_parameters()`` on the global generator); under ``FSDPStrategy`` it is not
(this package's materialisation draws nothing from them, where FSDP1 calls ``reset_parameters()``
per unit on full tensors; an eager build draws nothing at setup under either). Ranks that were not
seeded alike get rank 0's streams at setup (``parallel.rng.agree_on_streams``), so replicas agree.
The package's own policies are declared on the module: ``layout_independent_init = True`` (weights by parameter name,
``models.param_init``) and ``independent_training_streams = True`` (per-rank dropout streams,
``parallel.rng``); ``GPTModule`` declares both.

Import the class from ``lightning_disttrain.strategies`` instead of ``lightning.pytorch.strategies``
(or change the ``class_path`` in YAML); docs/guides/from-lightning.md has the table.
"""

from __future__ import annotations

import inspect
import itertools
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor import DTensor

from lightning_disttrain.models.param_init import layout_independent_init
from lightning_disttrain.parallel.activation import apply_activation_checkpointing
from lightning_disttrain.parallel.materialize import materialize_
from lightning_disttrain.parallel.mesh import ParallelDims
from lightning_disttrain.parallel.plan import as_block_list, find_blocks
from lightning_disttrain.parallel.transforms import TransformContext
from lightning_disttrain.strategies.nd_parallel import NDParallelStrategy


def _size(name: str, value: Any) -> Union[int, str]:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"{name}={value!r}: use 'auto' or an int >= 1")


def _not_distributed_checkpoint(cls: str) -> ValueError:
    return ValueError(
        f"{cls}(save_distributed_checkpoint=False) is not supported: checkpoints are always sharded DCP "
        f"directories with a manifest (every rank writes its shard; resume works at any world size). For one "
        f"file, consolidate after training: `lightning-disttrain export CKPT_DIR model.ckpt --full` "
        f"(one torch.save file with Lightning's keys: state_dict, hyper_parameters, loops, optimizer_states), "
        f"or drop the argument")


class ModelParallelStrategy(NDParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` arguments on ``NDParallelStrategy``.

    Args:
        data_parallel_size: ranks of one data-parallel (FSDP) group; "auto": the number of nodes.
        tensor_parallel_size: ranks of one tensor-parallel group; "auto": the devices per node.
        save_distributed_checkpoint: True (the default, as Lightning's); False is refused (see
            ``_not_distributed_checkpoint``).
        process_group_backend: the ``torch.distributed`` backend, as Lightning's; None (default):
            ``gloo`` on CPU, ``nccl`` on CUDA.
        timeout: the process groups' timeout for collectives, as Lightning's (default 30 minutes).
        **kwargs: any other ``NDParallelStrategy`` argument (``async_save``, ``empty_init``,
            ``cpu_offload``, ``compile``...). ``dp_shard``/``tp`` are the sizes above.

    As under Lightning's strategy, data_parallel_size x tensor_parallel_size must be the world size;
    FSDP shards over the data-parallel ranks (``self.device_mesh["data_parallel"]``), tensor
    parallel runs within each group of ``tensor_parallel_size`` consecutive ranks.
    """

    def __init__(
        self,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        taken = sorted(set(kwargs) & {"dp_shard", "dp_replicate", "tp"})
        if taken:
            raise ValueError(f"ModelParallelStrategy sets {', '.join(taken)} from data_parallel_size / "
                             f"tensor_parallel_size; pass those, or use NDParallelStrategy for other layouts")
        if not save_distributed_checkpoint:
            raise _not_distributed_checkpoint(type(self).__name__)
        self.data_parallel_size = _size("data_parallel_size", data_parallel_size)
        self.tensor_parallel_size = _size("tensor_parallel_size", tensor_parallel_size)
        # The model's own TP plan decides; its training_step enters loss_parallel() itself.
        kwargs.setdefault("sequence_parallel", False)
        kwargs.setdefault("loss_parallel", False)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)

    def _make_parallel_dims(self, world_size: int) -> ParallelDims:
        per_node = max(1, world_size // max(1, self.num_nodes))
        dp = self.num_nodes if self.data_parallel_size == "auto" else self.data_parallel_size
        tp = per_node if self.tensor_parallel_size == "auto" else self.tensor_parallel_size
        if dp * tp != world_size:
            raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp} must equal the world "
                             f"size ({world_size} = {self.num_nodes} node(s) x {per_node} devices); change one of them")
        return ParallelDims(dp_replicate=1, dp_shard=dp, tp=tp, pp=1, ep=1, cp=1, world_size=world_size)

    def _mesh_needs(self) -> dict[str, tuple[str, ...]]:
        # Lightning's ModelParallelStrategy mesh: both names, size 1 included, whatever the module.
        return {"keep": ("dp_shard", "tp"), "aliases": ("data_parallel", "tensor_parallel")}

    def _materialize(self, module: nn.Module) -> None:
        """A meta-device build (``trainer.init_module(empty_init=True)``) is materialised as
        Lightning's strategy does it, unless the module declares ``layout_independent_init``
        (then this package's initialisation, by parameter name): ``to_empty``, then every
        submodule's ``reset_parameters()`` drawing from the global generator on each rank's own
        shards. The weights and, above all, the place in the global streams where the module's
        later hooks draw (an ``init_weights()`` in ``on_train_start``) are then Lightning's (issue 40)."""
        if layout_independent_init(module):
            super()._materialize(module)
            return
        sharded = any(isinstance(p, DTensor) for p in module.parameters())
        device = torch.device("cpu") if (sharded and self.cpu_offload) else self.root_device  # as the mixin's
        materialize_(module, device, buffer_device=self.root_device, init=_reset_as_lightning)


def _reset_as_lightning(module: nn.Module) -> None:
    """Lightning's ``_materialize_distributed_module`` after ``to_empty``: each submodule that owns
    a parameter or buffer calls its ``reset_parameters()``, in ``modules()`` order, unseeded; those
    without one are named in a warning (their memory is left uninitialised, as there)."""
    missing = set()
    for sub in module.modules():
        if next(itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False)), None) is None:
            continue
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            missing.add(type(sub).__name__)
    if missing:
        rank_zero_warn(f"Parameter initialization incomplete: {', '.join(sorted(missing))} have no reset_parameters(); "
                       f"initialise them in a hook (on_train_start...) or give them one")


_SHARDING = {
    # FSDP1 sharding_strategy -> (reshard_after_forward, hsdp)
    "FULL_SHARD": (True, False),
    "SHARD_GRAD_OP": (False, False),
    "HYBRID_SHARD": (True, True),
    "_HYBRID_SHARD_ZERO2": (False, True),
}


def _classes(policy: Any, what: str) -> Optional[set[type]]:
    """The module classes of an FSDP1 wrap / checkpointing policy given as a class or a set/list of
    classes (Lightning's documented form); None for None."""
    if policy is None:
        return None
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return {policy}
    if isinstance(policy, (set, frozenset, list, tuple)) and all(isinstance(c, type) for c in policy):
        return set(policy)
    raise ValueError(f"{what}={policy!r}: only a set of module classes maps to "
                     f"FSDP2 units here; a callable policy does not. Pass the block class, e.g. {what}={{Block}}, "
                     f"or define parallel_plan() on the module (fsdp_groups for other units)")


class FSDPStrategy(NDParallelStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) arguments, mapped to FSDP2 (``fully_shard``).

    ======================================  ====================================================
    FSDP1 argument                          here
    ======================================  ====================================================
    ``sharding_strategy="FULL_SHARD"``      ``reshard_after_forward=True`` (ZeRO-3), the default
    ``"SHARD_GRAD_OP"``                     ``reshard_after_forward=False`` (ZeRO-2)
    ``"HYBRID_SHARD"``                      HSDP: replicate across nodes, shard within a node
    ``"_HYBRID_SHARD_ZERO2"``               HSDP, no reshard after forward
    ``"NO_SHARD"``                          refused: use ``DDPStrategy`` from this package
    ``auto_wrap_policy={Block}``            the FSDP units are the repeated blocks (found, or
                                            ``parallel_plan()``); a class that is not the block
                                            class is refused with what to do
    ``activation_checkpointing_policy``     full activation checkpointing of those blocks
    ``cpu_offload=True / CPUOffload(...)``  ``cpu_offload=True`` (parameters, gradients, states)
    ``state_dict_type="sharded"``           the default: DCP directories with a manifest
    ``state_dict_type="full"``              refused: ``lightning-disttrain export CKPT --full``
    ``mixed_precision=MixedPrecision``      refused: ``precision="bf16-mixed"`` or ``mp_policy``
    other FSDP1 keyword arguments           refused, by name
    ======================================  ====================================================

    Args:
        sharding_strategy: FSDP1's ``ShardingStrategy`` or its name: ``"FULL_SHARD"`` (default),
            ``"SHARD_GRAD_OP"``, ``"HYBRID_SHARD"`` or ``"_HYBRID_SHARD_ZERO2"``, mapped as in the
            table; ``"NO_SHARD"`` is refused (use ``DDPStrategy``).
        auto_wrap_policy: None, or a module class / set of classes (``{Block}``) that must be the
            model's repeated blocks (the FSDP2 units); a callable policy is refused.
        activation_checkpointing_policy: None, or a module class / set of classes (the repeated
            blocks) to fully checkpoint.
        cpu_offload: True / False or FSDP1's ``CPUOffload(offload_params=...)``: offload sharded
            parameters, gradients and optimizer state to host memory.
        state_dict_type: ``"sharded"`` (default, DCP directories with a manifest); ``"full"`` is
            refused (``lightning-disttrain export CKPT --full`` after training).
        mixed_precision: must stay None: FSDP1's ``MixedPrecision`` is refused (use the Trainer's
            ``precision="bf16-mixed"`` or ``mp_policy``).
        process_group_backend: the ``torch.distributed`` backend, as Lightning's; None (default):
            ``gloo`` on CPU, ``nccl`` on CUDA.
        timeout: the process groups' timeout for collectives, as Lightning's (default 30 minutes).
        activation_checkpointing: Lightning's deprecated form; must stay None (refused: pass
            ``activation_checkpointing_policy``).
        **kwargs: any ``NDParallelStrategy`` argument (``mp_policy``, ``async_save``, ...); other
            names are refused.
    """

    def __init__(
        self,
        sharding_strategy: Any = "FULL_SHARD",
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        cpu_offload: Any = None,
        state_dict_type: str = "sharded",
        mixed_precision: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        activation_checkpointing: Any = None,
        **kwargs: Any,
    ) -> None:
        ours = set(inspect.signature(NDParallelStrategy.__init__).parameters) - {"self"}
        foreign = sorted(k for k in kwargs if k not in ours)
        if foreign:
            raise ValueError(f"FSDPStrategy({', '.join(f'{k}=...' for k in foreign)}): FSDP1 arguments without an "
                             f"FSDP2 equivalent here; remove them (docs/guides/from-lightning.md)")
        name = getattr(sharding_strategy, "name", sharding_strategy)
        if name == "NO_SHARD":
            raise ValueError("FSDPStrategy(sharding_strategy='NO_SHARD') is data parallel without sharding: use "
                             "lightning_disttrain.strategies.DDPStrategy (FSDP2 replicating over every rank)")
        if name not in _SHARDING:
            raise ValueError(f"sharding_strategy={sharding_strategy!r}: use one of {sorted(_SHARDING)} or 'NO_SHARD'")
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"state_dict_type={state_dict_type!r}: use 'sharded'")
        if state_dict_type == "full":
            raise _not_distributed_checkpoint("FSDPStrategy(state_dict_type='full'): the same as ModelParallel")
        if mixed_precision is not None:
            raise ValueError("FSDPStrategy(mixed_precision=MixedPrecision(...)) is FSDP1's; pass the Trainer's "
                             "precision='bf16-mixed' (or mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy"
                             "(...) to this strategy)")
        if activation_checkpointing is not None:
            raise ValueError("activation_checkpointing= is deprecated in Lightning; pass "
                             "activation_checkpointing_policy={Block}")
        offload = cpu_offload if isinstance(cpu_offload, bool) or cpu_offload is None else bool(
            getattr(cpu_offload, "offload_params", True))
        reshard, hsdp = _SHARDING[name]
        self.hsdp = hsdp
        self.wrap_classes = _classes(auto_wrap_policy, "auto_wrap_policy")
        self.checkpoint_classes = _classes(activation_checkpointing_policy, "activation_checkpointing_policy")
        super().__init__(reshard_after_forward=reshard, cpu_offload=bool(offload),
                         process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        if self.checkpoint_classes:
            self.transforms.register("activation_checkpointing", self._checkpoint_blocks,
                                     name="FSDPStrategy(activation_checkpointing_policy)", owner=self)

    def _make_parallel_dims(self, world_size: int) -> ParallelDims:
        replicate = self.num_nodes if self.hsdp else 1
        return ParallelDims(dp_replicate=replicate, dp_shard=-1, world_size=world_size)

    def _block_classes(self, module: nn.Module) -> set[type]:
        return {type(b) for b in as_block_list(find_blocks(module))}

    def _refuse_other_classes(self, module: nn.Module, classes: set[type], what: str) -> None:
        blocks = self._block_classes(module)
        other = sorted(c.__name__ for c in classes - blocks)
        if other:
            raise ValueError(f"{what} names {other}, which are not {type(module).__name__}'s repeated blocks "
                             f"({sorted(c.__name__ for c in blocks)}), the FSDP2 units here; keep the block class "
                             f"only, or define parallel_plan() returning a ParallelPlan whose fsdp_groups lists the "
                             f"other modules")

    def setup(self, trainer: Any) -> None:
        # After configure_model (the blocks exist), before anything is sharded.
        if self.wrap_classes and self.lightning_module is not None:
            self._refuse_other_classes(self.lightning_module, self.wrap_classes, "auto_wrap_policy")
        super().setup(trainer)

    def _checkpoint_blocks(self, module: nn.Module, ctx: TransformContext) -> None:
        assert self.checkpoint_classes is not None
        self._refuse_other_classes(module, self.checkpoint_classes, "activation_checkpointing_policy")
        apply_activation_checkpointing(find_blocks(module), policy="full")


class DDPStrategy(NDParallelStrategy):
    """Lightning's ``DDPStrategy``: data parallel over every rank, as FSDP2 replicating the whole
    model (``dp_replicate`` = world size; one all-reduce of the gradients per optimizer step, as
    DDP), with this package's checkpoints, resume and preemption.

    ``find_unused_parameters``, ``static_graph`` and ``gradient_as_bucket_view`` are DDP tuning flags
    FSDP2 has no use for: accepted and ignored (FSDP2 reduces every parameter's gradient, zero where a
    parameter was unused). ``ddp_comm_hook``/``model_averaging_period`` are refused.

    Args:
        process_group_backend: the ``torch.distributed`` backend, as Lightning's; None (default):
            ``gloo`` on CPU, ``nccl`` on CUDA.
        timeout: the process groups' timeout for collectives, as Lightning's (default 30 minutes).
        find_unused_parameters: accepted and ignored (FSDP2 reduces every gradient).
        static_graph: accepted and ignored.
        gradient_as_bucket_view: accepted and ignored.
        ddp_comm_hook: must stay None: DDP communication hooks are refused.
        ddp_comm_state: must stay None (refused, as ``ddp_comm_hook``).
        ddp_comm_wrapper: must stay None (refused, as ``ddp_comm_hook``).
        model_averaging_period: must stay None (refused).
        **kwargs: any other ``NDParallelStrategy`` argument except the degrees (``dp_shard``,
            ``dp_replicate``, ``tp``, ``pp``, ``ep`` are refused).
    """

    def __init__(self, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, find_unused_parameters: bool = False,
                 static_graph: bool = False, gradient_as_bucket_view: bool = False, ddp_comm_hook: Any = None,
                 ddp_comm_state: Any = None, ddp_comm_wrapper: Any = None, model_averaging_period: Any = None,
                 **kwargs: Any) -> None:
        refused = [n for n, v in (("ddp_comm_hook", ddp_comm_hook), ("ddp_comm_state", ddp_comm_state),
                                  ("ddp_comm_wrapper", ddp_comm_wrapper),
                                  ("model_averaging_period", model_averaging_period)) if v is not None]
        if refused:
            raise ValueError(f"DDPStrategy({', '.join(refused)}=...): DDP communication hooks do not apply to FSDP2 "
                             f"replication; remove them (gradients are all-reduced in the parameters' dtype, or "
                             f"per mp_policy's reduce_dtype)")
        taken = sorted(set(kwargs) & {"dp_shard", "dp_replicate", "tp", "pp", "ep"})
        if taken:
            raise ValueError(f"DDPStrategy is data parallel only; {', '.join(taken)} belong to NDParallelStrategy")
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)

    def _make_parallel_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(dp_replicate=world_size, dp_shard=1, world_size=world_size)
