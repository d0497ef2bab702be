"""DCPCheckpointMixin: Lightning's Strategy checkpoint methods on top of DCP directories.

Mixed into the lightning-disttrain strategies first, ``class NDParallelStrategy(DCPCheckpointMixin,
ParallelStrategy)``, so its methods take precedence and reach the strategy through ``super()``.
It uses only what a Lightning ``ParallelStrategy`` has (``lightning_module``, ``optimizers``,
``global_rank``, ``world_size``) plus an optional ``async_save`` flag and ``parallel_dims``.

How Lightning drives it:

- save: ``trainer.save_checkpoint`` → ``dump_checkpoint`` (calls ``lightning_module_state_dict``
  and ``optimizer_state`` here: sharded DTensor state, no gathering) → ``save_checkpoint``, which
  writes one directory (layout in ``lightning_disttrain.checkpoint.dcp_io``) on every rank.
- restore: ``restore_checkpoint_after_setup`` is True, so ``load_checkpoint`` runs after the model
  is sharded and the optimizers exist; it verifies the manifest, loads weights and optimizer state
  in place (DCP reshards to the current world size) and returns the Lightning state, which
  Lightning then restores itself (loops, schedulers, callbacks, the data module's position).
  ``lightning_restore_optimizer`` is False: the optimizer is already loaded by then.
- RNG: each rank's generators are restored just before the first training batch after resume
  (``on_train_batch_start``), so nothing between loading and training (sanity validation,
  building the data loaders) can shift the streams. Different world sizes: see ``checkpoint.rng``.
  A checkpoint saved during ``fit`` stores the state at the save, and the next training batch of
  the running process starts from that same state: whatever drew random numbers
  between the save and that batch (the validation that often follows a save: its data loader
  draws a seed; a callback) cannot make the run differ from the same run resumed from that
  checkpoint. (A data set that draws from torch's global generator in the main process, as
  ``num_workers=0`` augmentation would, is not reproduced on resume in any case; right after a
  save its draws for the batch after next repeat the next step's.)
- ``ckpt_path="last"``: Lightning picks ModelCheckpoint's ``last.ckpt``; when that name reaches
  ``load_checkpoint`` it is replaced by the newest checkpoint in its directory that verifies,
  with a warning for each newer one skipped (an interrupted or corrupted save); an info line and
  Lightning's own "Restored all states from ..." name the directory really loaded.
- async: with ``async_save`` the save returns once the state is copied to CPU memory; the manifest
  is written when the background write is done. ``wait_for_checkpoint`` blocks for it; the next
  save and ``teardown`` call it, so a finished ``fit`` never leaves a checkpoint half written.
- a failed save (disk full, ``CheckpointSaveError`` on every rank together, the previous
  checkpoints untouched): ``on_save_error="stop"`` (default) raises it, which ends ``fit`` on every
  rank; ``"warn"`` logs it and training goes on, the next save trying again.
- ``ckpt_path="auto"`` is resolved by ``PreemptionCheckpoint``; reaching a strategy unresolved it
  is an error that says so.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain.checkpoint import rng, storage
from lightning_disttrain.checkpoint.dcp_io import (
    MODEL_KEY,
    CheckpointSaveError,
    CheckpointWriter,
    Comm,
    load_meta,
    load_sharded,
    optimizer_key,
    optimizer_state_options,
    unwrap_optimizer,
    verify_distributed,
)
from lightning_disttrain.checkpoint.discovery import find_latest_checkpoint, list_checkpoints

_DEFAULT_LAST = re.compile(r"^last(-v\d+)?\.ckpt$")


def _written_by_lightning(path: Path) -> bool:
    """A sharded checkpoint of Lightning's ModelParallelStrategy: DCP's ``.metadata`` and ``meta.pt``
    (the same names and keys as ours), but no manifest and no per-rank RNG files (one of ours that
    was cut short has ``rng/``). It loads without verification, with a warning that says so."""
    from lightning_disttrain.checkpoint.manifest import MANIFEST_NAME

    found = (path.is_dir() and (path / ".metadata").is_file() and (path / "meta.pt").is_file()
             and not (path / MANIFEST_NAME).exists() and not (path / rng.RNG_DIR).exists())
    if found:
        rank_zero_warn(f"{str(path)!r} has no manifest.json: a checkpoint of Lightning's ModelParallelStrategy "
                       f"(DCP shards + meta.pt); loading it without verification (a save that was cut short "
                       f"cannot be told from a complete one), RNG streams start fresh")
    return found


class DCPCheckpointMixin:
    """Sharded, verified, resumable checkpoints for a Lightning ``ParallelStrategy``."""

    saves_checkpoint_directories: bool = True
    """Marker read by code below the strategies (``callbacks.preemption``), which cannot import this
    class: a strategy with it set writes each checkpoint as a DCP directory, not a single file."""
    checkpoint_verify: bool = True
    """Check every file against the manifest before loading (a corrupted shard fails loudly)."""
    trust_checkpoint: bool = False
    """Load checkpoints with plain unpickling: DCP's ``.metadata`` and ``meta.pt`` may then hold
    any object, and unpickling them can run code from the checkpoint. Off (default): ``.metadata``
    resolves only the types DCP's metadata is made of, ``meta.pt`` is read with
    ``torch.load(weights_only=True)``, and anything else is refused (``checkpoint.safe_load``).
    Set it only for checkpoints whose writer you trust."""
    checkpoint_weights_only: bool = True
    """``torch.load(weights_only=...)`` for ``meta.pt`` when Lightning does not say and
    ``trust_checkpoint`` is off; False unpickles arbitrary objects saved in hyper-parameters or
    callback state (trusted files only). It does not lift the restriction on DCP's ``.metadata``:
    only ``trust_checkpoint`` does."""
    on_save_error: str = "stop"
    """A checkpoint that cannot be written (disk full): ``"stop"`` raises on every rank, ``"warn"``
    logs and trains on (the next save tries again). Either way the previous checkpoints stay valid."""

    # ---- what Lightning asks the strategy -----------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded state can only be loaded into a model that is already sharded, with optimizers.
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint has loaded it, resharded

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state dict (DTensors: each rank holds its shards; nothing gathered)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """One optimizer's sharded state, flattened and keyed by parameter name (so it reshards on
        load, also between pipeline layouts: ``dcp_io.optimizer_state_options``)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.lightning_module, unwrap_optimizer(optimizer),
                                        options=optimizer_state_options())

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` (from ``dump_checkpoint``) as a DCP directory at ``filepath``."""
        if storage_options is not None:
            raise ValueError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported: "
                             f"checkpoints are DCP directories written by every rank; drop storage_options")
        writer = self._checkpoint_writer()
        writer.async_save = bool(getattr(self, "async_save", False))
        # No collective here: the save in flight may still be running its own on the checkpoint
        # group from a background thread. `writer.save` waits for it first, then agrees on the path.
        self.wait_for_checkpoint()  # a failed save in flight is reported (or raised) as its own
        path = storage.location(filepath)  # a Path, or an fsspec URL kept as it is
        state = {MODEL_KEY: checkpoint["state_dict"]}
        for index, optim_state in enumerate(checkpoint.get("optimizer_states", [])):
            state[optimizer_key(index)] = optim_state
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        # What the next training batch starts from: the state an earlier save at this step boundary
        # stored, if any (a save during the validation that follows, e.g. a preemption, comes after
        # the validation loader has drawn its seed), else the streams as they are now.
        rng_state = getattr(self, "_dcp_rng_of_save", None) or rng.capture_rng_state()
        try:
            writer.save(path, state, meta, global_step=checkpoint.get("global_step"),
                        epoch=checkpoint.get("epoch"), extra=self._checkpoint_extra(), rng_state=rng_state)
        except CheckpointSaveError as err:
            self._save_failed(err)
        self._dcp_rng_of_save = rng_state

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Verify, then load weights and optimizer state in place; return the Lightning state."""
        if str(checkpoint_path) == "auto":
            raise ValueError("ckpt_path='auto' is resolved by the PreemptionCheckpoint callback: add "
                             "lightning_disttrain.callbacks.PreemptionCheckpoint to the Trainer's callbacks, or "
                             "pass ckpt_path='last' (ModelCheckpoint's last.ckpt) or a checkpoint path")
        writer = self._checkpoint_writer()
        self.wait_for_checkpoint()  # never read a directory this process is still writing
        comm = writer.comm()
        asked = storage.location(comm.broadcast(str(checkpoint_path)))
        path = self._resolve_checkpoint(asked, comm)
        trust = bool(self.trust_checkpoint)
        if weights_only is None:
            weights_only = self.checkpoint_weights_only and not trust
        module = self.lightning_module
        optimizers = [unwrap_optimizer(o) for o in self.optimizers] if self._fitting() else []
        # DCP's .metadata first (every rank reads it, so a refusal is every rank's), then meta.pt.
        load_sharded(path, module, optimizers, comm, strict=getattr(module, "strict_loading", True),
                     trust_checkpoint=trust)
        meta = load_meta(path, weights_only)
        self._stage_rng_restore(path, comm)
        if path != asked:
            self._name_loaded_checkpoint(path)
        return meta

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Nothing left to do: load_checkpoint loaded the weights, sharded, before returning.
        pass

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # as above (and not called: lightning_restore_optimizer is False)

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        """Delete a checkpoint directory (or a link to one, never its target); called by ModelCheckpoint
        for retention (``save_top_k``). During an async save it waits for that save to complete."""
        self._checkpoint_writer().remove(filepath)

    def wait_for_checkpoint(self) -> None:
        """Block until the async save in flight (if any) has its manifest; raise if it failed."""
        writer = getattr(self, "_dcp_writer", None)
        if writer is not None:
            try:
                writer.wait()
            except CheckpointSaveError as err:
                self._save_failed(err)

    def _save_failed(self, err: CheckpointSaveError) -> None:
        if self.on_save_error != "warn":
            raise err
        rank_zero_warn(f"{err}. Training goes on (on_save_error='warn'); the next save tries again.")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pending = getattr(self, "_dcp_pending_rng", None)
        saved = getattr(self, "_dcp_rng_of_save", None)
        self._dcp_pending_rng = self._dcp_rng_of_save = None
        if pending is not None:  # resumed: this rank's saved streams
            rng.apply_rank_rng(*pending)
        elif saved is not None:  # the first batch after a save: the streams that save stored
            rng.restore_rng_state(saved)
        super().on_train_batch_start(batch, batch_idx)

    def on_train_start(self) -> None:
        # Lightning has printed its restore message by now: give it back the path it asked for.
        # ModelCheckpoint never deletes trainer.ckpt_path, and the directory a "last" resume
        # resolved to must still leave through retention, not stay behind untracked forever.
        self._dcp_rng_of_save = None  # from a save before this fit: not this fit's stream
        renamed, self._dcp_renamed_ckpt_path = getattr(self, "_dcp_renamed_ckpt_path", None), None
        trainer = compat.trainer_of(self.lightning_module)
        if renamed is not None and trainer is not None and compat.resume_path(trainer) == renamed[1]:
            compat.rename_resume_path(trainer, renamed[0])
        super().on_train_start()

    def teardown(self) -> None:
        writer = getattr(self, "_dcp_writer", None)
        try:
            if writer is not None:
                self.wait_for_checkpoint()  # the in-flight save gets its manifest (or is reported)
                writer.close()
        finally:
            super().teardown()

    # ---- internals ----------------------------------------------------------------------------

    def _checkpoint_writer(self) -> CheckpointWriter:
        writer = getattr(self, "_dcp_writer", None)
        if writer is None:
            writer = self._dcp_writer = CheckpointWriter(async_save=bool(getattr(self, "async_save", False)))
        return writer

    def _checkpoint_extra(self) -> dict[str, Any]:
        import lightning

        extra: dict[str, Any] = {"torch": torch.__version__, "lightning": lightning.__version__,
                                 "strategy": type(self).__name__}
        dims = getattr(self, "parallel_dims", None)
        if dims is not None and dataclasses.is_dataclass(dims):
            extra["parallel_dims"] = {f.name: getattr(dims, f.name) for f in dataclasses.fields(dims)
                                      if isinstance(getattr(dims, f.name), (int, bool, str, type(None)))}
        return extra

    def _fitting(self) -> bool:
        from lightning.pytorch.trainer.states import TrainerFn

        trainer = compat.trainer_of(self.lightning_module)
        return bool(self.optimizers) and (trainer is None or trainer.state.fn == TrainerFn.FITTING)

    def _is_last_alias(self, path: Path) -> bool:
        """Whether ``path`` is a ModelCheckpoint "last" name (what ``ckpt_path="last"`` resolves to)."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        trainer = compat.trainer_of(self.lightning_module)
        for cb in getattr(trainer, "checkpoint_callbacks", None) or []:
            if not isinstance(cb, ModelCheckpoint) or not cb.dirpath:
                continue
            pattern = rf"^{re.escape(cb.CHECKPOINT_NAME_LAST)}(-v\d+)?{re.escape(cb.FILE_EXTENSION)}$"
            if Path(cb.dirpath).resolve() == path.parent.resolve() and re.match(pattern, path.name):
                return True
        return bool(_DEFAULT_LAST.match(path.name))

    def _resolve_checkpoint(self, path: Path, comm: Comm) -> Path:
        def verify(p: Path) -> None:
            verify_distributed(p, comm)

        if storage.is_url(path):  # an explicit URL (object stores have no "last" links)
            if self.checkpoint_verify:
                verify(path)
            return path
        if self._is_last_alias(path):
            # Lightning chose "last.ckpt"; it may point at a save that never completed. Take the
            # newest checkpoint beside it that verifies (the same list on every rank).
            candidates = comm.broadcast(list_checkpoints(path.parent) if comm.rank == 0 else None)
            found = find_latest_checkpoint(path.parent, verify=verify, candidates=candidates,
                                           report=comm.rank == 0)
            if found is None:
                why = (f"{len(candidates)} checkpoint(s) there, none verified: see the warnings above for why each "
                       f"was skipped" if candidates else "the directory holds no checkpoint at all")
                raise ValueError(f"ckpt_path={str(path)!r}: no complete checkpoint in {str(path.parent)!r} "
                                 f"({why}); pass ckpt_path=None to start from scratch, or the path of a "
                                 f"checkpoint saved elsewhere")
            chosen = next(c for c in candidates if c.resolved == found)
            verb = "Resuming from" if self._fitting() else "Loading"  # validate/test/predict resume nothing
            rank_zero_info(f"{verb} {chosen.describe()}, the newest complete checkpoint beside {str(path)!r}")
            return found
        if path.is_file():
            raise ValueError(f"{str(path)!r} is a file, but {type(self).__name__} saves and loads checkpoint "
                             f"directories; pass a directory written by trainer.save_checkpoint, or, to start "
                             f"from consolidated weights, call lightning_disttrain.checkpoint."
                             f"load_consolidated_into(module.model, file) in on_fit_start")
        if self.checkpoint_verify and not _written_by_lightning(path):
            verify(path)
        return path

    def _name_loaded_checkpoint(self, path: Path) -> None:
        # Lightning's "Restored all states from the checkpoint at ..." prints the connector's
        # _ckpt_path, the name it asked for ("last.ckpt"); make it name the directory really loaded.
        trainer = compat.trainer_of(self.lightning_module)
        if trainer is None or not compat.resume_path(trainer):
            return
        self._dcp_renamed_ckpt_path = (compat.resume_path(trainer), str(path))
        compat.rename_resume_path(trainer, str(path))

    def _stage_rng_restore(self, path: Path, comm: Comm) -> None:
        saved = rng.count_saved_ranks(path)
        if saved and saved != comm.world_size:
            rank_zero_warn(
                f"checkpoint {str(path)!r} was saved on {saved} ranks and resumes on {comm.world_size}: ranks "
                f"below {min(saved, comm.world_size)} restore their saved RNG streams"
                + (f", ranks {saved}..{comm.world_size - 1} get seeds derived from them" if comm.world_size > saved
                   else f", the streams of ranks {comm.world_size}..{saved - 1} are dropped")
                + "; randomness (dropout) will not match a run that kept its world size")
        self._dcp_pending_rng = rng.load_rank_rng(path, comm.rank, saved)
