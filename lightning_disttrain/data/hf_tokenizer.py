"""GPT-2's BPE as the files Hugging Face tokenizers read (``vocab.json``, ``merges.txt``), rebuilt
from the ranks this package ships (``tokenizer.load_r50k_ranks``): nothing is downloaded, and the
result equals OpenAI's released ``encoder.json`` / ``vocab.bpe``.

A tiktoken rank table has no merge list, but it implies one: token ``t`` of rank ``r`` is the merge
that BPE, restricted to ranks below ``r``, leaves as the last two pieces of ``t``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_disttrain.data.tokenizer import GPT2_EOT, GPT2_N_VOCAB, load_r50k_ranks

GPT2_VOCAB = GPT2_N_VOCAB


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (its ``encoder.py``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, limit), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank >= limit:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"the GPT-2 ranks imply no merge for token {token!r}; the bundled ranks are damaged")
    return parts[0], parts[1]


def gpt2_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """``vocab.json``'s mapping (50,257 entries) and ``merges.txt``'s lines (50,000, in rank order)."""
    ranks = load_r50k_ranks()
    show = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(show[x] for x in b)

    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[GPT2_EOT] = GPT2_N_VOCAB - 1
    merges = [" ".join(map(text, _last_merge(ranks, token)))
              for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]) if len(token) > 1]
    return vocab, merges


def write_gpt2_tokenizer(out_dir: str | os.PathLike, model_max_length: int = 1024) -> list[Path]:
    """Write GPT-2's tokenizer files into ``out_dir`` (``AutoTokenizer.from_pretrained`` reads them)."""
    out = Path(out_dir)
    vocab, merges = gpt2_vocab_and_merges()
    files = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
        "tokenizer_config.json": json.dumps({
            "tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length, "add_prefix_space": False,
            "bos_token": GPT2_EOT, "eos_token": GPT2_EOT, "unk_token": GPT2_EOT}, indent=2) + "\n",
        "special_tokens_map.json": json.dumps(
            {"bos_token": GPT2_EOT, "eos_token": GPT2_EOT, "unk_token": GPT2_EOT}, indent=2) + "\n",
    }
    for name, content in files.items():
        (out / name).write_text(content, encoding="utf-8")
    return [out / name for name in files]
