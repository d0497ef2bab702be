"""The manifest: sha256 and size of every file of a checkpoint, written last.

A checkpoint directory is complete exactly when ``manifest.json`` exists in it: global rank 0
writes it (atomically: temp file, fsync, rename) only after every rank's shards and side files
are on disk. Verification re-hashes the files and names the first one that is missing,
truncated or altered, so a resume never silently starts from half a checkpoint.

Hashing is split by file: :func:`hash_files` hashes any subset, so that in a distributed run
each rank hashes ``files[rank::world_size]`` and rank 0 only merges (see ``dcp_io``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_disttrain.checkpoint import storage

MANIFEST_NAME = "manifest.json"
"""Name of the manifest inside a checkpoint directory; its presence marks the checkpoint complete."""
FORMAT = "lightning-disttrain/dcp"
FORMAT_VERSION = 1
_CHUNK = 8 << 20  # hashlib releases the GIL on large updates, so async hashing overlaps training


class CheckpointVerificationError(ValueError):
    """A checkpoint directory is incomplete or damaged; ``path`` is the offending file."""

    def __init__(self, path: str | os.PathLike, reason: str, fix: str | None = None) -> None:
        self.path = storage.location(path)
        self.reason = reason
        fix = fix or ("re-save it, or resume from an earlier checkpoint "
                      "(lightning_disttrain.checkpoint.find_latest_checkpoint(dir) picks the newest "
                      "complete one)")
        super().__init__(f"checkpoint file {str(self.path)!r} {reason}; {fix}")


class IncompleteCheckpointError(CheckpointVerificationError):
    """The manifest is missing: the save never finished (crash, or an async write still running)."""


@dataclass
class FileEntry:
    sha256: str
    """Hex digest of the whole file."""
    bytes: int
    """Size in bytes; checked before hashing so truncation is reported as such."""


@dataclass
class Manifest:
    """What ``manifest.json`` holds. Paths are relative to the checkpoint directory, '/'-separated."""

    files: dict[str, FileEntry]
    """Every file of the checkpoint except the manifest itself."""
    world_size: int = 1
    """Ranks that wrote the checkpoint (and the number of per-rank RNG files)."""
    global_step: int | None = None
    """Trainer.global_step at save time (orders checkpoints for resume discovery)."""
    epoch: int | None = None
    created_unix: float = field(default_factory=time.time)
    """When the checkpoint became complete."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form information: parallel degrees, torch/lightning versions, async or not."""
    format: str = FORMAT
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate (``validate_manifest``); ``ValueError`` naming the first defect."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise ValueError(f"is {len(text)} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have")
        try:
            raw = json.loads(text, parse_constant=_no_constant)
        except RecursionError as err:
            raise ValueError("nests too deeply") from err
        return validate_manifest(raw)


MAX_MANIFEST_BYTES = 64 << 20
"""A manifest larger than this is refused unread (an entry takes ~100 bytes of JSON: room for
``MAX_FILES`` entries at most)."""
MAX_FILES = 1_000_000
MAX_EXTRA_DEPTH = 16
_MAX_UNIX = 253402300799.0  # 9999-12-31: datetime refuses later times (OverflowError)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = {"files", "world_size", "global_step", "epoch", "created_unix", "extra", "format", "version"}


def _no_constant(name: str):
    raise ValueError(f"holds {name}, not a finite number")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_relative_path(rel: Any) -> str | None:
    """Why ``rel`` is not a path inside a checkpoint ('/'-separated, relative, no '..'), or None."""
    if not isinstance(rel, str) or not rel:
        return f"{rel!r} is not a file name"
    if len(rel) > 4096 or "\\" in rel or "\0" in rel or rel.startswith("/") or re.match(r"^[A-Za-z]:", rel):
        return f"{rel!r} is not a relative path inside the checkpoint"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return f"{rel!r} is not a plain relative path inside the checkpoint (empty, '.' or '..' parts)"
    return None


