"""Writing and reading checkpoint directories with DCP, torch-only (no Lightning).

Layout of one checkpoint directory::

    step=000100.ckpt/
      .metadata            DCP's index of every tensor shard (written by DCP's coordinator)
      __0_0.distcp ...     DCP shard files, one per rank: model weights + optimizer state,
                           under the keys "state_dict" and "optimizer_0", "optimizer_1", ...
      meta.pt              everything else Lightning's dump_checkpoint gives (loops, schedulers,
                           callbacks, hyper-parameters, data-module state, epoch/global_step);
                           torch.save by rank 0. Same names as Lightning's ModelParallelStrategy.
      rng/rank_00000.json  each rank's generator states (see ``rng``)
      manifest.json        sha256 + size of each file above; written last, marks completion

:class:`CheckpointWriter` owns the save side: at most one save in flight, an optional
``dcp.async_save`` (state staged to CPU memory before it returns, written by a background thread),
and the finalisation that follows the write: every rank hashes a slice of the files, rank 0 writes
the manifest, everyone learns the outcome. All of its collectives run on a dedicated gloo group,
because async writes run collectives from a background thread while training keeps using the
default group (and because async_save needs a CPU backend even when training uses NCCL).

A save that fails (a full disk, a lost bucket) raises :class:`CheckpointSaveError` on every rank
together (each local write's outcome is agreed before DCP's collectives start) and leaves the
previous checkpoints complete: the partial directory is emptied (kept, empty, so that a
``last.ckpt`` link Lightning may point at it still resolves: resume then takes the newest complete
checkpoint beside it); a complete checkpoint that the save was overwriting in place
(``save_last=True`` reuses ``last.ckpt``) was moved aside to ``<name>.replaced`` and is moved
back; deletions that retention asked for meanwhile wait until a later save completes.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain import comm as collectives
from lightning_disttrain.checkpoint import rng, storage
from lightning_disttrain.checkpoint.safe_load import reader_for, unwrap_checkpoint_exception
from lightning_disttrain.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointVerificationError,
    Manifest,
    check_files,
    hash_files,
    list_files,
    merge_entries,
    raise_for_problems,
    read_manifest,
    warn_unlisted,
    write_manifest,
)

log = logging.getLogger(__name__)
_warned_unpinned: list[bool] = []  # the older-torch staging fallback is reported once per process

META_NAME = "meta.pt"
MODEL_KEY = "state_dict"


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (raised on every rank together). The directory has no manifest
    (resume skips it) and the checkpoints saved before it are untouched."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path, self.reason = str(path), reason
        super().__init__(f"saving checkpoint {str(path)!r} failed: {reason}. Nothing was marked complete; the "
                         f"previous checkpoints are untouched and resume (ckpt_path='last') takes the newest of them")


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


class Comm:
    """Object collectives on one process group; a no-op world of one when not distributed."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of the group's rank ``src``."""
        return collectives.broadcast_object(obj, group_src=src, group=self.group) if self.distributed else obj

    def all_gather(self, obj: Any) -> list[Any]:
        return collectives.all_gather_object(obj, group=self.group) if self.distributed else [obj]

    def barrier(self) -> None:
        if self.distributed:
            collectives.barrier(group=self.group)


