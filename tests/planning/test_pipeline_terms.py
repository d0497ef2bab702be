"""The planner's pipeline terms come from the strategy's schedule arguments: micro-batch forwards
held per schedule (checked against torch's own schedule orders), the stages of each rank, and the
memory of the most loaded pipeline rank, by hand."""

import pytest

from lightning_disttrain.parallel.pipeline import PipelineOptions
from lightning_disttrain.planning import (
    GB,
    Cluster,
    Layout,
    ModelShape,
    Workload,
    memory_per_gpu,
)
from lightning_disttrain.planning.activations import head_bytes, layer_bytes
from lightning_disttrain.planning.memory import LOGIT_GRAD_BYTES, LOGIT_OUTPUT_BYTES, LOGIT_SAVED_BYTES
from lightning_disttrain.planning.pipeline import (
    bubble,
    inflight,
    last_stage_inflight,
    rank_stages,
)


@pytest.mark.parametrize(("schedule", "v", "expected"), [
    ("GPipe", 1, [8, 8, 8, 8]),               # every forward before any backward
    ("1F1B", 1, [4, 3, 2, 1]),                # min(m, p - r)
    ("Interleaved1F1B", 2, [11, 9, 7, 5]),    # (v - 1) * 4 + 2 * (p - 1 - r) warm-up forwards, + 1
    ("LoopedBFS", 2, [16, 16, 16, 16]),       # m * v
    ("InterleavedZeroBubble", 2, [8, 8, 8, 8]),
    ("ZBVZeroBubble", 2, [8, 8, 8, 8]),
    ("DualPipeV", 2, [8, 8, 8, 9]),
])
def test_forwards_in_flight_per_schedule(schedule, v, expected):
    options = PipelineOptions(schedule, microbatches=8)
    assert options.local_stages == v
    assert [inflight(options, 4, r) for r in range(4)] == expected


def test_1f1b_holds_p_micro_batches_however_many_there_are():
    for m in (4, 8, 64):
        assert inflight(PipelineOptions("1F1B", m), 4, 0) == 4
    assert inflight(PipelineOptions("GPipe", 64), 4, 0) == 64
    assert last_stage_inflight(PipelineOptions("GPipe", 8), 4) == 8
    assert last_stage_inflight(PipelineOptions("1F1B", 8), 4) == 1


def _torch_peak(name: str, p: int, m: int, v: int) -> list[int]:
    """Peak forwards in flight per rank from torch's own action lists (a micro-batch's tensors
    are freed by its full backward, or by its weight-gradient step under zero bubble)."""
    import torch.distributed.pipelining.schedules as S

    cls = S.get_schedule_class(name)
    sched = cls.__new__(cls)  # the order only: no stages, no process group
    rounds = max(1, m // p)
    for attr, value in dict(pp_group_size=p, n_local_stages=v, _n_microbatches=m, _num_stages=p * v,
                            num_stages=p * v, number_of_rounds=rounds, microbatches_per_round=m // rounds,
                            _stages=[object()] * v).items():
        setattr(sched, attr, value)
    peaks = []
    for rank in range(p):
        held = peak = 0
        for action in sched._calculate_single_rank_operations(rank):
            if action is None:
                continue
            kind = action.computation_type
            held += 1 if kind == S.FORWARD else -1 if kind in (S.FULL_BACKWARD, S.BACKWARD_WEIGHT) else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                                  "DualPipeV"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (4, 12), (4, 16), (8, 16)])
def test_forwards_in_flight_match_torchs_schedule_orders(name, p, m):
    options = PipelineOptions(name, microbatches=m)
    assert [inflight(options, p, r) for r in range(p)] == _torch_peak(name, p, m, options.local_stages)


def test_bubble_from_the_schedule():
    assert bubble(PipelineOptions("1F1B", 12), 4) == pytest.approx(3 / 12)
    assert bubble(PipelineOptions("Interleaved1F1B", 12), 4) == pytest.approx(3 / 24)
    assert bubble(PipelineOptions("ZBVZeroBubble", 12), 4) == pytest.approx(3 / 24 / 3)
    assert bubble(PipelineOptions("1F1B", 12), 1) == 0


def test_stages_follow_the_strategys_split():
    # 10 blocks, 2 ranks x 2 stages (looped): stages [0-2], [3-5], [6-7], [8-9]; rank 0 holds 0 and 2
    ranks = rank_stages(PipelineOptions("Interleaved1F1B", 4), 2, 10)
    assert ranks[0].layers == ((0, 1, 2), (6, 7)) and ranks[0].first and not ranks[0].last
    assert ranks[1].layers == ((3, 4, 5), (8, 9)) and ranks[1].last
    v = rank_stages(PipelineOptions("ZBVZeroBubble", 4), 2, 8)  # V: rank 0 holds the first and the last stage
    assert v[0].stages == (0, 3) and v[0].first and v[0].last


def test_layout_checks_its_pipeline_like_the_strategy():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        Layout(dp_shard=1, pp=2, pp_schedule="zigzag")
    with pytest.raises(ValueError, match="runs one stage per rank"):
        Layout(dp_shard=1, pp=2, pp_schedule="1F1B", pp_stages_per_rank=2)
    assert Layout(dp_shard=2, pp=4, pp_microbatches=16).microbatches == 16
    assert Layout(dp_shard=2, pp=4).microbatches == 4  # the strategy's default: one per stage
    assert Layout(dp_shard=2, pp=4, pp_schedule="Interleaved1F1B").microbatches == 8


