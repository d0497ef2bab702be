"""Data pipeline throughput: TokenDataModule's train loader and `prepare`, on the embedded corpus.

    python benchmarks/bench_data.py                      # prints a table
    python benchmarks/bench_data.py --out bench_data.json

(1) loader: tokens/s the train DataLoader delivers (x and y int64 batches, what `training_step`
    receives), for batch 8 x seq 1024 and a small 8 x 256 config, with 0 and 2 workers. Compare
    with the tokens/s a training run consumes to see whether data loading can ever be the limit.
(2) prepare: tokens/s for tokenizing the full embedded corpus (stdlib .py files, ~12 MB) with
    the GPT-2 tokenizer into shards, on all cores and on one.
Everything runs in a temporary directory; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from lightning_disttrain.data import TokenDataModule, get_tokenizer, prepare
from lightning_disttrain.data.embedded import embedded_files

LOADER_CONFIGS = [  # (batch_size, seq_len, num_workers)
    (8, 1024, 0),
    (8, 1024, 2),
    (8, 256, 0),
    (8, 256, 2),
]


def bench_prepare(out_dir: Path, num_proc: int) -> dict:
    start = time.perf_counter()
    meta = prepare("embedded", out_dir, tokenizer="gpt2", num_proc=num_proc, progress=False)
    seconds = time.perf_counter() - start
    tokens = meta["train"]["tokens"] + meta["val"]["tokens"]
    docs = meta["train"]["documents"] + meta["val"]["documents"]
    return {"num_proc": num_proc, "tokens": tokens, "documents": docs, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds)}


def bench_loader(shards: Path, batch_size: int, seq_len: int, num_workers: int, min_seconds: float) -> dict:
    dm = TokenDataModule(str(shards), tokenizer="gpt2", seq_len=seq_len, batch_size=batch_size, val_batches=0,
                         num_workers=num_workers)
    dm.setup("fit")
    loader = dm.train_dataloader()
    it = iter(loader)
    for _ in range(5):  # warm-up: worker start, first permutation, page cache
        next(it)
    batches, this_epoch, start = 0, 5, time.perf_counter()
    while True:
        try:
            x, y = next(it)
        except StopIteration:  # a pass over the corpus is done: the next one continues the stream
            dm.load_state_dict({"consumed_samples": dm.consumed_samples + this_epoch * batch_size, "seed": dm.seed})
            it, this_epoch = iter(loader), 0
            continue
        assert x.shape == (batch_size, seq_len) and y.dtype == torch.int64
        batches, this_epoch = batches + 1, this_epoch + 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and batches >= 20:
            break
    tokens = batches * batch_size * seq_len
    return {"batch_size": batch_size, "seq_len": seq_len, "num_workers": num_workers, "batches": batches,
            "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--seconds", type=float, default=3.0, help="minimum time per loader measurement")
    args = parser.parse_args(argv)
    cpus = os.cpu_count() or 1
    results = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": cpus, "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "prepare": [],
        "loader": [],
    }
    # Warm-up outside the timings: the stdlib files into the page cache, the GPT-2 ranks parsed.
    sum(len(f.read_text()) for f in embedded_files())
    get_tokenizer("gpt2").encode("warm up")
    results["machine"]["load_avg_1m"] = round(os.getloadavg()[0], 2)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for num_proc in dict.fromkeys([cpus, 1]):
            results["prepare"].append(bench_prepare(tmp / f"embedded_np{num_proc}", num_proc))
        shards = tmp / f"embedded_np{cpus}"
        for batch_size, seq_len, workers in LOADER_CONFIGS:
            results["loader"].append(bench_loader(shards, batch_size, seq_len, workers, args.seconds))

    print(f"# bench_data  {results['date']}  ({results['command']})")
    m = results["machine"]
    print(f"# {m['cpus']} CPUs (1-min load average {m['load_avg_1m']} at start), {m['platform']}, "
          f"Python {m['python']}, torch {m['torch']}")
    print("\nprepare (embedded corpus, gpt2 tokenizer, full corpus)")
    print(f"{'num_proc':>8} {'tokens':>10} {'docs':>6} {'seconds':>8} {'tokens/s':>12}")
    for r in results["prepare"]:
        print(f"{r['num_proc']:>8} {r['tokens']:>10,} {r['documents']:>6} {r['seconds']:>8.2f} {r['tokens_per_s']:>12,}")
    print("\nTokenDataModule train loader (x, y int64)")
    print(f"{'batch':>5} {'seq':>5} {'workers':>7} {'batches':>8} {'seconds':>8} {'tokens/s':>12}")
    for r in results["loader"]:
        print(f"{r['batch_size']:>5} {r['seq_len']:>5} {r['num_workers']:>7} {r['batches']:>8} "
              f"{r['seconds']:>8.2f} {r['tokens_per_s']:>12,}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()
