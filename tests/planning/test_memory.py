"""The planner's memory arithmetic against the reference figures (ZeRO paper, Korthikanti et al. 2022)."""

import pytest

from lightning_disttrain.planning import (
    GB,
    STATE_BYTES,
    Cluster,
    Layout,
    ModelShape,
    Workload,
    activation_bytes_per_layer,
    memory_per_gpu,
    state_bytes_per_param,
)


def test_mixed_adamw_is_16_bytes_per_parameter():
    sb = STATE_BYTES["bf16"]
    assert (sb.weights, sb.grads, sb.master, sb.moments) == (2, 2, 4, 8)  # 2 + 2 + 4 + 4 + 4
    assert sb.total == 16 == state_bytes_per_param(0, 8)


@pytest.mark.parametrize(("n", "expected"), [(8, (2.9, 4.3, 8.0)), (64, (3.8, 7.2, 64.0))])
def test_zero_stages_reduce_state_as_published(n, expected):
    ratios = tuple(round(16 / state_bytes_per_param(z, n), 1) for z in (1, 2, 3))
    assert ratios == expected


def test_7b_needs_112_gb_of_state_and_14_gb_per_gpu_at_zero3_over_8():
    assert 7e9 * state_bytes_per_param(0, 1) / GB == pytest.approx(112)
    assert 7e9 * state_bytes_per_param(3, 8) / GB == pytest.approx(14)
    # and through the whole estimate: a 7B shape whose parameters are all in blocks
    shape = ModelShape("7b", params=7_000_000_000, embedding_params=0, block_params=218_750_000, expert_params=0,
                       active_params=7_000_000_000, n_layer=32, n_embd=4096, n_head=32, vocab=32000, tied=False,
                       flops_per_token=42 * 10**9, seq_len=4096)
    m = memory_per_gpu(shape, Layout(dp_shard=8, zero=3), Workload(4096, 8), Cluster("H100 SXM", 8))
    assert m.state / GB == pytest.approx(14)
    assert (m.params, m.grads, m.optimizer) == pytest.approx((7e9 * 2 / 8, 7e9 * 2 / 8, 7e9 * 12 / 8))


def test_megatron_activations_reference_example():
    # s=8192, b=1, h=4096, L=32, a=32, t=1: sbhL(34 + 5as/h) = 380 GB
    total = 32 * activation_bytes_per_layer(8192, 1, 4096, 32, 1)
    assert total / GB == pytest.approx(380.1, abs=0.1)
    assert total == 8192 * 4096 * 32 * (10 + 24 + 5 * 32 * 8192 / 4096)


def test_activation_forms():
    s, b, h, a = 2048, 4, 4096, 32
    sbh = s * b * h
    for t in (1, 2, 8):
        scores = 5 * a * s / (h * t)
        assert activation_bytes_per_layer(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + scores))
        assert activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=True) == pytest.approx(
            sbh * (34 / t + scores))
        assert activation_bytes_per_layer(s, b, h, a, t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
        assert activation_bytes_per_layer(s, b, h, a, t, flash=True) == pytest.approx(sbh * (10 + 24 / t))
        assert activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=True, flash=True) == pytest.approx(
            sbh * 34 / t)
        assert activation_bytes_per_layer(s, b, h, a, t, recompute="full") == pytest.approx(2 * sbh)
    assert activation_bytes_per_layer(s, b, h, a, act_bytes=4) == 2 * activation_bytes_per_layer(s, b, h, a)
    with pytest.raises(ValueError, match="'none', 'selective' or 'full'"):
        activation_bytes_per_layer(s, b, h, a, recompute="some")


def test_parallel_degrees_divide_what_they_shard():
    shape = ModelShape("x", params=1_100_000_000, embedding_params=100_000_000, block_params=125_000_000,
                       expert_params=0, active_params=1_100_000_000, n_layer=8, n_embd=2048, n_head=16, vocab=50304,
                       tied=False, flops_per_token=7 * 10**9, seq_len=2048)
    w, c = Workload(2048, 64), Cluster("H100 SXM", 8, nodes=2)
    ddp = memory_per_gpu(shape, Layout(dp_replicate=16, zero=0), w, c)
    assert ddp.state == pytest.approx(16 * 1.1e9)
    tp = memory_per_gpu(shape, Layout(dp_shard=8, tp=2, zero=3), w, c)
    assert tp.state == pytest.approx(16 * 1.1e9 / 16)  # blocks and the vocabulary-parallel head by tp, rest by FSDP
    assert tp.logits == pytest.approx(memory_per_gpu(shape, Layout(dp_shard=16), w, c).logits / 2)
    pp = memory_per_gpu(shape, Layout(dp_shard=8, pp=2, zero=3), w, c)
    assert pp.state == pytest.approx(16 * (1e9 / 2 + 0.05e9) / 8)  # half the blocks + the untied head's stage
    assert ddp.buffers == pytest.approx(2 * GB + 50e6)  # CUDA context + DDP buckets
    assert ddp.fits and ddp.headroom == pytest.approx(0.9 * 80 * GB - ddp.total)


