"""Pipeline parallel trains the objective of one process, and communicates as little: through
``L.Trainer`` against one process with the same global batch, fp32, 4 optimizer steps.

- A mixture of experts ("tiny-moe" at pp_worker's width, balance and z losses on) under pp=2: the
  auxiliary losses of every stage's MoE layers are part of the loss and of the gradients, and the
  balancing bias counts exactly the micro-batches' tokens. 1F1B (the stage is the model itself),
  and Interleaved1F1B with gradient accumulation (two stages per rank, the first without an MoE
  layer). 2 ranks.
- pp=2 x FSDP over 2 ranks with gradient accumulation 2: FSDP reduce-scatters the gradients at
  every schedule step (gradients stay sharded), or with ``accumulate_unsharded_grads`` once per
  optimizer step (the window's last batch). 4 ranks.

The runs are ``pp_worker``'s, in the suite's shared launches (conftest.py)."""

from __future__ import annotations

import pytest

import pp_worker as worker
from dist_utils import in_this_process

MOE_RUNS = ["moe_pp2_1f1b", "moe_pp2_interleaved_accum"]
WORKER, LAUNCH = "pp_worker", {2: MOE_RUNS, 4: ["pp2_fsdp2_accum", "pp2_fsdp2_accum_unsharded"]}  # conftest.py
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(launched):
    return {**launched(WORKER, 2), **launched(WORKER, 4)}


@pytest.fixture(scope="module")
def single():
    names = ("single_accum", "moe_single", "moe_single_accum")
    return in_this_process(lambda: {name: worker.fit_run(name, devices=1) for name in names})


@pytest.mark.slow
@pytest.mark.parametrize("run", MOE_RUNS)
def test_moe_pipeline_trains_the_one_process_objective(ranks, single, run):
    reference = single[worker.BASELINE[run]]
    assert len(reference["losses"]) == worker.STEPS
    # the auxiliary losses are a real part of the objective here (~0.2 of a ~4.2 loss)
    assert min(reference["aux_losses"]) > 0.05
    held_params, held_bias = {}, {}
    for r in ranks[run]:
        assert r["steps"] == worker.STEPS
        # cross-entropy + every stage's auxiliary losses, the same value on every rank
        assert r["losses"] == pytest.approx(reference["losses"], abs=TOL)
        assert r["aux_losses"] == pytest.approx(reference["aux_losses"], abs=TOL)
        assert r["val_loss"] == pytest.approx(reference["val_loss"], abs=TOL)
        for name, value in r["params"].items():  # the routers moved by the auxiliary losses' gradients
            assert value == pytest.approx(reference["params"][name], abs=1e-4), name
        for layer, bias in r["bias"].items():  # the balancing bias saw every micro-batch's tokens, no others
            assert bias == pytest.approx(reference["bias"][layer], abs=1e-6), layer
        held_params.update(r["params"])
        held_bias.update(r["bias"])
    assert sorted(held_params) == sorted(reference["params"])
    assert sorted(held_bias) == sorted(reference["bias"]) == ["1", "2", "3"]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["pp2_fsdp2_accum", "pp2_fsdp2_accum_unsharded"])
def test_pipeline_with_accumulation_reduces_gradients_as_chosen(ranks, single, run):
    reference = single["single_accum"]
    for r in ranks[run]:
        counts = r["reduce_scatters"]  # per training batch: 2 batches per optimizer step
        assert len(counts) == 2 * worker.STEPS
        assert counts[1] > 0 and counts[1::2] == [counts[1]] * worker.STEPS, counts  # a window's last reduces
        if run.endswith("unsharded"):
            assert counts[0::2] == [0] * worker.STEPS, counts  # a window's first batch only accumulates
        else:
            assert counts[0::2] == counts[1::2], counts  # every batch reduces: gradients stay sharded
        # ... and the training is that of one process
        assert r["losses"] == pytest.approx(reference["losses"], abs=TOL)
        assert r["val_loss"] == pytest.approx(reference["val_loss"], abs=TOL)
        for name, value in r["params"].items():
            assert value == pytest.approx(reference["params"][name], abs=1e-4), name
