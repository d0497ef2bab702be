"""Context parallel (issue 25): a GPT with RoPE and grouped-query attention trained with its
sequences sharded over cp ranks matches one process (``cp_worker.py``), alone and composed with
FSDP2, TP (+ sequence and loss parallel), PP, selective activation checkpointing and compile;
resume and resharding from its checkpoints; load balance; bad input refused with the fix."""

from __future__ import annotations

import pytest
import torch

import cp_worker as worker
from dist_utils import in_this_process
from lightning_disttrain.models.context_parallel import (
    ContextParallel,
    attention_work,
    check_length,
    shard_sequence,
)
from lightning_disttrain.models.ring_attention import pairs_computed

WORKER = "cp_worker"
LAUNCH = {2: ["cp2", "activations", "cp2_sac", "cp2_learned", "cp2_compile", "resume", "reshard"],
          4: ["cp4", "activations", "cp2_dp2", "cp2_tp2", "cp2_pp2"],  # "activations" after a fit
          8: ["cp2_pp2_tp2", "cp2_pp2_tp2_learned"]}  # in the suite's one 8-rank launch (with pp_worker's)
TOL = 1e-5


@pytest.fixture(scope="module")
def single():
    return in_this_process(lambda: {run: worker.fit_run(run, 1) for run in ("single", "single_learned")})


def _matches(ranks, reference):
    assert len(reference) == worker.base.STEPS
    for r in ranks:
        assert r["losses"] == pytest.approx(reference, abs=TOL)


@pytest.mark.parametrize("run", ["cp2", "cp2_sac", "cp2_compile"])
def test_cp2_matches_one_process(two, single, run):
    _matches(two[run], single["single"]["losses"])
    assert two[run][0]["steps"][0].startswith("context_parallel: cp=2")


def test_selective_checkpointing_keeps_the_ring_and_does_not_run_it_again(two):
    # ring attention is one operator that "selective" keeps: per layer and micro-batch cp - 1 = 1
    # transfer in forward and cp + 1 = 3 in backward (keys and values, then their gradients, the
    # last one home), as without checkpointing; a recomputed ring would add its forward's again
    per_micro_batch = 4 * worker.VARIANT["n_layer"]
    for run in ("cp2", "cp2_sac"):
        shifts = [r["ring_shifts"] for r in two[run]]
        assert shifts[0] == shifts[1] and shifts[0] % per_micro_batch == 0, (run, shifts)
    assert two["cp2_sac"][0]["ring_shifts"] == two["cp2"][0]["ring_shifts"]


def test_cp2_with_learned_positions_matches_one_process(two, single):
    _matches(two["cp2_learned"], single["single_learned"]["losses"])


@pytest.mark.parametrize("run", ["cp4", "cp2_dp2", "cp2_tp2", "cp2_pp2"])
def test_cp_composed_on_four_ranks_matches_one_process(four, single, run):
    _matches(four[run], single["single"]["losses"])


@pytest.mark.parametrize("run, baseline", [("cp2_pp2_tp2", "single"), ("cp2_pp2_tp2_learned", "single_learned")])
def test_cp_pp_tp_with_sequence_parallel_on_eight_ranks_matches_one_process(launched, single, run, baseline):
    # Issue 43: the second stage's input is hidden states holding 1/tp of the cp shard (sequence
    # parallel); its RoPE rows are those of the positions the strategy sharded, not of that length.
    eight = launched(WORKER, 8)
    _matches(eight[run], single[baseline]["losses"])
    steps = eight[run][0]["steps"]
    assert any(s.startswith("pipeline: 1F1B, 2 stages") for s in steps), steps
    assert any(s.startswith("context_parallel: cp=2") for s in steps), steps
    assert any(s.startswith("tensor_parallel: tp=2") and ", sequence parallel" in s for s in steps), steps
    shards = [r["shard"] for r in eight[run]]  # the cp ranks' chunks, equal across pp and tp ranks
    assert sorted(map(tuple, shards)) == sorted([(0, 1, 2, 3, 12, 13, 14, 15)] * 4 + [(4, 5, 6, 7, 8, 9, 10, 11)] * 4)


def test_each_cp_rank_holds_its_load_balanced_chunks(two, four):
    assert [r["shard"] for r in two["cp2"]] == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert [r["shard"] for r in four["cp4"]] == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # the cp ranks of a replica read the same samples; tokens are counted once, whole
    assert {str(r["sampler"]) for r in four["cp2_dp2"]} == {str({"num_replicas": 2, "rank": 0}),
                                                            str({"num_replicas": 2, "rank": 1})}
    assert two["cp2"][0]["tokens_seen"] == worker.base.STEPS * worker.base.GLOBAL_BATCH * worker.base.SEQ


def test_resume_and_reshard_from_a_cp2_checkpoint(two, single):
    after = single["single"]["losses"][worker.RESUME_AT:]
    assert after  # steps trained after the resume
    for r in two["resume"]:  # cp=2 -> cp=2
        assert r["resumed"] == pytest.approx(after, abs=TOL)
    for r in two["reshard"]:  # cp=2 -> dp=2 (cp=1) on the same ranks
        assert r["resumed"] == pytest.approx(after, abs=TOL)


