"""Data pipeline: tokenizers, llm.c token shards, `prepare`, and the resumable `TokenDataModule`."""

from .shards import read_header, read_shard, write_shard
from .tokenizer import get_tokenizer

__all__ = ["get_tokenizer", "read_header", "read_shard", "write_shard"]
