"""Fault-tolerant training across replica groups inside ``L.Trainer`` (``NDParallelStrategy(
fault_tolerance=FaultTolerance(...))``): the Lightning side of ``fault_tolerance/replicas.py``.

Each replica group is its own launch; within it the strategy runs FSDP2 / TP / PP / CP as usual.
Per optimizer step, on every rank of the group:

* ``on_train_batch_start`` (the first micro-batch of the step): the state a joining group would
  copy is captured on the main thread (model and optimizer state by reference, LR schedulers, the
  fit loop's counters, the data position, the fault-tolerance counters), then the quorum starts
  in the background.
* ``optimizer_step``: the closure (forward, backward) runs, the gradients are averaged over the
  live groups, and the step commits or not; only then does Lightning's precision plugin clip and
  step. An uncommitted step drops the gradients (the optimizer skips parameters without one), so
  the weights stay those of the last committed step; the loop still counts the batch, and the LR
  schedulers still step, identically in every group.
* A group that joins (fresh, or relaunched after a crash) heals inside its first commit: it loads
  its peer's captured state, moves the fit loop's counters and the data position to the peer's,
  and applies the step's averaged gradients, so it leaves the step with the survivors' weights.

Data: the data-parallel world is every rank of every *possible* group (``num_replica_groups``);
group g reads its slice of each global batch. A missing group's slices are skipped (not given to
the survivors), the data position advances by the whole global batch every step, and the loggers
get ``ft/samples_trained`` and ``ft/samples_skipped``. The survivors' gradient is the mean over
the samples that were trained on (a smaller batch), the schedule follows the step count.

Checkpoints: only the group that is participant 0 of the step's quorum writes (and prunes) the
DCP checkpoints, so one replica writes at a time; the others skip the save. Below
``min_replicas`` live groups the step is not committed, and the run saves a checkpoint and stops.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain import comm
from lightning_disttrain.fault_tolerance.settings import FaultTolerance



def _fsdp_units(module: torch.nn.Module) -> list:
    """The FSDP units of ``module`` that manage parameters of their own (each reduces them in one
    reduce-scatter and calls its all-reduce hook once per backward): a parameter belongs to its
    innermost enclosing unit."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[int, torch.nn.Module] = {}

    def walk(m: torch.nn.Module, unit: Optional[torch.nn.Module]) -> None:
        unit = m if isinstance(m, FSDPModule) else unit
        if unit is not None and any(True for _ in m.parameters(recurse=False)):
            units[id(unit)] = unit
        for child in m.children():
            walk(child, unit)

    walk(module, None)
    return list(units.values())