# ---- single process ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4])
def test_the_plan_counts_what_a_cp_rank_keeps_for_backward(two, four, cp):
    # planning/activations.py against what three blocks keep on each rank (fp32, CPU), to the byte:
    # ring attention keeps this rank's q, k, v, output and log-sum-exp, as one process does for its
    # tokens (no gathered K/V, index or masks). Read once the gloo threads have dropped the chunks
    # they carried (``activation_bytes(settle_s=...)``).
    for rank, result in enumerate((two if cp == 2 else four)["activations"]):
        for m in result["activations"]:
            assert m["measured"] == m["planned"], (rank, m)


def test_causal_work_is_balanced_across_cp_ranks():
    for seq_len, size in [(4096, 2), (4096, 4), (8192, 8), (32, 4)]:
        work = [attention_work(seq_len, r, size) for r in range(size)]
        assert max(work) / min(work) <= 1.05, work
        # what the kernels are handed (each chunk against its key prefix): exactly equal
        assert len({pairs_computed(seq_len, r, size) for r in range(size)}) == 1
    # a contiguous split would not be: the last rank computes 2*size-1 times the first's work
    contiguous = [sum(p + 1 for p in range(r * 1024, (r + 1) * 1024)) for r in range(4)]
    assert max(contiguous) / min(contiguous) > 5


def test_shards_are_a_partition():
    seq = torch.arange(24).view(1, -1)
    parts = [shard_sequence(seq, 1, r, 3) for r in range(3)]
    assert sorted(torch.cat(parts, 1).view(-1).tolist()) == list(range(24))


def test_a_sequence_not_divisible_by_2cp_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"not divisible by 4: use seq_len=20"):
        check_length(18, 2)


def test_a_batch_without_a_sequence_dimension_is_refused():
    from lightning_disttrain.parallel.mesh import ParallelDims
    from lightning_disttrain.strategies import NDParallelStrategy

    s = NDParallelStrategy(cp=2, dp_shard=1)
    s._parallel_dims = ParallelDims(cp=2, dp_shard=1, world_size=2)  # cp rank 0: no process group needed
    with pytest.raises(ValueError, match="has none: give the model"):
        s._shard_batch({"ids": torch.arange(4), "label": 3})
    with pytest.raises(ValueError, match="different sequence lengths"):
        s._shard_batch((torch.zeros(2, 8), torch.zeros(2, 12)))
    x, y = s._shard_batch((torch.arange(8).view(1, 8), torch.arange(8).view(1, 8)))
    assert x.view(-1).tolist() == [0, 1, 6, 7]


def test_the_strategy_records_the_positions_of_the_shard_for_every_stage():
    # Issue 43: a later pipeline stage takes its positions from the shard the strategy cut, not from
    # its input's length (hidden states: under sequence parallel 1/tp of the shard).
    from lightning_disttrain.models.gpt import GPT, GPTConfig
    from lightning_disttrain.parallel.mesh import ParallelDims
    from lightning_disttrain.strategies import NDParallelStrategy

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=64, pos_emb="rope"))
    cp = ContextParallel(group=None, rank=0, size=2)
    for m in model.modules():
        if hasattr(m, "context_parallel"):
            m.context_parallel = cp
    s = NDParallelStrategy(cp=2, dp_shard=1)
    s._parallel_dims = ParallelDims(cp=2, dp_shard=1, world_size=2)  # cp rank 0: no process group needed
    s._lightning_module = model
    with pytest.raises(ValueError, match="needs the positions of this rank's shard"):
        cp.shard_positions(tokens=None)  # a later stage before any batch was sharded
    s._shard_batch((torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long)))
    shard = [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp.positions.tolist() == shard
    assert cp.shard_positions(tokens=None).tolist() == shard  # a later stage: whatever its input's length
    assert cp.shard_positions(tokens=8).tolist() == shard  # the first stage: the sharded ids
    assert cp.shard_positions(tokens=4).tolist() == [0, 1, 6, 7]  # ids no strategy sharded: a shard of 8


def test_a_model_whose_attention_cannot_be_sharded_is_refused():
    from lightning_disttrain.parallel.context import apply_context_parallel

    class Mesh:
        def get_local_rank(self):
            return 0

        def size(self):
            return 2

    with pytest.raises(ValueError, match="has no module with a `context_parallel` attribute"):
        apply_context_parallel(torch.nn.Sequential(torch.nn.Linear(2, 2)), Mesh())


def test_cp_with_expert_parallel_is_refused_before_any_process_group():
    from lightning_disttrain.parallel.mesh import ParallelDims
    from lightning_disttrain.strategies import NDParallelStrategy

    s = NDParallelStrategy(cp=2, ep=2)
    s._make_parallel_dims = lambda world_size: ParallelDims(cp=2, ep=2, world_size=4)
    with pytest.raises(ValueError, match=r"ep=2 with cp=2 is not supported yet"):
        s.set_world_ranks()
