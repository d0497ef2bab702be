"""Every use of a torch private, in one module.

torch has no public API for a few things the package does: tracking which storages an op writes or
allocates (a ``TorchDispatchMode`` and pytree), a DTensor's shard object itself, every rank's piece
of a sharded tensor (Muon's owners under tensor parallel), flattening and unflattening a
``DeviceMesh``, FSDP2's post-backward without gradient sync, a forward-only
pipeline schedule for several stages per rank, DCP's single-process load and its fsspec storage,
dynamo's compilation records, inductor's async-TP switch, a FLOP formula ``FlopCounterMode``
passes through as is, the hook ``parallelize_module`` calls on a style (``ParallelStyleBase``), an
optimizer that skips ``Optimizer.__init__``, a pipeline stage's view of a module. Each such use is
an accessor here, with one line on why, so that a torch release that changes one breaks here,
loudly, and nowhere else. (``checkpoints_with_cache`` reads transformers' marker on a block: not
torch's, but the package's only other library private on a torch object.)

Checked against: torch 2.13.0 (``CHECKED_VERSIONS``; the package requires ``torch>=2.13``).

Policy:

- Each private is an entry of ``PRIVATES`` (its name, one line on why, and the public replacement
  where torch 2.13 has one, or why none fits), and an accessor below. ``check()`` resolves every
  entry on the installed torch (``tests/test_torch_compat.py`` runs it, and asserts that each
  accessor fails with :class:`TorchCompatError` when its private is gone). ``tests/test_private_seams.py``
  keeps such uses out of every other module.
- A private that is missing or changed raises :class:`TorchCompatError`, naming it, the installed
  torch and the versions checked: never a silent fallback to different behaviour.
- Version guard: on a torch whose ``major.minor`` is not among ``CHECKED_VERSIONS``, the first use
  of a private warns once (:class:`TorchCompatWarning`): the privates may be present but mean
  something else. Where torch changed what is needed between versions, the accessor decides by the
  version: ``enable_symm_mem_for_group`` is called below 2.13 only (2.13 deprecates it: "there is no
  need to call this function anymore").
- Where torch 2.13 has a public way that gives identical numbers, the package uses it instead:
  ``torch.nn.functional.grouped_mm`` (the same ``torch._grouped_mm`` kernel, called as is) for
  ``torch._grouped_mm``; ``torch.compiler.config.recompile_limit`` (an alias) for
  ``torch._dynamo.config.recompile_limit``; ``named_buffers(recurse=False)`` and ``setattr`` for
  writing ``module._buffers``; ``nn.ModuleDict.values()``/``__getitem__`` for its ``_modules``;
  ``StorageWeakRef(storage).cdata`` (the same integer) for ``storage._cdata``.

This module is of the foundation layer (``tests/test_layering.py``): it imports torch and nothing
else of the package, and imports torch's heavier or optional parts (dynamo, inductor, DCP's fsspec
storage, pipelining, FSDP's internals) inside the accessors, so that importing it costs nothing.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

CHECKED_VERSIONS: tuple[str, ...] = ("2.13.0",)
"""The torch releases every private below was checked against."""

SYMM_MEM_DEPRECATED_IN = (2, 13)
"""From this torch on, ``enable_symm_mem_for_group`` is deprecated and not needed."""

PINNED_STAGING_FROM = (2, 13)
"""From this torch on, DCP's ``DefaultStager`` (pinned, reused CPU buffers) stages DTensors. Its
deep copy reduces a DTensor's spec to ``(cls, ...)`` and looks the class up in a table that torch
2.11 lacks ``type`` in: ``KeyError: <class 'type'>`` at the first async save (seen on an H200,
torch 2.11.0+cu130, 2026-12-04); 2.13 has it (2.12 not checked)."""


class TorchCompatError(RuntimeError):
    """A torch private this package relies on is missing or changed in the installed version."""


class TorchCompatWarning(UserWarning):
    """The installed torch is not among the versions the privates were checked against."""


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch (``"2.13.0+cpu"`` -> ``(2, 13)``)."""
    match = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    if match is None:
        raise TorchCompatError(f"cannot read the installed torch's version from {torch.__version__!r}")
    return int(match[1]), int(match[2])


def _checked_minors() -> set[tuple[int, int]]:
    return {tuple(int(x) for x in v.split(".")[:2]) for v in CHECKED_VERSIONS}


_WARNED: set[str] = set()


def _guard_version() -> None:
    version = str(torch.__version__)
    if version in _WARNED:
        return
    _WARNED.add(version)
    if torch_version() not in _checked_minors():
        warnings.warn(
            f"lightning-disttrain uses torch privates (lightning_disttrain/_torch_compat.py) checked against torch "
            f"{', '.join(CHECKED_VERSIONS)}; the installed torch {version} is not among them. Those present are used "
            f"as they are; one that is missing raises TorchCompatError", TorchCompatWarning, stacklevel=3)


def _fail(private: str, why: str) -> TorchCompatError:
    return TorchCompatError(
        f"lightning-disttrain relies on torch's private {private} ({why}), which the installed torch "
        f"{torch.__version__} does not have or has changed; it was checked against torch "
        f"{', '.join(CHECKED_VERSIONS)}. Install a checked version (pip install 'torch==2.13.*') or report this to "
        f"lightning-disttrain")


# -- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Private:
    """One torch private the package relies on."""

    name: str
    """Its dotted name, e.g. ``torch.utils._pytree.tree_leaves``."""
    why: str
    """One line: what the package needs it for."""
    replacement: str
    """The public replacement in torch 2.13, or why none fits."""
    probe: Callable[[], Any]
    """Resolves it on the installed torch (raises ImportError/AttributeError/TorchCompatError when gone)."""
    below: tuple[int, int] | None = None
    """Relied on only on torch versions below this one (None: on every version)."""


def _module(name: str) -> Any:
    return sys.modules.get(name) or importlib.import_module(name)


def _resolve(module: str, path: str = "") -> Any:
    obj = _module(module)
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj


def _entry(name: str) -> Private:
    return _BY_NAME[name]


