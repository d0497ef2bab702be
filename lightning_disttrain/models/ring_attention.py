"""Ring attention: causal attention over a sequence sharded across the ``cp`` ranks, keys and values
passed around the ranks in a ring, each block's output merged by its log-sum-exp.

Each rank holds two chunks of every sequence (``context_parallel.local_positions``: chunk ``r``
and its mirror ``2*cp - 1 - r`` of ``2*cp`` chunks of length ``L``), its queries, keys and values
for those ``2L`` tokens. In ``cp`` steps the key/value chunks of every rank pass through every
other: at step ``s`` rank ``r`` holds those of rank ``src = r - s (mod cp)``, attends its queries
to them, and meanwhile sends them on to ``r + 1`` and receives ``src - 1``'s (``comm.ring_shift``:
the transfer overlaps the block's compute). Which (query chunk, key chunk) pairs a causal mask
leaves (``ring_blocks``):

- ``src == r``: head on head and tail on tail under the (square) causal mask, tail on head in full;
- ``src < r``: both query chunks on ``src``'s head chunk, in full (its tail chunk is later than both);
- ``src > r``: the tail query chunk on both of ``src``'s chunks, in full (the head is earlier than both).

Every step costs the same two ``L x L`` blocks on every rank (the first: two causal halves and one
whole; the load balance of the head-tail split), and fully masked pairs are never computed. Each block runs a fused kernel that returns
the output and each query's log-sum-exp (``_torch_compat.attention_with_lse``: CPU's flash kernel;
CUDA's flash in bf16/fp16, its memory-efficient kernel otherwise), and the blocks of a query row
merge exactly (online softmax) in float32: ``lse = logaddexp(lse, lse_b)``, ``out = out *
exp(lse_old - lse) + out_b * exp(lse_b - lse)``.

Backward runs the ring again: the keys and values travel as in the forward, each with a float32
accumulator of its gradient; each block's gradients come from the kernel's backward given the
*merged* output and log-sum-exp (the probabilities of the whole row), so they are exact; the
query gradient stays local, and the key/value accumulators arrive home after ``cp`` hops.

Memory per rank: the saved tensors are this rank's q, k, v, output and log-sum-exp, as without
context parallel on ``S/cp`` tokens; in flight, one key/value chunk pair being received (and in
backward its gradient accumulator): O(S/cp), with no ``S x S`` (or ``S x S/cp``) mask anywhere.

The whole ring is one operator, ``ldt::ring_attention`` (and ``ldt::ring_attention_backward``), a
``torch.library`` custom op: selective activation checkpointing keeps its output (a recomputed
block does not run the ring again) and ``torch.compile`` traces it whole. Its process group is
named by ``group_name`` and resolved when the op runs (``_torch_compat.resolve_process_group``:
the live group of that name, whatever graph was traced). The algorithm itself (``ring_forward``,
``ring_backward``) takes the transfer as a function, so one process can run it for several ranks
in threads (``LocalRing``: the tests, and the GPU check on one device).
"""

from __future__ import annotations

import math
import queue
from collections.abc import Callable
from typing import Any

import torch

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain import comm

Shift = Callable[[list[torch.Tensor]], Callable[[], list[torch.Tensor]]]
"""Start sending tensors to the ring's next rank and receiving the previous rank's; the returned
function waits and gives them (``comm.ring_shift`` bound to a group, or ``LocalRing.shift``)."""

Block = tuple[slice, slice, bool]
"""(query rows, key columns, causal) of this rank's ``2L`` local rows and of the held chunks."""


def ring_blocks(rank: int, src: int, chunk: int) -> list[Block]:
    """The blocks ``rank`` computes against the chunks of ``src`` (module docstring); local rows
    0..L are the head chunk, L..2L the tail, the same for the key columns."""
    head, tail, both = slice(0, chunk), slice(chunk, 2 * chunk), slice(0, 2 * chunk)
    if src == rank:
        return [(head, head, True), (tail, head, False), (tail, tail, True)]
    if src < rank:
        return [(both, head, False)]
    return [(tail, both, False)]


def pairs_computed(seq_len: int, rank: int, size: int) -> int:
    """(query, key) pairs the kernels are handed on ``rank`` (a causal block counts whole, as the
    kernels are handed it): ``2 * size + 1`` blocks of ``L x L``, the same on every rank; two of
    them are the causal diagonal ones, whose masked half the kernels skip tile by tile."""
    chunk = seq_len // (2 * size)
    total = 0
    for step in range(size):
        for rows, cols, _ in ring_blocks(rank, (rank - step) % size, chunk):
            total += (rows.stop - rows.start) * (cols.stop - cols.start)
    return total


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``heads / kv_heads`` query heads."""
    groups = heads // kv.size(1)
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _reduce(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of ``_expand``: summed over each key/value head's query heads, in fp32."""
    groups = grad.size(1) // kv_heads
    return grad if groups == 1 else grad.float().unflatten(1, (kv_heads, groups)).sum(2)


def _merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (output, log-sum-exp) into the running ones (views of the rows; float32)."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_((lse - merged).exp_().unsqueeze(-1)).add_(block_out.float() * (block_lse - merged).exp_().unsqueeze(-1))
    lse.copy_(merged)


