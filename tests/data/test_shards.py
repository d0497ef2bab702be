"""llm.c `.bin` shards: round trips, compatibility with llm.c's writer and reader, and bad files."""

import numpy as np
import pytest
import torch

from lightning_disttrain.data import read_header, read_shard, write_shard
from lightning_disttrain.data.shards import HEADER_BYTES, MAGIC, ShardWriter


def llmc_write_datafile(filename, toks):
    """llm.c dev/data/data_common.py::write_datafile for GPT-2 (version 1), line for line."""
    header = np.zeros(256, dtype=np.int32)
    header[0] = 20240520
    header[1] = 1
    header[2] = len(toks)
    toks_np = np.array(toks, dtype=np.uint16)
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(toks_np.tobytes())


def modded_nanogpt_load_data_shard(file):
    """modded-nanogpt's reader (train_gpt.py::_load_data_shard), line for line."""
    header = torch.from_file(str(file), False, 256, dtype=torch.int32)
    assert header[0] == 20240520, "magic number mismatch in the data .bin file"
    assert header[1] == 1, "unsupported version"
    num_tokens = int(header[2])
    with open(file, "rb", buffering=0) as f:
        tokens = torch.empty(num_tokens, dtype=torch.uint16)
        f.seek(256 * 4)
        nbytes = f.readinto(tokens.numpy())
        assert nbytes == 2 * num_tokens, "number of tokens read does not match header"
    return tokens


@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip(tmp_path, mmap):
    tokens = np.random.default_rng(0).integers(0, 65536, size=10_001)
    path = write_shard(tmp_path / "a.bin", tokens)
    assert path.stat().st_size == HEADER_BYTES + 2 * tokens.size
    assert read_header(path) == tokens.size
    got = read_shard(path, mmap=mmap)
    assert got.dtype == np.uint16 and isinstance(got, np.memmap) == mmap
    np.testing.assert_array_equal(got, tokens)


def test_empty_shard(tmp_path):
    path = write_shard(tmp_path / "empty.bin", [])
    assert read_header(path) == 0 and read_shard(path).size == 0


def test_reads_llmc_written_shard(tmp_path):
    toks = [50256, 15496, 995, 0, 65535]
    llmc_write_datafile(tmp_path / "llmc.bin", toks)
    assert read_shard(tmp_path / "llmc.bin").tolist() == toks


def test_llmc_style_reader_reads_ours(tmp_path):
    toks = np.random.default_rng(1).integers(0, 50257, size=777)
    write_shard(tmp_path / "ours.bin", toks)
    got = modded_nanogpt_load_data_shard(tmp_path / "ours.bin")
    np.testing.assert_array_equal(got.numpy().astype(np.int64), toks)
    header = np.fromfile(tmp_path / "ours.bin", dtype="<i4", count=256)
    assert header[0] == MAGIC and header[1] == 1 and header[2] == 777 and not header[3:].any()


def test_wrong_magic(tmp_path):
    path = tmp_path / "notashard.bin"
    path.write_bytes(b"\x00" * 2048)
    with pytest.raises(ValueError, match=r"notashard\.bin is not a llm\.c token shard: magic is 0"):
        read_shard(path)


def test_wrong_version(tmp_path):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [MAGIC, 2, 4]
    (tmp_path / "v2.bin").write_bytes(header.tobytes() + np.arange(4, dtype="<u4").tobytes())
    with pytest.raises(ValueError, match="version 2"):
        read_shard(tmp_path / "v2.bin")


def test_truncated(tmp_path):
    path = write_shard(tmp_path / "cut.bin", np.arange(1000))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"cut\.bin is truncated: its header announces 1000 tokens"):
        read_shard(path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="shorter than the 1024-byte header"):
        read_header(path)


def test_longer_than_header(tmp_path):
    path = write_shard(tmp_path / "long.bin", np.arange(10))
    path.write_bytes(path.read_bytes() + b"\0\0")
    with pytest.raises(ValueError, match="longer than its header says"):
        read_shard(path)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_shard(tmp_path / "nope.bin")


@pytest.mark.parametrize("bad", [[0, 65536], [-1, 5]])
def test_write_rejects_ids_outside_uint16(tmp_path, bad):
    with pytest.raises(ValueError, match=r"overflow\.bin.*0\.\.65535.*larger than 65536 cannot be stored"):
        write_shard(tmp_path / "overflow.bin", bad)
    assert not list(tmp_path.iterdir()), "nothing may be written for rejected tokens"


def test_write_rejects_non_integer_and_2d(tmp_path):
    with pytest.raises(ValueError, match="integers"):
        write_shard(tmp_path / "f.bin", np.ones(3))
    with pytest.raises(ValueError, match="one-dimensional"):
        write_shard(tmp_path / "f.bin", np.ones((2, 2), dtype=np.int64))


def test_shard_writer_splits_and_keeps_order(tmp_path):
    writer = ShardWriter(tmp_path / "c_train", shard_size=1000)
    chunks = [np.arange(n, dtype=np.uint16) + n for n in (1, 999, 1500, 7, 2493)]
    for c in chunks:
        writer.add(c)
    paths = writer.close()
    assert [p.name for p in paths] == [f"c_train_{i:06d}.bin" for i in range(5)]
    assert [read_header(p) for p in paths] == [1000, 1000, 1000, 1000, 1000]
    np.testing.assert_array_equal(np.concatenate([read_shard(p) for p in paths]), np.concatenate(chunks))
    assert writer.num_tokens == 5000