def _get(name: str) -> Any:
    """The private registered as ``name`` (a module path, then ``:``, then an attribute path)."""
    _guard_version()
    try:
        return _entry(name).probe()
    except (ImportError, AttributeError):
        raise _fail(name.replace(":", "."), _entry(name).why) from None


def _attr(obj: Any, attr: str, name: str) -> Any:
    """``getattr(obj, attr)`` for the private registered as ``name``, or the clear error."""
    _guard_version()
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise _fail(name.replace(":", "."), _entry(name).why) from None


def _reads_in_source(func: Any, text: str) -> bool:
    """Whether ``func``'s source contains ``text`` (no source available: assume it does)."""
    import inspect

    try:
        return text in inspect.getsource(func)
    except (OSError, TypeError):
        return True


def _instance_has(make: Callable[[], Any], *attrs: str) -> Any:
    obj = make()
    for attr in attrs:
        getattr(obj, attr)
    return obj


def _probe_source(module: str, path: str, text: str) -> Callable[[], Any]:
    def probe() -> Any:
        func = _resolve(module, path)
        if not _reads_in_source(func, text):
            raise AttributeError(f"{module}.{path} no longer reads {text}")
        return func

    return probe


def _tiny_optimizer() -> torch.optim.Optimizer:
    return torch.optim.Optimizer([torch.zeros(1, requires_grad=True)], {})


def _fsdp_state() -> Any:
    return _resolve("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState")()


OPTIMIZER_HOOK_DICTS: tuple[str, ...] = (
    "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
)
"""The hook dicts ``torch.optim.Optimizer.__init__`` creates and its ``step``/``state_dict``/
``load_state_dict`` wrappers read."""


def _probe_optimizer_hooks() -> None:
    found = {k for k, v in vars(_tiny_optimizer()).items() if k.startswith("_optimizer_") and k.endswith("_hooks")
             and isinstance(v, dict)}
    if found != set(OPTIMIZER_HOOK_DICTS):
        raise AttributeError(f"torch.optim.Optimizer.__init__ creates the hook dicts {sorted(found)}, "
                             f"not {sorted(OPTIMIZER_HOOK_DICTS)}")


def _probe_module_internals() -> None:
    module = torch.nn.Module()
    for attr, kind in (("_modules", dict), ("_parameters", dict), ("_buffers", dict),
                       ("_non_persistent_buffers_set", set)):
        if not isinstance(getattr(module, attr), kind):
            raise AttributeError(f"nn.Module.{attr} is no longer a {kind.__name__}")


def _probe_parallel_style_apply() -> None:
    style = _resolve("torch.distributed.tensor.parallel", "ParallelStyle")
    getattr(style, "_apply")
    if "_apply" not in getattr(style, "__abstractmethods__", ()):
        raise AttributeError("ParallelStyle._apply is no longer the abstract method parallelize_module calls")
    if not _reads_in_source(_resolve("torch.distributed.tensor.parallel.api", "parallelize_module"), "._apply("):
        raise AttributeError("parallelize_module no longer calls ParallelStyle._apply")


def _profiler_ops() -> tuple[Any, Any]:
    """record_function's enter and exit ops (what selective checkpointing must not match)."""
    profiler = torch.ops.profiler
    return (getattr(profiler, "_record_function_enter_new").default,
            getattr(profiler, "_record_function_exit")._RecordFunction)


def _probe_split_tensor() -> None:
    types = _module("torch.distributed.tensor.placement_types")
    index = torch.arange(5).view(5, 1)
    for placement in (types.Shard(0), types._StridedShard(0, split_factor=2)):
        pieces, _ = placement._split_tensor(index, 2, with_padding=False, contiguous=False)
        if len(pieces) != 2 or sorted(torch.cat(pieces).view(-1).tolist()) != list(range(5)):
            raise AttributeError(f"{type(placement).__name__}._split_tensor no longer splits into its ranks' pieces")


def _probe_micro_pipeline_tp() -> None:
    config = _module("torch._inductor.config")
    if not isinstance(getattr(config, "_micro_pipeline_tp"), bool):
        raise AttributeError("torch._inductor.config._micro_pipeline_tp is no longer a bool")


_SCHEDULES = "torch.distributed.pipelining.schedules"
_DCP = "torch.distributed.checkpoint"

