"""Sources: shard globs split by llm.c naming; text sources prepared once, cached, safe across processes."""

import json
import multiprocessing
import os
import time

import numpy as np
import pytest

from lightning_disttrain.data import TokenDataModule, get_tokenizer, read_shard, write_shard
from lightning_disttrain.data import sources
from lightning_disttrain.data.sources import cache_key, ensure_prepared, find_shards, resolve_source


def test_glob_and_directory_split_by_llmc_names(tmp_path):
    for name in ("fw_train_000001.bin", "fw_train_000002.bin", "fw_val_000000.bin", "eval-set_train_000000.bin"):
        write_shard(tmp_path / name, np.arange(10))
    by_glob = find_shards(str(tmp_path / "fw_*.bin"))
    assert [p.name for p in by_glob.train] == ["fw_train_000001.bin", "fw_train_000002.bin"]
    assert [p.name for p in by_glob.val] == ["fw_val_000000.bin"]
    by_dir = find_shards(str(tmp_path))
    # "eval-set" is a corpus name, not the word "val": that shard is training data.
    assert [p.name for p in by_dir.train][0] == "eval-set_train_000000.bin" and len(by_dir.train) == 3
    plain = tmp_path / "plain"
    write_shard(plain / "tokens.bin", np.arange(10))
    assert [p.name for p in find_shards(str(plain)).train] == ["tokens.bin"] and find_shards(str(plain)).val == ()


def test_local_text_is_prepared_once_and_cached(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world, " * 2000)
    calls = []
    real_prepare = sources.prepare
    monkeypatch.setattr(sources, "prepare", lambda *a, **k: calls.append(a) or real_prepare(*a, **k))
    dm = TokenDataModule(str(corpus), tokenizer="bytes", seq_len=32, batch_size=4, val_batches=1,
                         cache_dir=str(tmp_path / "cache"), num_proc=1)
    dm.prepare_data()
    dm.setup("fit")
    assert len(calls) == 1
    (cached,) = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    assert cached.name.startswith("corpus-") and (cached / "meta.json").is_file()
    tok = get_tokenizer("bytes")
    stream = np.concatenate([read_shard(p) for p in (*dm.shards.train, *dm.shards.val)])
    assert tok.decode(stream.tolist()) == corpus.read_text(), "one document, split head/tail, EOT-separated"

    again = TokenDataModule(str(corpus), tokenizer="bytes", seq_len=32, batch_size=4, val_batches=1,
                            cache_dir=str(tmp_path / "cache"), num_proc=2)  # num_proc is not in the key
    again.setup("fit")
    assert len(calls) == 1 and again.shards.train == dm.shards.train

    time.sleep(0.01)
    corpus.write_text("changed text " * 2000)  # an edited file is prepared again
    TokenDataModule(str(corpus), tokenizer="bytes", seq_len=32, batch_size=4, val_batches=1,
                    cache_dir=str(tmp_path / "cache")).setup("fit")
    assert len(calls) == 2


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DISTTRAIN_CACHE", str(tmp_path / "envcache"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(200)))
    shards = resolve_source(str(corpus), "bytes", prepare_kwargs={"num_proc": 1, "val_fraction": 0.05})
    assert str(shards.train[0]).startswith(str(tmp_path / "envcache"))
    assert shards.meta["val"]["documents"] == 10 and shards.meta["tokenizer"] == "bytes"


def test_cache_key_changes_with_what_changes_the_shards(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("x")
    base = cache_key(str(f), "gpt2", {})
    assert base == cache_key(str(f), "r50k_base", {"num_proc": 7}), "aliases and speed options share a key"
    assert base == cache_key(os.path.relpath(f), "gpt2", {}), "the same file however it is spelled"
    assert base != cache_key(str(f), "bytes", {})
    assert base != cache_key(str(f), "gpt2", {"val_fraction": 0.5})
    assert cache_key("embedded", "gpt2", {}).startswith("embedded-")
    assert cache_key("org/dataset", "gpt2", {"dataset_config": "a"}) != cache_key("org/dataset", "gpt2", {})


def test_tokenizer_mismatch_with_prepared_shards(tmp_path):
    corpus = tmp_path / "t.txt"
    corpus.write_text("some text " * 500)
    directory = ensure_prepared(str(corpus), "bytes", tmp_path / "cache", {"num_proc": 1})
    with pytest.raises(ValueError, match=r"made with tokenizer 'bytes' but tokenizer='gpt2'.*tokenizer='bytes'"):
        TokenDataModule(str(directory), tokenizer="gpt2", seq_len=8, batch_size=2).setup("fit")


def _prepare_in_child(args):
    source, cache, log = args
    real = sources.prepare

    def counted(*a, **k):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # widen the race window
        return real(*a, **k)

    sources.prepare = counted
    return str(ensure_prepared(source, "bytes", cache, {"num_proc": 1, "progress": False}))


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork to start fast")
def test_concurrent_processes_prepare_once(tmp_path):
    corpus = tmp_path / "race.txt"
    corpus.write_text("race condition " * 1000)
    log = tmp_path / "prepared.log"
    with multiprocessing.get_context("fork").Pool(3) as pool:
        dirs = pool.map(_prepare_in_child, [(str(corpus), str(tmp_path / "cache"), str(log))] * 3)
    assert len(set(dirs)) == 1 and len(log.read_text().split()) == 1
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name]
    assert leftovers == [] and (tmp_path / "cache" / os.path.basename(dirs[0]) / "meta.json").is_file()


def test_failed_preparation_leaves_no_cache_entry(tmp_path, monkeypatch):
    corpus = tmp_path / "fail.txt"
    corpus.write_text("abc " * 100)

    def broken(source, out_dir, *a, **k):
        (out_dir / "half_written_train_000000.bin").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "half_written_train_000000.bin").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(sources, "prepare", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_prepared(str(corpus), "bytes", tmp_path / "cache", {})
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_embedded_source_end_to_end(tmp_path):
    # Restricted with max_docs to stay fast; the full corpus is prepared in benchmarks/bench_data.py.
    dm = TokenDataModule("embedded", tokenizer="gpt2", seq_len=64, batch_size=2, val_batches=1, max_docs=60,
                         cache_dir=str(tmp_path), num_proc=1)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 64) and int(x.max()) < 50257
    assert dm.shards.meta["source"].startswith("embedded:") and len(dm.val_dataloader()) == 1
