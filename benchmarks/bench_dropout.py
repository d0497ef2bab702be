"""Dropout under the layouts: what the per-rank training streams (``parallel/rng.py``) change.

With sequence parallel the ranks of a tensor-parallel group share one stream, so they draw the
same mask for their different sequence shards (and attention dropout the same mask for the heads
each holds), where one process draws one mask over everything. This measures the effect on a run
with dropout: the ``tiny`` GPT, dropout 0.1, the embedded corpus (bytes tokenizer, seq 128,
global batch 8), AdamW 3e-3, ``--steps`` steps, then the held-out loss (dropout off) over 16
batches; per seed:

  one       one process (Lightning's single device)
  dp2       NDParallelStrategy(dp_shard=2): two data-parallel ranks, independent masks
  tp2_sp    NDParallelStrategy(tp=2, sequence_parallel=True): the correlated case
  tp2_nosp  NDParallelStrategy(tp=2, sequence_parallel=False): replicated activations, one mask

    python benchmarks/bench_dropout.py --steps 150 --seeds 0 1 2

Every figure is a loss (deterministic), so the machine's load does not change it. Results:
printed, and JSON under benchmarks/out/dropout/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench_common import OUT_ROOT, child_env, parser, report, table

OUT = OUT_ROOT / "dropout"
LAYOUTS = {"one": (1, None), "dp2": (2, dict(dp_shard=2)), "tp2_sp": (2, dict(tp=2, sequence_parallel=True)),
           "tp2_nosp": (2, dict(tp=2, sequence_parallel=False))}


def worker(layout: str, seed: int, steps: int, out: Path) -> None:
    import lightning as L

    from lightning_disttrain import GPTModule, TokenDataModule
    from lightning_disttrain.strategies import NDParallelStrategy

    devices, options = LAYOUTS[layout]
    L.seed_everything(seed)
    model = GPTModule("tiny", model_overrides={"dropout": 0.1, "block_size": 128}, lr=3e-3, warmup_steps=10,
                      weight_decay=0.1)
    dp = 2 if layout == "dp2" else 1
    data = TokenDataModule(source="embedded", tokenizer="bytes", seq_len=128, batch_size=8 // dp, val_batches=16,
                           cache_dir=str(out / "cache"))
    strategy = NDParallelStrategy(**options) if options else "auto"
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=16, val_check_interval=steps,
                        check_val_every_n_epoch=None)
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        val = float(trainer.callback_metrics["val/loss"])
        train = float(trainer.callback_metrics.get("train/loss", float("nan")))
        (out / f"{layout}.seed{seed}.json").write_text(json.dumps({"val_loss": val, "train_loss": train}))


def main() -> None:
    p = parser(__doc__, full_doc=True, steps=150)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--worker", nargs=2, metavar=("LAYOUT", "SEED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.steps, OUT)
        return
    results: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for seed in args.seeds:
        for layout in LAYOUTS:
            subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--worker", layout, str(seed)],
                           check=True, env=child_env())
            results[layout].append(json.loads((OUT / f"{layout}.seed{seed}.json").read_text())["val_loss"])
    text = f"held-out loss after {args.steps} steps, dropout 0.1, seeds {args.seeds}\n" + table(
        ["layout", *((f"seed {s}", ".4f") for s in args.seeds), ("mean", ".4f"), ("sd", ".4f")],
        [(layout, *vals, statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else None)
         for layout, vals in results.items()], indent="  ")
    report("dropout", {"steps": args.steps, "seeds": args.seeds, "val_loss": results}, text, out=OUT / "summary.json")


if __name__ == "__main__":
    main()
