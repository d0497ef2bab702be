"""Ring attention (``models/ring_attention.py``, issue 43) in one process: every rank of a ring run
in its own thread (``LocalRing``) on the shards ``context_parallel`` gives it, against one causal
SDPA over the whole sequence, forward and backward; the blocks a rank computes; the kernels' seam.
The multi-process runs (gloo, the custom op through ``L.Trainer``) are in
tests/strategies/test_context_parallel.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain.models.context_parallel import ContextParallel, attention_work, shard_sequence
from lightning_disttrain.models.ring_attention import LocalRing, pairs_computed, ring_backward, ring_blocks, ring_forward


def _ring(q, k, v, grad, size):
    """Each rank's (output, dq, dk, dv) from the ring run on its shards."""
    scale = 1 / math.sqrt(q.size(-1))

    def shard(t, r):
        return shard_sequence(t.detach(), 2, r, size)

    outs = LocalRing(size).run(lambda r, shift: ring_forward(shard(q, r), shard(k, r), shard(v, r), r, size, shift, scale))
    grads = LocalRing(size).run(lambda r, shift: ring_backward(
        shard(grad, r), shard(q, r), shard(k, r), shard(v, r), *outs[r], r, size, shift, scale))
    return [(outs[r][0], *grads[r]) for r in range(size)]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_the_ring_equals_full_causal_attention_forward_and_backward(size, heads, kv_heads):
    torch.manual_seed(size)
    T = 8 * size
    q = torch.randn(2, heads, T, 8, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, T, 8, requires_grad=True) for _ in range(2))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    grad = torch.randn_like(full)
    reference = (full, *torch.autograd.grad(full, (q, k, v), grad))
    for r, got in enumerate(_ring(q, k, v, grad, size)):
        for name, mine, ref in zip(("out", "dq", "dk", "dv"), got, reference):
            assert mine.dtype == torch.float32
            torch.testing.assert_close(mine, shard_sequence(ref.detach(), 2, r, size), atol=2e-6, rtol=1e-5,
                                       msg=lambda m: f"rank {r} {name}: {m}")


def test_bf16_ring_is_as_close_to_fp32_as_bf16_sdpa():
    torch.manual_seed(0)
    size, T = 2, 64
    q, k, v = (torch.randn(1, 4, T, 16) for _ in range(3))
    grad = torch.randn(1, 4, T, 16)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    sdpa = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    ring = _ring(q.bfloat16(), k.bfloat16(), v.bfloat16(), grad.bfloat16(), size)
    sdpa_err = (sdpa.float() - exact).abs().max()
    for r in range(size):
        assert ring[r][0].dtype == torch.bfloat16
        assert (ring[r][0].float() - shard_sequence(exact, 2, r, size)).abs().max() <= 2 * sdpa_err


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_every_rank_computes_the_same_blocks_and_no_fully_masked_one(size):
    chunk = 4
    seq = 2 * size * chunk
    for rank in range(size):
        mine = [(c, rank) for c in (rank, 2 * size - 1 - rank)]
        computed = set()
        for step in range(size):
            src = (rank - step) % size
            for rows, cols, causal in ring_blocks(rank, src, chunk):
                for qc in range(rows.start // chunk, rows.stop // chunk):
                    for kc in range(cols.start // chunk, cols.stop // chunk):
                        q_chunk = mine[qc][0]
                        k_chunk = (src, 2 * size - 1 - src)[kc]
                        assert k_chunk <= q_chunk, "a fully masked block was computed"
                        assert causal == (k_chunk == q_chunk)
                        computed.add((q_chunk, k_chunk))
        # every visible (query chunk, key chunk) pair exactly once
        assert computed == {(qc, kc) for qc, _ in mine for kc in range(2 * size) if kc <= qc}
        assert pairs_computed(seq, rank, size) == (2 * size + 1) * chunk * chunk
        # the kernels' work is within one diagonal block's mask of the causal work
        assert pairs_computed(seq, rank, size) - attention_work(seq, rank, size) == chunk * (chunk - 1)


def test_attention_dropout_under_cp_is_refused_with_the_fix():
    from lightning_disttrain.models.gpt import GPT, GPTConfig
    from lightning_disttrain.parallel.context import apply_context_parallel

    class Mesh:  # no process group: refused before any
        def get_local_rank(self):
            return 0

        def size(self):
            return 2

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=64, dropout=0.1))
    with pytest.raises(ValueError, match=r"cp=2 runs ring attention, .* dropout=0.1: set the model's dropout to 0"):
        apply_context_parallel(model, Mesh())
    assert all(getattr(m, "context_parallel", None) is None for m in model.modules())
    cp = ContextParallel(group=None, rank=0, size=2)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="no attention dropout .* set the model's dropout to 0"):
        cp.attention(q, q, q, dropout_p=0.1)


