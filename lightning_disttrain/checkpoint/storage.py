"""Where checkpoints go: a local directory or any fsspec URL (``s3://bucket/run``, ``gs://...``).

``is_url`` tells the two apart; ``check_writable`` proves, before training, that this process can
create a file under a checkpoint directory (each rank writes its own DCP shard, so each rank
checks), so that a read-only mount, a missing bucket or missing credentials fail at start and
not at the first save hours later.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_url(path: str | os.PathLike) -> bool:
    """True for an fsspec URL (``s3://...``, ``memory://...``); False for a local path (also ``file://``)."""
    text = str(path)
    return bool(_URL.match(text)) and not text.startswith("file://")


def check_writable(directory: str | os.PathLike) -> str | None:
    """Create ``directory`` if needed and write and delete a small probe file in it.

    Returns None when that works, else a message naming the directory, the error and the fix.
    Never raises for an unwritable directory: a distributed caller gathers every rank's answer
    first, so that all ranks raise together instead of some waiting for the others.
    """
    probe_name = f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if is_url(directory):
            import fsspec

            fs, root = fsspec.core.url_to_fs(str(directory))
            fs.makedirs(root, exist_ok=True)
            probe = f"{root.rstrip('/')}/{probe_name}"
            fs.pipe_file(probe, b"ok")
            fs.rm_file(probe)
        else:
            root = Path(str(directory).removeprefix("file://"))
            root.mkdir(parents=True, exist_ok=True)
            probe = root / probe_name
            probe.write_bytes(b"ok")
            probe.unlink()
    except Exception as err:  # noqa: BLE001  (permissions, a missing bucket, credentials, ...)
        return (f"checkpoint directory {str(directory)!r} is not writable from this process "
                f"({type(err).__name__}: {err}); fix its permissions or credentials, or pass another dirpath")
    return None


# ---- fsspec URLs: the few operations checkpoints need ---------------------------------------
# Local paths keep their own code (pathlib, links, fsync); these serve URLs only. Object stores
# have no directories and no rename: a "directory" is a key prefix, and a single PUT (pipe_file)
# is atomic, which is what the manifest needs to be written last and seen whole or not at all.


def location(path: str | os.PathLike) -> Path | str:
    """``Path`` for a local path, the URL string (no trailing '/') for an fsspec URL."""
    return str(path).rstrip("/") if is_url(path) else Path(path)


def url_fs(url: str):
    """(filesystem, path without protocol) for ``url``, with listings re-read (no stale cache)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return fs, path


def url_join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


def url_files(url: str) -> list[str]:
    """Every object under ``url``, relative ('/'-separated), sorted."""
    fs, root = url_fs(url)
    root = root.rstrip("/")
    return sorted(p[len(root) + 1:] for p in fs.find(root) if p.startswith(root + "/"))


def url_subdirs(url: str) -> list[str]:
    """The URLs of the "directories" (key prefixes) directly under ``url``."""
    fs, root = url_fs(url)
    if not fs.exists(root):
        return []
    return sorted(fs.unstrip_protocol(e["name"]) for e in fs.ls(root, detail=True) if e.get("type") == "directory")


def url_newest_mtime(url: str) -> float:
    """The newest modification time of the objects under ``url`` (0.0 when none says)."""
    fs, root = url_fs(url)
    newest = 0.0
    for info in fs.find(root, detail=True).values():
        stamp = info.get("LastModified") or info.get("mtime") or info.get("created")
        if hasattr(stamp, "timestamp"):
            stamp = stamp.timestamp()
        if isinstance(stamp, (int, float)):
            newest = max(newest, float(stamp))
    return newest


def url_exists(url: str) -> bool:
    fs, path = url_fs(url)
    return fs.exists(path)


def url_read(url: str) -> bytes:
    fs, path = url_fs(url)
    return fs.cat_file(path)


def url_write(url: str, data: bytes) -> None:
    fs, path = url_fs(url)
    fs.pipe_file(path, data)


def url_size(url: str) -> int:
    fs, path = url_fs(url)
    return int(fs.size(path))


def url_open(url: str, mode: str = "rb"):
    fs, path = url_fs(url)
    return fs.open(path, mode)


def url_remove(url: str, first: str | None = None) -> None:
    """Delete everything under ``url``; ``first`` (a relative name, the manifest) before the rest."""
    fs, path = url_fs(url)
    if first is not None and fs.exists(f"{path}/{first}"):
        fs.rm_file(f"{path}/{first}")
    if fs.exists(path):
        fs.rm(path, recursive=True)
