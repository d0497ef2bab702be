"""Finding the checkpoint to resume from, and pruning old ones.

A directory of checkpoints (a ``ModelCheckpoint`` dirpath) may end in a checkpoint that never
completed: the job died while writing, or while an async write was still running. Resume
discovery walks the checkpoints newest first and takes the first that verifies, warning about
each one it skips and why. "Newest" is the time the manifest says the checkpoint completed; a
checkpoint without a manifest is dated by its newest file, so that it still counts as the newest
(and is reported) when it is the one that was being written.

A checkpoint whose ``evals.json`` says the eval regression gate failed it (``CheckpointEval``
with a ``fail_checkpoint`` rule) is skipped as well, with a warning, unless ``include_failed``.

Why completion time and not the global step: a new run started from scratch in a directory that
still holds an older run's checkpoints (the quickstart run twice) saves low steps first. What
the user expects after its first save is that run, not the older run's higher step, so the most
recently completed checkpoint wins; the global step only breaks ties. The shipped configs also
keep ``last.ckpt`` a link to that same checkpoint (``save_last: link``, no version counter).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from lightning_disttrain.checkpoint import storage
from lightning_disttrain.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointVerificationError,
    Manifest,
    read_manifest,
    verify_checkpoint,
)

# Things a checkpoint directory holds at some stage of being written; a directory with none of
# them (and not named *.ckpt) is not ours and is left alone.
_MARKERS = (MANIFEST_NAME, ".metadata", "meta.pt", "rng")
EVALS_NAME = "evals.json"
"""Eval results stored in a checkpoint directory by ``CheckpointEval`` (listed in its manifest)."""


def gate_failure(ckpt_dir: str | os.PathLike) -> str | None:
    """Why the eval gate failed this checkpoint (from its ``evals.json``), or None if it did not."""
    try:
        if storage.is_url(ckpt_dir):
            text = storage.url_read(storage.url_join(str(ckpt_dir), EVALS_NAME)).decode()
        else:
            text = (Path(ckpt_dir) / EVALS_NAME).read_text()
        gate = json.loads(text).get("gate") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if gate.get("failed_checkpoint"):
        return "; ".join(v.get("message", "") for v in gate.get("violations", [])) or "failed by the eval gate"
    return None


@dataclass
class Candidate:
    """A directory that is, or was becoming, a checkpoint."""

    path: Path
    """As found in the parent directory (may be a link such as ``last.ckpt``)."""
    resolved: Path
    """The real directory."""
    complete: bool
    """Whether a manifest is present (its files are not verified here)."""
    timestamp: float
    """Completion time from the manifest; else the newest file's modification time."""
    global_step: int | None = None
    failed: str | None = None
    """Why the eval gate failed it (``evals.json``), or None."""

    def describe(self) -> str:
        """As ``describe_checkpoint``, from what listing read (no file access)."""
        if not self.complete:
            return f"{str(self.resolved)!r} (incomplete: no {MANIFEST_NAME})"
        return _describe(self.resolved, self.global_step, self.timestamp)


LAST_NAME = re.compile(r"^last(-v\d+)?\.ckpt$")
"""ModelCheckpoint's "last" names (``last.ckpt``, and ``last-v1.ckpt`` when its version counter is on)."""


def describe_checkpoint(path: str | os.PathLike, manifest: Manifest | None = None) -> str:
    """``'REAL_DIR' (global step N, completed ISO_TIME)``: which checkpoint a path really is, for
    messages that must not leave a user guessing what was resumed or exported."""
    real = storage.location(path) if storage.is_url(path) else Path(path).resolve()
    if manifest is None:
        try:
            manifest = read_manifest(real)
        except CheckpointVerificationError:
            return f"{str(real)!r} (incomplete: no {MANIFEST_NAME})"
    return _describe(real, manifest.global_step, manifest.created_unix)


def _describe(real: Path, global_step: int | None, completed_unix: float) -> str:
    when = datetime.fromtimestamp(completed_unix).astimezone().isoformat(timespec="seconds")
    return f"{str(real)!r} (global step {global_step}, completed {when})"


def _looks_like_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path.suffix == ".ckpt" or any((path / m).exists() for m in _MARKERS))


def _newest_mtime(path: Path) -> float:
    newest = path.stat().st_mtime
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                newest = max(newest, (Path(dirpath) / name).stat().st_mtime)
            except OSError:  # deleted under us
                pass
    return newest


