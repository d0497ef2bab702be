"""Token shards in llm.c's `.bin` format, so shards move freely between us, llm.c and modded-nanogpt.

Layout (llm.c `dev/data/data_common.py::write_datafile`, little-endian throughout):

    header: 256 x int32   [0] = 20240520 (magic), [1] = 1 (version: uint16 tokens),
                          [2] = number of tokens, [3:] = 0
    body:   N x uint16    the tokens

Version 2 of that format (uint32 tokens, for Llama 3's 128k vocabulary) is deliberately not
read: every tokenizer we ship fits in uint16, and a reader that accepted it silently would
hand the model ids it was not built for.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
MAX_TOKEN_ID = 65535
# header[2] is an int32, so a single shard holds fewer than 2**31 tokens.
MAX_SHARD_TOKENS = 2**31 - 1


def make_header(num_tokens: int) -> np.ndarray:
    """The 256-int32 header for a shard of `num_tokens` tokens."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, num_tokens
    return header


def write_shard(path: str | os.PathLike, tokens) -> Path:
    """Write `tokens` (any integer sequence or array) to `path` as a llm.c version-1 shard.

    The file is written under a temporary name and renamed into place, so a reader (or a crash)
    never sees half a shard under the final name.
    """
    path = Path(path)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{path}: tokens must be one-dimensional, got shape {arr.shape}; flatten them first.")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: tokens must be integers, got dtype {arr.dtype}.")
    if arr.size > MAX_SHARD_TOKENS:
        raise ValueError(f"{path}: {arr.size} tokens exceed the format's 2**31-1 per shard; split into smaller shards.")
    if arr.size and arr.dtype != TOKEN_DTYPE:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > MAX_TOKEN_ID:
            raise ValueError(
                f"{path}: token ids must be in 0..{MAX_TOKEN_ID} to be stored as uint16, got range {lo}..{hi}. "
                "A vocabulary larger than 65536 cannot be stored in this format (llm.c version 1); "
                "use a tokenizer with at most 65536 ids."
            )
    body = arr.astype(TOKEN_DTYPE, copy=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(make_header(body.size).tobytes())
        f.write(body.tobytes())
    os.replace(tmp, path)
    return path


def read_header(path: str | os.PathLike) -> int:
    """Validate the header of shard `path` and return its token count.

    Raises ValueError for a file that is not a llm.c version-1 shard or whose size does not
    match the token count in its header (truncated by an interrupted copy, or padded).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError as err:
        raise ValueError(f"shard {path} does not exist; check the path or run `prepare` first.") from err
    if len(raw) < HEADER_BYTES:
        raise ValueError(
            f"shard {path} is {size} bytes, shorter than the {HEADER_BYTES}-byte header: it is truncated "
            "or not a token shard. Re-copy or re-create it with `prepare`."
        )
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != MAGIC:
        raise ValueError(
            f"{path} is not a llm.c token shard: magic is {int(header[0])}, expected {MAGIC}. "
            "Point the data source at .bin files written by `prepare` (or llm.c / modded-nanogpt)."
        )
    if header[1] != VERSION:
        raise ValueError(
            f"shard {path} has format version {int(header[1])}; only version {VERSION} (uint16 tokens, GPT-2 "
            "style) is supported. Version 2 (uint32, Llama 3) shards must be re-tokenized with `prepare`."
        )
    num_tokens = int(header[2])
    expected = HEADER_BYTES + num_tokens * TOKEN_DTYPE.itemsize
    if num_tokens < 0 or size != expected:
        problem = "truncated" if size < expected else "longer than its header says"
        raise ValueError(
            f"shard {path} is {problem}: its header announces {num_tokens} tokens ({expected} bytes) but the "
            f"file has {size} bytes. Re-copy it or re-create it with `prepare`."
        )
    return num_tokens


def read_shard(path: str | os.PathLike, mmap: bool = True) -> np.ndarray:
    """The tokens of shard `path` as uint16: a read-only `np.memmap` by default, else in memory."""
    num_tokens = read_header(path)
    if mmap:
        if num_tokens == 0:  # np.memmap refuses zero-length maps
            return np.zeros(0, dtype=TOKEN_DTYPE)
        return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(num_tokens,))
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        return np.fromfile(f, dtype=TOKEN_DTYPE, count=num_tokens)


class ShardWriter:
    """Streams tokens into consecutive shards `{prefix}_{index:06d}.bin` of `shard_size` tokens.

    Used by `prepare`, whose corpora are far larger than memory: it fills one preallocated
    buffer and writes a shard each time the buffer is full.
    """

    def __init__(self, prefix: str | os.PathLike, shard_size: int) -> None:
        if not 0 < shard_size <= MAX_SHARD_TOKENS:
            raise ValueError(f"shard_size must be in 1..{MAX_SHARD_TOKENS} tokens, got {shard_size}.")
        self.prefix = Path(prefix)
        self.shard_size = shard_size
        self._buffer = np.empty(min(shard_size, 1 << 20), dtype=TOKEN_DTYPE)
        self._filled = 0
        self.paths: list[Path] = []
        self.num_tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        self.num_tokens += tokens.size
        while tokens.size:
            room = self.shard_size - self._filled
            take = tokens[:room]
            self._ensure_capacity(self._filled + take.size)
            self._buffer[self._filled : self._filled + take.size] = take
            self._filled += take.size
            tokens = tokens[take.size :]
            if self._filled == self.shard_size:
                self._flush()

    def close(self) -> list[Path]:
        """Write the last, partial shard; returns all shard paths in order."""
        if self._filled:
            self._flush()
        return self.paths

    def _ensure_capacity(self, n: int) -> None:
        # Grow geometrically up to shard_size, so small corpora do not allocate 200 MB up front.
        if n > self._buffer.size:
            new = np.empty(min(self.shard_size, max(n, 2 * self._buffer.size)), dtype=TOKEN_DTYPE)
            new[: self._filled] = self._buffer[: self._filled]
            self._buffer = new

    def _flush(self) -> None:
        path = self.prefix.with_name(f"{self.prefix.name}_{len(self.paths):06d}.bin")
        write_shard(path, self._buffer[: self._filled])
        self.paths.append(path)
        self._filled = 0
