"""A mixture-of-experts GPT (4 experts top-2 + 1 shared, DeepSeek-V3 bias balancing) under fsdp2 on
2 gloo ranks against one process, 8 steps, fp32: losses, the balancing bias on every rank, weights."""

import pytest

import moe_worker as worker
from dist_utils import in_this_process

WORKER, LAUNCH = "moe_worker", {2: ["fsdp2"]}  # in the suite's shared 2-rank launch (tests/conftest.py)


@pytest.mark.slow
def test_moe_under_fsdp2_matches_one_process(launched):
    single = in_this_process(worker.fit_run, "single", 1)
    assert any(any(b != 0 for b in bias) for bias in single["bias"].values())  # the bias did move
    for r in launched(WORKER, 2)["fsdp2"]:
        assert r["steps"] == worker.STEPS
        assert r["losses"] == pytest.approx(single["losses"], abs=1e-5)
        # counts all-reduced over the data-parallel ranks: each rank holds the one-process bias
        assert r["bias"] == single["bias"]
        for name, value in r["params"].items():
            assert value == pytest.approx(single["params"][name], abs=1e-4), name
