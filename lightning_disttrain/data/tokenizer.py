"""Tokenizers: GPT-2 BPE that works offline, and a 257-symbol byte tokenizer.

`get_tokenizer(name)` is the only entry point. Both tokenizers share one small interface
(`encode`, `encode_batch`, `decode`, `eot_token`, `n_vocab`, `name`) so the rest of the data
pipeline never branches on which one it has.

The GPT-2 ranks ship with the package (`assets/r50k_base.tiktoken.gz`, 366 KB) instead of being
downloaded by tiktoken on first use: training nodes often have no internet, and a tokenizer that
silently differs between machines corrupts every shard it touches, so the bundled file is checked
against the sha256 that tiktoken itself pins for `r50k_base`.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import tiktoken

R50K_ASSET = Path(__file__).parent / "assets" / "r50k_base.tiktoken.gz"
# sha256 of the *decompressed* file; the same value tiktoken checks after a download.
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"

# GPT-2's pre-tokenisation regex in the possessive form tiktoken uses for r50k_base/gpt2
# (tiktoken_ext/openai_public.py): equivalent to the original release's pattern, faster.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOT = "<|endoftext|>"
GPT2_N_VOCAB = 50257

# Canonical name per accepted name: "r50k_base" and "gpt2" are the same ranks, pattern and EOT.
_ALIASES = {"gpt2": "gpt2", "r50k_base": "gpt2", "bytes": "bytes"}
TOKENIZER_NAMES = tuple(_ALIASES)


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    eot_token: int
    n_vocab: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class GPT2Tokenizer:
    """GPT-2 BPE (tiktoken `r50k_base`), ids 0..50255 plus `<|endoftext|>` = 50256.

    `encode` treats a literal "<|endoftext|>" in the text as ordinary text (tiktoken's
    `encode_ordinary`): training data scraped from the web contains that string, and it must not
    become a document boundary. Boundaries are inserted by `prepare` as `eot_token`.
    """

    name = "gpt2"

    def __init__(self, num_threads: int = 8) -> None:
        self.encoding = _gpt2_encoding()
        self.eot_token: int = self.encoding.eot_token
        self.n_vocab: int = self.encoding.n_vocab
        # tiktoken's Rust core releases the GIL, so threads give real parallelism here.
        self.num_threads = num_threads

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(list(texts), num_threads=self.num_threads)

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))

    def __reduce__(self):
        # Rebuild from the cached Encoding in the receiving process instead of pickling 50k ranks.
        return (GPT2Tokenizer, (self.num_threads,))

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(n_vocab={self.n_vocab}, eot_token={self.eot_token})"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-text = 256, n_vocab = 257.

    Needs no vocabulary file at all, which makes it the tokenizer of choice for tiny smoke runs.
    Decoding arbitrary ids can cut a multi-byte character in half, hence errors="replace".
    """

    name = "bytes"
    eot_token = 256
    n_vocab = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i <= 256]
        if bad:
            raise ValueError(f"byte tokenizer ids are 0..256; got {bad[:5]}. Decode with the tokenizer the ids came from.")
        return bytes(i for i in ids if i != self.eot_token).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(n_vocab=257, eot_token=256)"


def canonical_tokenizer_name(name: str) -> str:
    """The canonical name for `name` ("r50k_base" -> "gpt2"); ValueError for an unknown one."""
    if not isinstance(name, str) or name.lower() not in _ALIASES:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZER_NAMES)}.")
    return _ALIASES[name.lower()]


def get_tokenizer(name: str | Tokenizer = "gpt2") -> Tokenizer:
    """The tokenizer called `name`: "gpt2" (alias "r50k_base") or "bytes".

    A tokenizer object is passed through unchanged, so APIs can accept either.
    """
    if not isinstance(name, str) and isinstance(name, Tokenizer):
        return name
    canonical = canonical_tokenizer_name(name)
    if canonical == "gpt2":
        return GPT2Tokenizer()
    return ByteTokenizer()


def load_r50k_ranks(path: Path | None = None) -> dict[bytes, int]:
    """The 50,256 GPT-2 merge ranks from the bundled gzip file, sha256-verified."""
    path = Path(path) if path is not None else R50K_ASSET
    if not path.is_file():
        raise ValueError(
            f"GPT-2 ranks {path} are missing: the package was installed without its data files. "
            "Reinstall lightning-disttrain (pip install --force-reinstall) or use tokenizer='bytes'."
        )
    try:
        raw = gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as err:
        raise ValueError(f"GPT-2 ranks {path} are not a valid gzip file ({err}); reinstall lightning-disttrain.") from err
    digest = hashlib.sha256(raw).hexdigest()
    if digest != R50K_SHA256:
        raise ValueError(
            f"GPT-2 ranks {path} have sha256 {digest}, expected {R50K_SHA256}: the file is corrupted or "
            "was replaced. Reinstall lightning-disttrain; shards tokenized with it would be wrong."
        )
    # tiktoken's own format: one "base64(token) rank" per line (tiktoken/load.py).
    ranks: dict[bytes, int] = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=1)
def _gpt2_encoding() -> tiktoken.Encoding:
    # Built once per process: parsing 50k ranks takes ~0.2 s and the Encoding is immutable.
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=load_r50k_ranks(),
        special_tokens={GPT2_EOT: 50256},
        explicit_n_vocab=GPT2_N_VOCAB,
    )

