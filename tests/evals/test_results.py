"""evals.json joins a complete checkpoint's manifest; a checkpoint the gate failed is skipped by
resume discovery and refused by export unless asked for (real DCP checkpoints, one process)."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_disttrain.checkpoint import CheckpointWriter, find_latest_checkpoint, verify_checkpoint
from lightning_disttrain.checkpoint.command import export_main
from lightning_disttrain.evals.results import evals_record, read_evals, write_evals
from lightning_disttrain.evals.suite import EvalResults


@pytest.fixture
def two_checkpoints(tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is.*")
        writer = CheckpointWriter()
        for step in (2, 4):
            writer.save(tmp_path / f"step={step}.ckpt", {"state_dict": {"w": torch.full((3,), float(step))}},
                        {"global_step": step}, global_step=step)
    return tmp_path, tmp_path / "step=2.ckpt", tmp_path / "step=4.ckpt"


def _record(failed: bool) -> dict:
    results = EvalResults({"heldout": {"loss": 3.0}}, {"heldout": 4}, {"heldout": 0.1, "total": 0.1})
    violations = [{"message": "eval/heldout/loss = 3 breaks 'at most 5% above its best'"}] if failed else []
    return evals_record(results, step=4, epoch=0, checkpoint="step=4.ckpt", config={},
                        gate={"passed": not failed, "failed_checkpoint": failed, "violations": violations})


def test_evals_json_is_listed_in_the_manifest_and_verified(two_checkpoints):
    _, _, newest = two_checkpoints
    write_evals(newest, _record(failed=False))
    manifest = verify_checkpoint(newest)
    assert "evals.json" in manifest.files and manifest.global_step == 4
    assert read_evals(newest)["metrics"] == {"eval/heldout/loss": 3.0}
    (newest / "evals.json").write_text("{}")  # altered afterwards: verification names it
    with pytest.raises(ValueError, match="evals.json"):
        verify_checkpoint(newest)


def test_a_failed_checkpoint_is_skipped_by_discovery_and_refused_by_export(two_checkpoints, tmp_path):
    folder, older, newest = two_checkpoints
    assert find_latest_checkpoint(folder) == newest.resolve()
    write_evals(newest, _record(failed=True))
    with pytest.warns(UserWarning, match="the eval gate failed it"):
        assert find_latest_checkpoint(folder) == older.resolve()
    assert find_latest_checkpoint(folder, include_failed=True) == newest.resolve()
    with pytest.raises(SystemExit, match="--allow-failed"):
        export_main([str(newest), str(tmp_path / "out.pt")])
    with pytest.warns(UserWarning, match="the eval gate failed it"):
        out = export_main([str(folder), str(tmp_path / "latest.pt"), "--latest"])
    assert torch.load(out, weights_only=True)["source"]["global_step"] == 2
