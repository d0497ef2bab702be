"""Hybrid Muon (Muon on the blocks' matrices, AdamW elsewhere) under fsdp2 (ZeRO-3 and ZeRO-2) / HSDP /
tensor parallel / FSDP2 x TP against one process.

Under FSDP2 the package's Muon (``parallel.muon.ShardedMuon``, issue 41) sends each matrix's
momentum shards to one owner rank, which runs torch's Newton-Schulz iteration on the whole matrix
and sends each rank its rows back: one all-to-all each way per bucket, 2 collectives per optimizer
step here (HSDP: 3, the owners spread over the replicas too) (torch's Muon on the DTensors: 182 on
this model, DTensor's redistributions inside every matmul). Under tensor parallel (tp=2 over
dp_shard=1: the row-parallel matrices' pieces are ``Shard(1)`` over tp, the column-parallel ones'
``Shard(0)``) the same two all-to-alls run over the tp group; under dp_shard=2 x tp=2 the pieces
travel over tp, then over dp_shard, to the owner and back: 4 collectives per step, each matrix
still orthogonalised once, whole, among the 4 ranks. With the iteration in fp32 (``ns_dtype``) the
weights after every step and the losses equal one process's to fp32 rounding (measured 1.6e-7 on
the weights, 4.8e-7 on the losses, as AdamW's; tp2 1.3e-7 and 4.8e-7, dp_shard=2 x tp=2 1.7e-7
and 4.8e-7). In torch's bf16 the same holds for the same gradient
(tests/parallel/test_muon_owner.py: bitwise), but a data-parallel gradient is summed in another
order than one process's, and a bf16 rounding that flips moves a weight by ~lr * 2^-8: the losses
agree to ~1e-4 (measured 6e-5).

The other layouts, fp32 (within 1e-5 of one process, weights at every step): pipeline parallel
(pp2: each stage its layers' matrices; pp2 x dp_shard2), context parallel (cp2: FSDP2 over the
dp_shard x cp ranks), CPU offload, and a mixture of experts under expert parallel (ep2, and ep2 in
dp_shard4: the attention and router matrices on ShardedMuon, each routed expert's matrices on
``ExpertMuon`` where the expert lives).
"""

import os

import numpy as np
import pytest

import muon_worker
from dist_utils import in_this_process

# The layouts run on 2 ranks also on 4 (ZeRO-2, cp2 x dp_shard2, CPU offload, float8): an extended run
# (LDT_MUON_EXTENDED=1), not collected otherwise (the suite's time budget), as the fault-tolerance
# tests' extended layouts; the exchange itself is tested on 4 ranks in tests/parallel/test_muon_owner.py.
EXTENDED = os.environ.get("LDT_MUON_EXTENDED") == "1"
EXTENDED_FOUR = ["fsdp2_zero2+fp32", "cp2dp2+fp32", "offload+fp32", "fsdp2_float8+fp32"]
# launched by conftest.py
WORKER, LAUNCH = "muon_worker", {2: ["fsdp2", "fsdp2+fp32", "fsdp2_zero2+fp32", "tp2+fp32", "resume", "reshard",
                                     "pp2+fp32", "cp2+fp32", "offload+fp32", "moe_ep2+fp32", "fsdp2_float8+fp32"],
                                 4: ["hsdp2x2+fp32", "fsdp2tp2x2+fp32", "pp2fsdp2+fp32", "moe_ep2fsdp4+fp32",
                                     *(EXTENDED_FOUR if EXTENDED else [])]}
