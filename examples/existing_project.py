"""Adding lightning-disttrain to an existing Lightning project.

The LightningModule below is "yours": a small character-level transformer built from stock
``nn.TransformerEncoderLayer`` blocks, with no knowledge of lightning-disttrain. Three lines
change to scale it:

    trainer = L.Trainer(
        strategy=FSDP2Strategy(),                         # or "fsdp2" / "fsdp2_zero2" / "hsdp"
        callbacks=[SelectiveActivationCheckpointing(),    # op-level selective recompute per block
                   MFUMonitor(flops_per_token=...)],      # tokens/s, TFLOP/s, MFU under perf/*
        ...)

FSDP2 finds the unit to shard by itself (the largest ``nn.ModuleList`` of identical blocks); the
callback registers its transform with the strategy, which applies it before sharding. Under any
other strategy (``--strategy auto``) the same callbacks apply themselves.

    python examples/existing_project.py --devices 2 --strategy fsdp2 --max-steps 20
    python examples/existing_project.py --devices 1 --strategy auto
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_disttrain.callbacks import MFUMonitor, SelectiveActivationCheckpointing
from lightning_disttrain.strategies import FSDP2Strategy

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


class CharDataset(Dataset):
    """Fixed windows of a text file as byte ids (or of a built-in string when it is missing)."""

    def __init__(self, seq_len: int = 64):
        text = SHAKESPEARE.read_text() if SHAKESPEARE.exists() else (__doc__ or "") * 40
        self.data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int):
        chunk = self.data[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class CharTransformer(L.LightningModule):
    """An ordinary LightningModule: nothing here knows about FSDP or lightning-disttrain."""

    def __init__(self, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, seq_len: int = 64, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(256, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(n_layers))
        self.head = nn.Linear(d_model, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.size(1)]
        for layer in self.layers:
            h = layer(h, src_mask=self.mask[: x.size(1), : x.size(1)], is_causal=True)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def flops_per_token(self, seq_len: int) -> float:
        # 6 x (matmul parameters) + attention scores: the usual dense-transformer count.
        n = sum(p.numel() for name, p in self.named_parameters() if p.dim() == 2 and name != "pos" and "embed" not in name)
        h = self.hparams
        return 6 * n + 12 * h.n_layers * h.d_model * seq_len


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="fsdp2", help="fsdp2 | fsdp2_zero2 | hsdp | auto | ddp ...")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--out", default="runs/example")
    args = p.parse_args(argv)
    L.seed_everything(0)
    strategy = FSDP2Strategy() if args.strategy == "fsdp2" else args.strategy
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
        callbacks=[SelectiveActivationCheckpointing(policy="selective"), MFUMonitor(window=5)],
        logger=L.pytorch.loggers.CSVLogger(args.out), log_every_n_steps=5, enable_checkpointing=False,
        enable_progress_bar=False)
    model = CharTransformer()
    trainer.fit(model, DataLoader(CharDataset(), batch_size=8, shuffle=True))
    if trainer.is_global_zero:
        print(f"final train_loss {trainer.callback_metrics['train_loss'].item():.4f}")


if __name__ == "__main__":
    main()
