"""`prepare`: text in, llm.c token shards out.

    prepare("embedded", "data/stdlib")                                   # no download
    prepare("input.txt", "data/shakespeare", tokenizer="bytes")          # one .txt = one document
    prepare("HuggingFaceFW/fineweb-edu", "data/edu", dataset_config="sample-10BT", streaming=True)

What it writes into `out_dir`:
    {name}_train_000000.bin, {name}_train_000001.bin, ...   shards of `shard_size` tokens
    {name}_val_000000.bin, ...                              (none when the val split is empty)
    meta.json                                               written last: its presence marks
                                                            the directory complete
Every document is preceded by the tokenizer's end-of-text token (llm.c's convention), so the
stream reads EOT doc0 EOT doc1 ... and a window that crosses a boundary sees where it is.

What a document is depends on the source (see `documents.py`); in short: one per stdlib file
for "embedded", ONE PER FILE for .txt/.md (a single huge .txt is one document), one per record
for .json/.jsonl/.parquet and hub datasets (`split`, `dataset_config`, `streaming=True` for
corpora larger than the disk).

Validation split, by document, decided before tokenizing so it does not depend on `num_proc`:
- `val_docs=N`: the first N documents (llm.c's FineWeb scripts use the first shard as val);
- otherwise document i goes to val when floor((i+1)*val_fraction) > floor(i*val_fraction),
  i.e. evenly spread, the first at i = 1/val_fraction - 1;
- when the document count is known (non-streaming) and that rule would give no val document at
  all (fewer than 1/val_fraction documents, e.g. one .txt file), each document is split instead:
  its last val_fraction of tokens go to val. meta.json records which rule was used;
- the embedded corpus brings its own split (a hash of each file's path) and ignores both.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import multiprocessing
import os
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from .documents import default_name, open_documents
from .shards import TOKEN_DTYPE, ShardWriter
from .tokenizer import canonical_tokenizer_name, get_tokenizer

PREPARE_VERSION = 1
"""Bump when the bytes `prepare` writes for the same input change: it is part of the cache key."""

# A unit of work for one process: ~1 MB of text or 1024 documents, whichever comes first, so a
# few huge documents and many tiny ones both spread over the workers.
BATCH_CHARS = 1 << 20
BATCH_DOCS = 1024


def prepare(
    source: str | Sequence[str],
    out_dir: str | os.PathLike,
    tokenizer: str = "gpt2",
    *,
    name: str | None = None,
    val_fraction: float = 0.01,
    val_docs: int | None = None,
    shard_size: int = 100_000_000,
    num_proc: int | None = None,
    text_field: str = "text",
    split: str = "train",
    dataset_config: str | None = None,
    streaming: bool = False,
    max_docs: int | None = None,
    progress: bool = True,
) -> dict:
    """Tokenize `source` into llm.c shards in `out_dir`; returns the contents of meta.json.

    Args:
        source: "embedded", a local file / directory / glob (or a list of files), or a Hugging
            Face dataset name.
        out_dir: created if missing; existing shards with the same name are overwritten.
        tokenizer: "gpt2" (alias "r50k_base") or "bytes".
        name: shard file prefix; defaults to a slug of the source ("embedded", "input", ...).
        val_fraction: share of documents (or tokens, see the module docstring) for validation.
        val_docs: take exactly the first `val_docs` documents as validation instead.
        shard_size: tokens per shard (llm.c and modded-nanogpt use 100M).
        num_proc: tokenizer processes; default all CPU cores.
        text_field: the text column of json/parquet/hub sources.
        split: the split of a hub dataset to read (`datasets.load_dataset`'s `split`).
        dataset_config: the configuration name of a hub dataset (`datasets.load_dataset`'s `name`).
        streaming: stream a hub dataset instead of downloading it whole.
        max_docs: stop after this many documents (smoke tests, quick experiments).
        progress: show a tqdm bar counting tokens.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
    if val_docs is not None and val_docs < 0:
        raise ValueError(f"val_docs must be >= 0, got {val_docs}.")
    if max_docs is not None and max_docs < 1:
        raise ValueError(f"max_docs must be >= 1 or None, got {max_docs}.")
    tokenizer = canonical_tokenizer_name(tokenizer)
    num_proc = max(1, num_proc or os.cpu_count() or 1)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".hf-cache-") as hf_cache:
        docs, num_docs, description = open_documents(
            source, text_field=text_field, split=split, dataset_config=dataset_config,
            streaming=streaming, hf_cache_dir=hf_cache,
        )
        if max_docs is not None:
            docs = _take(docs, max_docs)
            num_docs = min(num_docs, max_docs) if num_docs is not None else None
        split_by_tokens = (
            val_docs is None and val_fraction > 0 and num_docs is not None and num_docs * val_fraction < 1
        )
        labelled = _label_splits(docs, val_fraction, val_docs, split_by_tokens)
        name = name or default_name(source)
        meta = _tokenize_to_shards(labelled, out_dir, name, tokenizer, shard_size, num_proc, val_fraction, progress)

    meta.update(
        source=description,
        dataset_config=dataset_config,
        split=split,
        text_field=text_field,
        max_docs=max_docs,
        val_rule=(
            f"first {val_docs} documents" if val_docs is not None
            else f"last {val_fraction} of each document's tokens" if split_by_tokens
            else "embedded corpus: sha256(relative path) % 50 == 0" if description.startswith("embedded")
            else f"documents i with floor((i+1)*{val_fraction}) > floor(i*{val_fraction})"
        ),
    )
    # meta.json last: a directory with meta.json is complete (the datamodule relies on it).
    tmp = out_dir / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out_dir / "meta.json")
    return meta


