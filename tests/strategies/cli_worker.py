"""``lightning-disttrain`` CLI entry for the strategy tests, with a tiny data module and a reporter.

    python cli_worker.py fit --config run.yaml

Same as the console script (``lightning_disttrain.cli.main``); this file only adds classes the
YAML can name by ``class_path: cli_worker.X`` (the script's folder is on ``sys.path``).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset


class RandomTokenData(L.LightningDataModule):
    """Random token sequences; Lightning shards them with the strategy's distributed_sampler_kwargs."""

    def __init__(self, vocab_size: int = 64, seq_len: int = 16, batch_size: int = 4, samples: int = 64):
        super().__init__()
        self.vocab_size, self.seq_len, self.batch_size, self.samples = vocab_size, seq_len, batch_size, samples

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab_size, (self.samples, self.seq_len + 1), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=self.batch_size)


class ReportStrategy(L.Callback):
    """Writes, per rank, which strategy the CLI built and how training went."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module) -> None:
        s = trainer.strategy
        report = {
            "strategy": type(s).__name__,
            "reshard_after_forward": getattr(s, "reshard_after_forward", None),
            "dims": s.parallel_dims.degrees if hasattr(s, "parallel_dims") else None,
            "sampler": s.distributed_sampler_kwargs,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "loss": float(trainer.callback_metrics["train/loss"]),
        }
        rank = dist.get_rank() if dist.is_initialized() else 0
        Path(self.out_dir, f"cli.rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    from lightning_disttrain.cli import main

    main()
