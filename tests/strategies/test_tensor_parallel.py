"""Tensor parallel (+ sequence and loss parallel) through ``L.Trainer`` on 2 gloo ranks against one
process with the same global batch, 4 steps (``STEPS``), fp32: GPTModule in several shapes, with activation
checkpointing and float8, and a LightningModule with its own plan. FSDP2 x TP 2x2 is in
test_fsdp2_training.py, TP checkpoints (resume, reshard) in tests/checkpoint/test_resume.py.
Bad input: in process, no ranks launched."""

from __future__ import annotations


import lightning as L
import pytest
import torch

import tp_worker as worker
from dist_utils import in_this_process
from lightning_disttrain.module import GPTModule
from lightning_disttrain.strategies import NDParallelStrategy

RUNS = ["tp2", "tp2_nosp", "tp2_nolp", "tp2_variant", "tp2_sac", "tp2_fullac", "tp2_float8", "tp2_mixer",
        "tp2_compile"]
BASELINE = {"tp2": "single", "tp2_nosp": "single", "tp2_nolp": "single", "tp2_variant": "single_variant",
            "tp2_sac": "single", "tp2_fullac": "single", "tp2_float8": "single_float8", "tp2_mixer": "single_mixer",
            "tp2_compile": "single"}
WORKER, LAUNCH = "tp_worker", {2: RUNS}  # launched by conftest.py
TOL = 1e-5
FLOAT8_TOL = 1e-3
"""float8 (emulated on CPU) under TP vs one process: the same casts, scales from the same amax
(all-reduced over the shards), but matmuls over half the columns round differently; measured
2.2e-4 at most over 8 steps, 5.0e-5 over the 4 of ``STEPS``."""


@pytest.fixture(scope="module")
def single():
    return in_this_process(lambda: {name: worker.fit_run(name, devices=1) for name in sorted(set(BASELINE.values()))})


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_tp2_matches_one_process(two, single, run):
    reference = single[BASELINE[run]]
    assert len(reference["losses"]) == worker.base.STEPS
    for r in two[run]:
        assert r["losses"] == pytest.approx(reference["losses"], abs=FLOAT8_TOL if "float8" in run else TOL)
        assert r["sampler"] == {"num_replicas": 1, "rank": 0}  # both TP ranks read the whole batch
    if reference.get("generated") is not None:
        assert two[run][0]["generated"] == two[run][1]["generated"] == reference["generated"]


@pytest.mark.slow
def test_layouts(two):
    for r in two["tp2"]:
        # wq: (32, 32) sharded by TP on its rows (output features), FSDP over one data-parallel rank.
        assert r["mesh_dims"] == ["dp_shard", "tp"] and r["local_shape"] == [16, 32]
        assert r["tied"] is True  # the embedding and the head share one vocabulary-sharded weight
        assert r["steps"] == ["tensor_parallel: tp=2, 2 blocks + root, sequence parallel, loss parallel",
                              "fsdp: 2 blocks + 0 groups + root GPT"]
    assert two["tp2_nosp"][0]["steps"][0] == "tensor_parallel: tp=2, 2 blocks + root, loss parallel"
    assert two["tp2_nolp"][0]["steps"][0] == "tensor_parallel: tp=2, 2 blocks + root, sequence parallel"
    assert two["tp2_variant"][0]["tied"] is False
    assert two["tp2_mixer"][0]["local_shape"] == [64, 32]  # MixerLM.up: (128, 32), its own plan


@pytest.mark.slow
def test_selective_checkpointing_keeps_the_tp_collectives(two):
    # Backward runs the same TP collectives with selective checkpointing as without: the
    # forward's all-gathers / reduce-scatters are saved, not recomputed. Full checkpointing
    # reruns them (and is still correct: it is in test_tp2_matches_one_process).
    plain, sac, full = (two[run][0]["backward_collectives"] for run in ("tp2", "tp2_sac", "tp2_fullac"))
    assert len(plain) == worker.base.STEPS and plain == sac
    assert all(f > p for f, p in zip(full, plain))
    assert two["tp2_sac"][0]["checkpointed"] == [True, True]


@pytest.mark.slow
def test_float8_linears_under_tp(two):
    for r in two["tp2_float8"]:
        assert r["steps"][:2] == ["dtype: Float8Training",
                                  "tensor_parallel: tp=2, 2 blocks + root, sequence parallel, loss parallel"]
        assert r["float8"] == ["Float8Linear", "Float8Linear"]


# ---- bad input, in process ------------------------------------------------------------------


