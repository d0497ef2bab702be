"""Every collective the package issues, on the device its process group's backend expects.

NCCL (and the other accelerator backends) carry only tensors on the accelerator; gloo carries
host tensors. gloo lets any tensor through, so a CPU tensor handed to a collective passes every
CPU test and crashes the first GPU run (a generator state, a norm of CPU-offloaded gradients, a
flag built on the host). This module is the one place where package code meets
``torch.distributed``'s collectives, and it makes that mistake impossible by construction: each
tensor is staged onto ``group_device(group)`` when it lives elsewhere, and the result is copied
back into the caller's tensor. ``tests/test_comm_seam.py`` fails if code outside this module calls
a ``torch.distributed`` collective directly.

Object collectives (``broadcast_object``, ``all_gather_object``) are torch's own, which serialise
onto the right device themselves; they are here so that every collective has one address.

Plain torch, no Lightning: the models layer uses it too (the MoE balancing counts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_disttrain import _torch_compat as torch_compat

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_HOST_BACKENDS = ("gloo", "mpi", "fake")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (the same number without a group)."""
    return group_rank if group is None or not is_distributed() else dist.get_global_rank(group, group_rank)


def backend_device(backend: str) -> torch.device:
    """Where tensors must be for a collective of ``backend``: the host for gloo / MPI, else the
    current accelerator device (NCCL: ``cuda:<current>``; XCCL, HCCL, ...: their accelerator)."""
    backend = str(backend).lower()
    if backend in _HOST_BACKENDS:
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is None:
        raise RuntimeError(f"process-group backend {backend!r} needs an accelerator, and this process has none")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device ``group``'s collectives carry tensors on (None: the default group)."""
    return backend_device(dist.get_backend(group))


_SIDE_GROUPS: dict = {}  # purpose -> (the default group it was made for, the group or None)


def _side_group(purpose: str, reuse_default: bool) -> dist.ProcessGroup | None:
    default = dist.group.WORLD
    made = _SIDE_GROUPS.get(purpose)
    if made is None or made[0] is not default:  # first call, or a new default group
        host = reuse_default and str(dist.get_backend()).lower() in _HOST_BACKENDS
        _SIDE_GROUPS[purpose] = (default, None if host else dist.new_group(backend="gloo"))
    return _SIDE_GROUPS[purpose][1]


def host_group() -> dist.ProcessGroup | None:
    """A group of every rank whose collectives carry host tensors: the default group when its
    backend is a host one (gloo), else a gloo group over the same ranks, made once per default
    group (every fit in the process shares it). For control flags (the preemption agreement): a
    4-byte all-reduce on the host does not wait for the accelerator's queue, where the same flag
    over NCCL needs a device sync to read. Collective the first time: every rank must call it at
    the same point."""
    return _side_group("host", reuse_default=True)


def checkpoint_group() -> dist.ProcessGroup:
    """A gloo group of every rank for checkpoint collectives, made once per default group (every
    fit and every checkpoint writer in the process shares it). Its own group, not ``host_group``'s:
    an asynchronous save runs its collectives from a background thread, and two threads issuing
    collectives on one group may pair them differently on different ranks. Collective the first
    time."""
    group = _side_group("checkpoint", reuse_default=False)
    assert group is not None
    return group


def _staged(tensor: torch.Tensor, group) -> torch.Tensor:
    device = group_device(group)
    if tensor.device == device and tensor.is_contiguous():
        return tensor
    return tensor.to(device=device, copy=True).contiguous()


