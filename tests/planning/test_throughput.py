"""Step time, cost and the Young/Daly checkpoint interval."""

import math

import pytest

from lightning_disttrain.planning import throughput as tp
from lightning_disttrain.planning import young_daly_interval


def test_young_daly_is_sqrt_of_twice_cost_times_mtbf():
    assert young_daly_interval(60, 36_000) == pytest.approx(math.sqrt(2 * 60 * 36_000))  # 2078 s
    f = tp.failures(gpus=1000, nodes=125, checkpoint_seconds=60, device_mtbf_hours=50_000, restart_seconds=600)
    assert f.job_mtbf_hours == pytest.approx(50)
    assert f.interval_seconds == pytest.approx(math.sqrt(2 * 60 * 50 * 3600))
    assert f.overhead == pytest.approx(60 / f.interval_seconds + (f.interval_seconds / 2 + 600) / (50 * 3600))
    spot = tp.failures(1000, 125, 60, 50_000, preemptions_per_node_hour=0.01)
    assert spot.job_mtbf_hours == pytest.approx(1 / (1000 / 50_000 + 125 * 0.01))
    with pytest.raises(ValueError, match="must be > 0"):
        young_daly_interval(0, 10)


def test_step_time_from_flops_and_mfu():
    # 6 GFLOP/token x 1M tokens over 8 GPUs of 1 PFLOP/s at 50%: 1.5 s
    t = tp.throughput(6e9, 1e6, 8, 1e15, 0.5)
    assert t.step_seconds == pytest.approx(1.5) and t.tokens_per_second == pytest.approx(1e6 / 1.5)
    assert tp.throughput(6e9, 1e6, 8, 1e15, 0.5, full_recompute=True).step_seconds == pytest.approx(2.0)
    assert tp.throughput(6e9, 1e6, 8, 1e15, 0.5, pp=4, microbatches=12).step_seconds == pytest.approx(1.5 * 1.25)
    with pytest.raises(ValueError, match=r"mfu=40 must be in \(0, 1\]"):
        tp.throughput(6e9, 1e6, 8, 1e15, 40)


def test_cost_adds_20_percent_and_spot_savings():
    c = tp.cost(token_budget=3.6e9, tokens_per_second=1e6, gpus=8, overhead=0.0, price=2.0, spot_price=1.0,
                spot_overhead=0.5)
    assert c.hours == pytest.approx(1.0)
    assert c.on_demand == pytest.approx(2.0 * 8 * 1.0 * 1.2)
    assert c.spot_hours == pytest.approx(1.5) and c.spot == pytest.approx(1.0 * 8 * 1.5 * 1.2)
    assert c.spot_savings == pytest.approx(19.2 - 14.4)


# ---- the named terms of a step ---------------------------------------------------------------

from lightning_disttrain.planning import Cluster, Layout, ModelShape, Workload  # noqa: E402

DENSE = ModelShape("dense", params=900_000_000, embedding_params=100_000_000, block_params=100_000_000,
                   expert_params=0, active_params=900_000_000, n_layer=8, n_embd=1024, n_head=8, vocab=1024,
                   tied=False, flops_per_token=6 * 10**9, seq_len=1024)
H100x16 = Cluster("H100 SXM", 8, nodes=2)
INTRA, INTER = 450e9 * tp.LINK_EFFICIENCY, 50e9 * tp.LINK_EFFICIENCY
PEAK = 989.4e12


def test_tensor_parallel_and_fsdp_terms_by_hand():
    w = Workload(1024, 64, 1, "bf16")
    layout = Layout(dp_shard=8, tp=2, zero=3)
    t = tp.step_terms(DENSE, layout, w, H100x16, mfu=0.4, accumulation=8)
    compute = 6e9 * 64 * 1024 / (16 * PEAK * 0.4)
    assert t.terms["compute"] == pytest.approx(compute)
    # 2 all-gathers + 2 reduce-scatters of a 1024 x 1024 bf16 micro-batch, half of it per rank,
    # forward and backward, 8 blocks, 8 micro-steps, on NVLink
    assert t.terms["tp"] == pytest.approx(4 * 0.5 * 1024 * 1024 * 2 * 2 * 8 * 8 / INTRA)
    # FSDP over 8 ranks of a 16-GPU job spanning 2 nodes: 450M local parameters all-gathered in
    # forward and backward of every micro-step (bf16), gradients reduce-scattered (fp32) every
    # micro-step (the default: they stay sharded), or once with accumulate_unsharded_grads
    dp = (2 * 8 * 450e6 * 7 / 8 * 2 + 8 * 450e6 * 7 / 8 * 4) / INTER
    assert dp > compute and t.terms["dp"] == pytest.approx(dp - compute)
    once = tp.step_terms(DENSE, Layout(dp_shard=8, tp=2, zero=3, accumulate_unsharded_grads=True), w, H100x16,
                         mfu=0.4, accumulation=8)
    assert once.terms["dp"] == pytest.approx((2 * 8 * 450e6 * 7 / 8 * 2 + 450e6 * 7 / 8 * 4) / INTER - compute)
    assert t.terms["bubble"] == t.terms["pp"] == t.terms["ep"] == t.terms["recompute"] == 0
    assert t.step_seconds == pytest.approx(sum(t.terms.values()))
    full = tp.step_terms(DENSE, Layout(dp_shard=8, tp=2, zero=3, ac="full"), w, H100x16, 0.4, 8)
    assert full.terms["recompute"] == pytest.approx(compute / 3)
    assert full.terms["tp"] == pytest.approx(t.terms["tp"] * 3 / 2)  # the recomputed forward's collectives


