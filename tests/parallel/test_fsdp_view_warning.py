"""FSDP2 warns when a unit returns a view (an in-place op on it would skip that unit's
pre-backward all-gather). Any model ending in a biased ``nn.Linear`` on (batch, seq, dim) input
returns one from its root unit, which keeps its parameters gathered from forward to backward: that
warning, alarming and harmless, is silenced for the root only (``parallel.fsdp.apply_fsdp``);
blocks returning views still warn. One gloo rank, plain torch (``fsdp_view_worker.py``)."""

from pathlib import Path

import pytest

from dist_utils import read_ranks, run_torch_script

WORKER = Path(__file__).with_name("fsdp_view_worker.py")


@pytest.mark.slow  # one subprocess (a gloo rank), ~8 s
def test_root_returning_a_view_does_not_warn_but_blocks_do(tmp_path):
    run_torch_script(WORKER, 1, str(tmp_path), timeout=120)
    (result,) = read_ranks(tmp_path, "view", 1)
    assert result["plain"] == [], result  # formerly: "FSDP2-wrapped module (FSDPPlain) returned a view tensor"
    assert len(result["view_blocks"]) == 2 and all("(FSDPBlock)" in w for w in result["view_blocks"]), result
