"""Pipeline parallel through ``L.Trainer`` against one process with the same global batch, 4 steps,
fp32: every schedule kind on 2 gloo ranks (GPipe, 1F1B, Interleaved1F1B with 2 stages per rank,
ZBVZeroBubble; GPipe with gradient accumulation), pp x fsdp2 and pp x tp on 4 ranks, pp x fsdp2 x tp on 8.
Each run also validates (forward-only schedule) and generates (the last stage's logits sent to
every rank). Splitting and bad input: in process, no ranks launched."""

from __future__ import annotations


import lightning as L
import pytest
import torch
import torch.nn as nn

import pp_worker as worker
from dist_utils import in_this_process
from lightning_disttrain.module import GPTModule
from lightning_disttrain.parallel.pipeline import PipelineOptions, PipelinePlan, split_blocks, split_model, stage_ids
from lightning_disttrain.strategies import NDParallelStrategy

TWO = ["pp2_gpipe_accum", "pp2_1f1b", "pp2_interleaved", "pp2_zbv"]
FOUR = ["pp2_fsdp2", "pp2_tp2"]
EIGHT = ["pp2_fsdp2_tp2"]
WORKER, LAUNCH = "pp_worker", {2: TWO, 4: FOUR, 8: EIGHT}  # launched by conftest.py
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(launched):
    return {**launched(WORKER, 2), **launched(WORKER, 4), **launched(WORKER, 8)}


@pytest.fixture(scope="module")
def single():
    return in_this_process(lambda: {name: worker.fit_run(name, devices=1) for name in ("single", "single_accum")})


@pytest.mark.slow
@pytest.mark.parametrize("run", TWO + FOUR + EIGHT)
def test_pipeline_matches_one_process(ranks, single, run):
    reference = single[worker.BASELINE[run]]
    assert len(reference["losses"]) == worker.STEPS
    held = {}
    for r in ranks[run]:
        assert r["steps"] == worker.STEPS
        assert r["losses"] == pytest.approx(reference["losses"], abs=TOL)  # the same value on every rank
        assert r["val_loss"] == pytest.approx(reference["val_loss"], abs=TOL)
        assert r["generated"] == reference["generated"]
        for name, value in r["params"].items():  # sums of whole tensors after the steps
            assert value == pytest.approx(reference["params"][name], abs=1e-4), name
        held.update(r["params"])
    assert sorted(held) == sorted(reference["params"])  # the stages hold every parameter, under its own name
    stages = {len(r["params"]) for r in ranks[run]}
    assert max(stages) < len(reference["params"])  # no rank holds the whole model


@pytest.mark.slow
def test_stage_layouts(ranks):
    assert "4 stages of 4 blocks [1, 1, 1, 1]" in ranks["pp2_interleaved"][0]["parallelized_steps"][0]
    assert "stage 0 (blocks 0-0), stage 2 (blocks 2-2)" in ranks["pp2_interleaved"][0]["parallelized_steps"][0]
    assert "stage 0 (blocks 0-0), stage 3 (blocks 3-3)" in ranks["pp2_zbv"][0]["parallelized_steps"][0]  # a V
    assert [r["sampler"] for r in ranks["pp2_fsdp2"]] == [{"num_replicas": 2, "rank": i % 2} for i in range(4)]


@pytest.mark.slow
def test_checkpointing_compile_and_mfu_inside_stages(ranks):
    # the transforms run on each rank's stages only, under the unsplit block indices
    assert [r["checkpointed"] for r in ranks["pp2_1f1b"]] == [[0, 1], [2, 3]]
    assert [r["checkpointed"] for r in ranks["pp2_zbv"]] == [[0, 3], [1, 2]]  # a V: stages 0 and 3 on rank 0
    assert [r["compiled_blocks"] for r in ranks["pp2_1f1b"]] == [2, 2]
    # MFUMonitor counts the global batch's tokens once (data-parallel ranks, not stages) and the
    # whole model's FLOPs per token, whatever stage a rank holds.
    whole = worker.PPGPT()
    whole.configure_model()
    for r in ranks["pp2_fsdp2"]:
        mfu = r["mfu"]
        assert mfu["tokens_per_step"] == pytest.approx(worker.GLOBAL_BATCH * worker.SEQ, rel=1e-6)
        (flops_per_token,) = mfu["flops_per_token"].values()
        assert mfu["flops_per_step"] == pytest.approx(flops_per_token * worker.GLOBAL_BATCH * worker.SEQ, rel=1e-6)
        assert flops_per_token == whole.flops_per_token(worker.SEQ)


# ---- splitting, in process -------------------------------------------------------------------


def test_balanced_splits_and_lighter_edges():
    assert split_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert split_blocks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    # the embedding and the head each cost a block: no stage costs more than 4 (3 blocks + the
    # embedding, 4 blocks, ..., 2 blocks + the head); without the cost it would be 3 + 1 + 1 = 5
    assert [len(r) for r in split_blocks(12, 4, edge_cost=1.0)] == [3, 4, 3, 2]
    assert split_blocks(6, 2, split_points=[4]) == [range(0, 4), range(4, 6)]
    with pytest.raises(ValueError, match=r"pp_split_points=\[4, 2\] must be 2 increasing block indices"):
        split_blocks(6, 3, split_points=[4, 2])


def test_stage_placement():
    assert stage_ids(1, 2, PipelineOptions("Interleaved1F1B")) == [1, 3]
    assert stage_ids(0, 4, PipelineOptions("ZBVZeroBubble")) == [0, 7]
    assert stage_ids(1, 2, PipelineOptions("1F1B")) == [1]


