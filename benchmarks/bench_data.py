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

import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import header, load1, parser, report, table

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
    p = parser(__doc__, full_doc=True, out=(None, "where the results go as JSON (default: benchmarks/out/data.json)"))
    p.add_argument("--seconds", type=float, default=3.0, help="minimum time per loader measurement")
    args = p.parse_args(argv)
    header("bench_data", platform.platform())
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
    results["machine"]["load_avg_1m"] = round(load1(), 2)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for num_proc in dict.fromkeys([cpus, 1]):
            results["prepare"].append(bench_prepare(tmp / f"embedded_np{num_proc}", num_proc))
        shards = tmp / f"embedded_np{cpus}"
        for batch_size, seq_len, workers in LOADER_CONFIGS:
            results["loader"].append(bench_loader(shards, batch_size, seq_len, workers, args.seconds))

    report("data", results, "\n".join([
        f"# 1-min load average {results['machine']['load_avg_1m']} after the warm-up", "",
        "prepare (embedded corpus, gpt2 tokenizer, full corpus)",
        table([("num_proc", ""), ("tokens", ","), ("docs", ""), ("seconds", ".2f"), ("tokens/s", ",")],
              [(r["num_proc"], r["tokens"], r["documents"], r["seconds"], r["tokens_per_s"])
               for r in results["prepare"]]),
        "", "TokenDataModule train loader (x, y int64)",
        table(["batch", "seq", "workers", "batches", ("seconds", ".2f"), ("tokens/s", ",")],
              [(r["batch_size"], r["seq_len"], r["num_workers"], r["batches"], r["seconds"], r["tokens_per_s"])
               for r in results["loader"]])]), out=args.out, indent=2)
    return results


if __name__ == "__main__":
    main()
