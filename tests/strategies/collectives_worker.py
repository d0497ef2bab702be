"""Every collective of each training step, by layout (issue 38); one process per rank, in the
suite's shared 4-rank launch (tests/conftest.py).

A ``GPTModule`` trains 6 steps (loggers read steps 3 and 6) under the package's defaults, with
the default ``PreemptionCheckpoint``. From each batch's start to the next one's (so the module's
own end-of-step logging is inside) ``Recorder`` records each collective with the global ranks of
its process group (torch.distributed's at the call, the functional ones in a dispatch mode), and
the dispatch mode counts the collective ops dispatched (c10d's and the functional ones) on its own. ``PreemptionCheckpoint.agreements`` says which steps agreed on a
stop (its one all-reduce over the world, on its cadence).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import worker_main  # noqa: E402
from lightning_disttrain import GPTModule  # noqa: E402
from lightning_disttrain.callbacks import PreemptionCheckpoint  # noqa: E402
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402

STEPS, LOG_EVERY, SEQ, VOCAB, GLOBAL_BATCH = 6, 3, 16, 64, 8
LAYOUTS = {"fsdp4": {}, "hsdp2x2": {"dp_replicate": 2}, "fsdp2_tp2": {"tp": 2}}


# torch.distributed's collectives take the group as a Python object (FSDP2 calls them through the
# module, ``dist.reduce_scatter_single(...)``); inside a dispatch mode the group is an opaque
# ScriptObject, so these are recorded at the Python call, with the group's global ranks.
DIST_COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
                    "reduce_scatter_tensor", "all_gather", "broadcast", "all_gather_object",
                    "broadcast_object_list", "all_to_all_single", "barrier", "reduce", "gather", "scatter",
                    "all_reduce_coalesced")


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


class Recorder:
    """Records (collective, its group's global ranks) for each torch.distributed collective called
    while ``active``, and each functional collective (DTensor's, TP's, EP's) dispatched."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        for name in DIST_COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        import functools
        import inspect

        # torch's own function's parameters: torch's logging decorators take *args, **kwargs, and
        # other workers of the launch wrap torch.distributed's functions too (fsdp2_worker counts
        # reduce_scatter_single), so read the signature from the c10d module, which no one wraps
        original = getattr(dist.distributed_c10d, name, fn)
        signature = inspect.signature(inspect.unwrap(original))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.active:
                group = signature.bind(*args, **kwargs).arguments.get("group")
                self.calls.append((name, _ranks(group)))
            return fn(*args, **kwargs)

        return wrapper


class Functional(TorchDispatchMode):
    """The functional collectives (group by name) among the ops dispatched, and a count of the c10d
    collective ops dispatched (each torch.distributed collective runs one; CommDebugMode counts
    these and the functional ones): it must equal the torch.distributed calls recorded, so that
    no collective escaped the record."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder
        self.dispatched = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":  # what runs on a backend (a functional collective runs one too)
            self.dispatched += 1
        if func.namespace in ("_c10d_functional", "_c10d_functional_autograd") and "wait" not in func.__name__ \
                and "wrap" not in func.__name__:
            names = [a.name for a in func._schema.arguments]
            name = kwargs.get("group_name", args[names.index("group_name")] if "group_name" in names else None)
            group = torch._C._distributed_c10d._resolve_process_group(name) if name else None
            self.recorder.calls.append((f"funcol.{func.__name__.split('.')[0]}", _ranks(group)))
        return func(*args, **kwargs)


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


class HostReads:
    """Counts calls of torch.Tensor's host-reading methods while active (on an accelerator each is
    a sync that keeps the host from running ahead; tests/test_host_syncs.py does the same in one
    process, where Lightning's multi-rank paths do not run)."""

    def __init__(self) -> None:
        self.active, self.count = False, 0
        self.on_host: list[torch.Tensor] = []  # kept on the host by design: their reads are not syncs
        for name in HOST_READS:
            setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))

    def _counting(self, original):
        def wrapper(tensor, *args, **kwargs):
            if self.active and not any(tensor is t for t in self.on_host):
                self.count += 1
            return original(tensor, *args, **kwargs)

        return wrapper


_ONCE: dict[type, object] = {}


def _once(cls):
    """One instance of ``cls`` per process: the runs of a launch share the wrapped functions."""
    if cls not in _ONCE:
        _ONCE[cls] = cls()
    return _ONCE[cls]


class PerStep(L.Callback):
    """From one batch's start to the next's: the collectives by group, and the dispatched count.
    (torch's CommDebugMode, entered here, failed in its module tracker's forward hook on this
    model: "IndexError: list index out of range" in ``_fw_set_module_hook``; it also needs the
    forward's start inside it. The dispatch count here is what it counts, the same ops.)"""

    def __init__(self):
        self.steps: list[dict] = []
        self.recorder = _once(Recorder)
        self.host_reads = _once(HostReads)
        self._modes = None

    def _close(self) -> None:
        if self._modes is None:
            return
        functional = self._modes
        functional.__exit__(None, None, None)
        self.recorder.active = self.host_reads.active = False
        self.steps.append({"calls": [[op, list(ranks)] for op, ranks in self.recorder.calls],
                           "dispatched": functional.dispatched, "host_reads": self.host_reads.count})
        self._modes = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._close()
        self.recorder.calls, self.recorder.active = [], True
        self.host_reads.count, self.host_reads.active = 0, True
        # torch's AdamW keeps each parameter's step count on the host unless capturable or fused
        self.host_reads.on_host = [state["step"] for optimizer in trainer.optimizers
                                   for state in optimizer.state.values() if "step" in state]
        self._modes = Functional(self.recorder)
        self._modes.__enter__()

    def on_train_end(self, trainer, pl_module):
        self._close()


def fit_run(run: str, devices: int) -> dict:
    L.seed_everything(0)
    degrees = LAYOUTS[run]
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    replicas = devices // degrees.get("tp", 1)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=GLOBAL_BATCH // replicas)
    module = GPTModule("tiny", vocab_size=VOCAB, lr=1e-3, schedule="constant",
                       model_overrides=dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=2, mlp_hidden=64,
                                            block_size=SEQ))
    per_step, preemption = PerStep(), PreemptionCheckpoint()
    trainer = L.Trainer(strategy=NDParallelStrategy(**degrees), devices=devices, accelerator="cpu",
                        max_steps=STEPS, log_every_n_steps=LOG_EVERY, callbacks=[preemption, per_step],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, loader)
    counts = [Counter(op for op, _ in s["calls"]) for s in per_step.steps]
    return {"steps": per_step.steps, "ops": [dict(c) for c in counts], "world": devices,
            "agreement_steps": [a.step for a in preemption.agreements],
            "losses": float(trainer.callback_metrics["train/loss"])}


if __name__ == "__main__":
    worker_main(fit_run)