LSE_ATTENTION_OPS: tuple[str, ...] = (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")
"""The aten kernels ``attention_with_lse`` / ``attention_with_lse_backward`` call (CPU; CUDA flash; CUDA
memory-efficient)."""

PRIVATES: tuple[Private, ...] = (
    # -- dispatch: which storages an op writes (materialize) or allocates (activation memory) --
    Private("torch.utils._python_dispatch:TorchDispatchMode",
            "see every aten op (and its arguments) a forward or an initialiser runs",
            "none in torch 2.13 (no public re-export)",
            lambda: _resolve("torch.utils._python_dispatch", "TorchDispatchMode")),
    Private("torch.utils._pytree:tree_leaves",
            "the tensors among an op's (args, kwargs) inside __torch_dispatch__",
            "none in torch 2.13 (torch.utils.pytree is not a module of 2.13)",
            lambda: _resolve("torch.utils._pytree", "tree_leaves")),
    Private("torch._ops:OpOverload._schema",
            "which arguments of an op it writes in place (alias_info.is_write)",
            "none in torch 2.13 (OpOverload has no public schema)",
            lambda: _resolve("torch", "ops.aten.add_.Tensor._schema.arguments")),
    Private("torch._C:_current_graph_task_id",
            "whether an op runs inside a backward pass (FLOPs counted for the forward only)",
            "none in torch 2.13",
            lambda: _resolve("torch._C", "_current_graph_task_id")),
    Private("torch.utils.flop_counter:FlopCounterMode._get_raw",
            "mark a FLOP formula as already shape-wrapped, so FlopCounterMode passes it through as is",
            "none in torch 2.13 (custom_mapping wraps every formula otherwise)",
            _probe_source("torch.utils.flop_counter", "FlopCounterMode.__init__", '"_get_raw"')),
    # -- DTensor and meshes --
    Private("torch.distributed.tensor:DTensor._local_tensor",
            "the shard object a DTensor holds (to_local() gives a view of it with grad on, or for a Parameter)",
            "DTensor.to_local(), which is not the same object in those cases",
            lambda: _resolve("torch.distributed.tensor", "DTensor._local_tensor")),
    Private("torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
            "the slice of the full tensor a rank's shard holds (reading a Hugging Face checkpoint shard by shard)",
            "none in torch 2.13",
            lambda: _resolve("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")),
    Private("torch.distributed.tensor.placement_types:_StridedShard",
            "FSDP2's placement of a dimension tensor parallel shards too (split on the TP dimension first): "
            "ShardedMuon takes it as a sharded placement",
            "none in torch 2.13 (it is neither a Shard nor is_shard())",
            lambda: _resolve("torch.distributed.tensor.placement_types", "_StridedShard")),
    Private("torch.distributed.tensor.placement_types:Shard._split_tensor/_StridedShard._split_tensor",
            "the rows (columns) every rank of a mesh dimension holds, not only this rank's: ShardedMuon's owner "
            "assembles a tensor-parallel matrix from its pieces",
            "distribute_tensor(..., src_data_rank=None) gives this rank's piece only (ShardedMuon checks its own "
            "piece against it)",
            _probe_split_tensor),
    Private("torch.distributed.tensor._random:is_rng_supported_mesh",
            "whether DTensor's random ops draw a shard as the slice of one full random tensor on a mesh",
            "none in torch 2.13",
            lambda: _resolve("torch.distributed.tensor._random", "is_rng_supported_mesh")),
    Private("torch.distributed.device_mesh:DeviceMesh._flatten",
            "one mesh dimension for several (dp_shard x cp, ...) that keeps the world mesh as its root",
            "none in torch 2.13 (slicing a flattened dimension by name is deprecated)",
            lambda: _resolve("torch.distributed.device_mesh", "DeviceMesh._flatten")),
    Private("torch.distributed.device_mesh:DeviceMesh._unflatten",
            "HSDP's (replicate, shard) and expert parallel's (efsdp, ep) views of the same ranks, rooted at the world",
            "none in torch 2.13",
            lambda: _resolve("torch.distributed.device_mesh", "DeviceMesh._unflatten")),
    Private("torch.distributed.device_mesh:DeviceMesh._concatenate",
            "one mesh over dimensions of other meshes, rooted at their world mesh, using their process groups "
            "(HSDP x CP's (replicate, shard) mesh; the named views of ParallelDims(aliases=...)): no new group",
            "none in torch 2.13",
            lambda: _resolve("torch.distributed.device_mesh", "DeviceMesh._concatenate")),
    Private("torch.distributed.tensor.debug:_clear_sharding_prop_cache",
            "DTensor's sharding-propagation caches, Python's and the C++ fast path's (keyed by specs that "
            "hold meshes), are cleared when a layout's process groups are destroyed: a later, equal mesh "
            "would be served the old mesh (\"Could not resolve the process group registered under the name N\")",
            "none in torch 2.13",
            lambda: _resolve("torch.distributed.tensor.debug", "_clear_sharding_prop_cache")),
    Private("torch.distributed.tensor._redistribute:_gen_transform_infos",
            "the redistribution plans cached per (mesh, placements): cleared with the groups, as above",
            "none in torch 2.13",
            lambda: _resolve("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear")),
    Private("torch.distributed.tensor._redistribute:clear_redistribute_planner_cache",
            "the redistribution planners cached per (weak mesh, tensor meta): each planner holds its mesh, "
            "and the mesh its process groups, so a destroyed group's gloo threads (or NCCL communicator) "
            "outlived it; cleared with the groups",
            "none in torch 2.13",
            lambda: _resolve("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache")),
    Private("torch.distributed.tensor._sharding_prop:ShardingPropagator._propagate_tensor_meta_cached",
            "the output metadata cached per operator schema (an lru_cache on the class: its keys hold specs, "
            "specs their mesh, the mesh its groups): cleared with the groups, as above",
            "none in torch 2.13",
            lambda: _resolve("torch.distributed.tensor._sharding_prop",
                             "ShardingPropagator._propagate_tensor_meta_cached.cache_clear")),
    Private("torch.distributed.tensor._collective_utils:MeshTopoInfo.build_from_mesh",
            "the mesh topologies cached per mesh (an lru_cache that holds the mesh and so its groups): "
            "cleared with the groups, as above",
            "none in torch 2.13",
            lambda: _resolve("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear")),
    # -- collectives --
    Private("torch.distributed._functional_collectives",
            "collectives autograd flows through (all_to_all_single for experts)",
            "torch.distributed.nn.functional has autograd collectives, but another implementation (not traced alike)",
            lambda: [_resolve("torch.distributed._functional_collectives", name) for name in FUNCOL_NAMES]),
    Private("torch:_foreach_mul_",
            "scale every gradient shard of one (device, dtype) by the clip coefficient in one fused kernel",
            "per-tensor mul_ gives the same numbers but one kernel per gradient; "
            "torch.nn.utils.clip_grads_with_norm_ keeps the coefficient in float32 (other numbers for bf16)",
            lambda: _resolve("torch", "_foreach_mul_")),
    # -- nn.Module / optimizer internals --
    Private("torch.nn.Module._modules/_parameters/_buffers/_non_persistent_buffers_set",
            "a pipeline stage's view of the model: the model's class sharing its submodules, with only some children",
            "named_children()/named_buffers() skip None slots and duplicates, and buffers' persistence is not public",
            _probe_module_internals),
    Private("torch.nn.MultiheadAttention._reset_parameters",
            "initialise torch.nn modules that have only a private reset (after materialising a meta model)",
            "none in torch 2.13",
            lambda: _resolve("torch.nn", "MultiheadAttention._reset_parameters")),
    Private("torch.optim.Optimizer._optimizer_*_hooks",
            "HybridOptimizer skips Optimizer.__init__ (its parts own the groups); torch's step wrapper reads the dicts",
            "none in torch 2.13",
            _probe_optimizer_hooks),
    Private("torch.distributed.tensor.parallel:ParallelStyle._apply",
            "the method parallelize_module calls on a style (ParallelStyleBase delegates it to apply_style)",
            "none in torch 2.13 (ParallelStyle's only hook)",
            _probe_parallel_style_apply),
    # -- FSDP2 --
    Private("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._state_ctx",
            "every FSDP state under a root, to run their post-backward with gradient sync off",
            "none in torch 2.13",
            lambda: _instance_has(_fsdp_state, "_state_ctx")._state_ctx.all_states),
    Private("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._fsdp_param_groups",
            "each state's parameter groups, whose post_backward accumulates the unsharded gradient",
            "none in torch 2.13",
            lambda: (_instance_has(_fsdp_state, "_fsdp_param_groups"),
                     _resolve("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                              "FSDPParamGroup.post_backward"))),
    Private("torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState._root_post_backward_final_callback",
            "what FSDP runs at the end of a backward (resharding, clearing state)",
            "none in torch 2.13",
            lambda: _resolve("torch.distributed.fsdp._fully_shard._fsdp_state",
                             "FSDPState._root_post_backward_final_callback")),
    # -- pipelining --
    Private(f"{_SCHEDULES}:_Action", "one compute action of a forward-only schedule", "none in torch 2.13",
            lambda: _resolve(_SCHEDULES, "_Action")),
    Private(f"{_SCHEDULES}:_ComputationType", "the FORWARD action type", "none in torch 2.13",
            lambda: _resolve(_SCHEDULES, "_ComputationType.FORWARD")),
    Private(f"{_SCHEDULES}:_PipelineScheduleRuntime",
            "lowers a compute-only action list to sends and receives (forward-only evaluation)",
            "none in torch 2.13 (the V and zero-bubble schedules' own eval fails in 2.13)",
            lambda: _resolve(_SCHEDULES, "_PipelineScheduleRuntime")),
    Private(f"{_SCHEDULES}:_PipelineScheduleRuntime._prepare_schedule_with_comms",
            "installs the action list", "none in torch 2.13",
            lambda: _resolve(_SCHEDULES, "_PipelineScheduleRuntime._prepare_schedule_with_comms")),
    Private(f"{_SCHEDULES}:PipelineScheduleMulti._validate_and_set_stage_mapping",
            "overridden: torch's check wants every micro-batch to run backward too",
            "none in torch 2.13",
            lambda: _resolve(_SCHEDULES, "PipelineScheduleMulti._validate_and_set_stage_mapping")),
    Private(f"{_SCHEDULES}:PipelineScheduleMulti._stages",
            "the schedule's stages, each told the stage-to-rank mapping", "none in torch 2.13",
            _probe_source(_SCHEDULES, "PipelineScheduleMulti.__init__", "self._stages =")),
    # -- DCP --
    Private(f"{_DCP}._fsspec_filesystem:FsspecReader",
            "DCP's reader for fsspec URLs (s3://, gs://, ...)",
            "none in torch 2.13 (torch.distributed.checkpoint does not export it)",
            lambda: _resolve(f"{_DCP}._fsspec_filesystem", "FsspecReader")),
    Private(f"{_DCP}._fsspec_filesystem:FsspecWriter",
            "DCP's writer for fsspec URLs", "none in torch 2.13 (not exported)",
            lambda: _resolve(f"{_DCP}._fsspec_filesystem", "FsspecWriter")),
    Private(f"{_DCP}.default_planner:_EmptyStateDictLoadPlanner",
            "rebuild full tensors from the metadata without a model (what dcp_to_torch_save uses)",
            "none in torch 2.13",
            lambda: _resolve(f"{_DCP}.default_planner", "_EmptyStateDictLoadPlanner")),
    Private(f"{_DCP}.state_dict_loader:_load_state_dict",
            "load into an empty dict in one process (dcp.load copies only the keys given, and warns)",
            "dcp.load(no_dist=True) fills only the keys the state dict already has",
            lambda: _resolve(f"{_DCP}.state_dict_loader", "_load_state_dict")),
    Private(f"{_DCP}.filesystem:FileSystemReader._get_metadata_path",
            "where a DCP reader's metadata file is, to read it with restricted unpickling",
            "none in torch 2.13",
            lambda: _resolve(f"{_DCP}.filesystem", "FileSystemReader._get_metadata_path")),
    # -- activation checkpointing --
    Private("torch.ops.profiler:_record_function_enter_new/_record_function_exit",
            "profiler annotations that selective checkpointing must not count: FSDP2's hooks inside a checkpointed "
            "block (expert parallel's experts are their own FSDP unit) annotate a different number of times in the "
            "forward and in the recomputation, and SAC matches ops by (op, call index)",
            "none: they go into torch.utils.checkpoint.SAC_IGNORED_OPS (public, in its __all__), the set torch "
            "itself fills with ops whose count differs between forward and recomputation (detach)",
            _profiler_ops),
    Private("torch.distributed.distributed_c10d:_resolve_process_group",
            "the live process group registered under a name: ring attention's operator takes its group by name "
            "(an op's schema has no ProcessGroup type), as torch's functional collectives do",
            "none in torch 2.13 (the functional collectives resolve names with it too)",
            lambda: _resolve("torch.distributed.distributed_c10d", "_resolve_process_group")),
    # -- attention kernels that return the log-sum-exp (ring attention) --
    Private(f"torch.ops.aten:{'/'.join(LSE_ATTENTION_OPS)}",
            "fused attention of one block that also returns each query's log-sum-exp, and the backward that "
            "takes a given output and log-sum-exp (ring attention merges blocks exactly with them)",
            "none in torch 2.13 (F.scaled_dot_product_attention returns the output only)",
            lambda: [_resolve("torch", f"ops.aten.{name}.default") for name in LSE_ATTENTION_OPS]),
    # -- compile --
    Private("torch._dynamo.utils:get_compilation_metrics",
            "one record per dynamo compile with the guard failure that caused it (recompilation warnings)",
            "none in torch 2.13",
            lambda: _resolve("torch._dynamo.utils", "get_compilation_metrics")),
    Private("torch._inductor.config:_micro_pipeline_tp",
            "async tensor parallel: inductor fuses TP's collectives with the matmuls next to them",
            "none in torch 2.13",
            _probe_micro_pipeline_tp),
    Private("torch.distributed._symmetric_memory:enable_symm_mem_for_group",
            "symmetric memory between the TP ranks for async TP, below torch 2.13",
            "none needed from torch 2.13 on (deprecated: 'no need to call this function anymore')",
            lambda: _resolve("torch.distributed._symmetric_memory", "enable_symm_mem_for_group"),
            below=SYMM_MEM_DEPRECATED_IN),
)
"""Every torch private the package relies on (``name``: module ``:`` attribute path)."""

PRIVATE_NAMES: tuple[str, ...] = tuple(p.name for p in PRIVATES)

_BY_NAME: dict[str, Private] = {p.name: p for p in PRIVATES}


def relied_on(private: Private) -> bool:
    """Whether the installed torch's version needs ``private``."""
    return private.below is None or torch_version() < private.below


def check() -> None:
    """Raise :class:`TorchCompatError` naming every private of ``PRIVATES`` that the installed torch
    lacks (or has changed); return None when all resolve."""
    missing = []
    for private in PRIVATES:
        if not relied_on(private):
            continue
        try:
            private.probe()
        except (ImportError, AttributeError, TorchCompatError) as err:
            missing.append(f"{private.name.replace(':', '.')} ({private.why}: {err})")
    if missing:
        raise TorchCompatError(
            f"lightning-disttrain relies on torch's privates {'; '.join(missing)}, which the installed torch "
            f"{torch.__version__} does not have or has changed; they were checked against torch "
            f"{', '.join(CHECKED_VERSIONS)}. Install a checked version (pip install 'torch==2.13.*') or report this "
            f"to lightning-disttrain")


# -- dispatch, pytree, ops, autograd ----------------------------------------------------------


def ignore_profiler_ops_in_selective_checkpointing() -> None:
    """Make ``record_function``'s enter/exit ops invisible to selective activation checkpointing
    (``torch.utils.checkpoint.SAC_IGNORED_OPS``): they run as called, in the forward and in the
    recomputation, instead of being matched by call index. Idempotent; process-wide, like torch's
    own entries (profiler annotations have no values worth saving)."""
    from torch.utils.checkpoint import SAC_IGNORED_OPS

    SAC_IGNORED_OPS.update(_get("torch.ops.profiler:_record_function_enter_new/_record_function_exit"))


def tree_leaves(tree: Any, *args: Any, **kwargs: Any) -> list[Any]:
    """``torch.utils._pytree.tree_leaves``: the leaves of a nested (args, kwargs) structure."""
    return _get("torch.utils._pytree:tree_leaves")(tree, *args, **kwargs)


def op_schema(op: Any) -> Any:
    """An aten ``OpOverload``'s ``FunctionSchema`` (its ``arguments`` tell which it writes)."""
    return _attr(op, "_schema", "torch._ops:OpOverload._schema")


def current_graph_task_id() -> int:
    """The running autograd graph task's id; -1 outside a backward pass."""
    return _get("torch._C:_current_graph_task_id")()


_FLOP_RAW_CHECKED: set[str] = set()


def pass_flop_formula_through(formula: Callable[..., int]) -> Callable[..., int]:
    """Mark ``formula`` (already shape-wrapped: it takes the op's arguments) so that a
    ``FlopCounterMode(custom_mapping=...)`` uses it as is; return it. Raises if FlopCounterMode no
    longer reads the mark (it would then wrap the formula again and count wrong numbers)."""
    name = "torch.utils.flop_counter:FlopCounterMode._get_raw"
    if str(torch.__version__) not in _FLOP_RAW_CHECKED:
        _get(name)
        _FLOP_RAW_CHECKED.add(str(torch.__version__))
    formula._get_raw = True
    return formula


def __getattr__(name: str) -> Any:
    # Classes a module of the package subclasses at import: resolved (and checked) on first use.
    if name == "TorchDispatchMode":
        return _get("torch.utils._python_dispatch:TorchDispatchMode")
    if name == "ParallelStyleBase":
        return parallel_style_base()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- storages, DTensor, meshes ----------------------------------------------------------------


def local_tensor(t: Any) -> Any:
    """A DTensor's shard on this rank, the very tensor object it holds (``to_local()`` returns a
    view of it when grad is enabled or for a Parameter); any other object: itself."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    if dtensor is None or not isinstance(t, dtensor.DTensor):
        return t
    return _attr(t, "_local_tensor", "torch.distributed.tensor:DTensor._local_tensor")


def compute_local_shape_and_global_offset(global_shape: Any, mesh: Any, placements: Any) -> tuple[tuple, tuple]:
    """(shape, offset) of this rank's shard of a tensor of ``global_shape`` laid out by ``placements``."""
    return _get("torch.distributed.tensor._utils:compute_local_shape_and_global_offset")(
        global_shape, mesh, placements)


def strided_shard_type() -> type:
    """``_StridedShard``: FSDP2's placement of a tensor dimension that tensor parallel shards too."""
    return _get("torch.distributed.tensor.placement_types:_StridedShard")


def placement_pieces(placement: Any, tensor: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """The pieces a ``Shard`` or ``_StridedShard`` ``placement`` cuts ``tensor`` into over a mesh
    dimension of ``ranks`` ranks, in mesh-coordinate order, empty ones included: what
    ``distribute_tensor(..., src_data_rank=None)`` keeps of it on each rank (views, unpadded)."""
    split = _attr(placement, "_split_tensor",
                  "torch.distributed.tensor.placement_types:Shard._split_tensor/_StridedShard._split_tensor")
    pieces, _ = split(tensor, ranks, with_padding=False, contiguous=False)
    if len(pieces) != ranks:
        name = "torch.distributed.tensor.placement_types:Shard._split_tensor/_StridedShard._split_tensor"
        raise _fail(name.replace(":", "."), f"{_entry(name).why}; it gave {len(pieces)} pieces for {ranks} ranks")
    return list(pieces)


def is_rng_supported_mesh(mesh: Any) -> bool:
    """Whether DTensor's random ops support ``mesh``'s device type (it warns when not)."""
    return _get("torch.distributed.tensor._random:is_rng_supported_mesh")(mesh)


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh``'s dimensions as one named dimension, rooted at the same world mesh."""
    return _attr(mesh, "_flatten", "torch.distributed.device_mesh:DeviceMesh._flatten")(name)


def unflatten_mesh(mesh: Any, dim: int | str, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """``mesh``'s dimension ``dim`` split into ``sizes`` named ``names``, rooted at the same world mesh."""
    return _attr(mesh, "_unflatten", "torch.distributed.device_mesh:DeviceMesh._unflatten")(dim, sizes, names)


def concatenate_meshes(meshes: list[Any]) -> Any:
    """The meshes' dimensions side by side as one mesh over their existing process groups, rooted at
    their (common) world mesh."""
    return _get("torch.distributed.device_mesh:DeviceMesh._concatenate")(meshes)


def alias_mesh(mesh: Any, name: str) -> Any:
    """A 1-D view of the 1-D ``mesh`` named ``name``, over ``mesh``'s own process group, registered on
    the world mesh so that ``world[name]`` finds it (what ``_flatten`` registers, without the new
    group ``_flatten`` would make for the same ranks)."""
    key = "torch.distributed.device_mesh:DeviceMesh._concatenate"
    view = concatenate_meshes([mesh])
    root = _attr(view, "_get_root_mesh", key)()
    mapping = _attr(root, "_flatten_mapping", key)
    _attr(view, "_mesh_dim_names", key)
    view._mesh_dim_names = (name,)
    if name in mapping and mapping[name] is not view:
        raise ValueError(f"the world mesh has a dimension named {name!r} already")
    mapping[name] = view
    return view


def _run_in_backward_thread(fn: Callable[[], Any], device_type: str) -> None:
    """Run ``fn`` in the thread autograd runs ``device_type``'s backward in. The Python sharding
    cache is per thread; on an accelerator, backward runs in autograd's thread for that device, whose
    cache holds the backward ops' specs (on the CPU it is the calling thread: ``fn`` runs here)."""

    class _Call(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            fn()
            return grad

    x = torch.zeros((), device=torch.device(device_type), requires_grad=True)
    _Call.apply(x).backward()


def clear_mesh_caches(device_type: str = "cpu") -> None:
    """Empty torch's caches whose keys or values hold device meshes: DTensor's sharding propagation
    (Python's, this thread's, and the C++ fast path's), the redistribution plans and planners, and the
    mesh topologies. A mesh equals any other
    over the same layout and names, whatever its process groups, so after a layout's groups are
    destroyed a later mesh of that layout would be handed entries holding the destroyed one."""
    clear = _get("torch.distributed.tensor.debug:_clear_sharding_prop_cache")  # this thread's, and C++'s
    clear()
    _run_in_backward_thread(clear, device_type)  # the per-thread cache of the thread backward runs in
    _get("torch.distributed.tensor._redistribute:_gen_transform_infos")()
    _get("torch.distributed.tensor._sharding_prop:ShardingPropagator._propagate_tensor_meta_cached")()
    # These two hold meshes as values, and a mesh holds its process groups (``_pg_registry``): a
    # destroyed group stayed alive through them, with its threads (measured: 3 per gloo group).
    _get("torch.distributed.tensor._redistribute:clear_redistribute_planner_cache")()
    _get("torch.distributed.tensor._collective_utils:MeshTopoInfo.build_from_mesh")()


# -- collectives and gradients ----------------------------------------------------------------


FUNCOL_NAMES: tuple[str, ...] = ("all_to_all_single", "wait_tensor",
                                  "AsyncCollectiveTensor")
"""What the package uses of the functional collectives module."""


def funcol() -> Any:
    """The functional collectives module (``torch.distributed._functional_collectives``). Called
    inside compiled forwards (expert parallel's all-to-all), hence plain statements dynamo traces."""
    name = "torch.distributed._functional_collectives"
    try:
        import torch.distributed._functional_collectives as module
    except ImportError:
        raise _fail(name, _entry(name).why) from None
    for attr in FUNCOL_NAMES:
        if not hasattr(module, attr):
            raise _fail(f"{name}.{attr}", _entry(name).why)
    return module


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """``torch._foreach_mul_``: multiply each tensor in place by ``scalar`` (one fused kernel)."""
    _get("torch:_foreach_mul_")(tensors, scalar)


# -- attention with its log-sum-exp (ring attention) -----------------------------------------

_LSE_OPS = f"torch.ops.aten:{'/'.join(LSE_ATTENTION_OPS)}"
EFFICIENT_LSE_ALIGN = 32
"""CUDA's memory-efficient kernel pads its log-sum-exp to a multiple of this many queries."""


def _lse_op(name: str) -> Any:
    _guard_version()
    try:
        return getattr(torch.ops.aten, name).default
    except (AttributeError, RuntimeError):
        raise _fail(f"torch.ops.aten.{name}", _entry(_LSE_OPS).why) from None


def resolve_process_group(name: str) -> Any:
    """The process group registered under ``name`` now (``ProcessGroup.group_name``)."""
    return _get("torch.distributed.distributed_c10d:_resolve_process_group")(name)


def lse_kernel(q: torch.Tensor) -> str:
    """Which kernel ``attention_with_lse`` runs for queries like ``q`` (B, H, L, D): ``"cpu"``
    (CPU's flash kernel, any float dtype), ``"flash"`` (CUDA compute capability 8.0 or later,
    bf16/fp16, head_dim <= 256 and a multiple of 8) or ``"efficient"`` (CUDA, anything else: fp32,
    other head dims, older GPUs).
    None of them materialises the block's score matrix."""
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type != "cuda":
        raise ValueError(f"ring attention runs on CPU and CUDA tensors; these are on {q.device.type}")
    if (q.dtype in (torch.bfloat16, torch.float16) and q.size(-1) <= 256 and q.size(-1) % 8 == 0
            and torch.cuda.get_device_capability(q.device) >= (8, 0)):  # FlashAttention 2: Ampere and later
        return "flash"
    return "efficient"


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` (B, H, Lq, D) over ``k``, ``v`` (B, H, Lk, D) without dropout, with
    ``is_causal`` the upper-left (square) causal mask: (output like ``q``, log-sum-exp (B, H, Lq)
    in float32)."""
    kind = lse_kernel(q)
    if kind == "cpu":
        out, lse = _lse_op("_scaled_dot_product_flash_attention_for_cpu")(q, k, v, 0.0, is_causal, scale=scale)
    elif kind == "flash":
        out, lse = _lse_op("_scaled_dot_product_flash_attention")(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    else:
        out, lse = _lse_op("_scaled_dot_product_efficient_attention")(q, k, v, None, True, 0.0, is_causal,
                                                                      scale=scale)[:2]
        lse = lse[..., :q.size(2)]  # padded to a multiple of EFFICIENT_LSE_ALIGN queries
    return out, lse.float()


def _bthd(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, T, D) stored as (B, T, H, D) (a copy only when it is not)."""
    if t.stride(3) == 1 and t.stride(2) == t.size(1) * t.size(3):
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def attention_with_lse_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of ``attention_with_lse`` given the output ``out`` and log-sum-exp
    ``lse`` (B, H, Lq, float32) to take the probabilities from: those of the whole row's softmax
    when the block is one of several merged (the ring), so each block's gradients are exact."""
    kind = lse_kernel(q)
    if kind == "cpu":
        return _lse_op("_scaled_dot_product_flash_attention_for_cpu_backward")(
            grad_out, q, k, v, out, lse, 0.0, is_causal, scale=scale)
    if kind == "flash":
        # Dense inputs, no dropout: no cumulative lengths (None: not varlen), the block's own
        # lengths, and philox state the kernel reads only with dropout.
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        return _lse_op("_scaled_dot_product_flash_attention_backward")(
            grad_out, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, is_causal, unused, unused,
            scale=scale)
    # The memory-efficient backward reads the output (and its gradient) with the row stride of a
    # (B, T, H, D) layout whatever their strides say: give it that layout.
    out, grad_out = _bthd(out), _bthd(grad_out)
    rows = q.size(2)
    padded = lse.new_zeros(*lse.shape[:-1], -(-rows // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN)
    padded[..., :rows] = lse
    unused = torch.empty((), dtype=torch.int64, device=q.device)
    grads = _lse_op("_scaled_dot_product_efficient_attention_backward")(
        grad_out, q, k, v, None, out, padded, unused, unused, 0.0, [True, True, True, False], is_causal, scale=scale)
    return grads[0], grads[1], grads[2]


# -- nn.Module and optimizer internals --------------------------------------------------------

_MODULE_INTERNALS = "torch.nn.Module._modules/_parameters/_buffers/_non_persistent_buffers_set"


def child_slots(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """A copy of ``module``'s child-module slots in order, None slots and repeated modules included
    (``named_children()`` skips both)."""
    return dict(_attr(module, "_modules", _MODULE_INTERNALS))


def module_view(model: torch.nn.Module, children: Mapping[str, torch.nn.Module | None], *,
                share: bool = True) -> torch.nn.Module:
    """A new object of ``model``'s class, its ``__init__`` not run (nn.Module's only: hooks of its
    own). ``share``: with ``model``'s plain attributes, parameters, buffers (persistence kept) and
    child modules, the slots in ``children`` replaced; else with ``children`` as its only children."""
    cls = type(model)
    view = cls.__new__(cls)
    torch.nn.Module.__init__(view)
    _attr(view, "_modules", _MODULE_INTERNALS)
    if not share:
        view._modules = dict(children)
        return view
    for k, v in model.__dict__.items():
        view.__dict__.setdefault(k, v)  # plain attributes (config, flags)
    try:
        view._modules = dict(model._modules)
        view._parameters = dict(model._parameters)
        view._buffers = dict(model._buffers)
        view._non_persistent_buffers_set = set(model._non_persistent_buffers_set)
    except AttributeError:
        raise _fail(_MODULE_INTERNALS, _entry(_MODULE_INTERNALS).why) from None
    view._modules.update(children)
    return view


def torch_nn_reset_parameters(module: torch.nn.Module) -> Callable[[], None] | None:
    """The private ``_reset_parameters`` of a torch.nn module that has one (``nn.MultiheadAttention``),
    else None (a module of another library: its private is not an initialiser we know)."""
    if not type(module).__module__.startswith("torch.nn"):
        return None
    fn = getattr(module, "_reset_parameters", None)
    return fn if callable(fn) else None


def init_optimizer_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that does not run ``Optimizer.__init__`` the hook dicts torch's
    ``step``/``state_dict``/``load_state_dict`` wrappers read (empty ``OrderedDict``s, as torch
    makes them: ``register_*_hook`` keeps a weak reference to the dict, which a plain dict refuses)."""
    from collections import OrderedDict

    _get("torch.optim.Optimizer._optimizer_*_hooks")
    for name in OPTIMIZER_HOOK_DICTS:
        setattr(optimizer, name, OrderedDict())


_STYLE_BASE: list[type] = []


def parallel_style_base() -> type:
    """``ParallelStyleBase``: a ``ParallelStyle`` whose ``_apply`` (what ``parallelize_module``
    calls) runs ``apply_style(module, device_mesh)``, so our styles override no private."""
    if _STYLE_BASE:
        return _STYLE_BASE[0]
    _get("torch.distributed.tensor.parallel:ParallelStyle._apply")
    from torch.distributed.tensor.parallel import ParallelStyle

    class ParallelStyleBase(ParallelStyle):
        """A ``ParallelStyle`` defined by ``apply_style``."""

        def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
            return self.apply_style(module, device_mesh)

        @abstractmethod
        def apply_style(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
            """Parallelize ``module`` over ``device_mesh``; return it (``ParallelStyle._apply``)."""

    _STYLE_BASE.append(ParallelStyleBase)
    return ParallelStyleBase


# -- FSDP2 ------------------------------------------------------------------------------------


def fsdp_post_backward(module: Any) -> None:
    """Run what FSDP2 runs after a backward, for the FSDP root ``module`` and every FSDP module under
    it, as they are set (e.g. with gradient sync off): each parameter group's ``post_backward``
    (accumulate the unsharded gradient, reshard), then the root's final callback."""
    from torch.distributed.fsdp import fully_shard

    prefix = "torch.distributed.fsdp._fully_shard._fsdp_state:FSDPState."
    state = fully_shard.state(module)
    ctx = _attr(state, "_state_ctx", prefix + "_state_ctx")
    for each in ctx.all_states:
        for group in _attr(each, "_fsdp_param_groups", prefix + "_fsdp_param_groups"):
            group.post_backward()
    _attr(state, "_root_post_backward_final_callback", prefix + "_root_post_backward_final_callback")()


# -- pipelining -------------------------------------------------------------------------------


def compute_only_schedule(stages: list[Any], actions: Mapping[int, Iterable[tuple[int, int]]],
                          stage_to_rank: Mapping[int, int], **schedule_kwargs: Any) -> Any:
    """A schedule running, on each pipeline rank ``r``, the forward of ``actions[r]`` (pairs of
    stage index, micro-batch index) in order, lowered by torch's schedule runtime to sends and
    receives; ``stage_to_rank`` maps every stage to its rank. ``schedule_kwargs`` go to the
    schedule (``n_microbatches``, ``loss_fn``, ``scale_grads``)."""
    for name in ("_Action", "_ComputationType", "_PipelineScheduleRuntime",
                 "_PipelineScheduleRuntime._prepare_schedule_with_comms",
                 "PipelineScheduleMulti._validate_and_set_stage_mapping", "PipelineScheduleMulti._stages"):
        _get(f"{_SCHEDULES}:{name}")
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        _Action,
        _ComputationType,
        _PipelineScheduleRuntime,
    )

    mapping = dict(stage_to_rank)

    class KnownMapping(PipelineScheduleMulti):
        # torch's check wants every micro-batch to run backward too; here none does. The
        # runtime reaches this through super(), hence a class between it and PipelineScheduleMulti.
        def _validate_and_set_stage_mapping(self, actions) -> None:
            self.stage_index_to_group_rank = mapping
            for stage in self._stages:
                stage.stage_index_to_group_rank = mapping

    class ForwardOnly(_PipelineScheduleRuntime, KnownMapping):
        pass

    schedule = ForwardOnly(stages, **schedule_kwargs)
    forward = _ComputationType.FORWARD
    lowered = {rank: [_Action(stage, forward, mb) for stage, mb in pairs] for rank, pairs in actions.items()}
    schedule._prepare_schedule_with_comms(lowered, format="compute_only")
    return schedule


# -- DCP --------------------------------------------------------------------------------------


def fsspec_reader_class() -> type:
    """DCP's ``FsspecReader`` (a storage reader for fsspec URLs)."""
    return _get(f"{_DCP}._fsspec_filesystem:FsspecReader")


def fsspec_writer_class() -> type:
    """DCP's ``FsspecWriter`` (a storage writer for fsspec URLs)."""
    return _get(f"{_DCP}._fsspec_filesystem:FsspecWriter")


def empty_state_dict_load_planner(keys: set[str] | None = None) -> Any:
    """DCP's load planner that builds the state dict from the metadata (``keys``: top-level entries to keep)."""
    return _get(f"{_DCP}.default_planner:_EmptyStateDictLoadPlanner")(keys=keys)


def load_state_dict_no_dist(state: dict[str, Any], storage_reader: Any, planner: Any) -> None:
    """DCP's single-process load into ``state`` (filled by ``planner``), without a process group."""
    _get(f"{_DCP}.state_dict_loader:_load_state_dict")(
        state, storage_reader=storage_reader, planner=planner, no_dist=True)


def metadata_path(reader: Any, rank: int | None = None) -> Any:
    """Where DCP storage ``reader`` (a ``FileSystemReader`` or ``FsspecReader``) finds its metadata."""
    return _attr(reader, "_get_metadata_path", f"{_DCP}.filesystem:FileSystemReader._get_metadata_path")(rank)


# -- compile ----------------------------------------------------------------------------------


def compilation_metrics() -> list:
    """Dynamo's records of its last compiles (``CompilationMetrics``, with ``recompile_reason``)."""
    return _get("torch._dynamo.utils:get_compilation_metrics")()


def enable_micro_pipeline_tp() -> None:
    """Let inductor fuse TP's all-gather / reduce-scatter with the matmuls next to them."""
    _get("torch._inductor.config:_micro_pipeline_tp")
    _module("torch._inductor.config")._micro_pipeline_tp = True


def pinned_staging_stages_dtensors() -> bool:
    """Whether the installed torch's ``DefaultStager`` can stage a state dict holding DTensors
    (``PINNED_STAGING_FROM``); below it, async saves use the storage writer's own staging."""
    return torch_version() >= PINNED_STAGING_FROM


def enable_symm_mem_for_group(group_name: str) -> bool:
    """Set up symmetric memory for the process group ``group_name`` where the installed torch needs
    it (below 2.13; from 2.13 on torch does it on demand and deprecates the call). Returns whether
    it was called."""
    if torch_version() >= SYMM_MEM_DEPRECATED_IN:
        return False
    _get("torch.distributed._symmetric_memory:enable_symm_mem_for_group")(group_name)
    return True


# -- other libraries' privates on torch modules -----------------------------------------------


def checkpoints_with_cache(block: torch.nn.Module) -> bool:
    """Whether a Hugging Face block declares it may be checkpointed with its cache argument (the
    class attribute ``_can_checkpoint_with_cache`` of transformers' ``GradientCheckpointingLayer``,
    False there by default; not torch's, so not among ``PRIVATES``: a block without it is False)."""
    return bool(getattr(block, "_can_checkpoint_with_cache", False))