def _output_like(q: torch.Tensor, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """A (B, H, T, D) tensor stored as (B, T, H, D), as SDPA's kernels return theirs: the model's
    ``transpose(1, 2).reshape(B, T, -1)`` for the output projection is then a view, not a second
    copy of the output kept for backward."""
    b, h, t, d = q.shape
    make = torch.zeros if zero else torch.empty
    return make(b, t, h, d, dtype=dtype, device=q.device).transpose(1, 2)


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, size: int, shift: Shift,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's causal attention output (like ``q``: B, H, 2L, D) and log-sum-exp (B, H, 2L,
    float32) over the whole sequence; ``k``, ``v``: (B, H_kv, 2L, D)."""
    chunk, heads = q.size(2) // 2, q.size(1)
    out = _output_like(q, torch.float32, zero=True)
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
    held = [k, v]
    for step in range(size):
        pending = shift(held) if step < size - 1 else None  # the next chunk travels meanwhile
        for rows, cols, causal in ring_blocks(rank, (rank - step) % size, chunk):
            block_out, block_lse = torch_compat.attention_with_lse(
                q[:, :, rows], _expand(held[0][:, :, cols], heads), _expand(held[1][:, :, cols], heads),
                causal, scale)
            _merge_(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        if pending is not None:
            held = pending()
    return out.to(q.dtype), lse


def ring_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, rank: int, size: int, shift: Shift,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``ring_forward`` for this rank's tokens, given its output and log-sum-exp.

    At step ``s`` the rank holds ``src``'s keys and values and, arriving from the previous rank,
    the gradient accumulated for them by the ranks that held them before; it adds its blocks'
    share and sends the sum on at the next step, so the transfer overlaps the next step's compute.
    After the last step one more hop brings each accumulator home."""
    chunk, heads, kv_heads = q.size(2) // 2, q.size(1), k.size(1)
    grad_out = grad_out.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    held, acc = [k, v], None
    for step in range(size):
        sends = (held if step < size - 1 else []) + (acc if acc is not None else [])
        pending = shift(sends) if sends else None
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for rows, cols, causal in ring_blocks(rank, (rank - step) % size, chunk):
            bq, bk, bv = torch_compat.attention_with_lse_backward(
                grad_out[:, :, rows], q[:, :, rows], _expand(held[0][:, :, cols], heads),
                _expand(held[1][:, :, cols], heads), out[:, :, rows], lse[:, :, rows].contiguous(), causal, scale)
            dq[:, :, rows] += bq
            dk[:, :, cols] += _reduce(bk, kv_heads)
            dv[:, :, cols] += _reduce(bv, kv_heads)
            del bq, bk, bv
        received = pending() if pending is not None else []
        sends = pending = None  # what was sent is no longer needed
        if step < size - 1:
            held, received = received[:2], received[2:]
        acc = [dk, dv] if not received else [received[0].add_(dk), received[1].add_(dv)]
        del received, dk, dv
    dk, dv = shift(acc)() if size > 1 else acc  # home: the accumulator of this rank's keys and values
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- the operator -----------------------------------------------------------------------------

def group_name_of(group: Any) -> str:
    """The name the operator takes a process group (or a 1-D ``DeviceMesh``'s) by."""
    return (group.get_group() if hasattr(group, "get_group") else group).group_name


def ring_shift_of(group_name: str) -> Shift:
    """The ring's transfer over the process group named ``group_name``, resolved now (when the
    operator runs, not when a graph was traced): the live group of that name."""
    group = torch_compat.resolve_process_group(group_name)
    return lambda tensors: comm.ring_shift(tensors, group)


@torch.library.custom_op("ldt::ring_attention", mutates_args=())
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, rank: int,
                       size: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ring_forward(q, k, v, rank, size, ring_shift_of(group_name), scale)


@_ring_attention_op.register_fake
def _(q, k, v, group_name, rank, size, scale):
    return _output_like(q, q.dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("ldt::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, group_name: str, rank: int, size: int,
                                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ring_backward(grad_out, q, k, v, out, lse, rank, size, ring_shift_of(group_name), scale)


@_ring_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, group_name, rank, size, scale):
    # the real gradients are new contiguous tensors, whatever the inputs' strides
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, group_name, rank, size, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.ring = (group_name, rank, size, scale)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.ldt.ring_attention_backward(grad_out, q, k, v, out, lse, *ctx.ring)
    return dq, dk, dv, None, None, None, None


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)

RING_ATTENTION_OP = torch.ops.ldt.ring_attention.default
"""The operator, for selective activation checkpointing's save list and the FLOP counter."""


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str, rank: int, size: int,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries (B, H, 2L, D) over the whole sequence, whose
    key/value chunks (B, H_kv, 2L, D) the ranks of the process group named ``group_name`` hold
    (``group_name_of``; module docstring)."""
    if q.size(2) % 2:
        raise ValueError(f"ring attention: a rank holds two equal chunks of each sequence, but it was given "
                         f"{q.size(2)} tokens")
    if q.size(1) % k.size(1):
        raise ValueError(f"ring attention: {q.size(1)} query heads are not a multiple of {k.size(1)} key/value heads")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    out, _ = RING_ATTENTION_OP(q, k, v, group_name, rank, size, scale)
    return out


class LocalRing:
    """A ring of ``size`` ranks inside one process, one thread per rank: ``shift(rank)`` is the
    ``Shift`` of ``rank``. For running ``ring_forward``/``ring_backward`` of every rank on one
    device (the tests; the GPU check with one GPU)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._inbox = [queue.Queue() for _ in range(size)]

    def shift(self, rank: int) -> Shift:
        def start(tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
            self._inbox[(rank + 1) % self.size].put([t.clone() for t in tensors])
            return lambda: self._inbox[rank].get(timeout=60)
        return start

    def run(self, fn: Callable[[int, Shift], Any]) -> list[Any]:
        """``fn(rank, shift)`` for every rank at once (threads); their results in rank order."""
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(self.size) as pool:
            futures = [pool.submit(fn, r, self.shift(r)) for r in range(self.size)]
            return [f.result() for f in futures]