def test_pipeline_terms_by_hand():
    w = Workload(1024, 64, 1, "bf16")
    layout = Layout(dp_shard=4, tp=2, pp=2, zero=3, pp_microbatches=16)
    t = tp.step_terms(DENSE, layout, w, H100x16, mfu=0.4, accumulation=1)
    compute = 6e9 * 64 * 1024 / (16 * PEAK * 0.4)
    tp_comm = 4 * 0.5 * 1024 * 1024 * 2 * 2 * 4 * 16 / INTRA  # 4 blocks per rank, 16 micro-batches
    assert t.terms["tp"] == pytest.approx(tp_comm)
    assert t.terms["bubble"] == pytest.approx((2 - 1) / 16 * (compute + tp_comm))
    # each micro-batch's 1024 x 1024 / 2 bf16 boundary activations and gradients, 16 + 2 - 1 slots
    assert t.terms["pp"] == pytest.approx(2 * 17 * 1024 * 1024 / 2 * 2 / INTER)
    inter = tp.step_terms(DENSE, Layout(dp_shard=4, tp=2, pp=2, zero=3, pp_microbatches=16,
                                        pp_schedule="Interleaved1F1B"), w, H100x16, 0.4, 1)
    assert inter.terms["bubble"] == pytest.approx(t.terms["bubble"] / 2)  # 2 stages per rank


def test_expert_parallel_term_by_hand():
    moe = ModelShape("moe", params=10_000_000_000, embedding_params=0, block_params=1_250_000_000,
                     expert_params=8_000_000_000, active_params=4_000_000_000, n_layer=8, n_embd=2048, n_head=16,
                     vocab=32000, tied=False, flops_per_token=24 * 10**9, seq_len=2048, num_experts=8, moe_layers=8)
    w = Workload(2048, 8, 1, "bf16")
    t = tp.step_terms(moe, Layout(dp_shard=8, ep=8, zero=3), w, Cluster("H100 SXM", 8), 0.4, 1)
    # dispatch + combine of 2 assignments x 2048 tokens x 2048 wide in bf16, 7/8 leaving each rank,
    # forward and backward, 8 MoE blocks, on NVLink
    assert t.terms["ep"] == pytest.approx(2 * (2 * 7 / 8 * 2 * 2048 * 2048 * 2) * 8 / INTRA)
    # selective recomputes the routed experts (their grouped GEMMs are not in the save list)
    sel = tp.step_terms(moe, Layout(dp_shard=8, ep=8, zero=3, ac="selective"), w, Cluster("H100 SXM", 8), 0.4, 1)
    assert sel.terms["recompute"] == pytest.approx(2 * 2 * 1e9 * 2048 * 8 / (8 * PEAK * 0.4))


def test_plan_names_the_terms_of_every_usable_layout(capsys):
    from lightning_disttrain.cli import main

    main(["plan", "--model", "llama3-70b", "--nodes", "4", "--seq-len", "8192", "--global-batch", "64"])
    text = capsys.readouterr().out
    assert "seconds: compute" in text and "tp " in text and "(compute at 40%)" in text
    assert "links: 450 GB/s per GPU inside a node, 50 GB/s across nodes" in text


def test_hsdp_all_reduces_across_nodes_once_per_step_in_either_mode():
    # HSDP 2 x 8 (shard within a node): the reduce-scatter runs every micro-step by default (once
    # with accumulate_unsharded_grads), the all-reduce across the 2 nodes once per optimizer step in
    # both modes. Slow links (10 / 1 GB/s) so that the communication exceeds the compute.
    w = Workload(1024, 64, 1, "bf16")
    intra, inter = 10e9 * tp.LINK_EFFICIENCY, 1e9 * tp.LINK_EFFICIENCY
    local = sum(tp.local_params(DENSE, Layout(dp_replicate=2, dp_shard=8, zero=3)))

    def dp_seconds(unsharded: bool, accumulation: int) -> float:
        layout = Layout(dp_replicate=2, dp_shard=8, zero=3, accumulate_unsharded_grads=unsharded)
        t = tp.step_terms(DENSE, layout, w, H100x16, mfu=0.4, accumulation=accumulation, links=(10, 1))
        assert t.terms["dp"] > 0
        return t.terms["dp"] + t.terms["compute"]  # the whole dp communication

    gathers, scatter = 2 * 4 * local * 7 / 8 * 2 / intra, local * 7 / 8 * 4 / intra
    all_reduce = 2 * 0.5 * local / 8 * 4 / inter
    assert dp_seconds(False, 4) == pytest.approx(gathers + 4 * scatter + all_reduce)
    assert dp_seconds(True, 4) == pytest.approx(gathers + scatter + all_reduce)
