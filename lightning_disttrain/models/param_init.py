"""Initial weights that do not depend on the layout: each parameter is drawn from a generator of
its own, seeded by the run's seed and the parameter's name.

Drawing every weight from one global RNG stream ties the values to the order of the draws, which
the layout changes: a pipeline stage that holds blocks 4-7 only would give block 4 the values one
process gives the embedding, a rank that materialises its FSDP shard would draw that shard's
numbers from the start of the stream, and a meta-device build draws nothing at construction where
an eager one draws ``nn.Linear``'s defaults. Here a parameter's values are a function of
``(seed, name, shape, dtype, device type)`` only: the full tensor is drawn from its own generator
(on ``draw_device``) and each rank keeps its shard of it. So a model built eagerly on one process
and the same model built on the meta device and materialised under any FSDP / TP / PP / EP
layout, with or without CPU offload, hold bitwise the same weights (gathered).

Names are the module's own ``named_parameters`` names below the model (``blocks.3.attn.wq.weight``),
which stay the same when a pipeline split keeps only some blocks. The cost is one full-size draw
per parameter per rank, one parameter at a time (an embedding of a 7B model: ~0.5 GB, briefly); the
rank keeps a view of its block of it, so setting a model up holds its shards plus that one draw.

Plain torch, no Lightning.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator

import torch

_seed: int | None = None
_draw_device: torch.device | None = None


@contextlib.contextmanager
def init_settings(seed: int | None = None, draw_device: torch.device | str | None = None) -> Iterator[None]:
    """Within the block, ``base_seed()`` is ``seed`` and full tensors are drawn on ``draw_device``.

    Strategies set both around materialisation: the seed the ranks agreed on, and the device an
    eager build would have used (the accelerator even when parameters are offloaded to the host,
    since a CPU generator and a CUDA generator give different numbers for the same seed).
    """
    global _seed, _draw_device
    saved = (_seed, _draw_device)
    _seed = seed if seed is not None else _seed
    _draw_device = torch.device(draw_device) if draw_device is not None else _draw_device
    try:
        yield
    finally:
        _seed, _draw_device = saved


def base_seed() -> int:
    """The seed initialisation derives from: the one set by ``init_settings``, else the global
    generator's initial seed (what ``torch.manual_seed`` / ``L.seed_everything`` set)."""
    return _seed if _seed is not None else torch.initial_seed() & ((1 << 63) - 1)


def derived_seed(seed: int, key: str) -> int:
    """A 63-bit seed for ``key`` under ``seed``, stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def param_seed(name: str, seed: int | None = None) -> int:
    """The seed of the tensor called ``name`` (``derived_seed`` of ``base_seed()`` by default)."""
    return derived_seed(base_seed() if seed is None else seed, name)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def fill_(param: torch.Tensor, name: str, draw: Callable[[torch.Tensor, torch.Generator], None]) -> None:
    """Write into ``param`` (a plain tensor or a DTensor) this rank's part of a full tensor that
    ``draw(full, generator)`` fills, with the generator seeded by ``param_seed(name)``.

    A meta tensor is left alone (a meta build is initialised again after materialisation).
    """
    local = _local(param)
    if local.is_meta:
        return
    device = _draw_device or local.device
    full = torch.empty(param.shape, dtype=param.dtype, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(param_seed(name))
    draw(full, generator)
    part = local_part(full, param) if hasattr(param, "device_mesh") else full
    local.copy_(part.to(local.device))


def local_part(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``, the whole value of the DTensor ``param``; no communication.

    A view when the shard is one block of the full tensor (``Shard`` / ``Replicate`` placements:
    FSDP2, TP, HSDP), so keeping it costs no copy (a rank then holds its shards plus one full
    parameter at most); else ``distribute_tensor``'s copy (strided shards of FSDP x TP on one dim).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if all(type(p) in (Shard, Replicate) for p in param.placements):
        chunk = param.__create_chunk_list__()[0]  # this rank's block: offsets and sizes per dim
        return full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))]
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


def normal_(param: torch.Tensor, name: str, std: float, mean: float = 0.0) -> None:
    """``nn.init.normal_``, drawn as ``fill_`` describes."""
    fill_(param, name, lambda full, g: full.normal_(mean, std, generator=g))


def uniform_(param: torch.Tensor, name: str, low: float, high: float) -> None:
    """``nn.init.uniform_``, drawn as ``fill_`` describes."""
    fill_(param, name, lambda full, g: full.uniform_(low, high, generator=g))


@contextlib.contextmanager
def no_global_draws() -> Iterator[None]:
    """Leave the global generators as they were: module constructors (``nn.Linear``'s default
    init) draw from them on an eager build and not on a meta build, which would shift every later
    draw (dropout, data) between the two. Covers the CPU generator and, when the default device
    is an accelerator, that device's."""
    default = torch.get_default_device()
    devices = []
    if default.type == "cuda":
        devices = [default.index if default.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices, device_type=default.type if devices else "cuda"):
        yield


def layout_independent_init(module: torch.nn.Module) -> bool:
    """Whether ``module`` initialises every weight through ``models.param_init`` (a generator per
    parameter name: the values do not depend on the layout, the order of draws or the ranks)."""
    return bool(getattr(module, "layout_independent_init", False))