def test_the_block_kernel_returns_the_log_sum_exp_and_takes_a_given_one_in_backward():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, requires_grad=True) for _ in range(3))
    for causal in (False, True):
        out, lse = torch_compat.attention_with_lse(q, k, v, causal, 0.25)
        scores = (q @ k.transpose(-1, -2)) * 0.25
        if causal:
            scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), -math.inf)
        torch.testing.assert_close(lse, scores.logsumexp(-1))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.25)
        torch.testing.assert_close(out, ref)
        grad = torch.randn_like(ref)
        expected = torch.autograd.grad(ref, (q, k, v), grad)
        got = torch_compat.attention_with_lse_backward(grad, q, k, v, out, lse, causal, 0.25)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)


class _Like:
    def __init__(self, device, dtype, head_dim):
        self.device, self.dtype, self._d = torch.device(device), dtype, head_dim

    def size(self, dim):
        return self._d


@pytest.mark.parametrize("device, dtype, head_dim, kernel", [
    ("cpu", torch.float32, 64, "cpu"), ("cpu", torch.bfloat16, 512, "cpu"),
    ("cuda", torch.bfloat16, 128, "flash"), ("cuda", torch.float16, 256, "flash"),
    ("cuda", torch.float32, 128, "efficient"), ("cuda", torch.bfloat16, 512, "efficient"),
    ("cuda", torch.bfloat16, 100, "efficient")])
def test_the_kernel_chosen_per_device_dtype_and_head_dim(device, dtype, head_dim, kernel, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    assert torch_compat.lse_kernel(_Like(device, dtype, head_dim)) == kernel


def test_gpus_before_ampere_take_the_memory_efficient_kernel(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100: no FlashAttention 2
    assert torch_compat.lse_kernel(_Like("cuda", torch.bfloat16, 128)) == "efficient"


def test_a_device_without_a_kernel_is_refused():
    with pytest.raises(ValueError, match="runs on CPU and CUDA tensors; these are on mps"):
        torch_compat.lse_kernel(_Like("mps", torch.float32, 64))


def test_the_output_is_stored_as_the_model_reads_it():
    # (B, H, T, D) stored as (B, T, H, D), like SDPA's: the output projection's input is a view of
    # it, so the output is kept once for backward, not twice (planning/activations.py counts once).
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    for dtype in (torch.float32, torch.bfloat16):
        out, _ = LocalRing(2).run(lambda r, shift: ring_forward(q.to(dtype), k.to(dtype), v.to(dtype), r, 2, shift,
                                                                 0.5))[0]
        assert out.transpose(1, 2).is_contiguous() and out.dtype == dtype
        assert out.transpose(1, 2).reshape(1, 8, -1).data_ptr() == out.data_ptr()


def test_the_operators_fake_outputs_have_the_real_outputs_layout(tmp_path):
    # torch.compile (Inductor) lays out the graph from the fake implementations: a stride that
    # differs from the real op's is a failed size assert or a silently misread gradient. opcheck
    # runs both (the op on a 1-rank gloo group: the ring of one rank is its own neighbour).
    import torch.distributed as dist

    from lightning_disttrain.models.ring_attention import group_name_of

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        name = group_name_of(dist.group.WORLD)
        q = torch.randn(1, 6, 2, 4).transpose(1, 2).requires_grad_()  # (B, H, T, D) stored as (B, T, H, D): the model's
        k, v = (torch.randn(1, 6, 1, 4).transpose(1, 2).requires_grad_() for _ in range(2))
        torch.library.opcheck(torch.ops.ldt.ring_attention.default, (q, k, v, name, 0, 1, 0.5),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
        out, lse = torch.ops.ldt.ring_attention(q, k, v, name, 0, 1, 0.5)
        grads = torch.ops.ldt.ring_attention_backward(torch.ones_like(out), q, k, v, out, lse, name, 0, 1, 0.5)
        torch.library.opcheck(torch.ops.ldt.ring_attention_backward.default,
                              (torch.ones_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, name, 0, 1,
                               0.5), test_utils=("test_schema", "test_faketensor"))
        assert all(g.is_contiguous() for g in grads)
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, full)
    finally:
        dist.destroy_process_group()
