"""Peak memory per rank of gradient accumulation under FSDP2, measured, for
``test_accumulation_memory.py`` (runs in the suite's shared 2-rank launch, tests/conftest.py).

``fit_run(RUN, DEVICES)`` trains ``GPTModule("tiny", vocab_size=257)`` (fp32, AdamW, clipping 1.0)
through ``L.Trainer`` under ``NDParallelStrategy(accumulate_unsharded_grads=RUNS[RUN])`` with
``accumulate_grad_batches=ACCUMULATE`` for ``STEPS`` optimizer steps, and measures the last step's
accumulation window with ``LiveTensorBytes``.

How memory is measured on CPU (torch 2.13 has no allocator statistics for the CPU, and
``torch.distributed._tools.mem_tracker.MemTracker`` refuses a module called more than once per
tracker: one micro-batch): ``LiveTensorBytes`` is a ``TorchDispatchMode`` that sees every aten op
(forward, autograd's backward, the optimizer, FSDP's copies and c10d collectives), records each
CPU storage among the op's inputs and outputs (weakly: a storage freed drops out) and, after the
op, sums ``nbytes()`` over every storage recorded: the bytes of live tensor storages. Summing the
sizes each time (not adding allocations) follows FSDP2, which frees and re-allocates its gathered
parameters by resizing their storage in place (``free_storage`` / ``alloc_storage``), outside any
op. What it does not see: memory outside tensors (Python objects, gloo's own buffers) and a
storage no op touched inside the window, so the window starts by recording the module's
parameters, their gradients and the optimizer state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.weak import WeakIdKeyDictionary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import worker_main  # noqa: E402

from lightning_disttrain.parallel.activation import settled  # noqa: E402

SEQ = 64
MICRO = 4
"""Sequences per micro-batch and rank."""
ACCUMULATE = 4
STEPS = 2
VOCAB = 257
RUNS = {"accum_sharded": False, "accum_unsharded": True}
"""Run -> ``accumulate_unsharded_grads``."""


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of live CPU tensor storages, after every op: ``now`` and the ``peak`` since ``reset``
    (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.peak = 0

    def record(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                t = t.to_local() if hasattr(t, "to_local") else t
                self.storages[t.untyped_storage()] = True

    @property
    def now(self) -> int:
        return sum(s.nbytes() for s in list(self.storages.keys()))

    def reset(self) -> None:
        self.peak = self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(tree_flatten((args, kwargs, out))[0])
        self.peak = max(self.peak, self.now)
        return out


class Meter(L.Callback):
    """Measures the last optimizer step's accumulation window: the peak over it (forward, backward,
    clipping, AdamW of every micro-batch) and the bytes held after each micro-batch but the last."""

    def __init__(self) -> None:
        self.mode = LiveTensorBytes()
        self.window = (STEPS - 1) * ACCUMULATE
        self.between: list[int] = []
        self.peak = 0
        self.check: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != self.window:
            return
        self.check = self_check()
        self.mode.__enter__()
        optimizer = trainer.optimizers[0]
        self.mode.record([p for p in pl_module.parameters()] + [p.grad for p in pl_module.parameters()]
                         + [v for state in optimizer.state.values() for v in state.values()])
        self.mode.reset()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx < self.window:
            return
        if batch_idx < self.window + ACCUMULATE - 1:
            # once gloo's threads have dropped a collective's buffers (one CI run read 3 x 64 KiB +
            # 1 KiB more on one rank after the first micro-batch than every other run did)
            self.between.append(settled(lambda: self.mode.now, 2.0))
            return
        self.peak = self.mode.peak
        self.mode.__exit__(None, None, None)


def self_check() -> dict:
    """The meter on known tensors: 10 MB alive, then freed; 4 MB resized away in place."""
    with LiveTensorBytes() as mode:
        base = mode.now
        a = torch.ones(10**7, dtype=torch.uint8)
        alive = mode.now - base
        b = torch.zeros(4 * 10**6, dtype=torch.uint8) + 1
        b.untyped_storage().resize_(0)  # FSDP's free_storage
        torch.add(b[:0], 0)
        resized = mode.now - base
        del a, b
        freed = mode.now - base
    return {"alive": alive, "resized": resized, "freed": freed}


def fit_run(name: str, devices: int) -> dict:
    import torch.distributed as dist

    from lightning_disttrain.module import GPTModule
    from lightning_disttrain.strategies import NDParallelStrategy

    L.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (STEPS * ACCUMULATE * MICRO * devices, SEQ + 1), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), batch_size=MICRO)
    module = GPTModule("tiny", vocab_size=VOCAB, model_overrides={"block_size": SEQ})
    meter = Meter()
    strategy = NDParallelStrategy(accumulate_unsharded_grads=RUNS[name])
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=STEPS,
                        accumulate_grad_batches=ACCUMULATE, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[meter])
    trainer.fit(module, loader)
    return {"peak": meter.peak, "between": meter.between, "check": meter.check, "world": dist.get_world_size(),
            "accumulate_unsharded_grads": trainer.strategy.accumulate_unsharded_grads,
            "local_params": sum(p.to_local().numel() for p in module.parameters()),
            "params": sum(p.numel() for p in module.parameters())}


if __name__ == "__main__":
    worker_main(fit_run)
