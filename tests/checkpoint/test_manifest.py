"""The manifest: sha256 per file, and verification that names the bad file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from lightning_disttrain.checkpoint import (
    MANIFEST_NAME,
    CheckpointVerificationError,
    IncompleteCheckpointError,
    Manifest,
    read_manifest,
    verify_checkpoint,
)
from lightning_disttrain.checkpoint.manifest import list_files


def test_manifest_holds_sha256_and_size_of_every_file(ckpt):
    manifest = read_manifest(ckpt)
    files = list_files(ckpt)
    assert sorted(manifest.files) == files
    assert {".metadata", "__0_0.distcp", "meta.pt", "rng/rank_00000.json"} <= set(files)
    for rel, entry in manifest.files.items():
        data = (ckpt / rel).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest() and entry.bytes == len(data)
    assert manifest.global_step == 2 and manifest.world_size == 1
    assert not (ckpt / (MANIFEST_NAME + ".tmp")).exists()


def test_manifest_json_round_trip(ckpt):
    text = (ckpt / MANIFEST_NAME).read_text()
    assert json.loads(text)["format"] == "lightning-disttrain/dcp"
    assert Manifest.from_json(text) == read_manifest(ckpt)


def test_intact_checkpoint_verifies(ckpt):
    assert verify_checkpoint(ckpt).files


def test_corrupted_file_is_named(ckpt):
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1  # one bit: same size, different content
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointVerificationError, match="corrupted") as info:
        verify_checkpoint(ckpt)
    assert info.value.path == shard and str(shard) in str(info.value)


def test_truncated_file_is_named(ckpt):
    shard = ckpt / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    with pytest.raises(CheckpointVerificationError, match=f"truncated: {size // 2} bytes") as info:
        verify_checkpoint(ckpt)
    assert info.value.path == shard


def test_missing_file_is_named(ckpt):
    (ckpt / "rng" / "rank_00000.json").unlink()
    with pytest.raises(CheckpointVerificationError, match="is missing") as info:
        verify_checkpoint(ckpt)
    assert info.value.path == ckpt / "rng" / "rank_00000.json"


def test_all_bad_files_are_listed(ckpt):
    (ckpt / "meta.pt").write_bytes(b"x")
    (ckpt / ".metadata").unlink()
    with pytest.raises(CheckpointVerificationError) as info:
        verify_checkpoint(ckpt)
    assert info.value.path == ckpt / ".metadata" and "also bad: meta.pt" in str(info.value)


def test_missing_manifest_means_incomplete(ckpt):
    (ckpt / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteCheckpointError, match="incomplete") as info:
        verify_checkpoint(ckpt)
    assert info.value.path == ckpt / MANIFEST_NAME
    assert isinstance(info.value, ValueError)  # user-facing errors are ValueErrors that say the fix
    assert "find_latest_checkpoint" in str(info.value)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointVerificationError, match="does not exist"):
        verify_checkpoint(tmp_path / "nope")


def test_unreadable_manifest_is_named(ckpt):
    (ckpt / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointVerificationError, match="unreadable") as info:
        verify_checkpoint(ckpt)
    assert info.value.path == ckpt / MANIFEST_NAME


def test_unlisted_file_only_warns(ckpt):
    (ckpt / "notes.txt").write_text("hello")
    with pytest.warns(UserWarning, match="notes.txt"):
        verify_checkpoint(ckpt)


@pytest.mark.slow  # 2 processes
def test_a_read_error_on_one_rank_fails_every_rank_instead_of_hanging(ckpt, tmp_path):
    # Each rank hashes a slice of the files; an OSError on one of them is reported through the
    # same all_gather as a bad hash, so all ranks raise the same verification error together.
    from dist_utils import read_ranks, run_torch_script

    script = Path(__file__).parent / "scripts" / "verify_io_error.py"
    run_torch_script(script, 2, str(ckpt), str(tmp_path), timeout=120)
    errors = [r["error"] for r in read_ranks(tmp_path, "verify", 2)]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("CheckpointVerificationError") and "could not be read" in errors[0]
    assert "Input/output error" in errors[0]
