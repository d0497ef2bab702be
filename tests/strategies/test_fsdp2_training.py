"""FSDP2 through ``L.Trainer`` on 2 and 4 gloo ranks against one process with the same GLOBAL batch.

Each launch runs several ``trainer.fit`` (``fsdp2_worker.py``); Lightning's subprocess launcher
starts the other ranks. Compared per optimizer step over ``STEPS`` (4) steps: the loss averaged over the
global batch, the gradient norm (every gradient gathered whole), the norm after clipping.
"""


import pytest

import fsdp2_worker as worker
from dist_utils import in_this_process

TOL = 1e-5
TWO_RANK_RUNS = ["fsdp2", "fsdp2_zero2", "fsdp2_accum4", "fsdp2_accum4_unsharded", "hsdp_accum4", "fsdp2_meta",
                 "fsdp2_compile", "fsdp2_bf16", "flat_fsdp2", "ddp_like", "fsdp2_untied", "cli_by_name"]
FOUR_RANK_RUNS = ["fsdp2", "hsdp", "fsdp2_reshard2", "fsdp2_tp", "hsdp_tp"]
WORKER, LAUNCH = "fsdp2_worker", {2: TWO_RANK_RUNS, 4: FOUR_RANK_RUNS}  # launched by conftest.py


@pytest.fixture(scope="module")
def single():
    return in_this_process(worker.fit_run, "single", devices=1)


def assert_matches(ranks, single):
    assert len(single["losses"]) == worker.STEPS
    for rank, r in enumerate(ranks):
        assert r["optimizer_steps"] == worker.STEPS
        assert r["losses"] == pytest.approx(single["losses"], abs=TOL), f"rank {rank}"
        assert r["norms_before"] == pytest.approx(single["norms_before"], rel=TOL), f"rank {rank}"
        # trainer.validate after fit: same module, same strategy, sharded evaluation of the global set
        assert r["val_loss"] == pytest.approx(single["val_loss"], abs=TOL), f"rank {rank}"


@pytest.mark.parametrize("run", ["fsdp2", "fsdp2_zero2", "ddp_like"])
def test_two_ranks_match_single_process(two, single, run):
    assert_matches(two[run], single)
    assert two[run][0]["initial_checksum"] == single["initial_checksum"]  # rank 0's init, broadcast


@pytest.mark.parametrize("run", FOUR_RANK_RUNS)
def test_four_ranks_match_single_process(four, single, run):
    assert_matches(four[run], single)


def test_lightning_module_as_fsdp_root(two, single):
    # FlatGPT keeps the parts on the LightningModule and its training_step calls them directly:
    # FSDP's root hooks only run because the strategy enters training_step through __call__.
    ranks = two["flat_fsdp2"]
    assert all(r["root_is_lightning_module"] for r in ranks)
    assert_matches(ranks, single)


def test_replicate_only_all_reduces(two):
    for r in two["ddp_like"]:
        assert (r["dims"]["dp_replicate"], r["dims"]["dp_shard"]) == (2, 1)
        assert r["placements"] == ["R", "S(0)"] and r["local_rows"] == 32  # shards of size 1: full rows
        assert r["reduce_scatters"] == 0  # nothing to scatter over one shard: only the all-reduce


def test_layout_and_sampler(two, four):
    # The world mesh has the dimensions of size > 1 (and dp_shard, which FSDP wraps over): no
    # process group for a size-1 dimension. Parameters live on its dp_shard (x dp_replicate) slice.
    for ranks, run, dims, placements, mesh, rows in [
        (two["fsdp2"], "fsdp2", (1, 2), ["S(0)"], ["dp_shard"], 16),
        (four["fsdp2"], "fsdp2", (1, 4), ["S(0)"], ["dp_shard"], 8),
        (four["hsdp"], "hsdp", (2, 2), ["R", "S(0)"], ["dp_replicate", "dp_shard"], 16),
    ]:
        # Every rank is its own data-parallel rank here: no TP/PP ranks share samples.
        assert [r["sampler"] for r in ranks] == [{"num_replicas": len(ranks), "rank": i} for i in range(len(ranks))]
        for r in ranks:
            assert (r["dims"]["dp_replicate"], r["dims"]["dp_shard"]) == dims, run
            assert (r["placements"], r["mesh_dims"], r["local_rows"]) == (placements, mesh, rows), run
            assert r["lightning_module_mesh"] == mesh
            assert not r["root_is_lightning_module"]  # GPTModule.model owns every parameter
            assert r["sharded_after_validate"]


@pytest.mark.parametrize("run, per_step", [("fsdp2_accum4", 4), ("fsdp2_accum4_unsharded", 1)])
def test_gradient_accumulation_4x1_equals_1x4(two, single, run, per_step):
    accum, plain = two[run], two["fsdp2"]
    assert_matches(accum, single)
    for a, p in zip(accum, plain):
        assert a["micro_batches"] == 4 * worker.STEPS and p["micro_batches"] == worker.STEPS
        assert a["losses"] == pytest.approx(p["losses"], abs=TOL)
        # Default: gradients stay sharded, one reduce-scatter per FSDP unit per micro-batch;
        # accumulate_unsharded_grads: one per OPTIMIZER step (the unsharded gradients held meanwhile).
        assert a["fsdp_units"] == 3  # 2 blocks + the root
        assert p["reduce_scatters"] == worker.STEPS * 3
        assert a["reduce_scatters"] == per_step * worker.STEPS * 3


def test_hsdp_gradient_accumulation_equals_one_process(two, single):
    # Sharded accumulation under HSDP (2 replicas of 1 shard): the all-reduce across replicas waits
    # for the window's last micro-batch, FSDP keeping the partial sum meanwhile.
    assert_matches(two["hsdp_accum4"], single)


