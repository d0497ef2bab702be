"""Trainer overhead: tokens/s of GPTModule under L.Trainer vs a plain PyTorch loop.

Same model, seed, batches, optimizer (AdamW from lightning_disttrain.optim), LR schedule and
gradient clipping; the two run interleaved (A B A B ...) in one process so machine noise hits both.
Timing starts after ``--warmup`` steps and covers ``--steps`` optimizer steps.

    python benchmarks/bench_trainer.py --preset small --batch 4 --seq 128 --steps 30 --repeats 3
"""

from __future__ import annotations

import platform
import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F
from bench_common import dataset, header, parser, report, timed_rounds
from torch.utils.data import DataLoader, TensorDataset

from lightning_disttrain import GPTModule
from lightning_disttrain.optim import build_optimizer, build_scheduler


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
    p = parser(__doc__, full_doc=True, steps=30, warmup=5, repeats=3, out=(None, "where the results go as JSON "
                                                                            "(default: benchmarks/out/trainer.json)"))
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: stable timings on a shared 2-core machine)")
    p.add_argument("--log-dir", default="benchmarks/out/trainer")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    header("bench_trainer", f"{args.threads} torch threads")
    ds = dataset(args, (args.warmup + args.steps) * args.batch)

    def show(r: int, tok_s: dict) -> None:
        print(f"repeat {r}: plain {tok_s['plain']:,.0f} tok/s   L.Trainer {tok_s['lightning']:,.0f} tok/s   "
              f"ratio {tok_s['lightning'] / tok_s['plain']:.3f}", flush=True)

    tok_s, _ = timed_rounds({"plain": lambda: plain_loop(args, ds), "lightning": lambda: lightning_loop(args, ds)},
                            args.repeats, rotate=False, after_round=show)
    plain, lit = tok_s["plain"], tok_s["lightning"]
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "config": vars(args) | {"out": None},
        "plain_tok_s_median": statistics.median(plain), "trainer_tok_s_median": statistics.median(lit),
        "ratio_of_medians": statistics.median(lit) / statistics.median(plain),
    }
    report("trainer", result, f"median: plain {result['plain_tok_s_median']:,.0f} tok/s, L.Trainer "
           f"{result['trainer_tok_s_median']:,.0f} tok/s, ratio {result['ratio_of_medians']:.3f} (target >= 0.95)",
           out=args.out, indent=2)


if __name__ == "__main__":
    main()