def new_checkpoint_group() -> dist.ProcessGroup | None:
    """The gloo group over all ranks for checkpoint collectives (``comm.checkpoint_group``: one per
    process, shared by every writer; collective the first time: call on every rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return collectives.checkpoint_group()


_OURS = (MANIFEST_NAME, ".metadata", META_NAME, rng.RNG_DIR)
_EVALS_NAME = "evals.json"  # CheckpointEval's results (discovery.EVALS_NAME)


def is_checkpoint_file(rel: str) -> bool:
    """Whether ``rel`` (relative to a checkpoint directory, '/'-separated) is a file a save writes:
    the manifest (and its temp file), DCP's ``.metadata`` and ``*.distcp`` shards, ``meta.pt``,
    ``rng/rank_NNNNN.json``, ``evals.json``."""
    parts = rel.split("/")
    if len(parts) == 1:
        name = parts[0]
        return (name in (MANIFEST_NAME, MANIFEST_NAME + ".tmp", META_NAME, _EVALS_NAME) or name.endswith(".metadata")
                or name.endswith(".distcp"))
    return len(parts) == 2 and parts[0] == rng.RNG_DIR and parts[1].startswith("rank_") and parts[1].endswith(".json")


def foreign_entries(path: Path) -> list[str]:
    """What a local checkpoint directory holds besides checkpoint files (links count as foreign)."""
    foreign = []
    for dirpath, dirnames, names in os.walk(path):  # os.walk does not follow links to directories
        here = Path(dirpath)
        for name in names + [d for d in dirnames if (here / d).is_symlink()]:
            rel = (here / name).relative_to(path).as_posix()
            if (here / name).is_symlink() or not is_checkpoint_file(rel):
                foreign.append(rel)
        if here != path and here.relative_to(path).as_posix() != rng.RNG_DIR:
            foreign.append(here.relative_to(path).as_posix() + "/")
    return sorted(foreign)


def _inside(path: Path, root: Path) -> bool:
    """Whether ``path`` (not resolved itself: a link is judged where it lies) is strictly inside ``root``."""
    parent, real_root = path.parent.resolve(), root.resolve()
    return parent == real_root or real_root in parent.parents


def remove_checkpoint_path(path: str | os.PathLike, root: str | os.PathLike | None = None) -> bool:
    """Delete a checkpoint; True if it went (or was not there), False if it was refused (a warning).

    A link is unlinked, never its target. A directory loses its manifest first, so an interrupted
    delete leaves a directory that reads as incomplete, not as valid; a directory that holds
    anything but checkpoint files (``is_checkpoint_file``; links count) is left whole. With
    ``root`` (the run's checkpoint directory), a path not inside it is refused as well.
    """
    if storage.is_url(path):
        url = str(path).rstrip("/")
        if root is not None and storage.is_url(root) and not url.startswith(str(root).rstrip("/") + "/"):
            log.warning("not deleting %s: it is not under the checkpoint location %s", url, root)
            return False
        if foreign := [e for e in storage.url_files(url) if not is_checkpoint_file(e)]:
            log.warning("not deleting checkpoint %s: it holds objects that are not checkpoint files (%s); delete "
                        "them yourself if that is intended", url, ", ".join(foreign[:5]))
            return False
        storage.url_remove(url, first=MANIFEST_NAME)
        return True
    path = Path(path)
    if root is not None and not storage.is_url(root) and not _inside(path, Path(root)):
        log.warning("not deleting %s: it is not inside the checkpoint directory %s", path, root)
        return False
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        if foreign := foreign_entries(path):
            log.warning("not deleting checkpoint directory %s: it holds files that are not checkpoint files "
                        "(%s); delete it yourself if that is intended", path, ", ".join(foreign[:5]))
            return False
        (path / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(path)
    return True


def aside_path(path: Path) -> Path:
    """Where a complete checkpoint waits while a save overwrites it in place (discovery sees it)."""
    return path.with_name(path.name + ".replaced")


def _prepare(path: Path | str) -> tuple[str | None, str | None, Path | None]:
    """Rank 0: ``_prepare_directory`` as (refusal, OS error, the complete checkpoint moved aside)."""
    try:
        refusal, aside = _prepare_directory(path)
        return refusal, None, aside
    except OSError as err:
        return None, f"rank 0 preparing the directory: {err}", None


def _prepare_directory(path: Path | str) -> tuple[str | None, Path | None]:
    """Make ``path`` an empty directory. Returns an error message instead when that would destroy
    data, and the directory a complete checkpoint at ``path`` was moved to (None if none)."""
    if storage.is_url(path):  # a key prefix: nothing to create, only old objects to drop
        entries = storage.url_files(path)
        if entries and not any(e.split("/")[0] in _OURS or e.endswith(".distcp") for e in entries):
            return (f"{path!r} exists and is not a checkpoint directory (it holds {entries[:3]}); "
                    f"save the checkpoint to a new path, e.g. {storage.url_join(path, 'step=N.ckpt')!r}"), None
        if foreign := [e for e in entries if not is_checkpoint_file(e)]:
            return (f"{path!r} holds objects that are not checkpoint files ({foreign[:3]}), so saving over it "
                    f"would delete them; move them away, or save the checkpoint to a new path"), None
        if entries:  # object stores cannot rename: the old objects go before the new ones are written
            remove_checkpoint_path(path)
        return None, None
    # Overwriting (Lightning's save_last=True reuses "last.ckpt"): never write through a link
    # into the checkpoint it points at, and drop stale shards of an earlier save, which may
    # come from a different world size. A directory that is not a checkpoint is never emptied;
    # a complete one is moved aside until the new save is complete.
    aside = aside_path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        entries = [p.name for p in path.iterdir()]
        if entries and not any(name in _OURS or name.endswith(".distcp") for name in entries):
            return (f"{str(path)!r} exists and is not a checkpoint directory (it holds {entries[:3]}); "
                    f"save the checkpoint to a new path, e.g. {str(path / 'step=N.ckpt')!r}"), None
        if foreign := foreign_entries(path):  # never empty a directory that holds anything else
            return (f"{str(path)!r} holds files that are not checkpoint files ({foreign[:3]}), so saving over it "
                    f"would delete them; move them away, or save the checkpoint to a new path"), None
        if (path / MANIFEST_NAME).is_file():
            remove_checkpoint_path(aside)
            os.replace(path, aside)
        else:
            remove_checkpoint_path(path)  # incomplete; an aside copy left by a crash stays the complete one
    path.mkdir(parents=True)
    return None, (aside if (aside / MANIFEST_NAME).is_file() else None)


@dataclass
class _InFlight:
    path: Path | str
    future: Future
    aside: Path | None = None


@dataclass
class SaveTiming:
    """How long one save took on this rank (``CheckpointWriter.timings``)."""

    path: str
    blocking_s: float
    """From ``save`` being called to its return: the time training stood still."""
    total_s: float | None = None
    """From ``save`` being called to the manifest written (async: in the background); None until then."""


@dataclass
class CheckpointWriter:
    """Saves checkpoint directories; one per strategy (or per training script).

    ``save`` is collective. With ``async_save`` it returns once the state is staged in CPU
    memory; the manifest follows when the write completes. ``wait`` blocks until then (and
    raises if the write failed); call it before exiting (the strategy's teardown does).
    """

    async_save: bool = False
    """Write with ``dcp.async_save`` from a background thread instead of blocking."""
    group: dist.ProcessGroup | None = None
    """Group for the checkpoint collectives; on first use the process's checkpoint group."""
    _group_ready: bool = field(default=False, repr=False)
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)
    _in_flight: _InFlight | None = field(default=None, repr=False)
    _deferred_removals: list[Path] = field(default_factory=list, repr=False)
    _hold_removals: bool = field(default=False, repr=False)
    _stager: Any = field(default=None, repr=False)
    timings: list[SaveTiming] = field(default_factory=list, repr=False)
    """Every save's blocking and total time on this rank, oldest first (the cost in the
    Young/Daly checkpoint interval, ``checkpoint.cadence``)."""

    def comm(self) -> Comm:
        if not self._group_ready:
            self.group = self.group or new_checkpoint_group()
            self._group_ready = True
        return Comm(self.group)

    @property
    def in_flight(self) -> Path | None:
        """The directory of the save still being written, if any."""
        return self._in_flight.path if self._in_flight else None

    def save(self, path: str | os.PathLike, state: dict[str, Any], meta: dict[str, Any] | None = None,
             *, global_step: int | None = None, epoch: int | None = None,
             extra: dict[str, Any] | None = None, rng_state: dict[str, Any] | None = None) -> None:
        """Write ``state`` (DCP: tensors and DTensors, sharded) and ``meta`` (rank 0, torch.save).
        ``rng_state``: the generator states to store (``rng.capture_rng_state`` form); default now."""
        rng_state = rng_state or rng.capture_rng_state()  # first: nothing below may shift the streams first
        start = time.perf_counter()
        # One save in flight at most, and it must be finished before this thread issues any
        # collective: its background write and finalisation run collectives on the same group,
        # and two threads calling collectives on one group may pair them differently per rank.
        self.wait()
        comm = self.comm()
        path = storage.location(comm.broadcast(str(path)))  # rank 0's name everywhere (names can hold times)
        # also the barrier: nobody writes before the directory is ready
        refusal, error, aside = comm.broadcast(_prepare(path) if comm.rank == 0 else None)
        if refusal:
            raise ValueError(refusal)
        if error:
            raise CheckpointSaveError(path, error)
        try:
            self._write_local_files(comm, path, meta, rng_state)
            info = dict(world_size=comm.world_size, global_step=global_step, epoch=epoch,
                        extra={**(extra or {}), "async_save": self.async_save})
            timing = SaveTiming(str(path), 0.0)
            if not self.async_save:
                with _write_errors(path):
                    dcp.save(state, checkpoint_id=path, process_group=self.group, storage_writer=_writer_for(path))
                self._finalize(path, None, info)
            else:
                upload = dcp.async_save(state, checkpoint_id=path, process_group=self.group,
                                        async_stager=self._get_stager(), storage_writer=_writer_for(path))
        except CheckpointSaveError:
            self._failed(comm, path, aside)
            raise
        if not self.async_save:
            self._completed(comm, aside)
            timing.blocking_s = timing.total_s = time.perf_counter() - start
            self.timings.append(timing)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-finalize")
        future = self._executor.submit(self._finalize, path, upload, info, timing, start)
        future.add_done_callback(_log_failure)  # say so now; `wait` re-raises it later
        self._in_flight = _InFlight(path, future, aside)
        timing.blocking_s = time.perf_counter() - start
        self.timings.append(timing)

    @staticmethod
    def _write_local_files(comm: Comm, path: Path | str, meta: dict[str, Any] | None,
                           rng_state: dict[str, Any]) -> None:
        # meta.pt (rank 0) and each rank's RNG file: a rank whose write fails must not leave the
        # others waiting in DCP's collectives below, so every rank learns every outcome first.
        error = None
        try:
            if comm.rank == 0 and meta is not None:
                if storage.is_url(path):
                    with storage.url_open(storage.url_join(path, META_NAME), "wb") as f:
                        torch.save(meta, f)
                else:
                    torch.save(meta, path / META_NAME)
            rng.save_rank_rng(path, comm.rank, rng_state)
        except OSError as err:
            error = f"rank {comm.rank}: {err}"
        errors = [e for e in comm.all_gather(error) if e]
        if errors:
            raise CheckpointSaveError(path, "; ".join(errors))

    def _failed(self, comm: Comm, path: Path | str, aside: Path | None) -> None:
        """After a failed save (every rank): empty the partial directory, put back what it was
        replacing, and keep retention's deletions until a later save is complete."""
        self._hold_removals = True
        if comm.rank != 0:
            return
        try:
            remove_checkpoint_path(path)
            if aside is not None:
                os.replace(aside, path)
            elif not storage.is_url(path):
                Path(path).mkdir()  # incomplete (no manifest); a link to it keeps resolving
        except OSError as err:  # the disk may still be full; discovery skips the partial directory anyway
            log.warning("cleaning up after the failed save of %s: %s", path, err)

    def _completed(self, comm: Comm, aside: Path | None) -> None:
        removals, self._deferred_removals, self._hold_removals = self._deferred_removals, [], False
        if comm.rank == 0:
            for old in ([aside] if aside is not None else []) + removals:
                remove_checkpoint_path(old)

    def _get_stager(self):
        # On CPU, async_save's own stager (a plain copy, closed after each save) is right. With
        # CUDA, keep one stager so its pinned CPU buffers are reused across saves; that is safe
        # because `save` waits for the previous write before staging the next.
        if self._stager is None and torch.cuda.is_available():
            if not torch_compat.pinned_staging_stages_dtensors():
                if not _warned_unpinned:
                    _warned_unpinned.append(True)
                    log.warning("torch %s cannot stage DTensors in pinned buffers (DCP's DefaultStager, "
                                "fixed by torch %s): async checkpoints are staged by the storage writer "
                                "instead, into fresh CPU memory each save", torch.__version__,
                                ".".join(map(str, torch_compat.PINNED_STAGING_FROM)))
                return None
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=True))
        return self._stager

    def _finalize(self, path: Path, upload: Future | None, info: dict[str, Any],
                  timing: SaveTiming | None = None, start: float = 0.0) -> Manifest:
        if upload is not None:
            # DCP propagates a failed write to every rank through its own collectives, so all
            # ranks raise here together and none is left waiting below.
            with _write_errors(path):
                upload.result()
        comm = self.comm()
        files = comm.broadcast(list_files(path) if comm.rank == 0 else None)
        try:
            entries, error = hash_files(path, files[comm.rank::comm.world_size]), None
        except OSError as err:
            entries, error = {}, f"rank {comm.rank}: {err}"
        parts = comm.all_gather((entries, error))
        errors = [e for _, e in parts if e]
        manifest = Manifest(files=merge_entries(p for p, _ in parts), **info)
        if comm.rank == 0 and not errors:
            try:
                write_manifest(path, manifest)
            except OSError as err:
                errors.append(f"rank 0 writing {MANIFEST_NAME}: {err}")
        errors = comm.broadcast(errors)
        if errors:
            raise CheckpointSaveError(path, f"written but not completed: {'; '.join(errors)}")
        if timing is not None:
            timing.total_s = time.perf_counter() - start
        return manifest

    def wait(self) -> Manifest | None:
        """Block until the save in flight (if any) is complete; raise if it failed."""
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return None
        try:
            manifest = pending.future.result()
        except CheckpointSaveError:
            self._failed(self.comm(), pending.path, pending.aside)
            raise
        self._completed(self.comm(), pending.aside)
        return manifest

    def remove(self, path: str | os.PathLike) -> None:
        """Delete a checkpoint (rank 0 does the deleting). While a save is in flight, deletion waits
        until that save is complete, so the number of complete checkpoints never drops below the
        number that retention keeps (ModelCheckpoint deletes the old one right after starting the new)."""
        path = storage.location(path)
        if self._in_flight is not None:
            if _same(path, self._in_flight.path):
                self.wait()
            else:
                self._deferred_removals.append(path)
                return
        if self._hold_removals:  # the newest save failed: keep what it was meant to replace
            self._deferred_removals.append(path)
            return
        if self.comm().rank == 0:
            remove_checkpoint_path(path)

    def close(self) -> None:
        """Wait for the save in flight, then release the thread and staging buffers."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def _same(a: Path | str, b: Path | str) -> bool:
    if storage.is_url(a) or storage.is_url(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)


def _writer_for(path: Path | str):
    """DCP's fsspec writer for a URL; None (DCP's local FileSystemWriter) for a path."""
    if not storage.is_url(path):
        return None
    return torch_compat.fsspec_writer_class()(str(path))


def _reader_for(path: Path | str, trust_checkpoint: bool = False):
    """DCP's reader for ``path``: restricted unpickling (``safe_load``) unless ``trust_checkpoint``."""
    return reader_for(path, trust_checkpoint)


