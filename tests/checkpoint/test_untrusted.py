"""Checkpoints as untrusted input (issue 30): no code from a checkpoint runs on load unless the
user says they trust it, deletes stay inside the run's directory, malformed manifests are skipped.

The planted files create a marker file when unpickled (``untrusted_helpers``); each load path must
refuse them without creating it, and load them (creating it) with the opt-in. Resume through a
strategy (``ckpt_path``) on 2 ranks is ``test_untrusted_resume.py``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from ckpt_helpers import save
from test_consolidate import _gpt_module_meta
from untrusted_helpers import MALFORMED, malformed_text, plant_meta_pt, plant_metadata

from lightning_disttrain.checkpoint import (
    MANIFEST_NAME,
    CheckpointVerificationError,
    CheckpointWriter,
    export_consolidated,
    find_latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    verify_checkpoint,
)
from lightning_disttrain.checkpoint.command import export_main


@pytest.fixture
def planted(tmp_path, trained):
    """A GPTModule-like checkpoint (in ``ckpts/``) whose .metadata creates ``marker`` when unpickled."""
    module, opt = trained
    ckpt = save(tmp_path / "ckpts" / "step=2.ckpt", module, opt, step=2, meta=_gpt_module_meta(2))
    marker = tmp_path / "PWNED"
    plant_metadata(ckpt, marker)
    verify_checkpoint(ckpt)  # the manifest matches: verification is no defence
    return ckpt, marker


def test_model_export_refuses_planted_metadata_and_loads_it_when_trusted(planted, tmp_path):
    ckpt, marker = planted
    with pytest.raises(ValueError, match=r"refusing to load .*\.metadata.*operator.*getitem.*--trust-checkpoint"):
        export_consolidated(ckpt, tmp_path / "m.pt")
    assert not marker.exists()
    export_consolidated(ckpt, tmp_path / "m.pt", trust_checkpoint=True)
    assert marker.exists()


@pytest.mark.parametrize("args", [["{ckpt}", "{out}"], ["{dir}", "{out}", "--latest"],
                                  ["{ckpt}", "{out}", "--format", "hf"]], ids=["model", "latest", "hf"])
def test_export_command_refuses_planted_metadata_without_trust_checkpoint(planted, tmp_path, args):
    ckpt, marker = planted
    out = tmp_path / ("hf_out" if "hf" in args else "m.pt")
    argv = [a.format(ckpt=ckpt, dir=ckpt.parent, out=out) for a in args]
    with pytest.raises(SystemExit, match="refusing to load.*--trust-checkpoint"):
        export_main(argv)
    assert not marker.exists() and not out.exists()
    export_main([*argv, "--trust-checkpoint"])
    assert marker.exists() and out.exists()


def test_eval_refuses_planted_metadata_without_trust_checkpoint(planted):
    from lightning_disttrain.evals.command import build_parser, load_module

    ckpt, marker = planted
    with pytest.raises(ValueError, match="refusing to load"):
        load_module(ckpt)
    assert not marker.exists()
    assert build_parser().parse_args([str(ckpt), "--trust-checkpoint"]).trust_checkpoint
    module, _ = load_module(ckpt, trust_checkpoint=True)
    assert marker.exists() and module.model is not None


def test_full_export_unpickles_meta_pt_only_when_trusted(tmp_path, trained):
    module, opt = trained
    ckpt = save(tmp_path / "ckpts" / "step=2.ckpt", module, opt, step=2, meta=_gpt_module_meta(2))
    marker = tmp_path / "PWNED"
    plant_meta_pt(ckpt, marker)
    with pytest.raises(SystemExit, match=r"refusing to load .*meta\.pt.*--trust-checkpoint"):
        export_main([str(ckpt), str(tmp_path / "full.pt"), "--full"])
    assert not marker.exists()
    export_main([str(ckpt), str(tmp_path / "full.pt"), "--full", "--trust-checkpoint"])
    assert marker.exists()


def test_export_records_names_not_absolute_paths(tmp_path, trained):
    import torch

    module, opt = trained
    meta = _gpt_module_meta(2)
    meta["hyper_parameters"]["init_from"] = str(tmp_path / "private" / "base.pt")
    ckpt = save(tmp_path / "ckpts" / "step=2.ckpt", module, opt, step=2, meta=meta)
    for name, model_only in (("m.pt", True), ("full.pt", False)):
        raw = torch.load(export_consolidated(ckpt, tmp_path / name, model_only=model_only), weights_only=True)
        assert raw["source"]["checkpoint"] == "step=2.ckpt"
        assert raw["hyper_parameters"]["init_from"] == "base.pt"
        assert str(tmp_path) not in repr({k: v for k, v in raw.items() if k not in ("state_dict", "optimizer_states")})


# ---- deletes stay inside the run's checkpoint directory ------------------------------------


def _two_checkpoints(tmp_path, trained) -> Path:
    module, opt = trained
    ckpts = tmp_path / "ckpts"
    for step in (1, 2):
        save(ckpts / f"step={step}.ckpt", module, opt, step=step)
        time.sleep(0.05)
    return ckpts


def test_retention_unlinks_a_link_to_outside_data_and_keeps_the_data(tmp_path, trained):
    user_data = tmp_path / "user_data"
    user_data.mkdir()
    (user_data / "thesis.tex").write_text("years of work")
    old = time.time() - 3600
    os.utime(user_data / "thesis.tex", (old, old))
    os.utime(user_data, (old, old))
    ckpts = _two_checkpoints(tmp_path, trained)
    (ckpts / "init.ckpt").symlink_to("../user_data")
    prune_checkpoints(ckpts, keep_last=1)
    assert (user_data / "thesis.tex").read_text() == "years of work"
    assert not (ckpts / "init.ckpt").is_symlink()  # the link itself went
    assert sorted(p.name for p in ckpts.iterdir()) == ["step=2.ckpt"]


def test_retention_keeps_a_checkpoint_directory_that_holds_other_files(tmp_path, trained):
    ckpts = _two_checkpoints(tmp_path, trained)
    (ckpts / "step=1.ckpt" / "notes.txt").write_text("mine")
    assert prune_checkpoints(ckpts, keep_last=1) == []  # refused (logged), not deleted
    assert (ckpts / "step=1.ckpt" / "notes.txt").read_text() == "mine"


def test_saving_over_a_directory_with_unrelated_files_refuses_and_keeps_them(tmp_path, trained):
    module, opt = trained
    target = tmp_path / "out.ckpt"
    target.mkdir()
    (target / "meta.pt").write_bytes(b"not ours, but named like it")
    (target / "results.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not checkpoint files"):
        save(target, module, opt, step=3, writer=CheckpointWriter())
    assert (target / "results.csv").read_text() == "a,b\n1,2\n"


# ---- manifests are input: malformed ones are skipped ----------------------------------------


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_manifest_is_skipped_and_resume_falls_back(tmp_path, trained, kind):
    ckpts = _two_checkpoints(tmp_path, trained)
    newest = ckpts / "step=2.ckpt"
    good = json.loads((newest / MANIFEST_NAME).read_text())
    (newest / MANIFEST_NAME).write_text(malformed_text(kind, good))
    with pytest.raises(CheckpointVerificationError):
        verify_checkpoint(newest)
    list_checkpoints(ckpts)  # no exception escapes the listing either
    with pytest.warns(UserWarning, match="skipping checkpoint .*step=2.ckpt"):
        assert find_latest_checkpoint(ckpts) == (ckpts / "step=1.ckpt").resolve()


@pytest.mark.parametrize("absolute", [False, True], ids=["dotdot", "absolute"])
def test_traversal_entries_are_refused_without_reading_outside_files(tmp_path, trained, absolute):
    ckpts = _two_checkpoints(tmp_path, trained)
    secret = tmp_path / "secret"
    secret.write_text("x" * 12345)
    newest = ckpts / "step=2.ckpt"
    good = json.loads((newest / MANIFEST_NAME).read_text())
    good["files"][str(secret) if absolute else "../../secret"] = {"sha256": "0" * 64, "bytes": 1}
    (newest / MANIFEST_NAME).write_text(json.dumps(good))
    with pytest.raises(CheckpointVerificationError, match="not a (plain )?relative path") as err:
        verify_checkpoint(newest)
    assert "12345" not in str(err.value)


def test_a_listed_file_that_is_a_link_is_refused(tmp_path, trained):
    ckpts = _two_checkpoints(tmp_path, trained)
    newest = ckpts / "step=2.ckpt"
    (tmp_path / "big").write_bytes(b"y" * 100)
    (newest / "alias.distcp").symlink_to(tmp_path / "big")
    good = json.loads((newest / MANIFEST_NAME).read_text())
    good["files"]["alias.distcp"] = {"sha256": "0" * 64, "bytes": 100}
    (newest / MANIFEST_NAME).write_text(json.dumps(good))
    with pytest.raises(CheckpointVerificationError, match="is a link"):
        verify_checkpoint(newest)


def test_prune_does_not_fail_on_a_malformed_manifest(tmp_path, trained):
    ckpts = _two_checkpoints(tmp_path, trained)
    (ckpts / "step=2.ckpt" / MANIFEST_NAME).write_text('{"format": "lightning-disttrain/dcp", "files": []}')
    assert prune_checkpoints(ckpts, keep_last=1) == []  # one complete checkpoint left: nothing to prune
    assert (ckpts / "step=1.ckpt").is_dir() and (ckpts / "step=2.ckpt").is_dir()