def _strategy(module, devices=2, **kwargs) -> NDParallelStrategy:
    trainer = L.Trainer(strategy=NDParallelStrategy(**kwargs), devices=devices, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    return trainer.strategy


@pytest.mark.parametrize(("overrides", "message"), [
    ({"n_head": 3, "n_kv_head": 3, "n_embd": 48}, r"tp=2 does not divide n_head=3"),
    ({"n_head": 4, "n_kv_head": 1}, r"tp=2 does not divide n_kv_head=1"),
    ({"mlp_hidden": 129}, r"tp=2 does not divide mlp_hidden=129"),
    ({"vocab_size": 65, "pad_vocab_multiple": 1}, r"tp=2 does not divide padded_vocab_size=65"),
])
def test_shapes_tp_cannot_split_fail_before_the_process_group(overrides, message):
    strategy = _strategy(GPTModule("tiny", model_overrides=overrides), tp=2, dp_shard=1)
    with pytest.raises(ValueError, match=message):
        strategy._validate_model_early()  # setup_environment runs it before init_process_group


def test_a_module_without_a_plan_names_the_method():
    class Plain(L.LightningModule):
        pass

    with pytest.raises(ValueError, match=r"tp=2 needs a tensor-parallel plan: define Plain.parallel_plan\(\)"):
        _strategy(Plain(), tp=2, dp_shard=1)._validate_model_early()


def test_a_plan_without_tp_styles_names_the_fields():
    from lightning_disttrain.parallel.plan import ParallelPlan
    from lightning_disttrain.parallel.tensor import check_plan

    module = torch.nn.Module()
    module.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"define parallel_plan\(\) returning ParallelPlan\(.*tp_block_plan="):
        check_plan(module, ParallelPlan(blocks=module.blocks))


def test_sequence_parallel_needs_a_divisible_sequence_length():
    from lightning_disttrain.data import TokenDataModule

    module = GPTModule("tiny")
    trainer = L.Trainer(strategy=NDParallelStrategy(tp=2, dp_shard=1), devices=2, accelerator="cpu", logger=False)
    trainer.strategy.connect(module)
    # What Trainer.fit does before it launches the ranks (setup_environment then runs the check).
    trainer._data_connector.attach_data(module, datamodule=TokenDataModule(source="embedded", seq_len=127))
    with pytest.raises(ValueError, match=r"seq_len=127 is not divisible by 2: use seq_len=128, or sequence_parallel"):
        trainer.strategy._validate_model_early()
    from lightning_disttrain.parallel.tensor import _check_sequence_length

    with pytest.raises(ValueError, match=r"sequence length 7; use a sequence length divisible by 2"):
        _check_sequence_length(2, None, (torch.zeros(1, 7, dtype=torch.long),))


def test_layouts_that_do_not_add_up_fail_at_trainer_construction():
    with pytest.raises(ValueError, match=r"tp=3 does not divide world_size=4"):
        L.Trainer(strategy=NDParallelStrategy(tp=3), devices=4, accelerator="cpu", logger=False)
    with pytest.raises(ValueError, match=r"pp\*dp_replicate\*dp_shard\*cp\*tp = 1\*1\*1\*1\*2 = 2 but world_size=4"):
        L.Trainer(strategy=NDParallelStrategy(tp=2, dp_shard=1), devices=4, accelerator="cpu", logger=False)


def test_async_tp_is_refused_without_compile_and_on_cpu():
    with pytest.raises(ValueError, match="async_tp=True fuses TP collectives into compiled matmuls: also set compile"):
        NDParallelStrategy(tp=2, async_tp=True)
    strategy = _strategy(GPTModule("tiny"), tp=2, dp_shard=1, async_tp=True, compile=True)
    with pytest.raises(ValueError, match=r"async_tp=True needs CUDA GPUs .* this run is on 'cpu': set async_tp=False"):
        strategy.setup_environment()


@pytest.mark.slow
def test_compiled_checkpointed_blocks_under_tp(two):
    # Per-block compile (aot_eager: no C++ toolchain needed) of the TP-sharded, checkpointed blocks.
    assert [s.split(":")[0] for s in two["tp2_compile"][0]["steps"]] == [
        "tensor_parallel", "activation_checkpointing", "compile", "fsdp"]


def test_float8_linears_get_torchaos_float8_styles_where_float8_can_be_gathered():
    # The mapping the TP stage applies on NCCL meshes (gloo has no float8 type, so on CPU the
    # Float8Linears keep the plain styles: test_tp2_matches_one_process[tp2_float8]).
    from torch.distributed.tensor.parallel import PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from lightning_disttrain.models.gpt import GPTConfig
    from lightning_disttrain.parallel.gpt_tp import block_plan
    from lightning_disttrain.parallel.tensor import TensorParallelOptions, _float8_styles

    plan = block_plan(GPTConfig.from_name("tiny"), TensorParallelOptions())
    float8 = {f"model.blocks.0.{n}" for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2")}
    styles = _float8_styles(plan, "model.blocks.0", float8)
    assert all(type(styles[n]) is Float8ColwiseParallel for n in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1"))
    assert type(styles["attn.wo"]) is Float8RowwiseParallel and type(styles["mlp.w2"]) is Float8RowwiseParallel
    assert type(styles["attn"]) is PrepareFloat8ModuleInput and type(styles["mlp"]) is PrepareFloat8ModuleInput
    assert styles["attn.wo"].output_layouts == plan["attn.wo"].output_layouts  # layouts carried over
    assert type(_float8_styles(plan, "model.blocks.0", set())["attn"]) is PrepareModuleInput
