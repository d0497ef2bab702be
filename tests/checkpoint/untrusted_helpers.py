"""Checkpoints as a hostile writer would leave them: a DCP ``.metadata`` whose unpickling runs code
(here: creates a marker file, then gives back the real metadata, so a trusted load still works),
with a manifest that matches it (whoever writes the directory writes the manifest too)."""

from __future__ import annotations

import json
import operator
import pickle
from pathlib import Path

from lightning_disttrain.checkpoint.manifest import hash_files, list_files, read_manifest, write_manifest


class _Touch:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


class _Planted:
    def __init__(self, marker: Path, metadata) -> None:
        self.marker, self.metadata = marker, metadata

    def __reduce__(self):  # (touch(marker), metadata)[1]: runs touch while unpickling
        return operator.getitem, ((_Touch(self.marker), self.metadata), 1)


def rewrite_manifest(ckpt_dir: Path) -> None:
    manifest = read_manifest(ckpt_dir)
    manifest.files = hash_files(ckpt_dir, list_files(ckpt_dir))
    write_manifest(ckpt_dir, manifest)


def plant_metadata(ckpt_dir: Path, marker: Path) -> None:
    """Replace ``ckpt_dir/.metadata`` with one that creates ``marker`` when unpickled."""
    path = Path(ckpt_dir) / ".metadata"
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own, just written
    path.write_bytes(pickle.dumps(_Planted(Path(marker), metadata)))
    rewrite_manifest(Path(ckpt_dir))


class _TouchingDict(dict):
    def __reduce__(self):
        return operator.getitem, ((_Touch(self.marker), dict(self)), 1)


def plant_meta_pt(ckpt_dir: Path, marker: Path) -> None:
    """Replace ``ckpt_dir/meta.pt`` with a torch.save file that creates ``marker`` when unpickled fully."""
    import torch

    path = Path(ckpt_dir) / "meta.pt"
    meta = _TouchingDict(torch.load(path, weights_only=True))
    meta.marker = Path(marker)
    torch.save(meta, path)
    rewrite_manifest(Path(ckpt_dir))


def _deep(n: int) -> str:
    return "[" * n + "]" * n


MALFORMED = {
    "list": "[]",
    "deep": '{"format": "lightning-disttrain/dcp", "files": {}, "extra": {"a": ' + _deep(100000) + "}}",
    "string_step": None,  # built from the real manifest below
    "huge_time": None,
    "nan_time": None,
}


def malformed_text(kind: str, good: dict) -> str:
    """The manifest text of ``kind`` (``MALFORMED``), built from the good manifest ``good``."""
    if MALFORMED[kind] is not None:
        return MALFORMED[kind]
    bad = json.loads(json.dumps(good))
    if kind == "string_step":
        bad["global_step"] = "many"
    elif kind == "huge_time":
        bad["created_unix"] = 1e300
    elif kind == "nan_time":
        return json.dumps(bad).replace(f'"created_unix": {json.dumps(good["created_unix"])}', '"created_unix": NaN')
    return json.dumps(bad)
