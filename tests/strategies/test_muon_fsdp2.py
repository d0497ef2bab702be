"""Hybrid Muon (Muon on the blocks' matrices, AdamW elsewhere) under fsdp2 against one process.

torch's Muon runs its Newton-Schulz iteration on the DTensor gradient, i.e. on the whole matrix
(global semantics; DTensor redistributes as the matmuls need), not on each rank's shard. The
iteration is computed in bf16 by torch's implementation, so a different reduction order changes
its rounding: the losses agree to ~1e-4 (measured 9.9e-5 max over 6 steps), not to fp32's 1e-5.
Orthogonalising each shard alone instead changes the update by ~0.3 per element (vs 0.016 here).
"""

import pytest

import muon_worker
from dist_utils import in_this_process

WORKER, LAUNCH = "muon_worker", {2: ["fsdp2"]}  # launched by conftest.py


def test_muon_under_fsdp2_matches_one_process(launched):
    single = in_this_process(muon_worker.fit_run, "auto", 1)["losses"]
    for rank in launched(WORKER, 2)["fsdp2"]:
        assert len(rank["losses"]) == muon_worker.STEPS
        assert rank["losses"] == pytest.approx(single, abs=5e-4)
