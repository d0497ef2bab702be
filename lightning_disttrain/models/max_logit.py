"""The largest pre-softmax attention logit of each head: what QK-clip (MuonClip) bounds.

``max over (batch, query i, key j <= i) of scale * q_i . k_j`` per query head, computed without
gradients, in row chunks (never the whole ``T x T`` score matrix at once), keys shared by a
grouped-query head's queries without being copied (the queries are viewed as ``(kv_head, group)``).
Attention kernels (SDPA, flash) do not return it, so this is one more ``Q K^T`` per layer: the
cost of QK-clip, paid only when it is on (``callbacks.QKClip``).

Context parallel: ``ring_max_logit`` passes this rank's keys around the cp group (the ring of
``ring_attention``, keys only: no values, no gradients) and takes the blocks ring attention
computes (``ring_blocks``: causal ones on the diagonal, fully masked ones skipped), so each rank's
result is its queries' maximum over the whole sequence's keys; the ranks' maxima then reduce like
the data-parallel ones (``QKClip``).
"""

from __future__ import annotations

import math

import torch

from lightning_disttrain.models.ring_attention import Shift, ring_blocks

CHUNK_ELEMENTS = 1 << 24
"""At most this many scores (fp32 after the max) at once: 64 MiB of fp32."""
MIN_ROWS = 128
"""Query rows per tile at least (long sequences tile the keys instead), so a 128k-token sequence
takes hundreds of tiles per layer, not tens of thousands."""


def block_max_logit(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Per query head, the largest ``scale * q . k`` of the block (float32, shape ``(H,)``);
    ``q``: (B, H, Tq, D), ``k``: (B, H_kv, Tk, D) with H a multiple of H_kv. ``causal``: query row
    i sees keys 0..i only (a diagonal block: Tq == Tk). Tiled over query rows and keys so that a
    tile holds about ``CHUNK_ELEMENTS`` scores; keys after a causal tile's last row are skipped."""
    b, h, tq, d = q.shape
    kv = k.size(1)
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} key/value heads")
    if causal and tq != k.size(2):
        raise ValueError(f"a causal block needs as many keys as queries, got {tq} and {k.size(2)}")
    qg = q.unflatten(1, (kv, h // kv))  # (B, H_kv, G, Tq, D): query head kv*G + g uses key head kv
    kt = k.unsqueeze(2).transpose(-1, -2)  # (B, H_kv, 1, D, Tk)
    tk = k.size(2)
    rows = min(tq, max(MIN_ROWS, CHUNK_ELEMENTS // max(1, b * h * tk))) if tq else 1
    cols = max(1, CHUNK_ELEMENTS // max(1, b * h * rows))
    best = torch.full((h,), -math.inf, dtype=torch.float32, device=q.device)
    with torch.no_grad():
        for start in range(0, tq, rows):
            stop = min(tq, start + rows)
            for first in range(0, stop if causal else tk, cols):
                last = min(stop if causal else tk, first + cols)
                scores = torch.matmul(qg[..., start:stop, :], kt[..., first:last]).float()  # (B, H_kv, G, r, c)
                if causal and last - 1 > start:  # some key after some row's own position
                    i = torch.arange(start, stop, device=q.device).unsqueeze(1)
                    scores.masked_fill_(torch.arange(first, last, device=q.device) > i, -math.inf)
                best = torch.maximum(best, scores.amax(dim=(0, 3, 4)).flatten())
    return best * scale


def causal_max_logit(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Per query head, the largest causal attention logit of a whole sequence (float32, ``(H,)``)."""
    return block_max_logit(q, k, True, _scale(q, scale))


def ring_max_logit(q: torch.Tensor, k: torch.Tensor, rank: int, size: int, shift: Shift,
                   scale: float | None = None) -> torch.Tensor:
    """Per query head, the largest causal logit of this cp rank's queries (its head and tail chunks,
    ``2L`` rows) over the whole sequence's keys, which travel around the ring (``shift``)."""
    chunk, scale = q.size(2) // 2, _scale(q, scale)
    best = torch.full((q.size(1),), -math.inf, dtype=torch.float32, device=q.device)
    held = [k]
    with torch.no_grad():
        for step in range(size):
            pending = shift(held) if step < size - 1 else None
            for rows, cols, causal in ring_blocks(rank, (rank - step) % size, chunk):
                best = torch.maximum(best, block_max_logit(q[:, :, rows], held[0][:, :, cols], causal, scale))
            if pending is not None:
                held = pending()
    return best


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
