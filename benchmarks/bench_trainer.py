"""Trainer overhead: tokens/s of GPTModule under L.Trainer vs a plain PyTorch loop.

Same model, seed, batches, optimizer (AdamW from lightning_disttrain.optim), LR schedule and
gradient clipping; the two run interleaved (A B A B ...) in one process so machine noise hits both.
Timing starts after ``--warmup`` steps and covers ``--steps`` optimizer steps.

    python benchmarks/bench_trainer.py --preset small --batch 4 --seq 128 --steps 30 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_disttrain import GPTModule
from lightning_disttrain.optim import build_optimizer, build_scheduler


def make_data(n_batches: int, batch: int, seq: int, vocab: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n_batches * batch, seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def plain_loop(args, ds: TensorDataset) -> float:
    torch.manual_seed(0)
    module = GPTModule(args.preset, vocab_size=args.vocab, lr=6e-4, warmup_steps=5)
    module.configure_model()
    model = module.model.train()
    opt = build_optimizer(model, "adamw", lr=6e-4, weight_decay=0.1)
    sched = build_scheduler(opt, schedule="cosine", warmup_steps=5, total_steps=args.warmup + args.steps)
    loader = DataLoader(ds, batch_size=args.batch)
    t0 = None
    for i, (x, y) in enumerate(loader):
        if i == args.warmup:
            t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return args.steps * args.batch * args.seq / (time.perf_counter() - t0)


class _Clock(L.Callback):
    def __init__(self, warmup: int):
        self.warmup, self.t0, self.t1 = warmup, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            self.t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.t1 = time.perf_counter()


def lightning_loop(args, ds: TensorDataset) -> float:
    torch.manual_seed(0)
    module = GPTModule(args.preset, vocab_size=args.vocab, lr=6e-4, warmup_steps=5)
    clock = _Clock(args.warmup)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.warmup + args.steps, gradient_clip_val=1.0,
                        logger=L.pytorch.loggers.CSVLogger(args.log_dir), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[clock])
    trainer.fit(module, DataLoader(ds, batch_size=args.batch))
    return args.steps * args.batch * args.seq / (clock.t1 - clock.t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: stable timings on a shared 2-core machine)")
    p.add_argument("--log-dir", default="benchmarks/out/trainer")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ds = make_data(args.warmup + args.steps, args.batch, args.seq, args.vocab)
    plain, lit = [], []
    for r in range(args.repeats):
        plain.append(plain_loop(args, ds))
        lit.append(lightning_loop(args, ds))
        print(f"repeat {r}: plain {plain[-1]:,.0f} tok/s   L.Trainer {lit[-1]:,.0f} tok/s   ratio {lit[-1] / plain[-1]:.3f}")
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "config": vars(args) | {"out": None},
        "plain_tok_s_median": statistics.median(plain), "trainer_tok_s_median": statistics.median(lit),
        "ratio_of_medians": statistics.median(lit) / statistics.median(plain),
    }
    print(f"median: plain {result['plain_tok_s_median']:,.0f} tok/s, L.Trainer {result['trainer_tok_s_median']:,.0f} "
          f"tok/s, ratio {result['ratio_of_medians']:.3f} (target >= 0.95)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
