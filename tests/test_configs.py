"""The shipped configs' checkpointing: `last.ckpt` always names the newest checkpoint of the newest
run, also when a run is started again in the same directory."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ["quickstart.yaml", "gpt2-124m-fineweb.yaml", "tensor-parallel.yaml", "pipeline-parallel.yaml",
           "context-parallel.yaml"]


def _checkpoint_args(config: str) -> dict:
    callbacks = yaml.safe_load((REPO / "configs" / config).read_text())["trainer"]["callbacks"]
    (found,) = [c["init_args"] for c in callbacks if c["class_path"].endswith(".ModelCheckpoint")]
    return found


@pytest.mark.parametrize("config", CONFIGS)
def test_last_is_a_link_and_never_versioned(config):
    args = _checkpoint_args(config)
    # A link, not a second full checkpoint written (and hashed) at every save.
    assert args["save_last"] == "link"
    assert args["enable_version_counter"] is False


def _fit(args: dict, dirpath: Path, steps: int) -> None:
    callback = ModelCheckpoint(**{**args, "dirpath": str(dirpath), "every_n_train_steps": 2})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[callback], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(BoringModel())


@pytest.mark.parametrize("config", CONFIGS)
def test_a_second_run_in_the_same_directory_owns_last_ckpt(config, tmp_path):
    # Lightning's own saving, with the config's ModelCheckpoint arguments (steps made small).
    args, folder = _checkpoint_args(config), tmp_path / "checkpoints"
    _fit(args, folder, steps=4)
    _fit(args, folder, steps=2)  # the re-run, shorter, so that its newest differs from the first's
    last = folder / "last.ckpt"
    assert not (folder / "last-v1.ckpt").exists()
    assert last.is_symlink() and os.readlink(last) == "epoch=0-step=2.ckpt"


# Safe by default on SIGTERM (issue 28): every shipped config that trains with checkpoints saves on
# a preemption signal and resumes by itself. configs/profile.yaml (14 steps, no checkpoints) is the
# one exception.
TRAINING_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml") if p.name != "profile.yaml")


@pytest.mark.parametrize("config", TRAINING_CONFIGS)
def test_shipped_config_saves_on_sigterm_and_resumes_itself(config):
    data = yaml.safe_load((REPO / "configs" / config).read_text())
    paths = [c["class_path"] for c in data["trainer"]["callbacks"]]
    assert "lightning_disttrain.callbacks.PreemptionCheckpoint" in paths
    assert data.get("ckpt_path") == "auto"
    assert len(TRAINING_CONFIGS) == 9