def test_expert_parallel_shards_the_experts_only():
    shape = ModelShape("moe", params=10_000_000_000, embedding_params=0, block_params=1_250_000_000,
                       expert_params=8_000_000_000, active_params=4_000_000_000, n_layer=8, n_embd=2048, n_head=16,
                       vocab=32000, tied=False, flops_per_token=24 * 10**9, seq_len=2048, num_experts=8, moe_layers=8)
    w, c = Workload(2048, 8), Cluster("H100 SXM", 8)
    plain = memory_per_gpu(shape, Layout(dp_shard=8, zero=3), w, c)
    ep = memory_per_gpu(shape, Layout(dp_shard=8, ep=8, zero=3), w, c)
    assert plain.state == pytest.approx(16 * 10e9 / 8)
    # experts: 8B / ep 8, each expert then FSDP-sharded over dp_shard / ep = 1 rank: the same bytes per rank
    assert ep.state == pytest.approx(16 * (2e9 / 8 + 8e9 / 8))
    assert ep.buffers < plain.buffers  # a gathered block holds 1/8 of its experts


def test_inputs_are_checked_with_the_fix():
    with pytest.raises(ValueError, match="unknown GPU 'H900'"):
        Cluster("H900")
    with pytest.raises(ValueError, match="pass --gpu-memory"):
        Cluster("cpu")
    with pytest.raises(ValueError, match="precision='fp4' is unknown"):
        Workload(1024, 8, precision="fp4")
    with pytest.raises(ValueError, match="ep=3 must divide dp_shard\\*cp=8"):
        Layout(dp_shard=8, ep=3)


def test_gradient_accumulation_holds_unsharded_gradients_only_when_chosen():
    shape = ModelShape("m", params=1e9, embedding_params=0, block_params=1.25e8, expert_params=0,
                       active_params=1e9, n_layer=8, n_embd=4096, n_head=32, vocab=32000, tied=True,
                       flops_per_token=6e9, seq_len=2048)
    w, c = Workload(2048, 64, 1, "bf16"), Cluster("H100 SXM", 8)
    one = memory_per_gpu(shape, Layout(dp_shard=8, zero=3), w, c)
    # default: every micro-batch reduce-scatters, the gradients stay sharded: accumulation costs nothing
    assert memory_per_gpu(shape, Layout(dp_shard=8, zero=3), w, c, accumulation=8).total == one.total
    # accumulate_unsharded_grads: every unit's whole fp32 gradient (4 B/param) instead of the shard (2 B/8)
    held = memory_per_gpu(shape, Layout(dp_shard=8, zero=3, accumulate_unsharded_grads=True), w, c, accumulation=8)
    assert held.grads == pytest.approx(4 * 1e9) and one.grads == pytest.approx(2 * 1e9 / 8)
    assert held.total - one.total == pytest.approx(4e9 - 2e9 / 8)
    # tensor parallel divides what a rank holds; without accumulation the option changes nothing
    tp2 = memory_per_gpu(shape, Layout(dp_shard=4, tp=2, zero=3, accumulate_unsharded_grads=True), w, c, accumulation=8)
    assert tp2.grads == pytest.approx(4 * (1e9 - 32000 * 4096) / 2 + 4 * 32000 * 4096 / 2, rel=1e-3)
    assert memory_per_gpu(shape, Layout(dp_shard=8, zero=3, accumulate_unsharded_grads=True), w, c).total == one.total


def test_unsharded_accumulation_is_an_fsdp_option():
    with pytest.raises(ValueError, match="accumulate_unsharded_grads=True is an FSDP option"):
        Layout(dp_replicate=8, zero=0, accumulate_unsharded_grads=True)
