"""A plain PyTorch training script (no Lightning), the reference of ``bench_end_to_end.py``.

The recipe of the ``fit`` YAML that benchmark writes, by hand: ``lightning_disttrain.models.gpt.GPT``
built from a ``GPTConfig`` (the ``tiny`` preset, the byte tokenizer's 257 tokens), the token
shards that ``TokenDataModule`` reads (their paths given on the command line, prepared once by
the benchmark) in the same sample order (its ``TokenWindows`` / ``GlobalSampleSampler``, seed
1337), AdamW with weight decay on 2-D weights only (fused, as ``lightning_disttrain.optim``
builds it), linear warmup then cosine to 10% stepped every optimizer step, gradient
clipping at 1.0, the loss every 10 steps to a CSV file, validation every ``--val-every`` steps
on the first ``--val-batches`` batches of the validation split, and one checkpoint (model,
optimizer, scheduler, step) with ``torch.save`` at the end.

Prints ``@@e2e <event> <time.monotonic()>`` lines to stderr as ``e2e_phases.py`` does for ``fit``,
and at the end one ``@@e2e-json {...}`` line with every step's start and end, the validation
intervals, the checkpoint save and the losses.

``lightning_disttrain/__init__.py`` imports Lightning (its callbacks, strategies and module). A
plain script has no use for it, so the two packages on the way to the model and the sampler are
entered without running their ``__init__`` (``e2e_recipe.bare_imports``): only ``models/gpt.py`` and
``data/sampling.py`` and what they import (torch, numpy, the package's plain-torch helpers) load.
"""

import sys
import time

T_MAIN = time.monotonic()
EVENT, SUMMARY = "@@e2e", "@@e2e-json"


def mark(name: str, t: float | None = None) -> float:
    t = time.monotonic() if t is None else t
    sys.stderr.write(f"{EVENT} {name} {t:.6f}\n")
    sys.stderr.flush()
    return t


mark("main", T_MAIN)

import atexit  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from e2e_recipe import bare_imports, loaders, optimizer_and_schedule, recipe_args  # noqa: E402

GPT, GPTConfig, _, _ = bare_imports()

mark("imports")
atexit.register(lambda: mark("atexit"))
if "--imports-only" in sys.argv:  # bench_end_to_end.py times the imports alone
    sys.exit(0)


def main() -> None:
    args = recipe_args(__doc__)

    # -- data: the shards' windows in TokenDataModule's order (one process: dp 1, rank 0)
    mark("data_start")
    train_loader, val_loader = loaders(args)
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "metrics.csv", "w")  # noqa: SIM115 (closed at the end)
    log.write("step,train_loss,lr\n")
    mark("data_end")

    # -- model and optimizer: the weights a seeded one-process build draws (models/param_init.py)
    torch.manual_seed(args.seed)
    config = GPTConfig.from_name("tiny", vocab_size=args.vocab)
    model = GPT(config).train()
    opt, sched = optimizer_and_schedule(model.parameters(), args.lr, args.weight_decay, args.warmup, args.steps)
    mark("model_end")

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)[..., : config.vocab_size].float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    val_intervals, val_losses, train_losses = [], [], []

    def validate() -> None:
        t0 = time.monotonic()
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for x, y in val_loader:
                total += float(loss_of(x, y)) * x.numel()
                count += x.numel()
        model.train()
        val_losses.append(total / count)
        val_intervals.append([t0, time.monotonic()])

    starts, ends = [], []
    mark("train_start")
    batches = iter(train_loader)
    for step in range(1, args.steps + 1):
        x, y = next(batches)
        starts.append(time.monotonic())
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == args.steps:
            value = loss.item()
            train_losses.append([step, value])
            log.write(f"{step},{value:.6f},{sched.get_last_lr()[0]:.6g}\n")
        ends.append(time.monotonic())
        if step % args.val_every == 0 or step == args.steps:
            validate()

    t0 = time.monotonic()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": args.steps}, args.out / f"step={args.steps}.pt")
    checkpoints = [[t0, time.monotonic()]]
    log.close()
    mark("train_end")
    summary = {"step_starts": starts, "step_ends": ends, "val": val_intervals, "val_losses": val_losses,
               "train_losses": train_losses, "checkpoints": checkpoints, "global_step": args.steps,
               "threads": torch.get_num_threads(), "strategy": "plain"}
    sys.stderr.write(f"{SUMMARY} {json.dumps(summary)}\n")
    sys.stderr.flush()


if __name__ == "__main__":
    main()
