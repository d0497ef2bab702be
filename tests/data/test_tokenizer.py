"""Tokenizers: GPT-2 ids identical to tiktoken's official encoding, offline; the byte tokenizer."""

import gzip
import inspect
import os
from pathlib import Path

import pytest

from lightning_disttrain.data import get_tokenizer
from lightning_disttrain.data import tokenizer as tokenizer_mod

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"
TIKTOKEN_CACHE = SHARED / "tiktoken"
SHAKESPEARE = SHARED / "data" / "tinyshakespeare.txt"

UNICODE = "naïve café — 日本語のテキスト, emoji 🤖🎉, Ελληνικά, עִבְרִית, zero\u200bwidth, e\u0301, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
WHITESPACE = "a  b   c\t\td\n\n\n   e \r\n  \u00a0 f" + " " * 50 + "\n" * 10 + "\t end   "


def samples() -> dict[str, str]:
    out = {
        "python": inspect.getsource(tokenizer_mod) + Path(inspect.getfile(os)).read_text()[:50_000],
        "unicode": UNICODE,
        "whitespace": WHITESPACE,
        "contractions": "I'm you're they've she'll we'd it's DON'T 'quoted' 123456 3.14159 1,000,000",
        "literal_eot_text": "before <|endoftext|> after",
    }
    if SHAKESPEARE.is_file():
        out["tinyshakespeare"] = SHAKESPEARE.read_text()
    return out


def test_gpt2_known_ids():
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eot_token == 50256 and tok.n_vocab == 50257 and tok.name == "gpt2"
    assert get_tokenizer("r50k_base").encode("Hello world") == [15496, 995]
    assert get_tokenizer("GPT2").name == "gpt2"


@pytest.mark.skipif(not TIKTOKEN_CACHE.is_dir(), reason=f"{TIKTOKEN_CACHE} (offline tiktoken files) is absent")
@pytest.mark.parametrize("official_name", ["gpt2", "r50k_base"])
def test_gpt2_matches_official_tiktoken(monkeypatch, official_name):
    import tiktoken

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE.resolve()))
    official = tiktoken.get_encoding(official_name)
    ours = get_tokenizer("gpt2")
    texts = samples()
    for name, text in texts.items():
        assert ours.encode(text) == official.encode_ordinary(text), name
        assert ours.decode(ours.encode(text)) == text, name
    assert ours.encode_batch(list(texts.values())) == official.encode_ordinary_batch(list(texts.values()))
    assert ours.n_vocab == official.n_vocab and ours.eot_token == official.eot_token


def test_gpt2_literal_eot_is_text_not_a_boundary():
    tok = get_tokenizer("gpt2")
    ids = tok.encode("a<|endoftext|>b")
    assert tok.eot_token not in ids and tok.decode(ids) == "a<|endoftext|>b"


def test_encode_batch_equals_encode():
    for name in ("gpt2", "bytes"):
        tok = get_tokenizer(name)
        texts = ["", "x", UNICODE, WHITESPACE, "Hello world"]
        assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_bytes_tokenizer_round_trip():
    tok = get_tokenizer("bytes")
    assert (tok.eot_token, tok.n_vocab, tok.name) == (256, 257, "bytes")
    ids = tok.encode(UNICODE)
    assert ids == list(UNICODE.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == UNICODE
    assert tok.decode([tok.eot_token, *tok.encode("hi"), tok.eot_token]) == "hi"
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # half a character: replaced, not an exception
    with pytest.raises(ValueError, match="0..256"):
        tok.decode([300])


def test_unknown_tokenizer_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown tokenizer 'llama3'.*gpt2, r50k_base, bytes"):
        get_tokenizer("llama3")


def test_tokenizer_object_passes_through():
    tok = get_tokenizer("bytes")
    assert get_tokenizer(tok) is tok


def test_corrupted_asset_is_refused(tmp_path, monkeypatch):
    raw = bytearray(gzip.decompress(tokenizer_mod.R50K_ASSET.read_bytes()))
    raw[100] ^= 1  # one flipped bit in the ranks
    bad = tmp_path / "r50k_base.tiktoken.gz"
    bad.write_bytes(gzip.compress(bytes(raw)))
    monkeypatch.setattr(tokenizer_mod, "R50K_ASSET", bad)
    tokenizer_mod._gpt2_encoding.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"sha256 .* expected 306cd27f.*corrupted"):
            get_tokenizer("gpt2")
        (tmp_path / "r50k_base.tiktoken.gz").write_bytes(b"not gzip")
        with pytest.raises(ValueError, match="not a valid gzip file"):
            get_tokenizer("gpt2")
        monkeypatch.setattr(tokenizer_mod, "R50K_ASSET", tmp_path / "missing.gz")
        with pytest.raises(ValueError, match="missing"):
            get_tokenizer("gpt2")
    finally:
        tokenizer_mod._gpt2_encoding.cache_clear()  # later tests get the real ranks again


def test_asset_is_package_data():
    # The gzip file must sit where pyproject's package-data rule "data/assets/*" picks it up.
    asset = tokenizer_mod.R50K_ASSET
    assert asset.parent.name == "assets" and asset.parent.parent.name == "data" and asset.is_file()
    assert 300_000 < asset.stat().st_size < 450_000
