"""Bytes one transformer block of ``models/gpt.py`` keeps for backward, per token, by what it runs.

Derived from the model's ops, not from Megatron's table: what autograd saves in ``Block.forward``
for the ``GPTConfig`` fields (``ModelShape``: MLP kind and width, ``n_kv_head``, norm, MoE
experts / top-k / capacity / shared experts), under this package's activation checkpointing
policies (``parallel/activation.py``: ``none``, ``selective``, ``block``, ``full``) and tensor
parallel plan (``parallel/gpt_tp.py``: sequence parallel on). Checked exactly (to the byte) against
``parallel.activation.activation_bytes`` on CPU in ``tests/planning/test_activations.py``.

Per token, with h = n_embd, kv = n_kv_head x head_dim, f = the MLP's hidden width, a = heads,
e = bytes per activation element, t = tensor-parallel degree (sequence parallel: the residual
stream and the norms hold 1/t of the sequence, the attention / MLP inputs are all-gathered)::

    no checkpointing
      norms (2)         2 x norm / t         norm = e*h + 8 (its input; LayerNorm mean and rstd,
                                             or a fused RMSNorm's rstd in fp32) on GPUs; torch's
                                             CPU RMSNorm is composite: an fp32 input copy and the
                                             fp32 normalised tensor, 8*h + 4
      norm outputs      2 x e*h              the attention's and the MLP's input (gathered under TP:
                                             torch's styles keep the gathered copy, Megatron the shard)
      q, k, v           e*(h + 2*kv) / t     after RoPE (the pre-RoPE projections are freed)
      attention output  e*h / t + 4*a / t    SDPA's output and its fp32 logsumexp (FlashAttention and
                                             torch's CPU flash kernel never store the s x s scores)
      dense MLP         e*c*f / t            c = 2 for gelu / relu2 (the hidden before and after the
                                             activation), 4 for swiglu (w1's and w3's outputs, silu's,
                                             the product)
      MoE MLP           4*E + 4*h (if e < 4)  router probabilities; the router's fp32 input copy
                        + k' x (3*e*h + e*c*f_e + 28)   per routed assignment: the gathered token,
                                             the expert output and its weighted copy, the expert's
                                             hidden tensors, three int64 indices and the fp32 weight
                        + e*c*s_e*f_e        shared experts (one MLP of s_e x f_e)
                        k' = top_k, x capacity_factor when that is below 1 (balanced routing: an
                        upper bound; imbalance drops more)
    selective ("keep the outputs of matmuls, attention and collectives, recompute the rest")
      block input e*h/t; q, k, v projections e*(h + 2*kv)/t; attention e*h/t + 4*a/t; the two
      output projections' local results 2*e*h (full length under TP: the partial sums before the
      reduce-scatter); the MLP's input projections e*f/t (gelu, relu2) or 2*e*f/t (swiglu); under
      TP the all-gathered inputs 2*e*h and the reduce-scattered outputs 2*e*h/t. MoE: the router's
      fp32 logits 4*E, the shared experts' projections, the routed experts' grouped GEMMs only if
      ``aten._grouped_mm`` is among the saved ops (in this package it is not: the routed experts
      are recomputed), and under expert parallel the all-to-all outputs 2*k'*e*h.
    full: the block input, e*h/t. block (every_k): full for layers 0, k, 2k, ..., none for the rest.

Context parallel (``cp`` > 1, ring attention: ``models/ring_attention.py``): per token of the
rank's shard (1/cp of each sequence) the terms above and nothing more: the ring operator keeps
this rank's q, k, v, its output and log-sum-exp, as attention without context parallel does, and
the key/value chunks that pass through the rank are freed as the next arrives. Measured on 2 and
4 gloo ranks to the byte (tests/strategies/cp_worker.py). In flight during the attention's
backward (not kept: ``ring_backward_bytes``): the chunk being received, the fp32 gradient
accumulators and one block's gradients.

While a checkpointed block is recomputed in backward, it holds everything it recomputes (its
"none" bytes) besides what the blocks before it stored, and the gradients in flight: so with
checkpointing the peak can be in backward (``backward_peak``) rather than at the forward's end.

Without FlashAttention (``Workload.flash=False``) the attention stores its score matrices as
Megatron counts them: + 5*a*s*e/2 / t per token.
"""

from __future__ import annotations

import torch

from lightning_disttrain.parallel.activation import DEFAULT_SAVE_OPS
from lightning_disttrain.parallel.activation import POLICIES as AC_POLICIES
from lightning_disttrain.planning.model_shape import ModelShape

INDEX_BYTES_PER_ASSIGNMENT = 3 * 8 + 4
"""Per routed (token, expert) assignment: the top-k index, the sort order and the token index
(int64), and the fp32 router weight."""


