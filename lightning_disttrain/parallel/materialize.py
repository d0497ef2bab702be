"""Initial weights: materialising a meta-device model, checking every tensor was initialised,
keeping shared (tied) parameters shared, and agreeing on rank 0's weights.

Plain torch, no Lightning. The strategy calls these around the transforms of ``recipe.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain import comm
from lightning_disttrain.models.param_init import local_part, param_seed


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


# ---- a meta-device build that is given real values ------------------------------------------


class _RealIntoMeta(torch_compat.TorchDispatchMode):
    def __init__(self, owner: str) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.is_meta and isinstance(src, torch.Tensor) and not src.is_meta:
                raise ValueError(
                    f"{self.owner}.configure_model copied real values (a checkpoint, pretrained weights) into a "
                    f"tensor built on the meta device, where they are lost: more than one rank shares the model, "
                    f"so the strategy builds it there by default. Load them in init_weights() (it runs after "
                    f"materialisation), or build eagerly with the strategy's empty_init=False")
        return func(*args, **kwargs)


def refuse_real_values_on_meta(owner: str) -> contextlib.AbstractContextManager:
    """Within the block, copying a real tensor into a meta tensor (``load_state_dict`` on a meta
    build: a no-op, the values silently gone when the module is materialised) raises instead.
    ``owner``: the module's class name, for the message."""
    return _RealIntoMeta(owner)


# ---- initialisation -------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> int | None:
    local = torch_compat.local_tensor(t)  # a DTensor's shard on this rank
    # A wrapper tensor subclass (torchao's float8 weight under FSDP) has no storage of its own: its
    # first inner tensor's is where an in-place op on it writes.
    while hasattr(type(local), "__tensor_flatten__"):
        inner, _ = local.__tensor_flatten__()
        if not inner:
            return None
        local = torch_compat.local_tensor(getattr(local, inner[0]))
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


def _initialisers(module: nn.Module) -> Iterator[tuple[str, nn.Module, Callable[[], None]]]:
    """(name, submodule, initialiser) in the order ``_reset_every_submodule`` runs them.

    A submodule's own init_weights covers its subtree (a Hugging Face model inside a
    LightningModule); else the module's reset_parameters, or torch.nn's private
    _reset_parameters for modules that have only that (nn.MultiheadAttention)."""
    covered: set[int] = set()
    for name, sub in module.named_modules():
        if id(sub) in covered:
            continue
        for attr in ("init_weights", "reset_parameters", None):
            fn = getattr(sub, attr, None) if attr else torch_compat.torch_nn_reset_parameters(sub)
            if callable(fn):
                yield name, sub, fn
                if attr == "init_weights":
                    covered.update(id(m) for m in sub.modules())
                break


def _reset_every_submodule(module: nn.Module) -> None:
    # Each initialiser runs from a generator state seeded by its module's name
    # (param_init.param_seed), so a pipeline stage holding only some modules gives them the
    # values the whole model would.
    for name, sub, fn in _initialisers(module):
        with _seeded_by_name(sub, name):
            fn()


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
        raise ValueError(_uninitialised_message(module, untouched))


def _uninitialised_message(module: nn.Module, untouched: list[str]) -> str:
    shown = ", ".join(untouched[:8]) + (f" and {len(untouched) - 8} more" if len(untouched) > 8 else "")
    return (f"{type(module).__name__} was built on the meta device, but nothing initialised {shown} after "
            f"materialisation: they hold uninitialised memory. Define init_weights() on "
            f"{type(module).__name__} that initialises every parameter and buffer (GPTModule shows how), or "
            f"give those modules a reset_parameters(), or build it eagerly (the strategy's empty_init=False; "
            f"its default builds on the meta device on more than one rank)")


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(itertools.chain(module.named_parameters(), module.named_buffers()))


def materialize_(module: nn.Module, device: torch.device | str,
                 buffer_device: torch.device | str | None = None,
                 init: Callable[[nn.Module], None] = init_weights) -> None:
    """Allocate a meta-device module's tensors and initialise them, keeping tied parameters tied.

    ``device``: where parameters live (the host when FSDP offloads them to CPU); buffers go to
    ``buffer_device`` (default: ``device``), since the forward uses them beside the activations.
    """
    _allocate(module, device, buffer_device)
    init(module)


def _allocate(module: nn.Module, device: torch.device | str, buffer_device: torch.device | str | None) -> None:
    # to_empty allocates each module's tensors (a DTensor: its shard only), splitting ties. Only
    # on the modules that own meta tensors: to_empty on the LightningModule would also reach its
    # torchmetrics Metrics, whose _apply replaces their states and the defaults reset() restores
    # with uninitialised memory (validation losses were garbage, differently on every run).
    ties = tied_parameters(module)
    for sub in module.modules():
        if any(t.is_meta for t in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))):
            sub.to_empty(device=device, recurse=False)
    retie_parameters(module, ties)
    if buffer_device is not None and torch.device(buffer_device) != torch.device(device):
        for sub in module.modules():
            for name, buf in list(sub.named_buffers(recurse=False, remove_duplicate=False)):
                if (moved := buf.to(buffer_device)) is not buf:
                    setattr(sub, name, moved)


# ---- initialisation after sharding, one initialiser at a time -------------------------------


def has_own_init(module: nn.Module) -> bool:
    """Whether ``module`` initialises itself as a whole (an ``init_weights()`` of its own): the
    initialiser then writes every tensor at once and cannot run one submodule at a time."""
    return callable(getattr(module, "init_weights", None))


