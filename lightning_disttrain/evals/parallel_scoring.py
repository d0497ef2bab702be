"""Scoring requests with a model's forward, split across data-parallel ranks and gathered.

Every rank holds the whole request list (read from the same files), so the split needs no
communication: requests are ordered longest first (lm-evaluation-harness's order, which also
keeps padding low), rank r takes every ``size``-th from position r, in batches of ``batch_size``.
A sharded model (FSDP2) runs collectives inside every forward, so every rank must run the same
number of forwards: a rank with fewer batches runs one-token filler forwards until it has run as
many as the busiest rank. Scores are then gathered to every rank over the data-parallel group
(tensor-parallel peers of one replica compute the same requests).

Numerics: fp32 log-softmax over the tokenizer's vocabulary (padding columns of the logits cut);
right padding, which causal attention keeps out of the positions that are scored. A request
longer than ``max_length + 1`` tokens keeps its last ones (the context is cut from the left).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_disttrain.evals.requests import Request, Score

Forward = Callable[[torch.Tensor], torch.Tensor]
"""Token ids (B, T) -> logits (B, T, >= vocab), in eval mode without gradients."""


@dataclass
class DataParallel:
    """This rank's place among the data-parallel replicas, and how to gather from them."""

    rank: int = 0
    size: int = 1
    group: Any = None
    """torch.distributed group of the data-parallel ranks (None: the default group)."""

    def all_gather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        from lightning_disttrain import comm

        return comm.all_gather_object(obj, group=self.group)

    def all_reduce_max(self, value: int) -> int:
        return max(self.all_gather(value))


def shard(n: int, dp: DataParallel, lengths: Sequence[int] | None = None) -> list[int]:
    """The indices of ``n`` things this rank handles (longest first when ``lengths`` are given)."""
    order = sorted(range(n), key=lambda i: -lengths[i]) if lengths is not None else list(range(n))
    return order[dp.rank::dp.size]


def forwards_per_rank(n: int, dp: DataParallel, batch_size: int) -> int:
    """How many forwards every rank runs for ``n`` things (the busiest rank's count)."""
    return math.ceil(math.ceil(n / dp.size) / batch_size) if n else 0


def filler(forward: Forward, device: torch.device, width: int = 1) -> None:
    """A one-row forward whose output is discarded: keeps a short rank in step with the others."""
    forward(torch.zeros(1, width, dtype=torch.long, device=device))


def _rows(requests: list[Request], max_length: int) -> list[tuple[list[int], int]]:
    rows = []
    for r in requests:
        tokens = list(r.context + r.continuation)[-(max_length + 1):]
        rows.append((tokens, min(len(r.continuation), len(tokens) - 1)))
    return rows


def score_batch(forward: Forward, requests: list[Request], *, vocab: int, max_length: int, device: torch.device,
                pad_id: int = 0, multiple: int = 1) -> list[Score]:
    rows = _rows(requests, max_length)
    width = max(len(t) - 1 for t, _ in rows)
    width += -width % multiple
    idx = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, (tokens, _) in enumerate(rows):
        idx[i, : len(tokens) - 1] = torch.tensor(tokens[:-1])
    logits = forward(idx.to(device))
    logprobs = F.log_softmax(logits[..., :vocab].float(), dim=-1)
    out = []
    for i, (tokens, k) in enumerate(rows):
        end = len(tokens) - 1
        lp = logprobs[i, end - k: end]
        target = torch.tensor(tokens[end - k + 1: end + 1], device=lp.device)
        picked = lp.gather(-1, target[:, None]).squeeze(-1)
        out.append(Score(float(picked.double().sum()), bool((lp.argmax(-1) == target).all())))
    return out


def score_requests(forward: Forward, requests: list[Request], dp: DataParallel, *, vocab: int, max_length: int,
                   batch_size: int, device: torch.device, pad_id: int = 0, multiple: int = 1) -> list[Score]:
    """Scores of all ``requests`` (every rank gets them all), computed ``1/dp.size`` per rank."""
    mine = shard(len(requests), dp, [len(r.context) + len(r.continuation) for r in requests])
    local: list[tuple[int, Score]] = []
    for start in range(0, len(mine), batch_size):
        batch = mine[start:start + batch_size]
        scores = score_batch(forward, [requests[i] for i in batch], vocab=vocab, max_length=max_length,
                             device=device, pad_id=pad_id, multiple=multiple)
        local.extend(zip(batch, scores))
    for _ in range(forwards_per_rank(len(requests), dp, batch_size) - math.ceil(len(mine) / batch_size)):
        filler(forward, device, multiple)
    merged: dict[int, Score] = {}
    for part in dp.all_gather([(i, s.logprob, s.greedy) for i, s in local]):
        merged.update({i: Score(lp, g) for i, lp, g in part})
    if len(merged) != len(requests):
        raise RuntimeError(f"gathered {len(merged)} scores for {len(requests)} requests: the data-parallel ranks "
                           f"read different eval data; give every rank the same files")
    return [merged[i] for i in range(len(requests))]
