"""``strategy="fsdp2"`` on LightningModules that know nothing about this package, against one process:
a tied Hugging Face GPT-2, blocks in an ``nn.ModuleDict``, and a module that shards itself."""

from __future__ import annotations


import pytest

import existing_project_worker as worker
from dist_utils import in_this_process

RUNS = ["hf_gpt2", "dict_blocks", "self_sharded"]
WORKER, LAUNCH = "existing_project_worker", {2: RUNS}  # launched by conftest.py
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single():
    return in_this_process(lambda: {run: worker.fit_run(run, devices=1) for run in ("hf_gpt2", "dict_blocks")})


def _assert_matches(ranks, single):
    assert len(single["losses"]) == worker.STEPS
    for r in ranks:
        assert r["losses"] == pytest.approx(single["losses"], abs=1e-5)


def test_tied_hugging_face_gpt2_stays_tied_and_matches_one_process(two, single):
    # The tie used to break: FSDP's root was `transformer` (it holds every parameter), so the
    # embedding became a sharded parameter there while `lm_head` kept the old tensor.
    for r in two["hf_gpt2"]:
        assert r["tied"] is True
        assert r["fsdp_units"] == ["", "transformer.h.0", "transformer.h.1"]  # root = the whole GPT2LMHeadModel
    _assert_matches(two["hf_gpt2"], single["hf_gpt2"])


def test_blocks_in_a_module_dict_are_the_fsdp_units(two, single):
    for r in two["dict_blocks"]:
        assert r["fsdp_units"] == ["", "layers.0", "layers.1"]
        assert r["steps"] == ["fsdp: 2 blocks + 0 groups + root DictBlocksLM"]
    _assert_matches(two["dict_blocks"], single["dict_blocks"])


def test_a_module_that_shards_itself_is_not_sharded_again(two, single):
    for r in two["self_sharded"]:
        assert r["steps"] == []  # our FSDP stage was skipped
        assert r["fsdp_units"] == ["", "layers.0", "layers.1"]  # the module's own units, once
    # Same network, same seed, same data: it trains like the single process of the plain module.
    _assert_matches(two["self_sharded"], single["dict_blocks"])