def list_checkpoints(directory: str | os.PathLike) -> list[Candidate]:
    """Checkpoint directories directly inside ``directory``, newest first, links folded into targets."""
    if storage.is_url(directory):
        return _list_url_checkpoints(str(directory))
    root = Path(directory)
    if not root.is_dir():
        return []
    found: dict[Path, Candidate] = {}
    for entry in sorted(root.iterdir()):
        if not _looks_like_checkpoint(entry):
            continue
        resolved = entry.resolve()
        if resolved in found and not entry.is_symlink():
            found[resolved].path = entry  # report the real name, not the link's
        if resolved in found:
            continue
        manifest: Manifest | None = None
        try:
            manifest = read_manifest(resolved)
        except CheckpointVerificationError:
            pass
        if manifest is not None:
            found[resolved] = Candidate(entry, resolved, True, manifest.created_unix, manifest.global_step,
                                        gate_failure(resolved))
        else:
            found[resolved] = Candidate(entry, resolved, False, _newest_mtime(resolved))
    return sorted(found.values(), key=lambda c: (c.timestamp, c.global_step or -1), reverse=True)


def _list_url_checkpoints(url: str) -> list[Candidate]:
    # Object stores have no links and no directories: a checkpoint is a key prefix holding our files.
    found = []
    for sub in storage.url_subdirs(url):
        files = storage.url_files(sub)
        if not (sub.endswith(".ckpt") or any(f.split("/")[0] in _MARKERS for f in files)):
            continue
        try:
            manifest = read_manifest(sub)
            found.append(Candidate(sub, sub, True, manifest.created_unix, manifest.global_step, gate_failure(sub)))
        except CheckpointVerificationError:
            found.append(Candidate(sub, sub, False, storage.url_newest_mtime(sub)))
    return sorted(found, key=lambda c: (c.timestamp, c.global_step or -1), reverse=True)


def find_latest_checkpoint(directory: str | os.PathLike, *,
                           verify: Callable[[Path], object] = verify_checkpoint,
                           candidates: list[Candidate] | None = None,
                           report: bool = True, include_failed: bool = False) -> Path | None:
    """The newest complete, verified checkpoint in ``directory``, or None if there is none.

    Checkpoints the eval gate failed are skipped (with a warning) unless ``include_failed``.

    Each newer checkpoint that fails verification (no manifest, a missing, truncated or corrupted
    file) is skipped with a warning naming the reason. ``verify`` defaults to hashing every file
    in this process; strategies pass a version that splits the hashing across ranks (and then
    ``candidates`` listed once on rank 0, so that every rank walks the same list).
    """
    for cand in list_checkpoints(directory) if candidates is None else candidates:
        if getattr(cand, "failed", None) and not include_failed:
            if report:
                warnings.warn(f"skipping checkpoint {str(cand.path)!r}: the eval gate failed it ({cand.failed}); "
                              f"pass its path explicitly to use it anyway", stacklevel=2)
            continue
        try:
            verify(cand.resolved)
        except CheckpointVerificationError as err:
            if report:
                warnings.warn(f"skipping checkpoint {str(cand.path)!r} for resume: {err}", stacklevel=2)
            continue
        return cand.resolved
    return None


def prune_checkpoints(directory: str | os.PathLike, keep_last: int,
                      remove: Callable[[Path], None] | None = None) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints in ``directory``; return what went.

    Incomplete checkpoints older than the oldest kept one go too (they can never be resumed); newer
    ones are left alone, since one may still be being written. Links (``last.ckpt``) are never
    followed into deletion: a checkpoint reached only through a link is removed by unlinking the
    link, and nothing outside ``directory`` is ever deleted (``remove`` gets the entry as found in
    ``directory``). Call it on one rank only.
    """
    from lightning_disttrain.checkpoint.dcp_io import remove_checkpoint_path

    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}; keep at least 1 checkpoint (use 1 or more)")
    remove = remove or (lambda p: remove_checkpoint_path(p, root=directory))
    candidates = list_checkpoints(directory)
    complete = [c for c in candidates if c.complete]
    if len(complete) <= keep_last:
        return []
    oldest_kept = complete[keep_last - 1].timestamp
    doomed = complete[keep_last:] + [c for c in candidates if not c.complete and c.timestamp < oldest_kept]
    removed = []
    for cand in doomed:
        if remove(cand.path) is not False:
            removed.append(cand.resolved)
    if storage.is_url(directory):
        return removed
    # A link left pointing at a deleted directory would make ckpt_path="last" find nothing.
    for entry in Path(directory).iterdir():
        if entry.is_symlink() and not entry.exists():
            entry.unlink()
    return removed
