"""LightningModules written the way existing projects write them, trained under ``strategy="fsdp2"``.

    python existing_project_worker.py OUT_DIR DEVICES RUN [RUN ...]

Runs (``MODULES``):
- ``hf_gpt2``: Hugging Face ``GPT2LMHeadModel`` built in ``__init__`` with real weights; its head
  is tied to the token embedding (``transformer`` holds every parameter, ``lm_head`` refers to one).
- ``dict_blocks``: a torchtitan-style model whose blocks sit in an ``nn.ModuleDict`` keyed by
  layer index, with ``nn.MultiheadAttention`` inside.
- ``self_sharded``: the same model, sharded by the module itself in ``configure_model`` with
  ``fully_shard`` over ``self.device_mesh`` (a user coming from Lightning's ModelParallelStrategy).

Every run sees the same global batches; on W ranks rank r takes samples r, r+W, ... of each
global batch, so the mean of the ranks' losses is the single-process loss. Importable: the tests
run the single-process baselines in their own process with ``fit_run(run, devices=1)``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightning_disttrain.strategies  # noqa: E402,F401  (registers fsdp2)
from dist_utils import worker_main  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, STEPS, DIM = 96, 16, 8, 5, 32


class DictBlocksLM(nn.Module):
    """A pre-norm transformer whose layers are an ``nn.ModuleDict`` keyed "0", "1", ..."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm = nn.LayerNorm(DIM)
            self.attn = nn.MultiheadAttention(DIM, num_heads=4, batch_first=True)
            self.mlp_norm = nn.LayerNorm(DIM)
            self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.attn_norm(x)
            mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.mlp_norm(x))

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleDict({str(i): self.Block() for i in range(n_layers)})
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx) + self.pos_embeddings(torch.arange(idx.size(1), device=idx.device))
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))


class LM(L.LightningModule):
    """What a user writes: a network, a loss, AdamW. Records the per-step loss of its batch."""

    def __init__(self) -> None:
        super().__init__()
        self.model = self.build()
        self.losses: list[float] = []

    def build(self) -> nn.Module:
        return DictBlocksLM()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.logits(x).float().flatten(0, 1), y.flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


class HFGPT2(LM):
    def build(self) -> nn.Module:
        import transformers

        config = transformers.GPT2Config(n_layer=2, n_embd=DIM, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        return transformers.GPT2LMHeadModel(config)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits


class SelfSharded(LM):
    """Builds its network in ``configure_model`` and shards it there, as with ModelParallelStrategy."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.model: nn.Module | None = None
        self.losses = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = DictBlocksLM()  # under the strategy's init context: the same draws as LM's
        if self.device_mesh is None:  # a single device: nothing to shard
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["dp_shard"]
        for layer in self.model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


MODULES = {"hf_gpt2": HFGPT2, "dict_blocks": LM, "self_sharded": SelfSharded}


def _batches() -> TensorDataset:
    g = torch.Generator().manual_seed(4321)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class Data(L.LightningDataModule):
    def train_dataloader(self):
        data, world = _batches(), self.trainer.world_size
        if world > 1:  # rank r: samples r, r+W, ... of every global batch
            data = Subset(data, range(self.trainer.global_rank, len(data), world))
        return DataLoader(data, batch_size=GLOBAL_BATCH // world)


def fit_run(run: str, devices: int) -> dict:
    L.seed_everything(0)
    module = MODULES[run]()
    trainer = L.Trainer(strategy="fsdp2" if devices > 1 else "auto", devices=devices, accelerator="cpu",
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=Data())
    losses = torch.tensor(module.losses)
    if dist.is_initialized():
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    result = {"losses": losses.tolist()}
    if devices > 1:
        from torch.distributed.fsdp import FSDPModule

        model = module.model
        result.update(
            steps=trainer.strategy.parallelized_steps,
            fsdp_units=sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)),
            tied=(model.lm_head.weight is model.transformer.wte.weight) if run == "hf_gpt2" else None)
    return result


if __name__ == "__main__":
    worker_main(fit_run)
