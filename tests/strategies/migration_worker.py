"""A project written for Lightning's ModelParallelStrategy, run under Lightning's and under ours.

    python migration_worker.py OUT_DIR DEVICES RUN [RUN ...]

The module (``TPStyleLM``) is written the way Lightning's tensor-parallel docs write one: its
``configure_model`` parallelizes a Llama-style network itself with ``parallelize_module`` from
``self.device_mesh["tensor_parallel"]`` and ``fully_shard`` from ``["data_parallel"]``, the output
layer keeps vocabulary-sharded logits and the loss (and its backward) run under ``loss_parallel()``.

Runs (``RUNS``):
- ``lightning`` / ``ours``: Lightning's ``ModelParallelStrategy(dp, tp)`` / ours, same arguments.
- ``ours_tp_only``: the module applies only TP; ours shards it with FSDP2 over data_parallel.
- ``mixed_names``: the module uses our mesh names for TP (``"tp"``) and Lightning's for FSDP.
- ``resume_ours``: ours, saved at step 2, resumed by a second fit (steps 3-4).
- ``resume_lightning``: Lightning's strategy writes its sharded checkpoint at step 2; ours resumes it.
- ``example_lightning`` / ``example_ours``: examples/model_parallel_project.py's project (its
  ``train``) under Lightning's ``ModelParallelStrategy`` / ours: the final losses.
- ``fsdp1_style``: a plain module under our ``FSDPStrategy(auto_wrap_policy={Block},
  activation_checkpointing_policy={Block}, sharding_strategy="SHARD_GRAD_OP")``; ``ddp_style``:
  under our ``DDPStrategy(find_unused_parameters=True)``; ``single`` (1 device): their reference.

Every rank of one data-parallel replica sees the same batch (the strategies' samplers); the result
is the mean loss over the data-parallel ranks at each step.
"""

from __future__ import annotations

import os
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

VOCAB, SEQ, GLOBAL_BATCH, STEPS, DIM, HEAD_DIM = 64, 16, 8, 4, 32, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallel each rank holds its share of the heads.
        q, k, v = (w(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)
        self.w3 = nn.Linear(DIM, 2 * DIM, bias=False)

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
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def parallelize(model: Transformer, tp_mesh, dp_mesh, shard: bool = True) -> Transformer:
    """Lightning's documented recipe: TP per layer, then FSDP2 per block and the root."""
    from torch.distributed._tensor import Replicate, Shard
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })
        for block in model.layers:
            parallelize_module(block, tp_mesh, {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
            })
    if shard:
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


class TPStyleLM(L.LightningModule):
    """What a ModelParallelStrategy user writes."""

    def __init__(self, shard: bool = True, tp_dim: str = "tensor_parallel") -> None:
        super().__init__()
        self.shard, self.tp_dim = shard, tp_dim
        self.model = Transformer()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            parallelize(self.model, self.device_mesh[self.tp_dim], self.device_mesh["data_parallel"], self.shard)

    def training_step(self, batch, batch_idx):
        from torch.distributed.tensor.parallel import loss_parallel

        x, y = batch
        logits = self.model(x)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.losses.append(float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()))
        return loss

    def backward(self, loss, *args, **kwargs):
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():  # the parallel loss's backward must run under it too
            loss.backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


