"""`prepare`: local text / jsonl / parquet files and the embedded corpus into shards, EOT before each doc."""

import json

import numpy as np
import pytest

from lightning_disttrain.data import get_tokenizer, prepare, prepare_main, read_shard
from lightning_disttrain.data.embedded import embedded_files

DOCS = ["First document.\nIt has two lines.", "Second: naïve café 日本語 🤖", "third\n\n\n   spaced   out  ", "4"]


def decode_split(out_dir, meta, split, tokenizer):
    """All tokens of `split` in shard order."""
    return np.concatenate([read_shard(out_dir / name) for name in meta[split]["shards"]] or [np.zeros(0, np.uint16)])


def split_documents(tokens, tok):
    """The documents of a token stream that must read EOT doc EOT doc ...: decoded, EOT removed."""
    tokens = tokens.tolist()
    assert tokens == [] or tokens[0] == tok.eot_token, "the stream must start with EOT"
    docs, cur = [], None
    for t in tokens:
        if t == tok.eot_token:
            if cur is not None:
                docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    if cur is not None:
        docs.append(tok.decode(cur))
    return docs


@pytest.mark.parametrize("tokenizer", ["gpt2", "bytes"])
def test_txt_files_one_document_per_file(tmp_path, tokenizer):
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(DOCS):
        (src / f"doc{i}.txt").write_text(text)
    out = tmp_path / "out"
    meta = prepare(str(src), out, tokenizer=tokenizer, val_docs=1, num_proc=1, progress=False)
    tok = get_tokenizer(tokenizer)
    assert split_documents(decode_split(out, meta, "val", tok), tok) == DOCS[:1]
    assert split_documents(decode_split(out, meta, "train", tok), tok) == DOCS[1:]
    assert meta["train"]["documents"] == 3 and meta["val"]["documents"] == 1
    assert meta["train"]["shards"] == ["src_train_000000.bin"] and meta["val"]["shards"] == ["src_val_000000.bin"]
    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk["tokenizer"] == tokenizer and on_disk["train"]["tokens"] == meta["train"]["tokens"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary files must be gone"


def test_jsonl_records_with_custom_field_and_val_fraction(tmp_path):
    path = tmp_path / "corpus.jsonl"
    records = [{"id": i, "body": f"record number {i}: " + "x" * i} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    meta = prepare(str(path), out, tokenizer="gpt2", text_field="body", val_fraction=0.1, num_proc=1, progress=False)
    tok = get_tokenizer("gpt2")
    # val_fraction=0.1 puts documents 9, 19, 29, 39 into val: evenly spread, deterministic.
    val_ids = [9, 19, 29, 39]
    assert split_documents(decode_split(out, meta, "val", tok), tok) == [records[i]["body"] for i in val_ids]
    assert split_documents(decode_split(out, meta, "train", tok), tok) == [
        r["body"] for i, r in enumerate(records) if i not in val_ids
    ]
    with pytest.raises(ValueError, match=r"no column 'text'.*text_field"):
        prepare(str(path), tmp_path / "bad", num_proc=1, progress=False)


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS}), tmp_path / "d.parquet")
    meta = prepare(str(tmp_path / "d.parquet"), tmp_path / "out", tokenizer="bytes", val_docs=0, num_proc=1,
                   progress=False)
    tok = get_tokenizer("bytes")
    assert split_documents(decode_split(tmp_path / "out", meta, "train", tok), tok) == DOCS
    assert meta["val"] == {"tokens": 0, "documents": 0, "shards": []}


def test_single_txt_is_one_document_split_by_tokens(tmp_path):
    text = "".join(f"line {i} of a single long text file\n" for i in range(500))
    (tmp_path / "one.txt").write_text(text)
    meta = prepare(str(tmp_path / "one.txt"), tmp_path / "out", tokenizer="bytes", val_fraction=0.1, num_proc=1,
                   progress=False)
    tok = get_tokenizer("bytes")
    train = decode_split(tmp_path / "out", meta, "train", tok)
    val = decode_split(tmp_path / "out", meta, "val", tok)
    assert meta["train"]["documents"] == 1 and "tokens" in meta["val_rule"]
    # The head in train, the last 10% in val, each after one EOT; together the whole document.
    assert train[0] == val[0] == tok.eot_token
    assert tok.decode(train[1:].tolist()) + tok.decode(val[1:].tolist()) == text
    assert val.size - 1 == int(np.ceil(len(text.encode()) * 0.1))


def test_shards_are_independent_of_num_proc_and_split_by_size(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"{i:02d}.txt").write_text(f"document {i} " * (50 + 13 * i))
    one = prepare(str(src), tmp_path / "p1", tokenizer="gpt2", shard_size=1000, num_proc=1, val_docs=2,
                  progress=False)
    two = prepare(str(src), tmp_path / "p2", tokenizer="gpt2", shard_size=1000, num_proc=2, val_docs=2,
                  progress=False)
    assert len(one["train"]["shards"]) > 3 and one["train"] == two["train"] and one["val"] == two["val"]
    for name in one["train"]["shards"] + one["val"]["shards"]:
        assert (tmp_path / "p1" / name).read_bytes() == (tmp_path / "p2" / name).read_bytes()
    assert all(read_shard(tmp_path / "p1" / n).size == 1000 for n in one["train"]["shards"][:-1])


def test_embedded_with_max_docs(tmp_path):
    files = embedded_files()[:60]
    meta = prepare("embedded", tmp_path / "emb", tokenizer="gpt2", max_docs=60, num_proc=1, progress=False)
    tok = get_tokenizer("gpt2")
    for split in ("train", "val"):
        expected = [f.read_text() for f in files if f.split == split]
        assert split_documents(decode_split(tmp_path / "emb", meta, split, tok), tok) == expected
    assert meta["val"]["documents"] >= 1, "the first 60 stdlib files include a validation file"
    assert meta["train"]["shards"] == ["embedded_train_000000.bin"]
    assert meta["source"].startswith("embedded:python")


def test_local_path_that_does_not_exist(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        prepare(str(tmp_path / "missing.txt"), tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="matches no files"):
        prepare(str(tmp_path / "*.jsonl"), tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        prepare("embedded", tmp_path / "out", tokenizer="nope", progress=False)


def test_prepare_main_help_and_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        prepare_main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "lightning-disttrain prepare" in help_text and "--dataset-config" in help_text and "embedded" in help_text
    (tmp_path / "a.txt").write_text("hello prepare_main")
    meta = prepare_main([str(tmp_path / "a.txt"), str(tmp_path / "out"), "--tokenizer", "bytes", "--num-proc", "1",
                         "--val-fraction", "0", "--no-progress"])
    assert meta["train"]["tokens"] == 1 + len("hello prepare_main")
    assert "wrote 19 train tokens" in capsys.readouterr().out
