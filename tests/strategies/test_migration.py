"""A Lightning ModelParallelStrategy / FSDPStrategy / DDPStrategy project moves over by changing
one import (issue 24): ``migration_worker.py`` trains a module written in Lightning's documented TP
style under Lightning's strategy and under ours, on the same ranks, seed and data."""

from __future__ import annotations

import pytest

from dist_utils import in_this_process

import migration_worker as worker

WORKER = "migration_worker"
LAUNCH = {2: ["lightning", "ours", "fsdp1_style", "ddp_style", "example_lightning", "example_ours"],
          4: ["lightning", "ours", "ours_tp_only", "mixed_names", "resume_ours", "resume_lightning"]}


@pytest.fixture(scope="module")
def single():
    return in_this_process(lambda: worker.fit_run("single", 1))


def _same(a, b, tol):
    assert len(a) == len(b) == worker.STEPS or len(a) == len(b)
    assert a == pytest.approx(b, abs=tol), (a, b)


def test_tp2_matches_lightnings_own_strategy(two):
    # dp=1 x tp=2: the module's own TP plan and fully_shard, Lightning's mesh names.
    for ours, theirs in zip(two["ours"], two["lightning"]):
        assert ours["mesh"] == theirs["mesh"] == {"data_parallel": 1, "tensor_parallel": 2}
        assert ours["tp_ranks"] == theirs["tp_ranks"]
        _same(ours["losses"], theirs["losses"], 1e-6)


def test_the_examples_project_trains_under_ours_as_under_lightnings(two):
    # examples/model_parallel_project.py: the project, unchanged but for the import, gives the same
    # final loss (tests/test_examples.py runs the script itself, under ours)
    for ours, theirs in zip(two["example_ours"], two["example_lightning"]):
        assert ours["loss"] == theirs["loss"] and ours["loss"] < 3.0  # from ln(256) = 5.55


def test_dp2_tp2_matches_lightnings_own_strategy(four):
    for ours, theirs in zip(four["ours"], four["lightning"]):
        assert ours["mesh"] == theirs["mesh"] == {"data_parallel": 2, "tensor_parallel": 2}
        assert ours["tp_ranks"] == theirs["tp_ranks"]  # the same ranks in each TP group as Lightning's
        _same(ours["losses"], theirs["losses"], 1e-6)


def test_a_module_that_applies_only_tp_gets_fsdp_from_us(four):
    for r in four["ours_tp_only"]:
        assert any(step.startswith("fsdp:") for step in r["steps"]), r["steps"]
        assert not any(step.startswith("tensor_parallel") for step in r["steps"])  # the module's TP is kept
    # Same math as the module that shards itself (FSDP's units differ, the sums do not).
    _same(four["ours_tp_only"][0]["losses"], four["lightning"][0]["losses"], 1e-5)


def test_our_mesh_names_and_lightnings_mix(four):
    _same(four["mixed_names"][0]["losses"], four["lightning"][0]["losses"], 1e-6)


def test_resume_from_our_checkpoint(four):
    r = four["resume_ours"][0]
    _same(r["resumed"], r["full"][2:], 1e-6)


def test_resume_from_a_checkpoint_lightnings_strategy_wrote(four):
    r = four["resume_lightning"][0]
    assert "meta.pt" in r["files"] and ".metadata" in r["files"] and "manifest.json" not in r["files"]
    _same(r["resumed"], r["full"][2:], 1e-6)


def test_fsdp1_style_project_matches_one_process(two, single):
    for r in two["fsdp1_style"]:
        assert "activation_checkpointing: FSDPStrategy(activation_checkpointing_policy)" in r["steps"], r["steps"]
        _same(r["losses"], single["losses"], 1e-5)


def test_ddp_style_project_matches_one_process(two, single):
    for r in two["ddp_style"]:
        _same(r["losses"], single["losses"], 1e-5)


# ---- arguments: mapped or refused with what to do, before any process group -------------------------


def test_lightning_arguments_are_accepted_or_refused_with_the_fix():
    import torch.nn as nn
    from torch.distributed.fsdp import ShardingStrategy

    from lightning_disttrain.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size="auto", process_group_backend="gloo")
    with pytest.raises(ValueError, match="export CKPT_DIR model.ckpt --full"):
        ModelParallelStrategy(save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="data_parallel_size / tensor_parallel_size"):
        ModelParallelStrategy(tp=2)
    s = FSDPStrategy(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, cpu_offload=True)
    assert s.reshard_after_forward is False and s.cpu_offload is True
    assert FSDPStrategy(sharding_strategy="HYBRID_SHARD").hsdp is True
    with pytest.raises(ValueError, match="DDPStrategy"):
        FSDPStrategy(sharding_strategy="NO_SHARD")
    with pytest.raises(ValueError, match="--full"):
        FSDPStrategy(state_dict_type="full")
    with pytest.raises(ValueError, match="precision='bf16-mixed'"):
        FSDPStrategy(mixed_precision=object())
    with pytest.raises(ValueError, match="limit_all_gathers"):
        FSDPStrategy(limit_all_gathers=True)
    with pytest.raises(ValueError, match="set of module classes"):
        FSDPStrategy(auto_wrap_policy=lambda *a, **k: True)
    FSDPStrategy(auto_wrap_policy={nn.TransformerEncoderLayer})
    DDPStrategy(find_unused_parameters=True, static_graph=True)
    with pytest.raises(ValueError, match="communication hooks"):
        DDPStrategy(ddp_comm_hook=print)


def test_the_world_size_must_be_data_times_tensor_parallel():
    from lightning_disttrain.strategies import ModelParallelStrategy

    s = ModelParallelStrategy(data_parallel_size=3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_size=3 x tensor_parallel_size=2 = 6 must equal the world"):
        s._make_parallel_dims(4)
    assert ModelParallelStrategy()._make_parallel_dims(4).tp == 4  # "auto": devices per node, as Lightning's


def test_a_wrap_policy_naming_other_classes_than_the_blocks_is_refused():
    import torch.nn as nn

    from lightning_disttrain.strategies import FSDPStrategy

    s = FSDPStrategy(auto_wrap_policy={nn.Linear})
    with pytest.raises(ValueError, match=r"\['Linear'\], which are not Transformer's repeated blocks \(\['Block'\]\)"):
        s._refuse_other_classes(worker.Transformer(), {nn.Linear}, "auto_wrap_policy")
