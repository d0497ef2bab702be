"""Initial weights: materialising a meta-device model, checking every tensor was initialised,
keeping shared (tied) parameters shared, and agreeing on rank 0's weights.

Plain torch, no Lightning. The strategy calls these around the transforms of ``recipe.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable

import torch
import torch.nn as nn

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain import comm
from lightning_disttrain.models.param_init import param_seed


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def dtensor_rng_supported(mesh) -> bool:
    """Whether DTensor's random ops initialise a shard as the slice of one full random tensor on
    this mesh (CUDA-like devices). Elsewhere each rank would draw its shard from its local RNG."""
    with warnings.catch_warnings():  # it warns on every unsupported mesh; the answer is enough
        warnings.simplefilter("ignore")
        return torch_compat.is_rng_supported_mesh(mesh)


# ---- shared parameters ----------------------------------------------------------------------


def tied_parameters(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one ``Parameter`` (a tied embedding and head, ...)."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie_parameters(module: nn.Module, groups: list[list[str]]) -> None:
    """Make every name of each group refer to the first name's parameter again.

    ``to_empty`` (materialising a meta model) allocates a new tensor per module, splitting ties.
    """
    for first, *others in groups:
        shared = module.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, attr, shared)


def check_ties(module: nn.Module, groups: list[list[str]]) -> None:
    """Raise if a group of names recorded by ``tied_parameters`` no longer shares one parameter."""
    broken = [names for names in groups if len({id(module.get_parameter(n)) for n in names}) > 1]
    if broken:
        raise RuntimeError(
            f"shared parameters were split while parallelizing the model: {broken}; they would train "
            f"as separate weights. Keep modules that share a parameter in one FSDP unit (see "
            f"ParallelPlan.fsdp_groups) or untie them explicitly")


# ---- initialisation -------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> int | None:
    local = torch_compat.local_tensor(t)  # a DTensor's shard on this rank
    if local.is_meta or local.numel() == 0:
        return None
    return local.untyped_storage().data_ptr()


class _WriteTracker(torch_compat.TorchDispatchMode):
    """Records the storage of every tensor an op writes in place (``normal_``, ``copy_``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(torch_compat.op_schema(func).arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in torch_compat.tree_leaves(value):
                    if isinstance(t, torch.Tensor) and (key := _storage_key(t)) is not None:
                        self.written.add(key)
        return func(*args, **kwargs)


def _reset_every_submodule(module: nn.Module) -> None:
    # A submodule's own init_weights covers its subtree (a Hugging Face model inside a
    # LightningModule); else the module's reset_parameters, or torch.nn's private
    # _reset_parameters for modules that have only that (nn.MultiheadAttention).
    # Each runs from a generator state seeded by its module's name (param_init.param_seed), so a
    # pipeline stage holding only some modules gives them the values the whole model would.
    covered: set[int] = set()
    for name, sub in module.named_modules():
        if id(sub) in covered:
            continue
        for attr in ("init_weights", "reset_parameters", None):
            fn = getattr(sub, attr, None) if attr else torch_compat.torch_nn_reset_parameters(sub)
            if callable(fn):
                with _seeded_by_name(sub, name):
                    fn()
                if attr == "init_weights":
                    covered.update(id(m) for m in sub.modules())
                break


@contextlib.contextmanager
def _seeded_by_name(sub: nn.Module, name: str):
    devices = {torch_compat.local_tensor(t).device for t in itertools.chain(sub.parameters(), sub.buffers())}
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.manual_seed(param_seed(f"module/{name}"))
        yield


def init_weights(module: nn.Module) -> None:
    """(Re)initialise ``module`` in place, e.g. after ``to_empty``, and check that nothing was left
    uninitialised.

    Uses the module's own ``init_weights()`` when it has one (GPTModule, GPT); otherwise each
    submodule's ``init_weights()`` (covering its subtree), ``reset_parameters()`` or, for torch.nn
    modules such as ``nn.MultiheadAttention``, ``_reset_parameters()``. Every parameter and buffer
    must then have been written (or replaced): one that no initialiser touched still holds the
    garbage of ``torch.empty``, so a ``ValueError`` names it instead of training on it.
    """
    before = {name: (id(t), _storage_key(t)) for name, t in _named_tensors(module)}
    tracker = _WriteTracker()
    with torch.no_grad(), tracker:
        own = getattr(module, "init_weights", None)
        if callable(own):
            own()
        else:
            _reset_every_submodule(module)
    untouched = [name for name, t in _named_tensors(module)
                 if (key := _storage_key(t)) is not None and key not in tracker.written
                 and before.get(name) == (id(t), key)]
    if untouched:
        shown = ", ".join(untouched[:8]) + (f" and {len(untouched) - 8} more" if len(untouched) > 8 else "")
        raise ValueError(
            f"{type(module).__name__} was built on the meta device, but nothing initialised {shown} after "
            f"materialisation: they hold uninitialised memory. Define init_weights() on "
            f"{type(module).__name__} that initialises every parameter and buffer (GPTModule shows how), or "
            f"give those modules a reset_parameters()")


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(itertools.chain(module.named_parameters(), module.named_buffers()))


def materialize_(module: nn.Module, device: torch.device | str,
                 buffer_device: torch.device | str | None = None,
                 init: Callable[[nn.Module], None] = init_weights) -> None:
    """Allocate a meta-device module's tensors and initialise them, keeping tied parameters tied.

    ``device``: where parameters live (the host when FSDP offloads them to CPU); buffers go to
    ``buffer_device`` (default: ``device``), since the forward uses them beside the activations.
    """
    ties = tied_parameters(module)
    module.to_empty(device=device)
    retie_parameters(module, ties)
    if buffer_device is not None and torch.device(buffer_device) != torch.device(device):
        for sub in module.modules():
            for name, buf in list(sub.named_buffers(recurse=False, remove_duplicate=False)):
                if (moved := buf.to(buffer_device)) is not buf:
                    setattr(sub, name, moved)
    init(module)


# ---- agreeing on rank 0's weights -----------------------------------------------------------


@torch.no_grad()
def broadcast_module_(module: nn.Module, group_src: int = 0, group=None) -> None:
    """Overwrite every parameter and buffer with the group's rank ``group_src``'s (before sharding:
    full tensors). ``comm.broadcast`` stages each tensor that lives elsewhere than the group's
    device (NCCL carries only CUDA tensors; a module built in ``__init__`` is on the host) one at
    a time, so the device never holds more than one extra tensor."""
    seen: set[int] = set()
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        comm.broadcast(t.detach(), group_src=group_src, group=group)