def test_split_keeps_the_unsplit_names():
    module = GPTModule("tiny", vocab_size=64, model_overrides=worker.MODEL)
    module.configure_model()
    names = {n for n, _ in module.named_parameters()}
    plan = module.parallel_plan()
    ranges = split_blocks(4, 4)
    stages = split_model(plan.pipeline, plan.blocks, ranges, [1, 3])  # rank 1 of an interleaved pp=2
    kept = {n for n, _ in module.named_parameters()}
    assert kept <= names and {n.split(".")[2] for n in kept if n.startswith("model.blocks.")} == {"1", "3"}
    assert module.model.wte is None and module.model.lm_head is not None
    assert [list(s.blocks.keys()) for s in stages] == [["1"], ["3"]]
    assert stages[0].lm_head is None and stages[1].lm_head is module.model.lm_head
    h = torch.randn(2, 8, worker.MODEL["n_embd"])
    assert stages[0](h).shape == h.shape  # a middle stage maps hidden states to hidden states
    assert stages[1](h).shape == (2, 8, module.config.padded_vocab_size)


@pytest.mark.parametrize("pos_emb, cp, words", [("rope", False, "rope_cos, rope_sin"), ("learned", True, "cp=1"),
                                                  ("learned", False, None)])
def test_looped_schedule_stage_views_that_would_miss_state_are_refused(pos_emb, cp, words):
    # Several stages per rank run as views made at the split: a meta build's RoPE tables stay on the
    # meta device in them, and context parallel's state never reaches them (issue 43): refused
    # before any weight exists, instead of a crash in apply_rope or silently wrong positions.
    from lightning_disttrain.parallel.recipe import PipelineSettings, _refuse_stage_views_that_miss_state

    with torch.device("meta"):
        module = GPTModule("tiny", vocab_size=64, model_overrides={**worker.MODEL, "pos_emb": pos_emb})
        module.configure_model()
    plan = module.parallel_plan()
    stages = split_model(plan.pipeline, plan.blocks, split_blocks(4, 4), [1, 3])  # rank 1 of an interleaved pp=2
    settings = PipelineSettings(stages=stages)
    # one stage on a rank (1F1B, GPipe) is the model itself, not a view: nothing to refuse
    _refuse_stage_views_that_miss_state(module, PipelineSettings(stages=[module.model]), object())
    if words is None:
        _refuse_stage_views_that_miss_state(module, settings, None)
        return
    with pytest.raises(ValueError, match="several stages per rank") as err:
        _refuse_stage_views_that_miss_state(module, settings, object() if cp else None)
    assert words in str(err.value) and "1F1B" in str(err.value)


# ---- bad input, in process -------------------------------------------------------------------


def _strategy(module, devices=2, **kwargs) -> NDParallelStrategy:
    trainer = L.Trainer(strategy=NDParallelStrategy(**kwargs), devices=devices, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    return trainer.strategy


def _untied(**overrides):
    return GPTModule("tiny", vocab_size=64, model_overrides={**worker.MODEL, **overrides})


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(pp_schedule="1F1B", pp_microbatches=1), r"pp_microbatches=1 is fewer than the 2 pipeline stages"),
    (dict(pp_schedule="Interleaved1F1B", pp_stages_per_rank=4), r"8 pipeline stages .* but the model has 4 blocks"),
    (dict(pp_schedule="1F1B", pp_split_points=[0]), r"pp_split_points=\[0\] must be 1 increasing block indices"),
])
def test_layouts_a_pipeline_cannot_run_fail_before_the_process_group(kwargs, message):
    strategy = _strategy(_untied(), pp=2, **kwargs)
    with pytest.raises(ValueError, match=message):
        strategy._validate_model_early()


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(pp_schedule="ZeroBubbleFast"), r"unknown pipeline schedule 'ZeroBubbleFast'; choose one of GPipe, 1F1B"),
    (dict(pp_schedule="Interleaved1F1B", pp_stages_per_rank=1), r"interleaves several stages per rank, but"),
    (dict(pp_schedule="1F1B", pp_stages_per_rank=2), r"runs one stage per rank, but pp_stages_per_rank=2"),
    (dict(pp_schedule="DualPipeV", pp_stages_per_rank=3), r"exactly 2 stages per rank"),
])
def test_schedule_options_are_checked_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NDParallelStrategy(pp=2, **kwargs)


def test_a_batch_that_does_not_split_into_micro_batches():
    from lightning_disttrain.data import TokenDataModule

    module = _untied()
    trainer = L.Trainer(strategy=NDParallelStrategy(pp=2, pp_microbatches=4), devices=2, accelerator="cpu", logger=False)
    trainer.strategy.connect(module)
    trainer._data_connector.attach_data(module, datamodule=TokenDataModule(source="embedded", seq_len=16, batch_size=6))
    with pytest.raises(ValueError, match=r"batch of 6 samples does not split into pp_microbatches=4; use a batch size"):
        trainer.strategy._validate_model_early()


def test_tied_embeddings_and_models_without_a_plan():
    with pytest.raises(ValueError, match=r"cannot share a weight: set tie_embeddings=False"):
        _strategy(GPTModule("tiny", vocab_size=64), pp=2)._validate_model_early()

    class Plain(L.LightningModule):
        pass

    with pytest.raises(ValueError, match=r"pp=2 needs a pipeline plan: define Plain.parallel_plan\(\)"):
        _strategy(Plain(), pp=2)._validate_model_early()


def test_blocks_must_be_keyed_by_index():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"needs the blocks in an nn.ModuleDict keyed by layer index"):
        split_model(PipelinePlan(model), model.layers, split_blocks(2, 2), [0])
