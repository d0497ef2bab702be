"""What ``e2e_plain.py`` and ``e2e_lightning.py`` share of ``bench_end_to_end.py``'s recipe: the
model and sampler modules loaded without ``lightning_disttrain``'s Lightning layer, the learning
rate schedule and the data loaders. Importing it runs nothing."""

from __future__ import annotations

import importlib.util
import math
import sys


def _bare_package(name: str) -> None:
    """Put package ``name`` in ``sys.modules`` without running its ``__init__``, so that its
    submodules import on their own."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    sys.modules[name] = importlib.util.module_from_spec(spec)


def bare_imports():
    """``(GPT, GPTConfig, GlobalSampleSampler, TokenWindows)``: ``models/gpt.py`` and
    ``data/sampling.py`` and what they import (torch, numpy, the package's plain-torch helpers);
    ``lightning_disttrain/__init__.py``, which imports Lightning, does not run."""
    _bare_package("lightning_disttrain")
    _bare_package("lightning_disttrain.data")
    from lightning_disttrain.data.sampling import GlobalSampleSampler, TokenWindows
    from lightning_disttrain.models.gpt import GPT, GPTConfig

    return GPT, GPTConfig, GlobalSampleSampler, TokenWindows


def lr_lambda(warmup: int, total: int, min_ratio: float = 0.1):
    """Linear warmup over ``warmup`` steps, then cosine to ``min_ratio`` at ``total``."""
    def f(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def optimizer_and_schedule(parameters, lr: float, weight_decay: float, warmup: int, steps: int):
    """AdamW (betas 0.9/0.95, weight decay on 2-D weights only, fused as ``lightning_disttrain.optim``
    builds it on CPU and CUDA since 2026-12-04; foreach before) and its ``lr_lambda`` schedule,
    stepped every optimizer step."""
    import torch

    params = [p for p in parameters if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, steps))


def loaders(args):
    """The training and validation loaders of ``TokenDataModule``'s order for one process (dp 1,
    rank 0): ``args.train`` / ``args.val`` shards, ``args.seq``, ``args.batch``, ``args.seed``, the first
    ``args.val_batches`` validation batches."""
    from torch.utils.data import DataLoader

    _, _, GlobalSampleSampler, TokenWindows = bare_imports()
    train, val = TokenWindows(args.train, args.seq), TokenWindows(args.val, args.seq)
    train_loader = DataLoader(train, batch_size=args.batch, drop_last=True, sampler=GlobalSampleSampler(
        train, batch_size=args.batch, dp_size=1, dp_rank=0, seed=args.seed, start=0,
        num_batches=len(train) // args.batch))
    val_loader = DataLoader(val, batch_size=args.batch, drop_last=True, sampler=GlobalSampleSampler(
        val, batch_size=args.batch, dp_size=1, dp_rank=0, seed=args.seed, start=0,
        num_batches=min(args.val_batches, len(val) // args.batch), shuffle=False))
    return train_loader, val_loader


def recipe_args(doc: str):
    """The command line both scripts take from ``bench_end_to_end.py``, parsed; ``doc``'s first
    paragraph describes the script."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--train", nargs="+", required=True, help="training shards (.bin)")
    p.add_argument("--val", nargs="+", required=True, help="validation shards (.bin)")
    p.add_argument("--out", type=Path, required=True, help="the run's directory (log, checkpoint)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--val-every", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab", type=int, default=257, help="the byte tokenizer's 256 bytes + end of text")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args()
