"""Data pipeline: tokenizers, llm.c token shards, `prepare`, and the resumable `TokenDataModule`."""

from .datamodule import TokenDataModule
from .embedded import embedded_documents
from .prepare import prepare, prepare_main
from .shards import read_header, read_shard, write_shard
from .tokenizer import get_tokenizer

__all__ = [
    "TokenDataModule",
    "embedded_documents",
    "get_tokenizer",
    "prepare",
    "prepare_main",
    "read_header",
    "read_shard",
    "write_shard",
]