def test_gradient_clipping_uses_the_global_norm(two, four, single):
    runs = [two["fsdp2"], two["fsdp2_accum4"], four["hsdp"], four["fsdp2_tp"]]  # 2x2: norms over both dims
    for ranks in runs:
        for r in ranks:
            assert "install_mesh_aware_clipping" in r["clip_fn"]  # our DTensor-aware clip is what ran
            expected = [min(worker.CLIP, n) for n in single["norms_before"]]
            assert r["norms_after"] == pytest.approx(expected, rel=1e-4)
    assert max(single["norms_before"]) > worker.CLIP  # clipping was active


def test_transforms_run_in_stage_order(two):
    for r in two["fsdp2_compile"]:
        assert [e[0] for e in r["transform_log"]] == ["dtype", "activation_checkpointing", "fsdp"]
        # Earlier stages see the unsharded model; a transform registered at "fsdp" runs after ours.
        assert [e[1] for e in r["transform_log"]] == [False, False, True]
        assert r["transform_log"][0][2:] == ["32-true", 2]  # the context: precision, dims
        assert [n for _, n in r["transform_names"]] == ["probe_dtype", "probe_activation_checkpointing", "probe_fsdp"]
        steps = [s.split(":")[0] for s in r["parallelized_steps"]]
        assert steps == ["dtype", "activation_checkpointing", "compile", "fsdp", "fsdp"], r["parallelized_steps"]
        assert r["parallelized_steps"][2] == "compile: 2 blocks + the loss"  # GPTModule.compile_loss
        assert r["parallelized_steps"][3].startswith("fsdp: 2 blocks + 0 groups + root GPT")


def test_untied_head_group_keeps_its_parameters_after_forward(two, tmp_path_factory):
    # Backward starts at the head: the [ln_f, lm_head] unit keeps its gathered parameters after
    # forward, the last block reshards like the others (torchtitan's order). Tied: the head is in
    # the root (never resharded), so the last block keeps its parameters instead.
    for r in two["fsdp2_untied"]:
        assert r["unit_reshard"] == {"model": False, "model.blocks.0": True, "model.blocks.1": True,
                                     "model.wte": True, "model.ln_f": False, "model.lm_head": False}, r["unit_reshard"]
    for r in two["fsdp2"]:
        assert r["unit_reshard"] == {"model": False, "model.blocks.0": True, "model.blocks.1": False}, r["unit_reshard"]
    single = in_this_process(worker.fit_run, "single_untied", devices=1)
    assert_matches(two["fsdp2_untied"], single)


def test_compile_stage(two, single):
    assert_matches(two["fsdp2_compile"], single)
    assert all(r["compiled_blocks"] == 2 for r in two["fsdp2_compile"])
    assert all(r["recompile_watcher"] for r in two["fsdp2_compile"])  # polled every training batch
    assert not any(r["recompile_watcher"] for r in two["fsdp2"])


def test_bf16_mixed_trains_close_to_fp32(two, single):
    for r in two["fsdp2_bf16"]:
        assert r["transform_log"][0][2] == "bf16-mixed"  # the FSDP policy is derived from it
        assert r["losses"] == pytest.approx(single["losses"], abs=3e-2)
        assert r["losses"] == two["fsdp2_bf16"][0]["losses"]


def test_meta_init_equals_single_process_meta_build(two):
    import torch

    from lightning_disttrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    with torch.device("meta"):
        ref = GPT(GPTConfig.from_name("tiny", vocab_size=worker.VOCAB, **worker.MODEL))
    ref.to_empty(device="cpu")
    ref.init_weights()
    expected = worker.weights_checksum(ref)
    ranks = two["fsdp2_meta"]
    for r in ranks:
        assert r["initial_checksum"] == pytest.approx(expected, abs=1e-6)
        assert r["optimizer_steps"] == worker.STEPS and r["losses"] == ranks[0]["losses"]


def test_lightning_cli_fit_by_name(two):
    # A LightningCLI YAML naming the strategy (`strategy: fsdp2`), through DistTrainCLI on both ranks of the
    # shared launch (fsdp2_worker.CLI_BY_NAME); cli_worker.ReportStrategy reports what was built.
    ranks = two["cli_by_name"]
    for rank, r in enumerate(ranks):
        assert r["strategy"] == "FSDP2Strategy" and r["world_size"] == 2 and r["global_step"] == 3
        assert r["sampler"] == {"num_replicas": 2, "rank": rank}
    assert ranks[0]["loss"] == ranks[1]["loss"]  # logged with sync_dist: the global mean on every rank


def test_fsdp2_x_tensor_parallel_2x2(four):
    # Parameters are sharded over both: FSDP over the data-parallel pair, TP within each pair.
    for r in four["fsdp2_tp"]:
        assert (r["dims"]["dp_shard"], r["dims"]["tp"]) == (2, 2)
        assert r["mesh_dims"] == ["dp_shard", "tp"] and r["placements"] == ["_S(0, 2)", "S(0)"]
        assert r["local_rows"] == 32 // 4
        # The sampler counts replicas, not ranks: the TP pair (0, 1) reads replica 0's samples.
        assert r["sampler"]["num_replicas"] == 2
    assert [r["sampler"]["rank"] for r in four["fsdp2_tp"]] == [0, 0, 1, 1]
    for r in four["hsdp_tp"]:
        assert (r["dims"]["dp_replicate"], r["dims"]["dp_shard"], r["dims"]["tp"]) == (2, 1, 2)
        assert r["mesh_dims"] == ["dp_replicate", "dp_shard", "tp"] and r["local_rows"] == 32 // 2
    assert [r["sampler"]["rank"] for r in four["hsdp_tp"]] == [0, 0, 1, 1]