# what NDParallelStrategy gives the blocks' matrices with tp=2 (dp_shard=1 or 2): row-parallel wo / w2 and
# column-parallel wq / wk / wv / w1 (FSDP2 over TP's strided rows)
TP_PLACEMENTS = ["(Shard(dim=0), Shard(dim=1))", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"]


@pytest.fixture(scope="module")
def single():
    return {run: in_this_process(muon_worker.fit_run, run, 1)
            for run in ("auto", "auto+fp32", "moe_auto+fp32", "auto_float8+fp32")}


def test_muon_under_fsdp2_matches_one_process(launched, single):
    for rank in launched(WORKER, 2)["fsdp2"]:
        assert len(rank["losses"]) == muon_worker.STEPS
        assert rank["losses"] == pytest.approx(single["auto"]["losses"], abs=5e-4)


def _max_weight_diffs(run: dict, one: dict) -> list[float]:
    """Per step, the largest difference over the run's Muon matrices (a pipeline stage: its own)
    from one process's of the same name."""
    diffs = []
    for step, ref in zip(run["weights"], one["weights"], strict=True):
        assert step and set(step) <= set(ref)
        diffs.append(max(float(np.abs(np.subtract(w, ref[n])).max()) for n, w in step.items()))
    return diffs


@pytest.mark.parametrize(("devices", "run"), [(2, "fsdp2+fp32"), (2, "fsdp2_zero2+fp32"), (4, "hsdp2x2+fp32"),
                                              (2, "tp2+fp32"), (4, "fsdp2tp2x2+fp32")])
def test_fp32_muon_under_fsdp_and_tp_equals_one_process_at_every_step(launched, single, devices, run):
    one = single["auto+fp32"]
    assert len(one["weights"]) == muon_worker.STEPS
    for rank in launched(WORKER, devices)[run]:
        assert rank["muon"] == "ShardedMuon"
        assert max(_max_weight_diffs(rank, one)) <= 1e-5
        assert rank["losses"] == pytest.approx(one["losses"], abs=1e-5)
        if "tp" in run:
            assert rank["placements"] == TP_PLACEMENTS


@pytest.mark.parametrize(("devices", "run", "per_step"), [
    *([(4, "fsdp2_zero2+fp32", 2), (4, "cp2dp2+fp32", 2), (4, "offload+fp32", 2)] if EXTENDED else []),
    (2, "pp2+fp32", 0),  # each stage its layers' matrices, whole (dp_shard=1): no exchange
    (2, "cp2+fp32", 2), (2, "offload+fp32", 2),  # FSDP2 over dp_shard x cp; FSDP2 with CPU-offloaded shards
    (2, "moe_ep2+fp32", 2),  # MoE: attention and router matrices exchanged; the experts' stacks locally
    (4, "pp2fsdp2+fp32", 2), (4, "moe_ep2fsdp4+fp32", 2)])
def test_fp32_muon_under_pp_cp_offload_and_ep_equals_one_process_at_every_step(launched, single, devices, run,
                                                                              per_step):
    one = single["moe_auto+fp32" if run.startswith("moe_") else "auto+fp32"]
    for rank in launched(WORKER, devices)[run]:
        assert rank["muon"] == "ShardedMuon"
        assert max(_max_weight_diffs(rank, one)) <= 1e-5
        assert rank["losses"] == pytest.approx(one["losses"], abs=1e-5)
        assert rank["collectives"] == [per_step] * muon_worker.STEPS


@pytest.mark.parametrize("devices", [2, *([4] if EXTENDED else [])])
def test_muon_with_float8_linears_under_fsdp2_trains_as_one_process(launched, single, devices):
    # torchao's float8 Linears, FSDP2 gathering their weights in float8: not bit-exact against one
    # process by design (each rank scales its activations by their amax over its half of the batch;
    # tests/callbacks/test_float8.py holds AdamW to the same 5e-3), and Muon orthogonalises what
    # comes out of that: the owner path takes the float8 weights' DTensors as any others
    one = single["auto_float8+fp32"]
    for rank in launched(WORKER, devices)["fsdp2_float8+fp32"]:
        assert rank["muon"] == "ShardedMuon" and rank["collectives"] == [2] * muon_worker.STEPS
        assert rank["losses"] == pytest.approx(one["losses"], rel=5e-3)
        assert rank["losses"] != pytest.approx(single["auto+fp32"]["losses"], abs=1e-5)  # float8 did run


@pytest.mark.parametrize(("devices", "run", "per_step"),
                         [(2, "fsdp2", 2), (2, "fsdp2+fp32", 2), (2, "fsdp2_zero2+fp32", 2), (4, "hsdp2x2+fp32", 3),
                          (2, "tp2+fp32", 2), (4, "fsdp2tp2x2+fp32", 4)])
def test_a_muon_step_issues_two_collectives_per_bucket_and_splitting_dimension(launched, devices, run, per_step):
    # one bucket (the default): one all-to-all to the owners, one back, over each mesh dimension that
    # splits the matrices (dp_shard, tp or both); under HSDP one more, over the replica group (each
    # replica orthogonalises its share of the matrices); the AdamW part issues none
    for rank in launched(WORKER, devices)[run]:
        assert rank["collectives"] == [per_step] * muon_worker.STEPS


@pytest.mark.parametrize("run", ["resume", "reshard"])
def test_muon_state_resumes_from_a_dcp_checkpoint_on_the_same_and_another_layout(launched, single, run):
    # A mixture of experts under fsdp2 x2 saves after step 3 (ShardedMuon's and ExpertMuon's momenta
    # Shard(0) over 2 ranks); resumed by fsdp2 x2, or by HSDP over the same ranks (momenta
    # replicated): the steps after equal one uninterrupted process's, and on the same layout the
    # uninterrupted run's to the bit
    one, at = single["moe_auto+fp32"], muon_worker.RESUME_AT
    for rank in launched(WORKER, 2)[run]:
        assert rank["global_step"] == muon_worker.STEPS
        assert rank["muon"] == ["ShardedMuon", "ExpertMuon", "AdamW"]
        assert rank["momenta"] == sum(len(w) for w in one["weights"][:1])  # every Muon matrix and stack
        assert rank["losses"] == pytest.approx(one["losses"][at:], abs=1e-5)
        assert max(_max_weight_diffs(rank, {"weights": one["weights"][at:]})) <= 1e-5
        expected = "(Shard(dim=0),)" if run == "resume" else "(Replicate(), Shard(dim=0))"
        assert rank["momentum_placements"] == [expected], rank["momentum_placements"]
        if run == "resume":
            assert rank["losses"] == rank["uninterrupted"]["losses"][at:]
            assert rank["weights"] == rank["uninterrupted"]["weights"][at:]
