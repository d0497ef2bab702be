"""One replica group's membership in a fault-tolerant run: torchft's ``Manager``, per step.

Plain torch + torchft, no Lightning. The strategy (``strategies/fault_tolerant_steps.py``) calls,
on every rank of the group, once per optimizer step and in this order:

1. ``begin_step()`` before the forward: asks the lighthouse for this step's quorum, in the
   background (torchft's async quorum), so that it overlaps the forward and backward.
2. The gradients (each rank's local shards) are averaged over the replica groups in the quorum,
   group rank k with group rank k of every other group. A group that is healing this step
   contributes zeros and is not counted (torchft), so the survivors' average is over the live
   groups only. Either during the backward, each FSDP unit's reduce-scatter output as FSDP
   produces it (``overlap_with(modules)``: FSDP's all-reduce hook, as torchtitan does), or
   ``average_gradients(params)`` after it, in flat buckets per dtype; ``average_gradients``
   checks that the hooks ran for every unit when they are on.
3. ``commit()``: True when every rank of the group saw the step's collectives succeed and the
   quorum has at least ``min_replicas`` groups; only then may the optimizer step. A group that
   joined this step receives its state here (``load_state_dict`` runs on the calling thread).

The state a joining group receives is what ``state_dict`` returned when the source group called
``begin_step``: the strategy builds it on the main thread before ``begin_step``, so torchft's
quorum thread only reads tensors that the main thread does not change before ``commit`` (FSDP2's
state-dict hooks would race a backward on another thread).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor

from .settings import FaultTolerance

log = logging.getLogger(__name__)
STATE_KEY = "lightning_disttrain"
BUCKET_BYTES = 256 * 2**20
"""Gradients averaged per collective: a bucket is a copy, so its size bounds the extra memory."""


def require_torchft():
    try:
        import torchft
    except ImportError as err:
        raise ImportError("fault_tolerance needs torchft: pip install 'lightning-disttrain[ft]' (or pip install "
                          "torchft), or leave fault_tolerance unset") from err
    return torchft


class _QuietReconfigure(logging.Filter):
    # torchft logs this warning on every quorum change of a CPU build (no NCCL flight recorder).
    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


class ReplicaGroup:
    """This launch's replica group in the quorum of ``settings.num_replica_groups`` groups."""

    def __init__(self, settings: FaultTolerance, *, rank: int, world_size: int, store_addr: str, store_port: int,
                 device: torch.device, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        torchft = require_torchft()
        self.settings = settings
        self.device = torch.device(device)
        timeout = timedelta(seconds=settings.timeout_s)
        # The cross-group group: gloo for CPU tensors, NCCL for CUDA ones (torchft's own
        # reconfigurable groups; the gradients it carries are on the device the backend serves).
        pg = torchft.ProcessGroupGloo(timeout=timeout) if self.device.type == "cpu" \
            else torchft.ProcessGroupNCCL(timeout=timeout)
        logging.getLogger("torchft.manager").addFilter(_QuietReconfigure())
        self._load, self._state = load_state_dict, state_dict
        self.heals = 0
        self.last_heal_s: Optional[float] = None
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=settings.min_replicas,
            use_async_quorum=True, timeout=timeout, quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
            connect_timeout=timedelta(seconds=settings.connect_timeout_s), rank=rank, world_size=world_size,
            store_addr=store_addr, store_port=store_port, lighthouse_addr=settings.lighthouse,
            replica_id=f"ldt_replica_{settings.replica_id}",
            # Every group builds identical initial weights from the seed (GPTModule's initialisation
            # is a function of the seed and the parameter names), so no group heals at step 0 and
            # every group's first batch counts, as in one HSDP run.
            init_sync=False)
        self.manager.register_state_dict_fn(STATE_KEY, self._load_timed, self._state)
        self.participants_now = 0
        self.quorum_wait_s = 0.0
        self.reduce_s = 0.0
        self._hooked_units = 0  # FSDP units whose all-reduce hook averages over the groups
        self.overlap_now = False  # set per step by the strategy: the hooks average in this backward
        self.hook_calls = 0  # this step's

    # -- the step ------------------------------------------------------------------------------

    def begin_step(self) -> None:
        self.manager.start_quorum()
        self.hook_calls, self.quorum_wait_s, self.reduce_s = 0, 0.0, 0.0

    def overlap_with(self, fsdp_modules: list) -> None:
        """Average each of ``fsdp_modules``' gradients over the groups in FSDP's all-reduce hook:
        right after that unit's reduce-scatter (after its HSDP all-reduce, on FSDP's all-reduce
        stream), while the backward of the units before it still runs. Active in the steps the
        strategy sets ``overlap_now``."""
        for module in fsdp_modules:
            module.set_all_reduce_hook(self._average_unit)
        self._hooked_units = len(fsdp_modules)

    @property
    def hooked(self) -> bool:
        return self._hooked_units > 0

    @torch.no_grad()
    def _average_unit(self, reduce_output: torch.Tensor) -> None:
        if not self.overlap_now:
            return
        start = time.perf_counter()
        if self.hook_calls == 0:
            self.participants_now = int(self.manager.num_participants())  # waits for the quorum if not known yet
            self.quorum_wait_s = time.perf_counter() - start
            start = time.perf_counter()
        # FSDP's reduce output lives where the cross-group backend's tensors must (the device: also
        # with cpu_offload, which moves gradients to the host after this hook).
        self.manager.allreduce(reduce_output).wait()
        self.hook_calls += 1
        self.reduce_s += time.perf_counter() - start

    @torch.no_grad()
    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Average every gradient (local shard) over the live replica groups, in place (unless the
        FSDP hooks did it in this step's backward: then check that every unit's did). Every rank
        of every participating group must call it once per step, also with no gradients at all
        (zeros then), or the other groups' collective waits for it until the timeout. Also with one
        participant: a group healing in this step is not counted but takes part in the all-reduce,
        which is how it receives the step's gradients."""
        if self.overlap_now:  # averaged in the backward, unit by unit
            if self.hook_calls != self._hooked_units:
                raise RuntimeError(
                    f"fault tolerance: {self.hook_calls} of the model's {self._hooked_units} FSDP units averaged their "
                    "gradients over the replica groups in this backward (a unit whose parameters got no gradient "
                    "this step is not reduced, so the groups' collectives no longer match); set "
                    "fault_tolerance.average_after_backward=true for a model with parameters unused in some steps")
            return
        start = time.perf_counter()
        self.participants_now = int(self.manager.num_participants())  # waits for the quorum if not known yet
        self.quorum_wait_s = time.perf_counter() - start
        for bucket in _buckets([p for p in params if p.requires_grad], BUCKET_BYTES):
            self._average_bucket(bucket)
        self.reduce_s = time.perf_counter() - start - self.quorum_wait_s  # with the wait for the slowest group

    def _average_bucket(self, group: list[torch.nn.Parameter]) -> None:
        dtype, device = _local(group[0]).dtype, _local(group[0]).device
        grads = [_local(p.grad) if p.grad is not None else None for p in group]
        flat = torch.cat([g.reshape(-1) if g is not None else torch.zeros(_local(p).numel(), dtype=dtype,
                                                                         device=device)
                          for p, g in zip(group, grads)])
        # The cross-group backend's device (NCCL: the GPU), also for gradients kept on the host
        # (cpu_offload): one copy there and back.
        wire = flat if flat.device.type == self.device.type else flat.to(self.device)
        self.manager.allreduce(wire).wait()
        if wire is not flat:
            flat.copy_(wire)
        offset = 0
        for p, g in zip(group, grads):
            shape = _local(p).shape
            chunk = flat[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
            if g is not None:
                g.copy_(chunk)
            elif bool(chunk.any()):  # another group's gradient for a parameter unused here
                p.grad = (DTensor.from_local(chunk.clone(), p.device_mesh, p.placements, run_check=False)
                          if isinstance(p, DTensor) else chunk.clone())

    @torch.no_grad()
    def same_start(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """At the run's first step (every group at step 0, none healing): whether this rank's
        parameters equal those of the same rank in every other group (their sum, and its square,
        averaged over the groups, must have no spread). True at any other step: the groups that
        skip it skip it together (a joining group heals instead)."""
        if self.manager.current_step() != 0 or not self.manager.is_participating() or self.participants_now < 2:
            return True
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            total += _local(p).detach().double().sum().to(self.device)
        stats = torch.stack([total, total.square()])
        self.manager.allreduce(stats).wait()  # the mean over the groups of x and of x^2: no spread iff all equal
        mean, mean_sq = float(stats[0]), float(stats[1])
        return abs(mean_sq - mean * mean) <= 1e-12 * max(1.0, mean * mean)

    def wait_for_quorum(self) -> int:
        """The number of groups taking part in this step's quorum, once it has formed."""
        return int(self.manager.num_participants())

    def commit(self) -> bool:
        return bool(self.manager.should_commit())

    # -- what the step's quorum was ------------------------------------------------------------

    @property
    def participating_rank(self) -> Optional[int]:
        """This group's index among the participants (None while it heals)."""
        return self.manager.participating_rank()

    @property
    def committed_steps(self) -> int:
        return int(self.manager.current_step())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    def _load_timed(self, state: Any) -> None:
        start = time.perf_counter()
        self._load(state)
        self.heals += 1
        self.last_heal_s = time.perf_counter() - start
        log.info("replica group %d healed from a live group in %.3f s", self.settings.replica_id, self.last_heal_s)


def _buckets(params: list[torch.nn.Parameter], limit: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype and device, at most ``limit`` bytes a bucket (one larger
    parameter is a bucket of its own)."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        local = _local(p)
        nbytes = local.numel() * local.element_size()
        last = out[-1][0] if out else None
        if last is None or (_local(last).dtype, _local(last).device) != (local.dtype, local.device) \
                or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
