"""``planning.activations.ring_backward_bytes`` against the allocator's peak of ring attention's
backward on CPU (every allocation and free replayed in order, ``torch.profiler``), at a middle
rank of a 4-rank ring, whose steps hold the most (keys, values and gradient accumulators in flight
at once). The transfers are loopbacks that allocate what ``comm.ring_shift`` does (a receive
buffer per tensor); the inputs have the model's layout ((B, H, T, D) stored as (B, T, H, D))."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lightning_disttrain.models.gpt import GPTConfig
from lightning_disttrain.models.ring_attention import ring_backward, ring_forward
from lightning_disttrain.planning import shape_of
from lightning_disttrain.planning.activations import ring_backward_bytes


def _loopback(tensors):
    received = [t.clone() for t in tensors]  # a receive buffer each, allocated when the transfer starts
    return lambda: received


def _peak(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    return max(itertools.accumulate(n for _, n in mem))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU's flash kernel adds workspace per thread, which the plan does not count
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 32), (8, 2, 16)])
def test_the_plan_is_the_rings_backward_peak_within_10_percent(one_thread, dtype, heads, kv_heads, head_dim):
    tokens, size, rank = 512, 4, 1
    g = torch.Generator().manual_seed(0)

    def tensor(h):
        return torch.randn(1, tokens, h, head_dim, generator=g).to(dtype).transpose(1, 2)

    q, grad, k, v = tensor(heads), tensor(heads), tensor(kv_heads), tensor(kv_heads)
    out, lse = ring_forward(q, k, v, rank, size, _loopback, 0.25)
    measured = _peak(lambda: ring_backward(grad, q, k, v, out, lse, rank, size, _loopback, 0.25)) / tokens
    shape = shape_of(GPTConfig(n_layer=1, n_head=heads, n_kv_head=kv_heads, n_embd=heads * head_dim,
                               block_size=tokens, vocab_size=64), tokens)
    planned = ring_backward_bytes(shape, 2 if dtype == torch.bfloat16 else 4)
    assert 0.9 * measured <= planned <= 1.10 * measured, (measured, planned)


def test_the_rings_exposed_time_is_its_last_hop_when_compute_hides_the_rest_and_all_of_it_when_none():
    from lightning_disttrain.planning.throughput import ring_exposed_seconds

    shape = shape_of(GPTConfig(n_layer=1, n_head=8, n_kv_head=2, n_embd=256, block_size=4096, vocab_size=64), 4096)
    cp, e, bw = 4, 2, 1e9
    pair = 4096 / cp * 2 * shape.kv_dim * e / bw  # one key/value chunk pair, per micro-batch of one sequence
    grads = pair * 4 / e  # its fp32 gradients
    slow = ring_exposed_seconds(shape, cp, 1, 1, 4096, e, bw, flops_per_s=1.0)  # compute hides every step
    assert slow == pytest.approx(grads)
    fast = ring_exposed_seconds(shape, cp, 1, 1, 4096, e, bw, flops_per_s=1e30)  # nothing hidden
    assert fast == pytest.approx((cp - 1) * pair + (cp - 1) * pair + cp * grads)
    assert ring_exposed_seconds(shape, cp, 1, 1, 4096, e, bw, 1e30, recomputed=1.0) == pytest.approx(fast + (cp - 1) * pair)
