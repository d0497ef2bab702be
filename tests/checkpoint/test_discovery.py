"""Resume discovery (newest complete checkpoint, with fallback) and retention."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
from ckpt_helpers import save

from lightning_disttrain.checkpoint import (
    MANIFEST_NAME,
    describe_checkpoint,
    find_latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    remove_checkpoint_path,
)


@pytest.fixture(scope="module")
def _three_template(tmp_path_factory, _trained_once):
    module, opt = _trained_once
    root = tmp_path_factory.mktemp("three")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is.*")
        return [save(root / f"step={s}.ckpt", module, opt, step=s) for s in (1, 2, 3)]


@pytest.fixture
def three(tmp_path, _three_template):
    """Three complete checkpoints, steps 1 < 2 < 3 in time (copies: tests damage them)."""
    return [Path(shutil.copytree(src, tmp_path / src.name)) for src in _three_template]


def test_newest_complete_is_found(tmp_path, three):
    assert find_latest_checkpoint(tmp_path) == three[2].resolve()
    assert [c.global_step for c in list_checkpoints(tmp_path)] == [3, 2, 1]


def test_incomplete_newest_falls_back_with_a_warning(tmp_path, three):
    (three[2] / MANIFEST_NAME).unlink()  # as if the job died while step 3 was being written
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step=3\.ckpt.*incomplete"):
        assert find_latest_checkpoint(tmp_path) == three[1].resolve()


def test_corrupted_newest_falls_back_naming_the_file(tmp_path, three):
    shard = three[2] / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"__0_0\.distcp.*corrupted"):
        assert find_latest_checkpoint(tmp_path) == three[1].resolve()


def test_falls_back_more_than_once(tmp_path, three):
    for path in three[1:]:
        (path / MANIFEST_NAME).unlink()
    with pytest.warns(UserWarning) as record:
        assert find_latest_checkpoint(tmp_path) == three[0].resolve()
    assert len([w for w in record if "skipping" in str(w.message)]) == 2


def test_nothing_complete_gives_none(tmp_path, three):
    for path in three:
        (path / MANIFEST_NAME).unlink()
    with pytest.warns(UserWarning):
        assert find_latest_checkpoint(tmp_path) is None
    assert find_latest_checkpoint(tmp_path / "missing") is None


def test_links_are_folded_into_their_target(tmp_path, three):
    os.symlink("step=3.ckpt", tmp_path / "last.ckpt")
    (tmp_path / "unrelated").mkdir()  # not a checkpoint: ignored
    names = [c.path.name for c in list_checkpoints(tmp_path)]
    assert names == ["step=3.ckpt", "step=2.ckpt", "step=1.ckpt"]


def test_a_directory_still_being_written_counts_as_newest(tmp_path, three):
    started = tmp_path / "step=4.ckpt"
    started.mkdir()
    (started / "meta.pt").write_bytes(b"partial")
    first = list_checkpoints(tmp_path)[0]
    assert first.path == started and not first.complete


def test_prune_keeps_the_newest_complete(tmp_path, three):
    os.symlink("step=1.ckpt", tmp_path / "old-link.ckpt")
    removed = prune_checkpoints(tmp_path, keep_last=2)
    assert removed == [three[0].resolve()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt", "step=3.ckpt"]  # dangling link gone


def test_prune_never_counts_incomplete_and_spares_newer_ones(tmp_path, three):
    (three[2] / MANIFEST_NAME).unlink()  # newest: maybe still being written -> kept
    removed = prune_checkpoints(tmp_path, keep_last=1)
    assert removed == [three[0].resolve()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt", "step=3.ckpt"]
    with pytest.raises(ValueError, match="keep at least 1"):
        prune_checkpoints(tmp_path, keep_last=0)


def test_removing_a_link_keeps_its_target(tmp_path, three):
    link = tmp_path / "last.ckpt"
    os.symlink("step=3.ckpt", link)
    remove_checkpoint_path(link)
    assert not link.exists() and three[2].is_dir()
    remove_checkpoint_path(three[2])
    assert not three[2].exists()


def test_a_fresh_run_in_the_same_directory_wins_over_the_older_runs_higher_step(tmp_path, three, trained):
    # The quickstart run twice into one directory: the new run's first save (step 1, same name as
    # the old run's) completed last, so resume and `export --latest` take it, not the old step 3.
    module, opt = trained
    save(tmp_path / "step=1.ckpt", module, opt, step=1)
    assert find_latest_checkpoint(tmp_path) == three[0].resolve()
    assert [c.global_step for c in list_checkpoints(tmp_path)] == [1, 3, 2]


def test_describe_names_the_real_directory_step_and_time(tmp_path, three):
    os.symlink("step=2.ckpt", tmp_path / "last.ckpt")
    text = describe_checkpoint(tmp_path / "last.ckpt")
    assert text.startswith(f"{str(three[1].resolve())!r} (global step 2, completed 20")
    listed = next(c for c in list_checkpoints(tmp_path) if c.global_step == 2)
    assert listed.describe() == text
    (three[2] / MANIFEST_NAME).unlink()
    assert describe_checkpoint(three[2]).endswith(f"(incomplete: no {MANIFEST_NAME})")