def _take(docs: Iterable, n: int) -> Iterator:
    for i, doc in enumerate(docs):
        if i >= n:
            return
        yield doc


def _label_splits(docs, val_fraction: float, val_docs: int | None, split_by_tokens: bool) -> Iterator[tuple[str, str]]:
    """Each document with its destination: "train", "val", or "split" (its tail goes to val)."""
    for i, (text, fixed) in enumerate(docs):
        if fixed is not None:
            yield text, fixed
        elif split_by_tokens:
            yield text, "split"
        elif val_docs is not None:
            yield text, "val" if i < val_docs else "train"
        else:
            yield text, "val" if math.floor((i + 1) * val_fraction) > math.floor(i * val_fraction) else "train"


def _batches(labelled: Iterable[tuple[str, str]]) -> Iterator[list[tuple[str, str]]]:
    batch, chars = [], 0
    for doc in labelled:
        batch.append(doc)
        chars += len(doc[0])
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# One tokenizer per worker process, built by the pool initializer (not pickled per task).
_WORKER_TOKENIZER = None


def _init_worker(tokenizer_name: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = get_tokenizer(tokenizer_name)
    if hasattr(_WORKER_TOKENIZER, "num_threads"):
        _WORKER_TOKENIZER.num_threads = 1  # the processes already fill the cores


def _tokenize_batch(batch: list[tuple[str, str]], val_fraction: float) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(train tokens, val tokens, train docs, val docs) of one batch, EOT before each document."""
    tok = _WORKER_TOKENIZER
    eot = tok.eot_token
    train, val, n_train, n_val = [], [], 0, 0
    for (text, where), ids in zip(batch, tok.encode_batch([t for t, _ in batch])):
        doc = np.empty(len(ids) + 1, dtype=TOKEN_DTYPE)
        doc[0] = eot
        doc[1:] = ids
        if where == "train":
            train.append(doc)
            n_train += 1
        elif where == "val":
            val.append(doc)
            n_val += 1
        else:  # "split": the head stays in train; the tail, after its own EOT, goes to val
            cut = len(doc) - math.ceil(len(ids) * val_fraction)
            train.append(doc[:cut])
            val.append(np.concatenate([doc[:1], doc[cut:]]))
            n_train, n_val = n_train + 1, n_val + 1
    empty = np.zeros(0, dtype=TOKEN_DTYPE)
    return (np.concatenate(train) if train else empty, np.concatenate(val) if val else empty, n_train, n_val)


def _tokenized_batches(labelled, tokenizer: str, num_proc: int, val_fraction: float) -> Iterator[tuple]:
    """Tokenized batches in source order, on `num_proc` processes."""
    if num_proc == 1:
        _init_worker(tokenizer)
        for batch in _batches(labelled):
            yield _tokenize_batch(batch, val_fraction)
        return
    # fork where there is one: workers then start in milliseconds and inherit the ranks.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    with ctx.Pool(num_proc, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        # Bounded window instead of Pool.imap, whose feeder thread would read an entire streamed
        # corpus into memory ahead of the tokenizers.
        pending: collections.deque = collections.deque()
        for batch in _batches(labelled):
            pending.append(pool.apply_async(_tokenize_batch, (batch, val_fraction)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _tokenize_to_shards(labelled, out_dir: Path, name: str, tokenizer: str, shard_size: int,
                        num_proc: int, val_fraction: float, progress: bool) -> dict:
    from tqdm.auto import tqdm

    tok = get_tokenizer(tokenizer)
    writers = {s: ShardWriter(out_dir / f"{name}_{s}", shard_size) for s in ("train", "val")}
    docs = {"train": 0, "val": 0}
    with tqdm(desc=f"tokenizing {name}", unit="tok", unit_scale=True, disable=not progress) as bar:
        for train, val, n_train, n_val in _tokenized_batches(labelled, tokenizer, num_proc, val_fraction):
            writers["train"].add(train)
            writers["val"].add(val)
            docs["train"] += n_train
            docs["val"] += n_val
            bar.update(train.size + val.size)
    meta = {"prepare_version": PREPARE_VERSION, "format": "llm.c .bin v1 (uint16)", "tokenizer": tokenizer,
            "n_vocab": tok.n_vocab, "eot_token": tok.eot_token, "document_separator": "eot before each document"}
    for split, writer in writers.items():
        paths = writer.close()
        meta[split] = {"tokens": writer.num_tokens, "documents": docs[split], "shards": [p.name for p in paths]}
    if meta["train"]["tokens"] == 0:
        raise ValueError(f"source for {name!r} yielded no training tokens; check the source and text_field.")
    return meta


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-disttrain prepare",
        description="Tokenize text into llm.c .bin token shards (+ meta.json) for TokenDataModule, llm.c "
        "and modded-nanogpt. Every document is preceded by the end-of-text token.",
        epilog="examples:\n"
        "  lightning-disttrain prepare embedded data/stdlib\n"
        "  lightning-disttrain prepare input.txt data/shakespeare --tokenizer bytes\n"
        "  lightning-disttrain prepare HuggingFaceFW/fineweb-edu data/edu10B --dataset-config sample-10BT "
        "--streaming --val-docs 100000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", help='"embedded" (the Python stdlib sources, no download), a local .txt/.md '
                   "(one document per file), .json/.jsonl/.parquet file, directory or glob, or a Hugging Face dataset name")
    p.add_argument("out_dir", help="directory for the shards and meta.json")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2 (alias r50k_base) or bytes (default: gpt2)")
    p.add_argument("--name", default=None, help="shard file prefix (default: derived from the source)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents for validation (default 0.01)")
    p.add_argument("--val-docs", type=int, default=None, help="use the first N documents as validation instead")
    p.add_argument("--shard-size", type=int, default=100_000_000, help="tokens per shard (default 100M)")
    p.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: all cores)")
    p.add_argument("--text-field", default="text", help="text column of json/parquet/hub data (default: text)")
    p.add_argument("--split", default="train", help="split of a hub dataset to read (default: train)")
    p.add_argument("--dataset-config", default=None, help="hub dataset configuration, e.g. sample-10BT")
    p.add_argument("--streaming", action="store_true", help="stream a hub dataset instead of downloading it whole")
    p.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def prepare_main(argv: Sequence[str] | None = None) -> dict:
    """Entry point of `lightning-disttrain prepare ...`: parses `argv` and runs `prepare`."""
    args = build_parser().parse_args(argv)
    meta = prepare(
        args.source, args.out_dir, tokenizer=args.tokenizer, name=args.name, val_fraction=args.val_fraction,
        val_docs=args.val_docs, shard_size=args.shard_size, num_proc=args.num_proc, text_field=args.text_field,
        split=args.split, dataset_config=args.dataset_config, streaming=args.streaming, max_docs=args.max_docs,
        progress=not args.no_progress,
    )
    print(
        f"wrote {meta['train']['tokens']:,} train tokens ({len(meta['train']['shards'])} shards) and "
        f"{meta['val']['tokens']:,} val tokens ({len(meta['val']['shards'])} shards) to {args.out_dir}"
    )
    return meta
