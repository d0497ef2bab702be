"""What a ``self.log`` call costs a training step under ``L.Trainer``, whatever the logging cadence.

One process, the ``tiny`` GPT on random tokens (batch 8 x 128), AdamW, Lightning's defaults but
no progress bar, a CSVLogger at ``log_every_n_steps=10``. Variants: ``k`` host scalars logged with
``self.log(name, value, on_step=True, on_epoch=False)`` in every ``training_step`` on top of the
loss (k = 0 and ``--calls``); rounds alternate the variants. The cost per call is
``(median step with k calls - median step with 0) / k``, round by round: Lightning's result
collection does its work on every call, also at the steps whose metrics no logger receives
(why ``GPTModule`` logs its loggers-only values at the logging cadence; docs/benchmarks.md, section 18).

    flock /tmp/ldt_test.lock python benchmarks/bench_log_calls.py --steps 150 --repeats 5
"""

from __future__ import annotations

import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F
from bench_common import header, parser, random_tokens, report, spread, timed_rounds
from torch.utils.data import DataLoader

from lightning_disttrain.models.gpt import GPT, GPTConfig


class Logged(L.LightningModule):
    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls = calls
        torch.manual_seed(0)
        self.config = GPTConfig.from_name("tiny", vocab_size=257)
        self.model = GPT(self.config)
        self.starts: list[float] = []

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)[..., : self.config.vocab_size].float()
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train/loss", loss)
        for i in range(self.calls):
            self.log(f"extra/{i}", float(batch_idx + i), on_step=True, on_epoch=False)
        return loss

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)


def run(calls: int, steps: int, warmup: int, work: str) -> float:
    """The median step (start to start) in ms after ``warmup`` steps."""
    module = Logged(calls)
    data = DataLoader(random_tokens(8 * (steps + 1), 128, 257), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=10,
                        logger=L.pytorch.loggers.CSVLogger(work, name=f"calls{calls}"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, data)
    gaps = [b - a for a, b in zip(module.starts[warmup:-1], module.starts[warmup + 1:])]
    return 1e3 * statistics.median(gaps)


def main() -> None:
    p = parser(__doc__, steps=(150, "optimizer steps per run"), warmup=(20, "steps not timed"),
               repeats=(5, "alternating rounds"), out=(None, "the JSON (default benchmarks/out/log_calls.json)"))
    p.add_argument("--calls", type=int, default=8, help="self.log calls per step of the second variant")
    args = p.parse_args()
    header("bench_log_calls", "1 process", f"torch threads {torch.get_num_threads()}")
    work = "benchmarks/out/log_calls"
    variants = {f"{k} calls": (lambda k=k: run(k, args.steps, args.warmup, work)) for k in (0, args.calls)}
    results, rounds = timed_rounds(variants, args.repeats, warmup=1)
    base, more = results["0 calls"], results[f"{args.calls} calls"]
    per_call = [(m - b) / args.calls for b, m in zip(base, more)]
    lines = [f"median step, ms (round by round): 0 calls {' '.join(f'{v:.2f}' for v in base)}; "
             f"{args.calls} calls {' '.join(f'{v:.2f}' for v in more)}",
             f"per self.log call, ms (round by round, min median max): {spread(per_call)}",
             "1-min load average before each round: " + " ".join(f"{r['load1_before']:.2f}" for r in rounds)]
    report("log_calls", {"results": results, "per_call_ms": per_call, "rounds": rounds, "args": vars(args)},
           "\n".join(lines), out=args.out)


if __name__ == "__main__":
    main()
