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
