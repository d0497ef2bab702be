"""Peak tensor memory per rank while a strategy sets a model up (``configure_model`` through
``strategy.setup``: build, shard, materialise), for ``tests/strategies/test_setup_memory.py`` and
``benchmarks/bench_setup_memory.py``.

``LiveTensorBytes`` counts the bytes of every tensor storage an aten op creates on a real device
while it is active, and forgets each when its storage dies (a weak reference), so ``peak`` is the
most such bytes alive at once: the allocator's peak for tensors, temporaries between ops included
(not those inside one op, nor buffers that gloo allocates itself). ``SetupMemory`` enters it in the
callbacks' ``setup`` hook, which Lightning runs just before ``configure_model``, and leaves it in
``on_fit_start``, just after ``strategy.setup``; no step runs (``max_steps=0``).

Runs (2 ranks; GPTModule with the strategy's default ``empty_init``, the generic module with
``empty_init=True``, which it needs: by default it is built eagerly, as under Lightning):
- ``gpt``: GPTModule (layout-independent initialisation) under ``fsdp2``.
- ``generic``: a module built in ``configure_model`` from torch.nn layers, initialised by their
  ``reset_parameters()`` (plus one initialiser whose values depend on the rank), under ``fsdp2``.
- ``generic_replicas``: the same module replicated on both ranks (``dp_replicate=2``).
The generic runs also write their weights, gathered, to ``LDT_LAUNCH_OUT/setup_memory``.
"""

from __future__ import annotations

import os
import sys
import weakref
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightning_disttrain.strategies  # noqa: E402,F401  (registers fsdp2)
from lightning_disttrain import _torch_compat as torch_compat  # noqa: E402
from lightning_disttrain.module import GPTModule  # noqa: E402
from lightning_disttrain.parallel.materialize import _initialisers  # noqa: E402
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402

SEED = 11
GPT_MODEL = dict(n_layer=4, n_head=4, n_kv_head=4, n_embd=256, mlp_hidden=1024, block_size=64)
GPT_VOCAB = 4096
DIM, VOCAB = 256, 2048


class LiveTensorBytes(torch_compat.TorchDispatchMode):
    """Bytes of the tensor storages created while active and still alive: ``now`` and ``peak``."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._live: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch_compat.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(torch_compat.local_tensor(t))
        return out

    def _track(self, t: torch.Tensor) -> None:
        if t.is_meta:
            return
        storage = t.untyped_storage()
        key = id(storage)
        ref = self._live.get(key)
        if ref is not None and ref() is storage:
            return
        nbytes = storage.nbytes()
        self._live[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._free(key, nbytes))
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def _free(self, key: int, nbytes: int) -> None:
        self._live.pop(key, None)
        self.now -= nbytes


class SetupMemory(L.Callback):
    """``LiveTensorBytes`` from just before ``configure_model`` to just after ``strategy.setup``;
    ``meter``: optionally a ``benchmarks/memory_meter.ProcessMeter`` over the same window."""

    def __init__(self, meter=None) -> None:
        self.tracker, self.meter = LiveTensorBytes(), meter

    def setup(self, trainer, pl_module, stage):
        if self.meter is not None:
            self.meter.start()
            self.meter.begin_window("setup")
        self.tracker.__enter__()

    def on_fit_start(self, trainer, pl_module):
        self.tracker.__exit__(None, None, None)
        if self.meter is not None:
            self.meter.end_window("setup")


def model_facts(module: nn.Module) -> dict[str, int]:
    """fp32 bytes of the whole model (each shared parameter once), of its largest parameter, and
    of the largest set of parameters one initialiser writes (``materialize._initialisers``)."""
    params = {id(p): p for p in module.parameters()}.values()
    units = [{id(p): p for p in sub.parameters()}.values() for _, sub, _ in _initialisers(module)]
    return {"model_bytes": 4 * sum(p.numel() for p in params),
            "largest_param_bytes": 4 * max(p.numel() for p in params),
            "largest_unit_bytes": 4 * max((sum(p.numel() for p in u) for u in units), default=0)}


# ---- a module that is not layout independent -------------------------------------------------


class RankDependent(nn.Module):
    """An initialiser whose values depend on the rank (as an unseeded one would): replicas agree
    only if the strategy makes them rank 0's."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(DIM))

    def reset_parameters(self) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        nn.init.constant_(self.scale, 1.0 + rank)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)  # _reset_parameters writes out_proj.bias
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0] + self.mlp(h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(3)])
        self.gain = RankDependent()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x * self.gain.scale)


class Generic(L.LightningModule):
    """Builds ``Net`` in ``configure_model`` (under the strategy's init context)."""

    def __init__(self) -> None:
        super().__init__()
        self.net: Net | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = Net()

    def training_step(self, batch, batch_idx):
        raise AssertionError("setup only")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def gathered(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
            for n, t in list(module.named_parameters()) + list(module.named_buffers())}


def local(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: torch_compat.local_tensor(t).detach().cpu().clone() for n, t in module.named_parameters()}


def setup_only(module: L.LightningModule, strategy, devices: int, meter=None) -> tuple[L.Trainer, SetupMemory]:
    probe = SetupMemory(meter)
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=0, callbacks=[probe],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=[torch.zeros(1, 8, dtype=torch.long)])  # never read (max_steps=0)
    return trainer, probe


def fit_run(run: str, devices: int) -> dict:
    L.seed_everything(SEED)
    if run == "gpt":
        module = GPTModule("tiny", vocab_size=GPT_VOCAB, model_overrides=GPT_MODEL, schedule="constant", max_steps=1)
        trainer, probe = setup_only(module, "fsdp2", devices)
        return {"peak": probe.tracker.peak, **model_facts(module)}
    # Opted in (empty_init=True): a module whose initialisation is not layout independent is built
    # eagerly by default, as under Lightning's strategies (its weights are then the eager ones).
    strategy = NDParallelStrategy(dp_replicate=2, dp_shard=1, empty_init=True) if run == "generic_replicas" \
        else NDParallelStrategy(empty_init=True)
    trainer, probe = setup_only(Generic(), strategy, devices)
    module = trainer.lightning_module
    out = Path(os.environ["LDT_LAUNCH_OUT"]) / "setup_memory"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{run}.rank{trainer.global_rank}.pt"
    torch.save({"gathered": gathered(module.net), "local": local(module.net)}, path)
    return {"peak": probe.tracker.peak, **model_facts(module.net), "file": str(path),
            "seed": trainer.strategy._agreed_init_seed()}