@contextmanager
def _load_errors():
    # A refusal of the restricted reader inside dcp.load reaches us wrapped in DCP's
    # CheckpointException (a BaseException, raised on every rank): give it back as itself.
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        cause = unwrap_checkpoint_exception(err)
        if cause is err:
            raise
        raise cause from err


@contextmanager
def _write_errors(path: Path):
    # DCP's CheckpointException derives from BaseException, which `except Exception` (Lightning's
    # and most user code) lets through; re-raise it as the RuntimeError it is.
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        raise CheckpointSaveError(path, f"writing failed: {_first_failures(err)}") from err


def _first_failures(err: BaseException) -> str:
    failures = getattr(err, "failures", None)  # {rank: exception} from DCP
    if not failures:
        return str(err)
    excs = {r: (e[0] if isinstance(e, tuple) else e) for r, e in failures.items()}  # (exception, stack) pairs
    return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(excs.items())[:4])


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("async checkpoint save failed: %s", future.exception())


# ---- reading --------------------------------------------------------------------------------


def verify_distributed(path: str | os.PathLike, comm: Comm) -> Manifest:
    """Verify a checkpoint with the hashing split across ranks; every rank raises the same error."""
    path = storage.location(path)
    try:
        manifest, failure = (read_manifest(path), None) if comm.rank == 0 else (None, None)
    except ValueError as err:  # CheckpointVerificationError: re-raised identically on every rank
        manifest, failure = None, (type(err), str(err.path), err.reason)
    except OSError as err:  # unreadable: every rank must learn it, or they wait below for rank 0
        manifest, failure = None, (CheckpointVerificationError, f"{str(path).rstrip('/')}/{MANIFEST_NAME}",
                                   f"could not be read ({type(err).__name__}: {err})")
    manifest, failure = comm.broadcast((manifest, failure))
    if failure is not None:
        cls, bad, reason = failure
        raise cls(bad, reason)
    files = sorted(manifest.files)
    problems = check_files(path, manifest, files[comm.rank::comm.world_size])
    raise_for_problems(path, [p for part in comm.all_gather(problems) for p in part])
    if comm.rank == 0:
        warn_unlisted(path, manifest)
    return manifest


