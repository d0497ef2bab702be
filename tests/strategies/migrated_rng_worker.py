"""A project that initialises its weights late, under Lightning's strategies and under ours (issue 40).

    python migrated_rng_worker.py OUT_DIR DEVICES RUN [RUN ...]

The module (``LateInitLM``) is the common shape of a Lightning tensor-parallel project: a
Llama-style network with dropout, built under ``trainer.init_module(empty_init=True)`` (the meta
device under a model-parallel strategy), parallelized by the module itself in ``configure_model``
(TP from ``self.device_mesh["tensor_parallel"]``, ``fully_shard`` from ``["data_parallel"]``) or
left to the strategy, and initialised by its own ``init_weights()`` in ``on_train_start`` (or in
its first ``training_step``, before the forward). ``init_weights`` draws each full tensor from the
global generator and keeps this rank's part, so a layout changes where values live, not what they
are: any two layouts over the same data-parallel ranks train alike if, and only if, their global
streams are where Lightning's strategy leaves them.

Runs, ``{strategy}_{init}`` (init: ``start`` = ``on_train_start``, ``fwd`` = the first step):
- 2 ranks: ``lmp`` / ``mp``: Lightning's / our ``ModelParallelStrategy(1, 2)`` (dp1 x tp2, the
  module parallelizes itself); ``lmp1`` / ``mp1``: the same at dp2 x tp1; ``lddp`` / ``ddp``:
  Lightning's / our ``DDPStrategy`` (dp2, the strategy parallelizes); ``fsdp``: our
  ``FSDPStrategy(auto_wrap_policy={Block})`` (ZeRO-3 over 2 ranks: the arithmetic of ``lddp``;
  Lightning's own FSDPStrategy refuses a CPU accelerator).
- ``ddp_start_unseeded``: our ``DDPStrategy``, each rank seeded differently (no ``seed_everything``).
- 4 ranks: ``lmp`` / ``mp`` at dp2 x tp2; ``lddp`` at dp4 and ``hsdp``: our ``NDParallelStrategy(
  dp_replicate=2, dp_shard=2)`` (HSDP: the arithmetic of DDP over 4 ranks).

Each rank returns the data-parallel mean loss per step, a hash of its global CPU generator's state
at each hook (``configure_model``, ``on_fit_start``, ``on_train_start``, the first forward), and
each parameter's local block (its place in the full tensor and a hash of its bytes) right after
the module's own initialisation.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import worker_main  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, STEPS, DIM, HEAD_DIM, DROPOUT = 32, 8, 8, 4, 16, 4, 0.2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention = Attention()
        self.w1, self.w2 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(2 * DIM, DIM, bias=False)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.w2(F.silu(self.w1(self.ffn_norm(x)))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every full tensor from the global stream (norms around 1), this rank keeps its part."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for name, p in self.named_parameters():
            full = torch.randn(p.shape) * (0.1 if "norm" in name else 0.05) + (1.0 if "norm" in name else 0.0)
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(full)


def parallelize(model: Transformer, tp_mesh, dp_mesh) -> None:
    """Lightning's documented recipe: TP per layer, then FSDP2 per block and the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        for block in model.layers:
            parallelize_module(block, tp_mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "w1": ColwiseParallel(), "w2": RowwiseParallel()})
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def _stream() -> str:
    return hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def _blocks(module: nn.Module) -> dict[str, list]:
    """Each parameter's local block: [offsets, sizes, hash of its bytes]."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(p, DTensor):
            chunk = p.__create_chunk_list__()[0]
            where = [list(chunk.offsets), list(chunk.sizes)]
        else:
            where = [[0] * p.dim(), list(p.shape)]
        data = local.detach().contiguous().numpy().tobytes()
        out[name] = [*where, hashlib.sha256(data).hexdigest()[:16]]
    return out


class LateInitLM(L.LightningModule):
    def __init__(self, self_parallel: bool, init_at: str) -> None:
        super().__init__()
        self.self_parallel, self.init_at = self_parallel, init_at
        self.model = Transformer()
        self.losses: list[float] = []
        self.streams: dict[str, str] = {}
        self.blocks: dict[str, list] = {}

    def _init(self) -> None:
        self.model.init_weights()
        self.blocks = _blocks(self.model)

    def configure_model(self) -> None:
        self.streams["configure_model"] = _stream()
        if self.self_parallel:
            parallelize(self.model, self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"])

    def on_fit_start(self) -> None:
        self.streams["on_fit_start"] = _stream()

    def on_train_start(self) -> None:
        self.streams["on_train_start"] = _stream()
        if self.init_at == "start":
            self._init()

    def training_step(self, batch, batch_idx):
        from torch.distributed.tensor.parallel import loss_parallel

        if not self.losses:
            self.streams["first_forward"] = _stream()
            if self.init_at == "fwd":
                self._init()
        x, y = batch
        logits = self.model(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.losses.append(float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()))
        return loss

    def backward(self, loss, *args, **kwargs):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss.backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Data(L.LightningDataModule):
    """The global batch of step k is samples 8k..8k+7; a data-parallel rank takes every R-th
    (from its own generator: the global streams are the strategies' business)."""

    def train_dataloader(self):
        g = torch.Generator().manual_seed(4321)
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
        kwargs = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        replicas, rank = kwargs["num_replicas"], kwargs["rank"]
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        return DataLoader(Subset(data, range(rank, len(data), replicas)), batch_size=GLOBAL_BATCH // replicas)


def _strategy(kind: str, devices: int):
    tp = 1 if kind.endswith("1") else 2
    dp, kind = devices // tp, kind.rstrip("1")
    if kind == "lmp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    if kind == "lddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    from lightning_disttrain.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, NDParallelStrategy

    if kind == "mp":
        return ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    if kind == "ddp":
        return DDPStrategy()
    if kind == "fsdp":
        return FSDPStrategy(auto_wrap_policy={Block})
    if kind == "hsdp":
        return NDParallelStrategy(dp_replicate=2, dp_shard=2)
    raise ValueError(kind)


def fit_run(run: str, devices: int) -> dict:
    kind, init_at, *unseeded = run.split("_")
    if unseeded:  # every process its own seed, as processes that nobody seeded
        torch.seed()
    else:
        L.seed_everything(42)
    trainer = L.Trainer(strategy=_strategy(kind, devices), devices=devices, accelerator="cpu", max_steps=STEPS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    with trainer.init_module(empty_init=True):
        module = LateInitLM(self_parallel=kind.rstrip("1") in ("lmp", "mp"), init_at=init_at)
    trainer.fit(module, datamodule=Data())
    losses = torch.tensor(module.losses)
    dist.all_reduce(losses)  # every rank of a data-parallel replica holds its replica's loss
    return {"losses": (losses / dist.get_world_size()).tolist(), "streams": module.streams,
            "blocks": module.blocks}


if __name__ == "__main__":
    worker_main(fit_run)
