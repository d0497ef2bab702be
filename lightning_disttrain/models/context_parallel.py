"""Context parallel for attention: each rank of a ``cp`` group holds a shard of every sequence.

Load balance for causal attention: the sequence is cut into ``2 * cp`` chunks and rank ``r`` holds
chunks ``r`` and ``2*cp - 1 - r`` (a head chunk and its mirror from the tail), so every rank's
queries see the same number of keys in total (the work of a causal mask is a triangle; a head
chunk's cheap rows pair with a tail chunk's expensive ones).

Attention over the whole sequence: ring attention (``models/ring_attention.py``): each rank keeps
its own keys and values; their chunks pass around the cp group's ranks point to point while each
rank attends its queries to the chunk it holds, fully masked blocks skipped, and the blocks merge
exactly by their log-sum-exp. Every rank keeps O(S/cp) for backward and in flight (no rank holds
the whole sequence's keys and values); with grouped-query attention the chunks that travel are
``n_kv_head / n_head`` the size of the queries. It has no attention dropout (refused at setup).
Positions (learned embeddings, RoPE) are the global positions of the rank's tokens: those of the
shard the strategy cut from the batch (``ContextParallel.shard``, recorded per batch), never
inferred from an activation's shape (a later pipeline stage's hidden states hold 1/tp of the shard
under sequence parallel).

Plain torch: a model opts in by giving its position-dependent modules a
``context_parallel`` attribute (None: off), which the strategy sets to a :class:`ContextParallel`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_disttrain.models.ring_attention import group_name_of, ring_attention


@dataclass(eq=False)
class ContextParallel:
    """This rank's place in its context-parallel group, and the positions of the shard it holds now."""

    group: Any
    """The cp ranks: a process group or a 1-D ``DeviceMesh``."""
    rank: int
    size: int
    positions: torch.Tensor | None = field(default=None, repr=False)
    """The global positions of this rank's tokens in the batch the strategy sharded last
    (``shard``), or None before any. Shared by every module (and pipeline stage) of the model."""
    group_name: str | None = field(default=None, init=False, repr=False)
    """``group``'s process group's name, which ring attention's operator takes (read here, once,
    outside any traced code); None without a group."""

    def __post_init__(self) -> None:
        if self.group is not None:
            self.group_name = group_name_of(self.group)

    def full_length(self, local_len: int) -> int:
        return local_len * self.size

    def shard(self, seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Record that this rank now holds its shard of sequences of ``seq_len`` tokens (the
        strategy calls it for each batch it shards) and return that shard's global positions."""
        self.positions = local_positions(seq_len, self.rank, self.size, device)
        return self.positions

    def shard_positions(self, device: torch.device | str | None = None, tokens: int | None = None) -> torch.Tensor:
        """The global positions of this rank's tokens in the current forward.

        ``tokens``: how many token ids the forward received, when its input is the ids (the first
        pipeline stage, or the whole model): with no recorded shard of that many positions (a
        forward no strategy sharded for), the ids are taken as this rank's shard of a sequence of
        ``tokens * size``. A forward whose input is hidden states (a later pipeline stage) passes
        None and gets the recorded shard: the hidden states' length is not the shard's (1/tp of it
        under sequence parallel), so positions are never inferred from it."""
        recorded = self.positions
        if recorded is not None and (tokens is None or recorded.numel() == tokens):
            return recorded if device is None else recorded.to(device)
        if tokens is None:
            raise ValueError(
                f"cp={self.size}: a pipeline stage after the first needs the positions of this rank's shard of the "
                f"sequence, which the strategy records when it shards the batch (ContextParallel.shard), and none "
                f"was recorded: run the model through NDParallelStrategy's steps, or call "
                f"context_parallel.shard(seq_len) before the forward")
        return self.local_positions(tokens, device)

    def local_positions(self, local_len: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions of this rank's ``local_len`` tokens."""
        return local_positions(self.full_length(local_len), self.rank, self.size, device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                  enable_gqa: bool = False) -> torch.Tensor:
        """Causal attention of this rank's queries (B, H, T_local, D) over the whole sequence: ring
        attention (``models/ring_attention.py``), the cp group's key/value chunks passed around the
        ranks, each block merged by its log-sum-exp. ``enable_gqa``: ``k``/``v`` have fewer heads."""
        if dropout_p:
            raise ValueError(f"context parallel (cp={self.size}) runs ring attention, which has no attention dropout "
                             f"(dropout_p={dropout_p}): set the model's dropout to 0 (pre-training runs use 0) or use cp=1")
        if not enable_gqa and k.size(1) != q.size(1):
            raise ValueError(f"{q.size(1)} query heads and {k.size(1)} key/value heads need enable_gqa=True")
        if self.group_name is None:
            raise ValueError(f"context parallel (cp={self.size}) needs the cp ranks' process group: "
                             f"ContextParallel(group=None) cannot attend across the shards")
        return ring_attention(q, k, v, self.group_name, self.rank, self.size)


def check_length(seq_len: int, size: int) -> None:
    if seq_len % (2 * size):
        raise ValueError(f"context parallel cp={size} cuts each sequence into 2 x cp = {2 * size} equal chunks, but "
                         f"the sequence length {seq_len} is not divisible by {2 * size}: use seq_len="
                         f"{seq_len + (-seq_len) % (2 * size)} (or a multiple of {2 * size}), or a smaller cp")


def local_positions(seq_len: int, rank: int, size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions held by ``rank`` of ``size`` in a sequence of ``seq_len``: chunk ``rank`` and
    chunk ``2*size - 1 - rank`` of ``2*size`` equal chunks."""
    check_length(seq_len, size)
    chunk = seq_len // (2 * size)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([head, tail])


def shard_sequence(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """This rank's tokens of ``t`` along ``dim`` (a copy, contiguous)."""
    index = local_positions(t.size(dim), rank, size, t.device)
    return t.index_select(dim, index)


def attention_work(seq_len: int, rank: int, size: int) -> int:
    """(query, key) pairs a causal mask lets ``rank`` compute: the load-balance measure."""
    q = local_positions(seq_len, rank, size)
    return int((q + 1).sum())


@contextmanager
def whole_sequences(module: torch.nn.Module) -> Iterator[None]:
    """Run ``module`` on whole sequences on every rank (context parallel off), e.g. to generate:
    every rank then computes the same thing, as with cp=1; restored on exit."""
    saved = [(m, m.context_parallel) for m in module.modules() if getattr(m, "context_parallel", None) is not None]
    for m, _ in saved:
        m.context_parallel = None
    try:
        yield
    finally:
        for m, cp in saved:
            m.context_parallel = cp