def saved_keys(path: str | os.PathLike, full: bool = False, trust_checkpoint: bool = False) -> set[str]:
    """Top-level keys DCP holds in ``path`` ("state_dict", "optimizer_0", ...); ``full``: every
    flattened key ("optimizer_0.state.model.wte.weight.exp_avg", ...). Reads DCP's ``.metadata``
    with restricted unpickling unless ``trust_checkpoint`` (``safe_load``)."""
    metadata = _reader_for(path, trust_checkpoint).read_metadata()
    return set(metadata.state_dict_metadata) if full else {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def optimizer_state_options(flatten: bool = True):
    """How optimizer state is saved and loaded: flattened (``flatten_optimizer_state_dict``), every
    value keyed by its parameter's name, hyper-parameters too ("param_groups.<fqn>.lr"). The nested
    form keeps parameter groups as lists of names, which DCP stores once for all ranks: right
    only while every rank holds every parameter, wrong under pipeline parallel, where each stage
    has its own groups. Checkpoints written in the nested form (before this) still load."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flatten)


def load_meta(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    if storage.is_url(path):
        url = storage.url_join(str(path), META_NAME)
        if not storage.url_exists(url):
            return {}
        with storage.url_open(url) as f:
            import io

            return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=weights_only)
    meta_path = Path(path) / META_NAME
    if not meta_path.is_file():
        return {}
    try:
        return torch.load(meta_path, map_location="cpu", weights_only=weights_only)
    except Exception as err:  # torch raises UnpicklingError subclasses and plain RuntimeErrors here
        if not weights_only:
            raise
        raise ValueError(
            f"{str(meta_path)!r} holds objects torch.load(weights_only=True) refuses ({err}). If you "
            f"trust this checkpoint, pass --trust-checkpoint (trust_checkpoint=True; for a strategy: "
            f"strategy.trust_checkpoint = True) to unpickle it fully") from err


def load_sharded(path: str | os.PathLike, module: torch.nn.Module, optimizers: list[list[torch.optim.Optimizer]],
                 comm: Comm, strict: bool = True, trust_checkpoint: bool = False) -> None:
    """Load model and optimizer state from ``path`` into live (sharded) objects, resharding as
    needed: each rank reads exactly the pieces its current shards cover, whatever world size wrote them.

    ``optimizers``: one entry per saved optimizer slot; an entry is the list of torch optimizers
    that were saved together (a ``HybridOptimizer``'s parts).

    Nothing in the checkpoint is unpickled beyond plain data unless ``trust_checkpoint``
    (``safe_load``); every rank reads the same ``.metadata`` first, so a refusal is raised by
    every rank before any collective.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    keys = saved_keys(path, trust_checkpoint=trust_checkpoint)
    if MODEL_KEY not in keys:
        raise ValueError(f"checkpoint {str(path)!r} holds no model state (keys: {sorted(keys)}); "
                         f"pass a checkpoint saved by trainer.save_checkpoint under a lightning-disttrain strategy")
    model_state = {MODEL_KEY: get_model_state_dict(module)}
    # strict=False (LightningModule.strict_loading) lets keys missing from the checkpoint keep
    # their current values instead of failing the load.
    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    with _load_errors():
        dcp.load(model_state, checkpoint_id=path, process_group=comm.group, planner=planner,
                 storage_reader=_reader_for(path, trust_checkpoint))
    set_model_state_dict(module, model_state[MODEL_KEY], options=StateDictOptions(strict=strict))

    saved_optimizers = sorted(k for k in keys if k.startswith("optimizer_"))
    if optimizers and not saved_optimizers:
        raise ValueError(f"checkpoint {str(path)!r} holds model weights only (saved with save_weights_only=True?), "
                         f"so training cannot resume from it; resume from a full checkpoint, or start a new run "
                         f"from these weights: export_consolidated(...) then load_consolidated_into(...)")
    if optimizers and len(saved_optimizers) != len(optimizers):
        raise ValueError(f"checkpoint {str(path)!r} holds {len(saved_optimizers)} optimizer state(s), "
                         f"this run configures {len(optimizers)}; return the same optimizers from "
                         f"configure_optimizers as the run that saved it")
    every_key = saved_keys(path, full=True, trust_checkpoint=trust_checkpoint) if optimizers else set()
    for index, parts in enumerate(optimizers):
        key = optimizer_key(index)
        options = optimizer_state_options(flatten=f"{key}.param_groups.0.params" not in every_key)
        optim_state = {key: get_optimizer_state_dict(module, parts, options=options)}
        try:
            with _load_errors():
                dcp.load(optim_state, checkpoint_id=path, process_group=comm.group,
                         storage_reader=_reader_for(path, trust_checkpoint))
        except BaseException as err:  # DCP's CheckpointException is one (raised on every rank)
            if "Missing key in checkpoint state_dict" not in str(err):
                raise
            from lightning_disttrain.optim import OPTIMIZER_CHANGED

            raise ValueError(f"checkpoint {str(path)!r}: this run's optimizer state has entries the checkpoint "
                             f"lacks ({err}): {OPTIMIZER_CHANGED}") from err
        set_optimizer_state_dict(module, parts, optim_state_dict=optim_state[key], options=options)


def unwrap_optimizer(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind one Lightning optimizer slot.

    Unwraps ``LightningOptimizer`` and splits a ``HybridOptimizer`` (anything with an
    ``.optimizers`` list) into its parts, which DCP's state-dict helpers take as a list.
    """
    if isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):  # LightningOptimizer
        optimizer = optimizer.optimizer
    parts = getattr(optimizer, "optimizers", None)
    if isinstance(parts, (list, tuple)) and parts:
        return list(parts)
    return [optimizer]