class PlainLM(L.LightningModule):
    """A module that does not parallelize itself (an FSDPStrategy / DDPStrategy project)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


class Data(L.LightningDataModule):
    def train_dataloader(self):
        g = torch.Generator().manual_seed(4321)
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        replicas, rank = 1, 0
        if self.trainer.world_size > 1:  # the strategy's data-parallel rank: TP ranks share a batch
            kwargs = self.trainer.strategy.distributed_sampler_kwargs
            replicas, rank = kwargs["num_replicas"], kwargs["rank"]
        # replica r: samples r, r+R, ... of each global batch, so step k covers samples 8k..8k+7;
        # a resumed fit (global_step restored before this runs) starts after what was trained
        start = self.trainer.global_step * GLOBAL_BATCH
        return DataLoader(Subset(data, range(start + rank, len(data), replicas)), batch_size=GLOBAL_BATCH // replicas)


def _strategy(kind: str, devices: int):
    dp, tp = (1, 2) if devices == 2 else (2, 2)
    if kind == "lightning":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    from lightning_disttrain.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    if kind == "fsdp1_style":
        return FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy={Block},
                            activation_checkpointing_policy={Block})
    if kind == "ddp_style":
        return DDPStrategy(find_unused_parameters=True)
    return ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)


def _fit(module: L.LightningModule, strategy, devices: int, max_steps: int = STEPS, ckpt_dir: Path | None = None,
         ckpt_path: str | None = None) -> list[float]:
    callbacks = []
    if ckpt_dir is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1,
                                         filename="step={step}", auto_insert_metric_name=False))
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=max_steps, logger=False,
                        enable_checkpointing=ckpt_dir is not None, callbacks=callbacks, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        use_distributed_sampler=False)
    trainer.fit(module, datamodule=Data(), ckpt_path=ckpt_path)
    losses = torch.tensor(module.losses)
    if dist.is_initialized():  # the mean over ranks: TP ranks hold their replica's loss, so it is the dp mean
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    module.trainer_used = trainer
    return losses.tolist()


def _example():
    """examples/model_parallel_project.py, imported (its ``train`` runs the user's project)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "model_parallel_project.py"
    spec = importlib.util.spec_from_file_location("model_parallel_project", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fit_run(run: str, devices: int) -> dict:
    if run in ("example_lightning", "example_ours"):  # the example's own project under each strategy
        if run == "example_lightning":
            from lightning.pytorch.strategies import ModelParallelStrategy
        else:
            from lightning_disttrain.strategies import ModelParallelStrategy
        out = Path(os.environ.get("LDT_LAUNCH_OUT", "/tmp")) / f"migration_{run}"
        trainer = _example().train(ModelParallelStrategy, devices, tp=2, max_steps=8, out=str(out))
        return {"loss": float(trainer.callback_metrics["train_loss"])}
    L.seed_everything(0)
    out = Path(os.environ.get("LDT_LAUNCH_OUT", "/tmp")) / f"migration_{run}_{devices}"
    if run == "single":
        return {"losses": _fit(PlainLM(), "auto", 1)}
    if run in ("fsdp1_style", "ddp_style"):
        module = PlainLM()
        losses = _fit(module, _strategy(run, devices), devices)
        return {"losses": losses, "steps": module.trainer_used.strategy.parallelized_steps}
    if run in ("lightning", "ours"):
        module = TPStyleLM()
        losses = _fit(module, _strategy(run, devices), devices)
        mesh = module.device_mesh
        return {"losses": losses, "mesh": {name: mesh[name].size() for name in ("data_parallel", "tensor_parallel")},
                "tp_ranks": sorted(dist.get_process_group_ranks(mesh["tensor_parallel"].get_group()))}
    if run == "ours_tp_only":
        module = TPStyleLM(shard=False)
        losses = _fit(module, _strategy("ours", devices), devices)
        return {"losses": losses, "steps": module.trainer_used.strategy.parallelized_steps}
    if run == "mixed_names":
        module = TPStyleLM(tp_dim="tp")
        return {"losses": _fit(module, _strategy("ours", devices), devices)}
    if run == "resume_ours":
        full = _fit(TPStyleLM(), _strategy("ours", devices), devices, ckpt_dir=out)
        L.seed_everything(0)
        resumed = _fit(TPStyleLM(), _strategy("ours", devices), devices, ckpt_path=str(out / "step=2.ckpt"))
        return {"full": full, "resumed": resumed}
    if run == "resume_lightning":
        full = _fit(TPStyleLM(), _strategy("lightning", devices), devices, ckpt_dir=out)
        L.seed_everything(0)
        resumed = _fit(TPStyleLM(), _strategy("ours", devices), devices, ckpt_path=str(out / "step=2.ckpt"))
        return {"full": full, "resumed": resumed, "files": sorted(p.name for p in (out / "step=2.ckpt").iterdir())}
    raise ValueError(run)


if __name__ == "__main__":
    worker_main(fit_run)
