"""``ckpt_path`` under every subcommand, as a user sees it (issue 42, items 2 and 4).

- A shipped config sets ``ckpt_path: auto`` with a ``PreemptionCheckpoint``: ``validate`` (and
  ``test``/``predict``) must run with it as written, evaluating the newest complete checkpoint or,
  with none, the model as built, and say which in their own words (not "Resuming", not "starting
  from scratch").
- A file that is not a checkpoint, as ``--ckpt_path`` or to ``eval``: one line, the same for every
  command, exit status 2, never torch's advice to retry with ``weights_only=False``.

Each subprocess is one process (``devices: 1``); the checkpoint runs take a few seconds each.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml


def _config(tmp_path: Path) -> Path:
    """The shipped configs' checkpoint setup (``ckpt_path: auto``, a ModelCheckpoint with a ``last``
    link, a PreemptionCheckpoint, fsdp2's DCP directories), on the tiny model, one process."""
    ckpt_dir = str(tmp_path / "checkpoints")
    config = {
        "seed_everything": 0,
        "ckpt_path": "auto",
        "trainer": {"accelerator": "cpu", "devices": 1, "strategy": "fsdp2", "max_steps": 2, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": str(tmp_path),
                    "val_check_interval": 2, "check_val_every_n_epoch": None, "limit_val_batches": 1,
                    "num_sanity_val_steps": 0,
                    "callbacks": [
                        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                         "init_args": {"dirpath": ckpt_dir, "every_n_train_steps": 2, "save_last": "link",
                                       "enable_version_counter": False}},
                        {"class_path": "lightning_disttrain.callbacks.PreemptionCheckpoint"}]},
        "model": {"class_path": "lightning_disttrain.GPTModule", "init_args": {"config": "tiny"}},
        "data": {"class_path": "lightning_disttrain.TokenDataModule",
                 "init_args": {"source": "embedded", "tokenizer": "bytes", "seq_len": 32, "batch_size": 2,
                               "val_batches": 1, "max_docs": 40, "num_proc": 1, "cache_dir": str(tmp_path / "cache")}},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LDT_TRACEBACK", "LDT_DEBUG")} | {"PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "lightning_disttrain.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False, timeout=600)


def _out(out: subprocess.CompletedProcess) -> str:
    return out.stdout + out.stderr


# ---- item 2: ckpt_path: auto under validate ---------------------------------------------------------


def test_validate_runs_a_config_with_ckpt_path_auto_before_and_after_a_checkpoint_exists(tmp_path):
    config = str(_config(tmp_path))

    before = _run(tmp_path, "validate", "--config", config)
    text = _out(before)
    assert before.returncode == 0, text[-3000:]
    assert "validating the model as built" in text and "--ckpt_path PATH" in text, text[-3000:]
    assert "PreemptionCheckpoint callback: add" not in text and "starting from scratch" not in text
    assert "val/loss" in text

    fit = _run(tmp_path, "fit", "--config", config)
    assert fit.returncode == 0, _out(fit)[-3000:]
    newest = (tmp_path / "checkpoints" / "epoch=0-step=2.ckpt").resolve()
    assert newest.is_dir()

    after = _run(tmp_path, "validate", "--config", config)
    text = _out(after)
    assert after.returncode == 0, text[-3000:]
    assert f"ckpt_path='auto': validating {newest}, the newest complete checkpoint" in text, text[-3000:]
    assert "Resuming" not in text and "resuming" not in text

    last = _run(tmp_path, "validate", "--config", config, "--ckpt_path", str(tmp_path / "checkpoints" / "last.ckpt"))
    text = _out(last)
    assert last.returncode == 0, text[-3000:]
    assert "Loading" in text and "Resuming" not in text, text[-3000:]


# ---- item 4: a file that is not a checkpoint --------------------------------------------------------


@pytest.fixture
def object_file(tmp_path) -> Path:
    """A torch.save file holding a Python object: torch's weights-only refusal tells the user to
    retry with weights_only=False, i.e. to run whatever the file holds."""
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"obj": object()}}, path)
    return path


def test_a_file_that_is_not_a_checkpoint_is_the_same_one_line_under_every_command(tmp_path, object_file):
    config = str(_config(tmp_path))
    messages = {}
    for command in (["fit", "--config", config, "--ckpt_path", object_file.name],
                    ["validate", "--config", config, "--ckpt_path", object_file.name],
                    ["eval", object_file.name]):
        out = _run(tmp_path, *command)
        lines = [line for line in _out(out).splitlines() if line.strip()]
        assert out.returncode == 2, (command[0], _out(out)[-3000:])  # README: an error naming the fix exits 2
        assert len(lines) == 1, (command[0], lines)
        prefix = f"error: {command[0]}: "
        assert lines[0].startswith(prefix), lines
        messages[command[0]] = lines[0][len(prefix):]
        assert "weights_only" not in lines[0] and "file an issue" not in lines[0].lower()
    assert len(set(messages.values())) == 1, messages
    assert "'model.ckpt' is not a checkpoint" in messages["eval"]
    assert "`lightning-disttrain fit`" in messages["eval"]  # what to pass instead


def test_check_checkpoint_file_names_what_is_wrong(tmp_path, object_file):
    from lightning_disttrain.checkpoint.safe_load import NotACheckpointError, check_checkpoint_file

    text, empty, good = tmp_path / "notes.ckpt", tmp_path / "empty.ckpt", tmp_path / "good.ckpt"
    text.write_text("not a checkpoint\n")
    empty.write_bytes(b"")
    torch.save({"state_dict": {"w": torch.ones(2)}}, good)
    check_checkpoint_file(good)  # a checkpoint passes
    for path, why in ((text, "not a file written by torch.save"), (empty, "it is empty"),
                      (object_file, "holds more than tensors and plain data")):
        with pytest.raises(NotACheckpointError, match=why) as info:
            check_checkpoint_file(path)
        assert "\n" not in str(info.value) and "weights_only" not in str(info.value)


@pytest.mark.parametrize("stage", ["test", "predict"])
def test_test_and_predict_without_such_a_split_say_what_evaluates_it_in_one_line(tmp_path, capsys, stage):
    # TokenDataModule has train and validation splits only: Lightning's traceback from inside the run
    # ("`test_dataloader` must be implemented") becomes one line naming validate and eval.
    from lightning_disttrain.cli import DistTrainCLI

    with pytest.raises(SystemExit) as info:
        DistTrainCLI(args=[stage, "--config", str(_config(tmp_path))])
    assert info.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {stage}: TokenDataModule has no {stage} split") and "validate" in line