def _land(tensor: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor


@torch.no_grad()
def all_reduce(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In place over ``group`` (``op``: ``"sum"``, ``"max"`` or ``"min"``); returns ``tensor``.
    A no-op when torch.distributed is not initialised."""
    if op not in _OPS:
        raise ValueError(f"op={op!r}: use one of {sorted(_OPS)}")
    if not is_distributed():
        return tensor
    staged = _staged(tensor, group)
    dist.all_reduce(staged, op=_OPS[op], group=group)
    return _land(tensor, staged)


@torch.no_grad()
def broadcast(tensor: torch.Tensor, group_src: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In place: every rank of ``group`` gets the tensor of the group's rank ``group_src``."""
    if not is_distributed():
        return tensor
    staged = _staged(tensor, group)
    dist.broadcast(staged, src=global_rank(group, group_src), group=group)
    return _land(tensor, staged)


def broadcast_object(obj: Any, group_src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """A picklable object from the group's rank ``group_src``, on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=global_rank(group, group_src), group=group)
    return box[0]


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, in group-rank order."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if not is_distributed():
        return
    device = group_device(group)
    if device.type == "cuda":  # NCCL's barrier needs the device, or it guesses (and warns)
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def all_to_all_single(tensor: torch.Tensor, output_split_sizes: list[int] | None,
                      input_split_sizes: list[int] | None, group) -> torch.Tensor:
    """Functional ``all_to_all_single`` (autograd flows through it: its backward is the reverse
    exchange), waited on. ``group``: a process group or a 1-D ``DeviceMesh``. A tensor that lives
    elsewhere than the group's device goes there and its result comes back (differentiably)."""
    funcol = torch_compat.funcol()
    device = group_device(group.get_group() if hasattr(group, "get_group") else group)
    staged = tensor if tensor.device == device else tensor.to(device)
    out = funcol.all_to_all_single(staged, output_split_sizes, input_split_sizes, group)
    out = funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out
    return out if out.device == tensor.device else out.to(tensor.device)


@torch.no_grad()
def ring_shift(tensors: list[torch.Tensor], group) -> Callable[[], list[torch.Tensor]]:
    """Start sending ``tensors`` to the next rank of ``group``'s ring (group rank ``r`` to
    ``r + 1 mod size``) while receiving the previous rank's (the same shapes and dtypes) into new
    buffers; return ``wait()``, which waits for both and gives the received tensors. Point-to-point,
    one ``batch_isend_irecv`` per call: the transfer runs while the caller computes (ring
    attention's next key/value chunk). ``group``: a process group or a 1-D ``DeviceMesh``. A tensor
    that lives elsewhere than the group's device travels through a staged copy and comes back to
    its device."""
    pg = group.get_group() if hasattr(group, "get_group") else group
    size, me = dist.get_world_size(pg), dist.get_rank(pg)
    device = group_device(pg)
    home = [t.device for t in tensors]
    staged = [t if t.device == device and t.is_contiguous() else t.to(device).contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in staged]
    ops = [dist.P2POp(dist.isend, t, group=pg, group_peer=(me + 1) % size) for t in staged]
    ops += [dist.P2POp(dist.irecv, t, group=pg, group_peer=(me - 1) % size) for t in received]
    works = dist.batch_isend_irecv(ops) if ops else []

    def wait() -> list[torch.Tensor]:
        for work in works:
            work.wait()
        staged.clear()  # held until here: the sends read them until they complete
        return [t if t.device == d else t.to(d) for t, d in zip(received, home)]

    return wait


@torch.no_grad()
def all_to_all_packed(sends: list[torch.Tensor], recv_numels: list[int],
                      group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """One ``all_to_all_single`` of a list: ``sends[d]`` (any shape, possibly empty; one dtype
    for all) goes to the group's rank ``d``; returns the 1-D tensors received, ``recv_numels[s]``
    elements from rank ``s``, on the device of ``sends[0]``. One collective however uneven the
    pieces (the sizes are the caller's to know on both sides: no size exchange). Muon's owner
    exchange (``parallel/muon.py``). Without torch.distributed: ``[sends[0]]`` flattened."""
    if len(sends) != len(recv_numels):
        raise ValueError(f"{len(sends)} pieces to send but {len(recv_numels)} sizes to receive")
    home = sends[0].device
    if not is_distributed():
        return [sends[0].reshape(-1)]
    if len(sends) != dist.get_world_size(group):
        raise ValueError(f"{len(sends)} pieces for a group of {dist.get_world_size(group)} ranks")
    device = group_device(group)
    send = torch.cat([s.reshape(-1).to(device) for s in sends])
    recv = torch.empty(sum(recv_numels), dtype=send.dtype, device=device)
    dist.all_to_all_single(recv, send, output_split_sizes=list(recv_numels),
                           input_split_sizes=[s.numel() for s in sends], group=group)
    return list(recv.to(home).split(list(recv_numels)))