def work_done_marker(device: torch.device) -> Any:
    """A CUDA event recorded in ``device``'s current stream (``synchronize()`` waits until the work
    enqueued before it has run), or None where the host runs the work itself (CPU: done already)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class FaultTolerantStepMixin:
    """Mixed into ``NDParallelStrategy`` before the other step mixins. Inactive (every method
    passes through) unless ``fault_tolerance`` is set. Reads ``parallel_dims``, ``optimizers``,
    ``lr_scheduler_configs``, ``lightning_module``, ``cluster_environment`` and ``root_device``."""

    fault_tolerance: Optional[FaultTolerance] = None
    _replicas = None
    _ft_capture: Optional[dict[str, Any]] = None
    _ft_capture_ready: Any = None
    _ft_step_open: bool = False
    _ft_stop_step: Optional[int] = None
    _ft_last_participants: Optional[int] = None
    _ft_most_seen: int = 0
    ft_metrics: Optional[dict[str, float]] = None
    """The last step's fault-tolerance metrics (also logged under ``ft/``)."""

    # -- construction-time checks ----------------------------------------------------------

    def _check_fault_tolerance_layout(self, dims) -> None:
        if self.fault_tolerance is not None and dims.dp_replicate > 1:
            raise ValueError(f"fault_tolerance with dp_replicate={dims.dp_replicate}: with fault tolerance the "
                             f"replicas are separate launches (replica groups), so set dp_replicate=1 and start "
                             f"fault_tolerance.num_replica_groups={self.fault_tolerance.num_replica_groups} groups "
                             f"(lightning-disttrain ft-local tries it on one machine)")

    # -- the data-parallel world ------------------------------------------------------------

    @property
    def evaluation_sampler_kwargs(self) -> dict[str, int]:
        """(num_replicas, rank) for validation and test: this group's own data-parallel ranks, so
        that every group evaluates the whole validation set, as one job would."""
        dims = self.parallel_dims
        return {"num_replicas": dims.dp_size, "rank": dims.dp_rank}

    def _ft_data_parallel(self, dp_size: int, dp_rank: int) -> tuple[int, int]:
        """(size, rank) among the data-parallel ranks of every replica group the run may have."""
        ft = self.fault_tolerance
        if ft is None:
            return dp_size, dp_rank
        return dp_size * ft.num_replica_groups, ft.replica_id * dp_size + dp_rank

    # -- setup and teardown -------------------------------------------------------------------

    def _ft_setup(self, trainer) -> None:
        """Join the run's replica groups (fit only): checks, then torchft's Manager."""
        ft = self.fault_tolerance
        if ft is None or self._replicas is not None:
            return
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError("fault_tolerance needs automatic optimization (one optimizer step per batch, gated by "
                             "the quorum); this LightningModule sets automatic_optimization=False")
        if len(self.optimizers) != 1:
            raise ValueError(f"fault_tolerance supports one optimizer; configure_optimizers returned "
                             f"{len(self.optimizers)}")
        config = getattr(module, "config", None)
        if getattr(config, "moe_num_experts", 0):
            raise ValueError("fault_tolerance with a mixture-of-experts model is not supported yet: the routers' "
                             "load-balancing biases are updated from each replica group's own loads, so the groups "
                             "would drift apart; use a dense model (moe_num_experts=0) or no fault_tolerance")
        datamodule = getattr(trainer, "datamodule", None)
        if not (callable(getattr(datamodule, "seek", None)) and hasattr(datamodule, "consumed_samples")):
            raise ValueError("fault_tolerance needs a datamodule whose position a joining replica group can take "
                             "from its peers (consumed_samples and seek(n), as TokenDataModule has); pass one as "
                             "trainer.fit(model, datamodule=...)")
        from lightning_disttrain.fault_tolerance.lighthouse import LighthouseUnreachable, check_reachable
        from lightning_disttrain.fault_tolerance.replicas import ReplicaGroup

        # Rank 0 of the group looks, every rank raises the same error: no rank waits on a
        # Manager whose peers gave up.
        problem = None
        if self.global_rank == 0:
            try:
                check_reachable(ft.lighthouse, ft.connect_timeout_s)
            except LighthouseUnreachable as err:
                problem = str(err)
        problem = comm.broadcast_object(problem, group_src=0)
        if problem is not None:
            raise LighthouseUnreachable(problem)
        env = self.cluster_environment
        self._replicas = ReplicaGroup(ft, rank=self.global_rank, world_size=self.world_size,
                                      store_addr=env.main_address, store_port=env.main_port, device=self.root_device,
                                      state_dict=self._ft_state, load_state_dict=self._ft_heal)
        if not ft.average_after_backward and not self.parallel_dims.pp_enabled:
            # Each FSDP unit's gradient is averaged over the groups inside the backward, as soon as
            # FSDP reduced it (its all-reduce hook), overlapped with the backward of the units
            # before it. Not under pipeline parallel: its schedule reduces on its own terms.
            self._replicas.overlap_with(_fsdp_units(module))
        self._ft_stats = {"samples_trained": 0, "samples_skipped": 0, "uncommitted_steps": 0}
        self._ft_capture, self._ft_stop_step, self._ft_last_participants, self._ft_most_seen = None, None, None, 0
        self._ft_committed_once = False  # this process saw a committed step (agreed group-wide by should_commit)
        rank_zero_info(f"fault tolerance: replica group {ft.replica_id} of {ft.num_replica_groups} "
                       f"(lighthouse {ft.lighthouse}, min_replicas={ft.min_replicas})")

    def _ft_teardown(self) -> None:
        if self._replicas is not None:
            self._replicas.shutdown()
            self._replicas = None

    # -- the step ------------------------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._replicas is not None:  # after a checkpoint's restore: where this fit's data starts
            self._ft_consumed_before = int(compat.trainer_of(self.lightning_module).datamodule.consumed_samples)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._replicas is None or self._ft_step_open:
            return  # a later micro-batch of the same optimizer step
        self._ft_step_open = True
        trainer = compat.trainer_of(self.lightning_module)
        # Captured before the quorum starts: torchft's thread may hand it to a joining group at
        # once. Tensors by reference: the optimizer changes them only after the commit, and torchft
        # blocks the commit while a transfer is being served.
        # On a GPU the previous step's optimizer kernels may still be queued: torchft copies the
        # tensors on a stream of its own, so a heal waits for this event (all work enqueued up to
        # here, the last optimizer step included) before serving them (_ft_state).
        self._ft_capture_ready = work_done_marker(self.root_device)
        self._ft_capture = {
            "model": self.lightning_module.state_dict(),
            "optimizer": self.optimizers[0].state_dict(),
            "schedulers": [config.scheduler.state_dict() for config in self.lr_scheduler_configs],
            "position": compat.training_position(trainer),
            "consumed_samples": int(trainer.datamodule.consumed_samples),
            "stats": dict(self._ft_stats),
        }
        self._replicas.begin_step()
        # The hooks average each micro-batch's reduce-scatter: with sharded gradient accumulation
        # that would be k cross-group all-reduces a step; then once, after the backward, instead.
        accumulate = max(1, int(trainer.accumulate_grad_batches))
        self._replicas.overlap_now = self._replicas.hooked and (accumulate == 1 or self.accumulate_unsharded_grads)
        if self._ft_most_seen < self.fault_tolerance.min_replicas:
            self._ft_wait_for_min_replicas()

    def _ft_wait_for_min_replicas(self) -> None:
        """Before min_replicas groups have met once (the run's start, groups launched at different
        times): close each quorum this group forms alone without a step, and ask again, so that
        its first batch, step count and data position wait for the others instead of running ahead
        (uncommitted) of them."""
        replicas, wanted, told = self._replicas, self.fault_tolerance.min_replicas, False
        while True:
            seen = replicas.wait_for_quorum()
            self._ft_most_seen = max(self._ft_most_seen, seen)
            if seen >= wanted:
                return
            if not told:
                rank_zero_info(f"fault tolerance: waiting for {wanted} replica groups (min_replicas); {seen} in the "
                               f"quorum")
                told = True
            replicas.commit()  # not committed (too few): closes this quorum
            time.sleep(0.1)
            replicas.begin_step()

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        if self._replicas is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        replicas = self._replicas
        outcome: dict[str, Any] = {}

        def gated_closure() -> Any:
            result = closure()  # forward and backward (all micro-batches' gradients accumulated)
            params = list(self.lightning_module.parameters())
            replicas.average_gradients(params)
            # Until this group's first committed step: a flag of this process, the same on every rank
            # of the group (should_commit agrees group-wide), unlike torchft's step count, which a heal
            # that failed on one rank would leave behind there (that rank alone would then enter the
            # group all-reduce below).
            if not self._ft_committed_once:
                self._ft_check_same_start(params)
            outcome["committed"] = replicas.commit()  # a joining group heals in here (_ft_heal)
            self._ft_committed_once = self._ft_committed_once or outcome["committed"]
            if not outcome["committed"]:
                for p in params:
                    p.grad = None  # the optimizer skips them: no update from an uncommitted step
            return result

        try:
            return super().optimizer_step(optimizer, gated_closure, model, **kwargs)
        finally:
            self._ft_step_open = False
            if "committed" in outcome:
                self._ft_after_step(outcome["committed"])

    def _ft_check_same_start(self, params: list) -> None:
        """The groups build their initial weights each from its own seed (torchft's init_sync would
        instead drop every group's first batch but one): at the first step, refuse to train on if
        they differ, on every rank (agreed within the group; every group sees the same spread)."""
        differs = torch.tensor([0.0 if self._replicas.same_start(params) else 1.0])
        comm.all_reduce(differs, "max")
        if differs.item():
            raise ValueError("fault tolerance: the replica groups start from different weights; give every group the "
                             "same seed (seed_everything: N in the YAML, L.seed_everything(N) in code) and a model "
                             "whose initialisation depends only on it")

    def _ft_after_step(self, committed: bool) -> None:
        replicas, ft, stats = self._replicas, self.fault_tolerance, self._ft_stats
        trainer = compat.trainer_of(self.lightning_module)
        participants = replicas.participants_now
        consumed = int(trainer.datamodule.consumed_samples)
        step_samples, self._ft_consumed_before = consumed - self._ft_consumed_before, consumed
        trained = step_samples * participants // ft.num_replica_groups if committed else 0
        stats["samples_trained"] += trained
        stats["samples_skipped"] += step_samples - trained
        stats["uncommitted_steps"] += 0 if committed else 1
        if participants != self._ft_last_participants:
            missing = ft.num_replica_groups - participants
            rank_zero_info(f"fault tolerance: {participants} of {ft.num_replica_groups} replica groups in the quorum "
                           f"at step {trainer.global_step}" + (
                               f"; the share of the {missing} missing group(s), {step_samples - trained} of "
                               f"{step_samples} samples per step, is skipped until they rejoin" if missing else ""))
            self._ft_last_participants = participants
        metrics = {"ft/live_replicas": participants, "ft/committed": int(committed), "ft/heals": replicas.heals,
                   "ft/quorum_wait_ms": 1e3 * replicas.quorum_wait_s, "ft/allreduce_ms": 1e3 * replicas.reduce_s,
                   # FSDP units whose gradient was averaged over the groups inside the backward
                   "ft/units_averaged_in_backward": replicas.hook_calls if replicas.overlap_now else 0,
                   "ft/committed_steps": replicas.committed_steps, "ft/last_heal_ms": 1e3 * (replicas.last_heal_s or 0.0),
                   **{f"ft/{k}": v for k, v in stats.items()}}
        self.ft_metrics = metrics
        # Below min_replicas only after that many were seen: a group that reaches the lighthouse
        # before the others trains (uncommitted) until they arrive instead of stopping at once.
        self._ft_most_seen = max(self._ft_most_seen, participants)
        if participants < ft.min_replicas <= self._ft_most_seen and self._ft_stop_step is None:
            rank_zero_info(f"fault tolerance: {participants} live replica group(s), fewer than min_replicas="
                           f"{ft.min_replicas}: the step was not applied; saving a checkpoint and stopping")
            self._ft_stop_step = trainer.global_step
            trainer.should_stop = True
        # Straight to the loggers at the steps Lightning writes its own metrics (this step is not
        # counted yet), not through self.log every step (Lightning's result collection per call;
        # the metrics are host numbers already).
        if trainer.loggers and compat.loggers_write_step(trainer, trainer.global_step + 1):
            for logger in trainer.loggers:
                logger.log_metrics({name: float(value) for name, value in metrics.items()}, step=trainer.global_step)

    # -- healing -------------------------------------------------------------------------------

    def _ft_state(self) -> dict[str, Any]:
        """What a joining group copies (torchft's quorum thread calls it on the source group)."""
        if self._ft_capture is None:
            raise RuntimeError("fault tolerance: asked for this replica group's state before its first step")
        if self._ft_capture_ready is not None:
            self._ft_capture_ready.synchronize()  # the captured tensors hold the last step's values
        return self._ft_capture

    def _ft_heal(self, state: dict[str, Any]) -> None:
        """Take a live group's state, inside this step's commit (on the main thread)."""
        trainer = compat.trainer_of(self.lightning_module)
        from lightning_disttrain.fault_tolerance.state import model_state_here, optimizer_state_here

        mine = self._ft_capture
        # On this rank's devices and meshes: torchft sends every tensor through host memory.
        self.lightning_module.load_state_dict(model_state_here(state["model"], self.lightning_module))
        self.optimizers[0].load_state_dict(optimizer_state_here(state["optimizer"], self.optimizers[0]))
        for config, scheduler_state in zip(self.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(scheduler_state)
        compat.move_training_position(trainer, state["position"], mine["position"])
        datamodule = trainer.datamodule
        moved = state["consumed_samples"] - mine["consumed_samples"]
        datamodule.seek(int(datamodule.consumed_samples) + moved)
        self._ft_consumed_before += moved  # this step's samples are counted from the peer's position
        self._ft_stats = dict(state["stats"])
        rank_zero_info(f"fault tolerance: replica group {self.fault_tolerance.replica_id} healed from a live group: "
                       f"now at step {trainer.global_step}, global sample {datamodule.consumed_samples}")

    # -- checkpoints: one replica group writes -------------------------------------------------

    def writes_checkpoints(self) -> bool:
        """Whether this process's saves are written: with fault tolerance one replica group writes
        the run's checkpoints at a time (participant 0 of the step's quorum), the others skip them;
        always without it."""
        if self._replicas is None:
            return True
        if self._ft_capture is None:  # before the first quorum: the first group
            return self.fault_tolerance.replica_id == 0
        return self._replicas.participating_rank == 0

    def _ft_on_train_end(self) -> None:
        if self._replicas is None or self._ft_stop_step is None:
            return
        trainer = compat.trainer_of(self.lightning_module)
        callback = getattr(trainer, "checkpoint_callback", None)
        directory = getattr(callback, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        path = os.path.join(str(directory), f"ft-stopped-step={trainer.global_step}.ckpt")
        trainer.save_checkpoint(path, weights_only=False)  # a full checkpoint: says so (Lightning notes an unset flag)
        if self.writes_checkpoints():
            rank_zero_info(f"fault tolerance: below min_replicas, saved {path}")