def materialize_sharded_(module: nn.Module, device: torch.device | str,
                         buffer_device: torch.device | str | None = None,
                         draw_device: torch.device | str | None = None, group=None) -> None:
    """``materialize_`` for a module whose parameters are already sharded (FSDP2 / TP DTensors on
    the meta device) and whose initialisers are not layout independent (``reset_parameters()``...).

    Each rank allocates its shards, then runs the initialisers of ``_initialisers`` one at a time,
    in the order and with the seeds ``init_weights`` uses: during one, the DTensor parameters of its
    submodule stand in as full plain tensors on ``draw_device`` (empty, or gathered if an earlier
    initialiser wrote them: nn.MultiheadAttention's writes its out_proj's bias), every full tensor it
    wrote is broadcast from the rank ``0`` of ``group`` (None: no broadcast), each rank keeps its
    slice and the full tensors are freed. So the model equals, gathered, ``materialize_`` of the
    whole module on one process, replicas are rank 0's bitwise (also if an initialiser draws from an
    unseeded or rank-dependent source), and no rank holds more than its shards plus one submodule's
    full parameters (a submodule's ``init_weights()`` covers its subtree: all of it then). Plain
    tensors (buffers, parameters left unsharded) are written in place, then broadcast one at a time.
    An uninitialised tensor is the ``ValueError`` of ``init_weights``.
    """
    _allocate(module, device, buffer_device)
    draw = torch.device(draw_device) if draw_device is not None else None
    before = {name: (id(t), _storage_key(t)) for name, t in _named_tensors(module)}
    filled: set[int] = set()  # ids of the DTensor parameters some initialiser wrote
    written: set[int] = set()  # storages of plain tensors some initialiser wrote
    own = getattr(module, "init_weights", None) if has_own_init(module) else None
    units = [("", module, own)] if own is not None else list(_initialisers(module))
    with torch.no_grad():
        for name, sub, fn in units:
            # One initialiser per call: its full tensors are freed on return, before the next one's.
            written |= _initialise_one(name, sub, fn, fn is own, draw, filled, group)
        if group is not None:
            seen: set[int] = set()
            for t in itertools.chain(module.parameters(), module.buffers()):
                if id(t) not in seen and not isinstance(t, DTensor):
                    seen.add(id(t))
                    comm.broadcast(t.detach(), group_src=0, group=group)
    untouched = []
    sharded = {id(p) for p in module.parameters() if isinstance(p, DTensor)}
    for name, t in _named_tensors(module):
        if id(t) in sharded:
            if t.numel() and id(t) not in filled:
                untouched.append(name)
        elif (key := _storage_key(t)) is not None and key not in written and before.get(name) == (id(t), key):
            untouched.append(name)
    if untouched:
        raise ValueError(_uninitialised_message(module, untouched))


def _initialise_one(name: str, sub: nn.Module, fn: Callable[[], None], unseeded: bool,
                    draw: torch.device | None, filled: set[int], group) -> set[int]:
    """Run one initialiser of ``materialize_sharded_`` on full stand-ins of ``sub``'s DTensor
    parameters, keep each rank's slice of what it wrote (after the broadcast); the storages of
    plain tensors it wrote."""
    with _whole_parameters(sub, draw, filled) as stand_ins:
        tracker = _WriteTracker()
        # The module's own init_weights runs as init_weights() runs it: unseeded.
        with (contextlib.nullcontext() if unseeded else _seeded_by_name(sub, name)), tracker:
            fn()
        for param, full, places in stand_ins:
            now = getattr(places[0][0], places[0][1])
            if now is not full:  # the initialiser replaced the parameter: that is its value
                full = now
            elif _storage_key(full) not in tracker.written:
                continue
            if group is not None:
                comm.broadcast(full.detach(), group_src=0, group=group)
            local = torch_compat.local_tensor(param)
            local.copy_(local_part(full.detach(), param).to(local.device))
            filled.add(id(param))
    return tracker.written


@contextlib.contextmanager
def _whole_parameters(sub: nn.Module, device: torch.device | None, filled: set[int]):
    """Within the block, every DTensor parameter of ``sub``'s subtree is a plain full-size
    ``Parameter`` (every name of a tied one the same); yields ``[(dtensor, full, [(owner, attr)])]``
    and puts the DTensors back afterwards."""
    swaps: dict[int, tuple[torch.Tensor, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for qualified, p in sub.named_parameters(remove_duplicate=False):
        if not isinstance(p, DTensor):
            continue
        if id(p) not in swaps:
            where = device or torch_compat.local_tensor(p).device
            # Gathered when an earlier initialiser wrote it (this one may write part of it or none).
            data = (p.full_tensor().to(where) if id(p) in filled
                    else torch.empty(p.shape, dtype=p.dtype, device=where))
            swaps[id(p)] = (p, nn.Parameter(data, requires_grad=p.requires_grad), [])
        owner, _, attr = qualified.rpartition(".")
        swaps[id(p)][2].append((sub.get_submodule(owner) if owner else sub, attr))
    for _, full, places in swaps.values():
        for owner, attr in places:
            setattr(owner, attr, full)
    try:
        yield list(swaps.values())
    finally:
        for param, _, places in swaps.values():
            for owner, attr in places:
                setattr(owner, attr, param)


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
