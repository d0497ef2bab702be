"""The hybrid Muon optimizer under fsdp2 (DTensor gradients) vs one process: per-step losses.

    python multi_worker.py OUT_DIR DEVICES muon_worker:STRATEGY
"""

import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_disttrain import GPTModule  # noqa: E402  (registers fsdp2)

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 6, 8, 16, 64


class Losses(L.Callback):
    monitor = "train/loss"  # read at every step: GPTModule then logs (and averages) the loss every step

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train/loss"].item())  # sync_dist: the global mean


def fit_run(strategy: str, devices: int) -> dict:
    L.seed_everything(0)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    # Rank r takes slice r of every global batch (Lightning's own sampler would shuffle), so each
    # step's global batch is the same 8 samples as the one-process run's.
    rank, micro = int(os.environ.get("LOCAL_RANK", 0)), GLOBAL_BATCH // devices
    order = [s * GLOBAL_BATCH + rank * micro + i for s in range(STEPS) for i in range(micro)]
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=micro, sampler=order)
    module = GPTModule("tiny", vocab_size=VOCAB, optimizer="muon", lr=1e-3, muon_lr=0.02,
                       model_overrides=dict(n_layer=2, n_embd=32, n_head=2, block_size=SEQ))
    losses = Losses()
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=STEPS, callbacks=[losses],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, loader)
    return {"losses": losses.losses}