def grouped_gemm_saved() -> bool:
    """Whether ``policy="selective"`` keeps the routed experts' grouped GEMM outputs."""
    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    return grouped is not None and hasattr(grouped, "default") and grouped.default in DEFAULT_SAVE_OPS


def _mlp_factor(kind: str) -> int:
    """Hidden-width tensors a feed-forward keeps with no checkpointing."""
    return 4 if kind == "swiglu" else 2


def _mlp_saved_projections(kind: str) -> int:
    """Hidden-width matmul outputs (what ``selective`` keeps) of a feed-forward."""
    return 2 if kind == "swiglu" else 1


def norm_bytes(shape: ModelShape, e: int, cpu: bool) -> float:
    """Bytes per token one norm keeps, its input included (see the module docstring)."""
    h = shape.n_embd
    if shape.norm == "rmsnorm":
        return 8 * h + 4 if cpu else e * h + 4
    return e * h + 8


def routed_assignments(shape: ModelShape) -> float:
    """Routed (token, expert) assignments per token that reach an expert."""
    cf = shape.moe_capacity_factor
    return shape.moe_top_k * (min(1.0, cf) if cf is not None else 1.0)


def ring_backward_bytes(shape: ModelShape, e: int = 2, t: int = 1) -> float:
    """Bytes per token of the shard that ring attention's backward holds at once besides what the
    block kept (context parallel only), at a middle step of ``ring_backward`` (cp >= 3; cp = 2
    holds less), by the buffers it allocates: the incoming gradient made contiguous (e*h), the fp32
    query gradient (4*h), one block's kernel gradients (3*e*h: a block spans at most the shard's
    rows) and, in 16-bit, the fp32 copy of its query gradient the accumulation makes (4*h); the
    key/value chunks held and arriving (4*e*kv); three fp32 key/value gradient pairs (this step's,
    the one arriving, the one leaving: 24*kv) and, in 16-bit without grouped-query attention, the
    fp32 copy of the block's (8*kv); with grouped-query attention, one block's keys and values
    widened to every head (2*e*h), one widened gradient's fp32 copy in 16-bit (4*h) and the two
    summed (8*kv). Not counted: the kernels' own workspace. Checked against the allocator's peak of
    ``ring_backward`` on CPU at one intra-op thread (``tests/planning/test_ring_backward_bytes.py``:
    within 10%, bf16 and fp32, with and without GQA; CPU's flash kernel adds workspace per thread)."""
    h, kv = shape.n_embd, shape.kv_dim
    low = e < 4  # 16-bit: the accumulations into fp32 make fp32 copies
    total = (e + 4 + 3 * e + (4 if low else 0)) * h + (4 * e + 24) * kv
    if kv < h:  # grouped-query attention: _expand / _reduce
        total += (2 * e + (4 if low else 0)) * h + 8 * kv
    elif low:
        total += 8 * kv
    return total / t


def layer_bytes(shape: ModelShape, layer: int, *, policy: str = "none", e: int = 2, t: int = 1, ep: int = 1,
                cp: int = 1, cpu: bool = False, flash: bool = True, seq_len: int | None = None) -> float:
    """Bytes per token block ``layer`` keeps for backward under the checkpointing ``policy``
    (``selective``, ``full`` or ``none``; a ``block`` policy is ``full`` or ``none`` per layer);
    under context parallel, per token of the rank's shard (ring attention adds nothing kept)."""
    if policy not in ("none", "selective", "full"):
        raise ValueError(f"policy={policy!r}: per layer use 'none', 'selective' or 'full' ('block' is one of the "
                         f"two for each layer: see stage_bytes)")
    if policy == "full":
        return e * shape.n_embd / t
    return _block_bytes(shape, layer, policy, e, t, ep, cpu, flash, seq_len)