def _depth_ok(value: Any, depth: int) -> bool:
    if depth > MAX_EXTRA_DEPTH:
        return False
    if isinstance(value, dict):
        return all(_depth_ok(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return all(_depth_ok(v, depth + 1) for v in value)
    return True


def validate_manifest(raw: Any) -> Manifest:
    """A :class:`Manifest` from parsed JSON, or ``ValueError`` naming what is wrong: the schema,
    each field's type, finite numbers, file names that are relative paths inside the checkpoint,
    bounded size and nesting. Whoever wrote the directory wrote the manifest: it is input, not truth."""
    if not isinstance(raw, dict):
        raise ValueError(f"is a JSON {type(raw).__name__}, not an object")
    if raw.get("format") != FORMAT:
        raise ValueError(f"is not a {FORMAT} manifest (format={str(raw.get('format'))[:80]!r})")
    if unknown := sorted(set(raw) - _FIELDS):
        raise ValueError(f"has unknown fields {unknown[:5]}")
    if not _is_int(raw.get("version", FORMAT_VERSION)):
        raise ValueError("has a version that is not an integer")
    files = raw.get("files")
    if not isinstance(files, dict):
        raise ValueError("has no `files` object")
    if len(files) > MAX_FILES:
        raise ValueError(f"lists {len(files)} files, more than {MAX_FILES}")
    entries = {}
    for rel, entry in files.items():
        if why := check_relative_path(rel):
            raise ValueError(f"lists {why}")
        if rel == MANIFEST_NAME or rel.startswith(MANIFEST_NAME + "."):
            raise ValueError(f"lists itself ({rel!r})")
        if (not isinstance(entry, dict) or set(entry) != {"sha256", "bytes"} or not isinstance(entry["sha256"], str)
                or not _SHA256.match(entry["sha256"]) or not _is_int(entry["bytes"]) or entry["bytes"] < 0):
            raise ValueError(f"has a malformed entry for {rel!r} (want {{\"sha256\": 64 hex digits, \"bytes\": n >= 0}})")
        entries[rel] = FileEntry(entry["sha256"], entry["bytes"])
    world_size = raw.get("world_size", 1)
    if not _is_int(world_size) or not 1 <= world_size <= 1 << 24:
        raise ValueError(f"has world_size={str(world_size)[:40]}, not a positive integer")
    for key in ("global_step", "epoch"):
        value = raw.get(key)
        if value is not None and (not _is_int(value) or not 0 <= value < 1 << 62):
            raise ValueError(f"has {key}={str(value)[:40]}, not a non-negative integer or null")
    created = raw.get("created_unix", 0.0)
    if (not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created)
            or not 0 <= created <= _MAX_UNIX):
        raise ValueError(f"has created_unix={str(created)[:40]}, not a time between 1970 and 9999")
    extra = raw.get("extra", {})
    if not isinstance(extra, dict) or not _depth_ok(extra, 0):
        raise ValueError(f"has an `extra` that is not an object nested at most {MAX_EXTRA_DEPTH} deep")
    return Manifest(files=entries, world_size=world_size, global_step=raw.get("global_step"), epoch=raw.get("epoch"),
                    created_unix=float(created), extra=extra, format=FORMAT, version=raw.get("version", FORMAT_VERSION))


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with (storage.url_open(str(path)) if storage.is_url(path) else open(path, "rb")) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def list_files(ckpt_dir: str | os.PathLike) -> list[str]:
    """Every regular file under ``ckpt_dir`` except the manifest (and its temp file), sorted."""
    if storage.is_url(ckpt_dir):
        return [rel for rel in storage.url_files(str(ckpt_dir)) if not rel.startswith(MANIFEST_NAME)]
    root = Path(ckpt_dir)
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if not rel.startswith(MANIFEST_NAME):
                out.append(rel)
    return sorted(out)


def hash_files(ckpt_dir: str | os.PathLike, rel_paths: Iterable[str]) -> dict[str, FileEntry]:
    if storage.is_url(ckpt_dir):
        urls = {rel: storage.url_join(str(ckpt_dir), rel) for rel in rel_paths}
        return {rel: FileEntry(sha256_file(url), storage.url_size(url)) for rel, url in urls.items()}
    root = Path(ckpt_dir)
    return {rel: FileEntry(sha256_file(root / rel), (root / rel).stat().st_size) for rel in rel_paths}


def write_manifest(ckpt_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically: a reader sees either no manifest or the whole of it."""
    if storage.is_url(ckpt_dir):  # one PUT: an object store shows all of it or nothing
        url = storage.url_join(str(ckpt_dir), MANIFEST_NAME)
        storage.url_write(url, manifest.to_json().encode())
        return url
    root = Path(ckpt_dir)
    final, tmp = root / MANIFEST_NAME, root / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    # fsync the directory too, or the rename itself may not survive a power loss.
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def read_manifest(ckpt_dir: str | os.PathLike) -> Manifest:
    """The manifest of ``ckpt_dir``; ``IncompleteCheckpointError`` if there is none."""
    if storage.is_url(ckpt_dir):
        return _read_url_manifest(str(ckpt_dir))
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointVerificationError(
            root, "does not exist or is not a directory",
            fix="pass the path of a checkpoint directory written by a lightning-disttrain strategy")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise IncompleteCheckpointError(
            path, "is missing, so the checkpoint is incomplete (the save was interrupted or an "
                  "async save had not finished)")
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise ValueError(f"is {path.stat().st_size} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have")
        return Manifest.from_json(path.read_bytes())
    except _MALFORMED as err:
        raise CheckpointVerificationError(path, f"is malformed ({_short(err)})") from err


# Whatever parsing a hostile manifest raises: all of it means "skip this checkpoint".
_MALFORMED = (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError, UnicodeDecodeError)


def _short(err: BaseException) -> str:
    return str(err)[:300]


def _read_url_manifest(url: str) -> Manifest:
    path = storage.url_join(url, MANIFEST_NAME)
    if not storage.url_exists(path):
        if not storage.url_files(url):
            raise CheckpointVerificationError(
                url, "does not exist or is empty",
                fix="pass the URL of a checkpoint directory written by a lightning-disttrain strategy")
        raise IncompleteCheckpointError(
            path, "is missing, so the checkpoint is incomplete (the save was interrupted or an "
                  "async save had not finished)")
    try:
        if storage.url_size(path) > MAX_MANIFEST_BYTES:
            raise ValueError(f"is more than the {MAX_MANIFEST_BYTES} bytes a manifest may have")
        return Manifest.from_json(storage.url_read(path))
    except _MALFORMED as err:
        raise CheckpointVerificationError(path, f"is malformed ({_short(err)})") from err


Problem = tuple[str, str]
"""(relative path, what is wrong with it)."""


def check_files(ckpt_dir: str | os.PathLike, manifest: Manifest, rel_paths: Iterable[str]) -> list[Problem]:
    """Check ``rel_paths`` (a subset of the manifest's files) against it; the problems found.

    Size first (cheap, and says "truncated" rather than "sha256 mismatch"), then the hash.
    """
    if storage.is_url(ckpt_dir):
        url = str(ckpt_dir)
        locate, exists, size_of = (lambda rel: storage.url_join(url, rel)), storage.url_exists, storage.url_size
    else:
        root = Path(ckpt_dir)
        locate, exists, size_of = (lambda rel: root / rel), (lambda p: p.is_file()), (lambda p: p.stat().st_size)
    problems = []
    for rel in rel_paths:
        entry, path = manifest.files[rel], locate(rel)
        if why := check_relative_path(rel):  # validate_manifest refuses these; a Manifest built in code may not
            problems.append((rel, f"is not checked: {why}"))
            continue
        try:
            if not storage.is_url(ckpt_dir) and path.is_symlink():
                problems.append((rel, "is a link; a checkpoint's files are regular files inside it"))
            elif not exists(path):
                problems.append((rel, f"is missing (listed in {MANIFEST_NAME})"))
            elif (size := size_of(path)) != entry.bytes:
                kind = "truncated" if size < entry.bytes else "longer than recorded"
                problems.append((rel, f"is {kind}: {size} bytes, {MANIFEST_NAME} says {entry.bytes}"))
            elif sha256_file(path) != entry.sha256:
                problems.append((rel, f"is corrupted: its sha256 differs from the one in {MANIFEST_NAME}"))
        except OSError as err:
            # A problem, not an exception: in a distributed check the other ranks wait for this
            # rank's list in a collective, and an exception here would leave them waiting.
            problems.append((rel, f"could not be read ({type(err).__name__}: {err})"))
    return problems


def unlisted_files(ckpt_dir: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Files present on disk but not in the manifest (e.g. shards of a different save mixed in)."""
    return [f for f in list_files(ckpt_dir) if f not in manifest.files]


def raise_for_problems(ckpt_dir: str | os.PathLike, problems: Iterable[Problem]) -> None:
    """Turn ``check_files`` output into one error naming the first bad file (and listing the rest)."""
    problems = sorted(problems)
    if not problems:
        return
    rel, reason = problems[0]
    more = f" (also bad: {', '.join(p[0] for p in problems[1:])})" if len(problems) > 1 else ""
    bad = storage.url_join(str(ckpt_dir), rel) if storage.is_url(ckpt_dir) else Path(ckpt_dir) / rel
    raise CheckpointVerificationError(bad, reason + more)


def verify_checkpoint(ckpt_dir: str | os.PathLike) -> Manifest:
    """Verify every file of a checkpoint in this process; return its manifest or raise.

    Files on disk that the manifest does not list are reported with a warning, not an error:
    DCP's ``.metadata`` never references them, so they cannot leak into a load. Distributed runs
    split the hashing across ranks instead (``dcp_io.verify_distributed``).
    """
    manifest = read_manifest(ckpt_dir)
    raise_for_problems(ckpt_dir, check_files(ckpt_dir, manifest, sorted(manifest.files)))
    warn_unlisted(ckpt_dir, manifest)
    return manifest


def warn_unlisted(ckpt_dir: str | os.PathLike, manifest: Manifest) -> None:
    if extra := unlisted_files(ckpt_dir, manifest):
        warnings.warn(f"checkpoint {str(ckpt_dir)!r} holds files its {MANIFEST_NAME} does not list "
                      f"(ignored): {extra[:5]}{' ...' if len(extra) > 5 else ''}", stacklevel=3)


def add_to_manifest(ckpt_dir: str | os.PathLike, rel_paths: Iterable[str]) -> Manifest:
    """Hash files written into a complete checkpoint after its manifest (``evals.json``) and list
    them in it, rewritten atomically: a reader sees the old manifest or the new one, never half.

    The rest of the manifest (its files, step, completion time) is kept as it was. Call it on one
    rank only, and only once the save has its manifest (an async save finalises in the background).
    """
    manifest = read_manifest(ckpt_dir)
    manifest.files = merge_entries([manifest.files, hash_files(ckpt_dir, rel_paths)])
    write_manifest(ckpt_dir, manifest)
    return manifest


def merge_entries(parts: Iterable[Mapping[str, FileEntry]]) -> dict[str, FileEntry]:
    merged: dict[str, FileEntry] = {}
    for part in parts:
        merged.update(part)
    return dict(sorted(merged.items()))
