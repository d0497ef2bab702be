"""A project written for Lightning's ``ModelParallelStrategy``, moved over by changing one import.

The LightningModule below follows Lightning's tensor-parallel guide: ``configure_model``
parallelizes a Llama-style network itself, tensor parallel with ``parallelize_module`` from
``self.device_mesh["tensor_parallel"]`` and FSDP2 with ``fully_shard`` from
``self.device_mesh["data_parallel"]``; the output layer keeps vocabulary-sharded logits, and the
loss and its backward run under ``loss_parallel()``. The only changed line:

    # from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning_disttrain.strategies import ModelParallelStrategy

What that adds: checkpoints as DCP directories with a manifest (verified on load, resumed exactly,
at any world size), ``ckpt_path="auto"`` and safe preemption, clipping over the mesh, and every
other lightning-disttrain callback. ``--lightning`` runs Lightning's own strategy instead, for a
side-by-side (the losses are the same).

    python examples/model_parallel_project.py --devices 2 --tp 2 --max-steps 8
    python examples/model_parallel_project.py --devices 4 --tp 2 --max-steps 8   # data_parallel=2
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, DIM, HEAD_DIM, LAYERS = 256, 64, 64, 16, 2


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # -1 heads: this rank's share
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def parallelize(model: Transformer, device_mesh) -> Transformer:
    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # for loss_parallel
        })
        for block in model.layers:
            parallelize_module(block, tp_mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            })
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


class LitTransformer(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer()

    def configure_model(self) -> None:
        parallelize(self.model, self.device_mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        with loss_parallel():
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss.full_tensor() if hasattr(loss, "full_tensor") else loss, prog_bar=True)
        return loss

    def backward(self, loss, *args, **kwargs):
        with loss_parallel():  # the parallel loss's backward runs under it too
            loss.backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def data(samples: int = 512) -> DataLoader:
    """Byte windows of a repeated text: learnable in a few steps."""
    text = ("The quick brown fox jumps over the lazy dog. " * (samples * (SEQ + 1) // 45 + 1)).encode()
    ids = torch.tensor(list(text[:samples * (SEQ + 1)]), dtype=torch.long).view(samples, SEQ + 1)
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=8)


def train(strategy_class, devices: int = 2, tp: int = 2, max_steps: int = 8,
          out: str = "model_parallel_run") -> L.Trainer:
    """Fit ``LitTransformer`` under ``strategy_class`` (Lightning's ``ModelParallelStrategy`` or ours)."""
    L.seed_everything(0)
    strategy = strategy_class(data_parallel_size=devices // tp, tensor_parallel_size=tp)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
                        default_root_dir=out, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(LitTransformer(), data())
    return trainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--lightning", action="store_true", help="Lightning's own ModelParallelStrategy")
    p.add_argument("--out", default="model_parallel_run")
    args = p.parse_args()
    if args.lightning:
        from lightning.pytorch.strategies import ModelParallelStrategy
    else:
        from lightning_disttrain.strategies import ModelParallelStrategy  # the one changed line
    trainer = train(ModelParallelStrategy, args.devices, args.tp, args.max_steps, args.out)
    if trainer.is_global_zero:
        print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    main()