def _block_bytes(shape: ModelShape, layer: int, policy: str, e: int, t: int, ep: int, cpu: bool, flash: bool,
                 seq_len: int | None) -> float:
    h, a, kv = shape.n_embd, shape.n_head, shape.kv_dim
    moe = shape.is_moe_layer(layer)
    scores = 0.0 if flash else 5 * a * (seq_len or shape.seq_len) * e / 2 / t
    if policy == "none":
        attn = norm_bytes(shape, e, cpu) / t + e * h + e * (h + 2 * kv) / t + e * h / t + 4 * a / t + scores
        if not moe:
            return attn + _mlp_bytes(shape, layer, e, t, cpu)
        ffn = norm_bytes(shape, e, cpu) / t + e * h
        c, fe = _mlp_factor(shape.mlp), shape.expert_hidden
        ffn += 4 * shape.num_experts + (4 * h if e < 4 else 0)
        ffn += routed_assignments(shape) * (3 * e * h + e * c * fe + INDEX_BYTES_PER_ASSIGNMENT)
        ffn += e * c * shape.moe_shared_experts * fe
        return attn + ffn
    # selective: the block input and what the matmuls / attention / collectives returned
    gathered = 2 * e * h + 2 * e * h / t if t > 1 else 0.0
    attn = e * h / t + e * (h + 2 * kv) / t + e * h / t + 4 * a / t + scores + e * h
    if not moe:
        return attn + e * _mlp_saved_projections(shape.mlp) * shape.ffn_hidden / t + e * h + gathered
    k, fe, c = routed_assignments(shape), shape.expert_hidden, _mlp_saved_projections(shape.mlp)
    ffn = 4 * shape.num_experts
    if shape.moe_shared_experts:
        ffn += e * c * shape.moe_shared_experts * fe + e * h
    if grouped_gemm_saved():
        ffn += k * (e * c * fe + e * h)
    if ep > 1:
        ffn += 2 * k * e * h  # the dispatch's and the combine's all-to-all outputs
    return attn + ffn + gathered


def checkpointed(policy: str, layer: int, every_k: int = 2) -> str:
    """The per-layer policy of ``layer`` under a model-wide ``policy``."""
    if policy == "block":
        return "full" if layer % every_k == 0 else "none"
    return policy


def stage_bytes(shape: ModelShape, layers, policy: str = "none", every_k: int = 2, **kw) -> float:
    """Bytes per token the blocks ``layers`` keep for backward under a model-wide ``policy``."""
    if policy not in AC_POLICIES:
        raise ValueError(f"activation checkpointing policy={policy!r} is unknown; use one of {AC_POLICIES}")
    return sum(layer_bytes(shape, i, policy=checkpointed(policy, i, every_k), **kw) for i in layers)


def _mlp_bytes(shape: ModelShape, layer: int, e: int, t: int, cpu: bool) -> float:
    """What a dense block's MLP half keeps with no checkpointing (its norm, the norm's output, the
    hidden tensors), freed before the attention's backward; 0 for an MoE block (not modelled)."""
    if shape.is_moe_layer(layer):
        return 0.0
    return norm_bytes(shape, e, cpu) / t + e * shape.n_embd + e * _mlp_factor(shape.mlp) * shape.ffn_hidden / t


def backward_transient(shape: ModelShape, e: int = 2, t: int = 1, ep: int = 1) -> float:
    """Bytes per token of what a recomputed block's backward holds besides its tensors: the
    gradients in flight (the block output's and the widest hidden one: the MLP's, or the routed
    experts'), and under expert parallel the dispatch's send and receive copies (2*k'*e*h)."""
    widest = max(shape.ffn_hidden, routed_assignments(shape) * shape.expert_hidden if shape.is_moe else 0)
    a2a = 2 * routed_assignments(shape) * e * shape.n_embd if shape.is_moe and ep > 1 else 0.0
    return e * (shape.n_embd + widest) / t + a2a


def backward_peak(shape: ModelShape, layers, policy: str = "none", every_k: int = 2, **kw) -> float:
    """Bytes per token the backward of the blocks ``layers`` holds at most when some are
    recomputed: the blocks before the one being recomputed keep what they stored, that one holds
    everything it recomputes (its "none" bytes), plus ``backward_transient`` while its MLP's
    backward runs; under context parallel, while its attention's backward runs (the MLP's tensors
    freed, the attention output's gradient held), ``ring_backward_bytes``. 0 when no block is
    recomputed (the forward's end is then the peak)."""
    best = prefix = 0.0
    for i in layers:
        p = checkpointed(policy, i, every_k)
        if p != "none":
            e, t = kw.get("e", 2), kw.get("t", 1)
            held = layer_bytes(shape, i, policy="none", **kw)
            at_mlp = held + backward_transient(shape, e, t, kw.get("ep", 1))
            at_attention = 0.0
            if kw.get("cp", 1) > 1:  # the ring's buffers, once the MLP's tensors and gradients are freed
                at_attention = held - _mlp_bytes(shape, i, e, t, kw.get("cpu", False)) + e * shape.n_embd / t
                at_attention += ring_backward_bytes(shape, e, t)
            best = max(best, prefix + max(at_mlp, at_attention))
        prefix += layer_bytes(shape, i, policy=p, **kw)
    return best


def head_bytes(shape: ModelShape, e: int = 2, t: int = 1, cpu: bool = False) -> float:
    """Bytes per token the last stage keeps outside the blocks and the logits: the final norm
    (its input, the last block's output) and its output, the head's input (gathered under TP)."""
    return norm_bytes(shape, e, cpu) / t + e * shape.n_embd