SHAPE = ModelShape("8-layer", params=900_000_000, embedding_params=100_000_000, block_params=100_000_000,
                   expert_params=0, active_params=900_000_000, n_layer=8, n_embd=1024, n_head=8, vocab=1024,
                   tied=False, flops_per_token=6 * 10**9, seq_len=1024)


def _pp_memory(schedule: str, m: int, precision: str = "fp32"):
    layout = Layout(dp_shard=1, pp=2, zero=3, pp_schedule=schedule, pp_microbatches=m)
    return memory_per_gpu(SHAPE, layout, Workload(1024, m, micro_batch=1, precision=precision),
                          Cluster("cpu", 2, memory_gb=64))


def test_1f1b_memory_is_the_first_ranks_by_hand():
    s, e, h = 1024, 4, 1024
    layer = layer_bytes(SHAPE, 0, e=e, cpu=True)
    # rank 0: 2 micro-batches of blocks 0-3 (+ each stage output kept for its send); rank 1: one of
    # blocks 4-7, the final norm and head input, the logits (the stage output, kept until its
    # backward), the loss's log-softmax output and its backward's two gradients: 4 + 4 + 8 B in fp32
    rank0 = 2 * s * (4 * layer + e * h)
    logit = LOGIT_OUTPUT_BYTES["fp32"] + LOGIT_SAVED_BYTES + LOGIT_GRAD_BYTES
    assert logit == 16
    rank1 = s * (4 * layer + head_bytes(SHAPE, e, 1, True)) + s * 1024 * logit
    m = _pp_memory("1F1B", 8)
    assert m.rank == 0 and m.activations == pytest.approx(rank0) and m.logits == 0
    assert rank0 > rank1
    # no FSDP for pipeline stages alone on their data-parallel rank in fp32: the state is 16 B per
    # local parameter (4 blocks + the embedding), no gathered buffers; torch's first stage keeps a
    # receive buffer for its output's gradient per micro-batch
    assert m.state == pytest.approx(16 * (4 * 100e6 + 50e6))
    assert m.buffers == m.persistent == 8 * s * e * h


def test_gpipe_holds_every_micro_batch_and_its_logits():
    s, e = 1024, 4
    layer = layer_bytes(SHAPE, 0, e=e, cpu=True)
    g = _pp_memory("GPipe", 8)
    # 8 micro-batches' logits and log-softmax outputs (8 B per element in fp32), one backward's
    # gradients (8 B)
    last = s * 8 * (4 * layer + head_bytes(SHAPE, e, 1, True)) + s * 1024 * (8 * 8 + 8)
    assert g.rank == 1 and g.activations + g.logits == pytest.approx(last)
    one = _pp_memory("1F1B", 8)
    assert g.activations + g.logits > 3.5 * (one.activations + one.logits)  # 8 micro-batches in flight, not 2


def test_pipeline_with_fsdp_keeps_the_stage_gathered():
    # bf16 runs FSDP under pp (reshard_after_forward=False): the stage's parameters stay gathered
    layout = Layout(dp_shard=2, pp=2, zero=3, pp_microbatches=4)
    m = memory_per_gpu(SHAPE, layout, Workload(1024, 16, precision="bf16"), Cluster("H100 SXM", 8))
    local = 4 * 100e6 + 50e6
    assert m.state == pytest.approx(16 * local / 2)
    receive = 4 * 1024 * 2 * 1024  # rank 0: its output's gradient, per micro-batch
    assert m.buffers == pytest.approx(local * 2 + 100e6 * 4 + receive + 2 * GB)  # stage at bf16, a block's fp32 grad
    # gradient accumulation: by default every schedule step reduce-scatters, nothing more is held;
    # with accumulate_unsharded_grads each unit keeps its whole fp32 gradient between the steps
    acc = memory_per_gpu(SHAPE, layout, Workload(1024, 32, precision="bf16"), Cluster("H100 SXM", 8),
                         accumulation=2)
    assert acc.total == pytest.approx(m.total)
    unsharded = Layout(dp_shard=2, pp=2, zero=3, pp_microbatches=4, accumulate_unsharded_grads=True)
    held = memory_per_gpu(SHAPE, unsharded, Workload(1024, 32, precision="bf16"), Cluster("H100 SXM", 8),
                          accumulation=2)
    assert held.grads == pytest.approx(local * 4) and held.total - m.total == pytest.approx(local * 4 - m.grads)
    assert memory_per_gpu(SHAPE, unsharded, Workload(1024, 16, precision="bf16"),
                          Cluster("H100 SXM", 8)).total == pytest.approx(m.total)  # no accumulation: no change


def test_tied_model_is_planned_untied_under_a_pipeline():
    tied = ModelShape("tied", params=810_000_000, embedding_params=10_000_000, block_params=100_000_000,
                      expert_params=0, active_params=810_000_000, n_layer=8, n_embd=1024, n_head=8, vocab=32000,
                      tied=True, flops_per_token=6 * 10**9, seq_len=1024, head_params=2048)
    layout = Layout(dp_shard=1, pp=2, zero=3, pp_microbatches=2)
    m = memory_per_gpu(tied, layout, Workload(1024, 2), Cluster("H100 SXM", 8))
    # the last stage gains its own 32000 x 1024 head: 4 blocks + head + final norm
    assert m.rank == 1 and m.params == pytest.approx((4 * 100e6 + 32000 * 1024 + 2048) * 2)
