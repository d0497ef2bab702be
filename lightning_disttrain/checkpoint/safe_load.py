"""Reading DCP checkpoints without running code from them.

DCP stores its index of tensor shards, ``.metadata``, as a pickle, and torch's ``FileSystemReader``
reads it with a plain ``pickle.load``: whoever wrote the directory can make that run any code.
Non-tensor values saved through DCP (optimizer hyper-parameters such as ``lr``) are stored as
``torch.save`` bytes that DCP's load planner reads back with ``torch.load(weights_only=False)``.

The readers here close both:

- ``.metadata`` goes through :class:`MetadataUnpickler`, which resolves only the classes DCP's
  metadata is built from (``torch.distributed.checkpoint.metadata``, ``torch.Size``, dtypes,
  paths) and refuses anything else with :class:`UntrustedCheckpointError` naming the type;
- each bytes item is read with ``torch.load(weights_only=True)`` before the planner sees it.

``reader_for(path, trust_checkpoint=True)`` gives torch's own readers back, for checkpoints the
user says they trust (``--trust-checkpoint`` / ``trust_checkpoint=True``).

``check_checkpoint_file`` is the one answer every command gives for a file that is not a
checkpoint (``fit``/``validate``/``test``/``predict --ckpt_path FILE``, ``eval FILE``): one line
that says so, never torch's advice to retry with ``weights_only=False`` (which would run whatever
code the file holds).
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain.checkpoint import storage

TRUST_HINT = ("if you trust whoever wrote this checkpoint, pass --trust-checkpoint "
              "(trust_checkpoint=True; for a strategy: strategy.trust_checkpoint = True)")

_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((module, cls) for module in ("pathlib", "pathlib._local")
      for cls in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
}
"""(module, name) pairs DCP's ``.metadata`` is made of: dataclasses and value types whose
construction runs no code of the file's choosing."""


class UntrustedCheckpointError(ValueError):
    """A checkpoint file would run code (or build objects) that loading refuses without trust."""

    def __init__(self, path: str | os.PathLike, what: str) -> None:
        self.path, self.what = str(path), what
        super().__init__(f"refusing to load {self.path!r}: {what}, which loading a checkpoint never needs and "
                         f"which could run code from the file; {TRUST_HINT}")


class NotACheckpointError(ValueError):
    """A file given as a checkpoint that the weights-only loader cannot read (``check_checkpoint_file``)."""

    def __init__(self, path: str | os.PathLike, why: str) -> None:
        self.path, self.why = str(path), why
        super().__init__(f"{self.path!r} is not a checkpoint: {why}; pass a checkpoint saved by "
                         f"`lightning-disttrain fit` or a file written by `lightning-disttrain export`")


def check_checkpoint_file(path: str | os.PathLike) -> None:
    """Raise ``NotACheckpointError`` unless ``torch.load(path, weights_only=True)`` reads ``path``.

    Called before anything else loads the file, so that the error is ours (one line, the same for
    every command) rather than torch's, which tells the user to unpickle the file with
    ``weights_only=False``. A zip checkpoint (torch's format since 1.6) is read with ``mmap=True``:
    only its pickle is read here, not its tensors, so the later real load is not paid twice."""
    mmap = zipfile.is_zipfile(path)
    try:
        with warnings.catch_warnings():  # the weights-only unpickler's "please file an issue" on any pickle
            warnings.simplefilter("ignore")
            torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        text = str(err)
        if "WeightsUnpickler error:" in text:
            # The refusal's first sentence ("Unsupported global: GLOBAL builtins.object was not an
            # allowed global by default"), without torch's advice on how to allow it.
            detail = next((line for line in text.split("WeightsUnpickler error:", 1)[1].splitlines() if line.strip()),
                          "").strip().split(". ")[0]
            if detail.startswith("Unsupported operand"):  # a pickle torch.save never writes, or no pickle
                raise NotACheckpointError(path, "it is not a file written by torch.save") from None
            raise NotACheckpointError(path, "it holds more than tensors and plain data, and loading never "
                                            f"unpickles anything else (it could run code){f': {detail}' if detail else ''}"
                                      ) from None
        raise NotACheckpointError(path, "it is not a file written by torch.save") from None
    except (EOFError, KeyError, RuntimeError, ValueError, zipfile.BadZipFile, UnicodeDecodeError):
        empty = os.path.getsize(path) == 0
        raise NotACheckpointError(path, "it is empty" if empty else "it is not a file written by torch.save") from None


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the types DCP's metadata holds (fail closed)."""

    def __init__(self, file, where: str | os.PathLike = ".metadata") -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UntrustedCheckpointError(self.where, f"its DCP metadata refers to {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedCheckpointError(self.where, "its DCP metadata holds a persistent reference")


def load_dcp_metadata(stream, where: str | os.PathLike = ".metadata") -> Metadata:
    """Unpickle DCP metadata from ``stream`` with :class:`MetadataUnpickler`."""
    try:
        metadata = MetadataUnpickler(stream, where).load()
    except UntrustedCheckpointError:
        raise
    except Exception as err:  # a truncated or garbled pickle
        raise UntrustedCheckpointError(where, f"its DCP metadata is not readable ({type(err).__name__}: {err})") from err
    if not isinstance(metadata, Metadata):
        raise UntrustedCheckpointError(where, f"its DCP metadata is a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class _WeightsOnlyBytes:
    """A load planner whose bytes items are checked with ``torch.load(weights_only=True)`` first
    (the planner itself unpickles them with ``weights_only=False``)."""

    def __init__(self, planner, where: str) -> None:
        self._planner, self._where = planner, where

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:
            raise UntrustedCheckpointError(
                self._where, f"its value {read_item.dest_index.fqn!r} holds objects torch.load(weights_only=True) "
                             f"refuses ({str(err).splitlines()[0][:200]})") from err
        self._planner.load_bytes(read_item, io.BytesIO(data))


class _Restricted:
    """``read_metadata`` and ``read_data`` of a DCP reader, without unrestricted unpickling."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = torch_compat.metadata_path(self, kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_dcp_metadata(f, where=path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, _WeightsOnlyBytes(planner, str(self.path)))


class SafeFileSystemReader(_Restricted, FileSystemReader):
    """torch's ``FileSystemReader`` with restricted unpickling (module docstring)."""


_fsspec_reader: type | None = None


def _safe_fsspec_reader() -> type:
    global _fsspec_reader
    if _fsspec_reader is None:
        _fsspec_reader = type("SafeFsspecReader", (_Restricted, torch_compat.fsspec_reader_class()),
                              {"__doc__": "torch's FsspecReader with restricted unpickling."})
    return _fsspec_reader


def reader_for(path: str | os.PathLike, trust_checkpoint: bool = False):
    """The DCP storage reader for a local path or an fsspec URL: restricted unless trusted."""
    if storage.is_url(path):
        if trust_checkpoint:
            return torch_compat.fsspec_reader_class()(str(path))
        return _safe_fsspec_reader()(str(path))
    return FileSystemReader(Path(path)) if trust_checkpoint else SafeFileSystemReader(Path(path))


def unwrap_checkpoint_exception(err: BaseException) -> BaseException:
    """DCP wraps errors raised while loading in its ``CheckpointException`` (a BaseException);
    the first ``UntrustedCheckpointError`` inside it, else ``err`` itself."""
    for failure in (getattr(err, "failures", None) or {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, UntrustedCheckpointError):
            return exc
    return err
