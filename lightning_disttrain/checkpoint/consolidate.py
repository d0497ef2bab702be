"""Consolidated single-file exports: a DCP checkpoint written out for inference and sharing, and
loaded back (``GPT.from_exported``, a plain model, or the initial weights of a new sharded run).

Exporting runs in one process without a process group: DCP's single-process read assembles each
tensor from all shards, whatever the world size that wrote them.

The file (format version 1) is one ``torch.save`` dict, readable with ``weights_only=True``::

    format            "lightning-disttrain/consolidated"
    format_version    1; readers refuse a higher number (written by a newer lightning-disttrain)
    contents          "model" (weights only) or "full" (see below)
    state_dict        {name: tensor}
    model_config      the model's config as plain data, or None: for ``GPTModule`` the
                      ``GPTConfig`` fields (its ``hyper_parameters["config"]``), which
                      ``GPT.from_exported`` builds the model from
    hyper_parameters  the LightningModule's hyper-parameters, or None
    source            {"checkpoint": the real directory's name (no absolute path: the file is
                      meant for sharing), "global_step", "completed_unix"}

- ``contents="model"`` (default): ``state_dict`` is the model's, with the LightningModule attribute
  prefix (``model.``) stripped, so a plain ``GPT(config).load_state_dict(...)`` takes it.
- ``contents="full"``: a Lightning-style single-file checkpoint with the keys above added:
  ``state_dict`` (LightningModule names), ``optimizer_states`` (DCP's full optimizer state dicts,
  flattened and keyed by parameter name, "state.<fqn>.exp_avg", "param_groups.<fqn>.lr": load them
  with ``set_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=True,
  flatten_optimizer_state_dict=True))``; checkpoints saved before the flattened form give the
  nested one, loaded without that flag) and the Lightning state (loops, schedulers,
  callbacks, hyper-parameters as saved, data position). Reading it needs ``weights_only=False``
  when the Lightning state holds objects.

Files exported before format version 1 (a plain ``{name: tensor}``, or the full shape without the
format keys) still load everywhere. A different layout (e.g. Hugging Face) gets its own
``format`` string; an incompatible change to this one bumps ``format_version``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_disttrain.checkpoint.dcp_io import META_NAME, MODEL_KEY, load_meta
from lightning_disttrain.checkpoint.discovery import (
    LAST_NAME,
    describe_checkpoint,
    find_latest_checkpoint,
    gate_failure,
    list_checkpoints,
)
from lightning_disttrain.checkpoint.safe_load import UntrustedCheckpointError, reader_for, unwrap_checkpoint_exception
from lightning_disttrain.checkpoint.manifest import (
    CheckpointVerificationError,
    Manifest,
    read_manifest,
    verify_checkpoint,
)

DEFAULT_PREFIX = "model."
EXPORT_FORMAT = "lightning-disttrain/consolidated"
EXPORT_FORMAT_VERSION = 1
HPARAMS_KEY = "hyper_parameters"  # Lightning's LightningModule.CHECKPOINT_HYPER_PARAMS_KEY


def _read_dcp(ckpt_dir: Path, keys: set[str] | None, trust_checkpoint: bool = False) -> dict[str, Any]:
    # DCP's own single-process reader (what dcp_to_torch_save uses): rebuilds full tensors from
    # the metadata without a model or a process group. `keys` picks top-level entries, so a
    # model-only export never reads the optimizer's shards. The reader unpickles nothing but
    # plain data unless trusted (safe_load).
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    # The metadata on its own first: inside DCP a refusal is logged, retried as rank-local
    # metadata and folded into another error's text.
    reader_for(ckpt_dir, trust_checkpoint).read_metadata()
    try:
        _load_state_dict(state, storage_reader=reader_for(ckpt_dir, trust_checkpoint),
                         planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    except CheckpointException as err:
        cause = unwrap_checkpoint_exception(err)
        if cause is err:
            raise
        raise cause from err
    return state


def strip_prefix(state_dict: Mapping[str, Any], prefix: str | None = DEFAULT_PREFIX) -> dict[str, Any]:
    """Drop ``prefix`` from every key, when every key has it (else return the keys unchanged)."""
    if prefix and state_dict and all(k.startswith(prefix) for k in state_dict):
        return {k[len(prefix):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def export_consolidated(ckpt_dir: str | os.PathLike, out_file: str | os.PathLike, *, model_only: bool = True,
                        prefix: str | None = DEFAULT_PREFIX, verify: bool = True,
                        dtype: torch.dtype | None = None, trust_checkpoint: bool = False) -> Path:
    """Write one ``torch.save`` file (format in the module docstring) from a checkpoint directory;
    returns its path.

    Args:
        ckpt_dir: a checkpoint directory (verified against its manifest unless ``verify=False``).
        out_file: where to write; parent directories are created.
        model_only: only the model's weights and config (``contents="model"``); else ``"full"``.
        prefix: stripped from the model's keys when all have it (``model_only`` only); None keeps them.
        dtype: cast floating-point weights (e.g. ``torch.bfloat16`` to halve a release file).
        trust_checkpoint: read the checkpoint with plain (unrestricted) unpickling: DCP's
            ``.metadata`` and, for a full export, ``meta.pt`` with ``weights_only=False``. Only for
            checkpoints whose writer you trust: unpickling can run code.
    """
    ckpt_dir, out_file = Path(ckpt_dir), Path(out_file)
    manifest = verify_checkpoint(ckpt_dir) if verify else _manifest_or_none(ckpt_dir)
    state = _read_dcp(ckpt_dir, {MODEL_KEY} if model_only else None, trust_checkpoint)
    if MODEL_KEY not in state:
        raise ValueError(f"{str(ckpt_dir)!r} holds no model state under {MODEL_KEY!r}; "
                         f"pass a directory written by trainer.save_checkpoint under a lightning-disttrain strategy")
    model = state[MODEL_KEY]
    if dtype is not None:
        model = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in model.items()}
    meta = _meta_for_full_export(ckpt_dir, trust_checkpoint) if not model_only else _meta_for_model_export(ckpt_dir)
    hparams = _shareable_hparams(meta.get(HPARAMS_KEY))
    header = {"format": EXPORT_FORMAT, "format_version": EXPORT_FORMAT_VERSION,
              "model_config": _model_config(hparams),
              "source": {"checkpoint": ckpt_dir.resolve().name,  # a name: the file is meant for sharing
                         "global_step": manifest.global_step if manifest else meta.get("global_step"),
                         "completed_unix": manifest.created_unix if manifest else None}}
    if model_only:
        out: dict[str, Any] = {**header, "contents": "model", MODEL_KEY: strip_prefix(model, prefix),
                               HPARAMS_KEY: dict(hparams) if isinstance(hparams, Mapping) else None}
    else:
        optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
        if hparams is not None:
            meta = {**meta, HPARAMS_KEY: hparams}
        out = {**meta, **header, "contents": "full", MODEL_KEY: model,
               "optimizer_states": [state[k] for k in optimizers]}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, out_file)
    return out_file


def _manifest_or_none(ckpt_dir: Path) -> Manifest | None:
    try:
        return read_manifest(ckpt_dir)
    except CheckpointVerificationError:
        return None


def _meta_for_full_export(ckpt_dir: Path, trust_checkpoint: bool) -> dict[str, Any]:
    # A full export keeps Lightning's state as saved; objects beyond plain data need trust.
    try:
        return load_meta(ckpt_dir, weights_only=not trust_checkpoint)
    except ValueError as err:
        if trust_checkpoint:
            raise
        raise UntrustedCheckpointError(ckpt_dir / META_NAME, "its Lightning state holds objects "
                                       "torch.load(weights_only=True) refuses") from err


def _meta_for_model_export(ckpt_dir: Path) -> dict[str, Any]:
    # weights_only: a model export must not run code from the checkpoint it reads, and what loads
    # this way loads the same way from the export. A GPTModule's hyper-parameters are plain data;
    # hyper-parameters that are not cost the export its config, not the weights.
    try:
        return load_meta(ckpt_dir, weights_only=True)
    except ValueError:
        warnings.warn(f"exporting {str(ckpt_dir)!r} without its hyper-parameters or model config: its "
                      f"{META_NAME} holds objects that torch.load(weights_only=True) refuses, and a model export "
                      f"does not unpickle them; load the export with GPT.from_exported(file, config=...)",
                      stacklevel=3)
        return {}


_LOCAL_PATH_HPARAMS = ("init_from",)


def _shareable_hparams(hparams: Any) -> Any:
    """Hyper-parameters with local paths (``init_from``) reduced to their names: an export is
    meant for sharing, and an absolute path says where the writer keeps their files."""
    if not isinstance(hparams, Mapping) or not any(isinstance(hparams.get(k), (str, os.PathLike))
                                                   for k in _LOCAL_PATH_HPARAMS):
        return hparams
    out = dict(hparams)
    for key in _LOCAL_PATH_HPARAMS:
        if isinstance(out.get(key), (str, os.PathLike)):
            out[key] = Path(str(out[key]).rstrip("/")).name
    return out


def _model_config(hparams: Any) -> dict[str, Any] | None:
    config = hparams.get("config") if isinstance(hparams, Mapping) else None
    return dict(config) if isinstance(config, Mapping) else None


@dataclass
class Exported:
    """An exported file as read back (either shape, any format version)."""

    state_dict: dict[str, torch.Tensor]
    model_config: dict[str, Any] | None
    """The config to build the model from (None: not recorded, e.g. a plain pre-format file)."""
    hyper_parameters: dict[str, Any] | None
    source: dict[str, Any] | None
    """Which checkpoint was exported: ``checkpoint`` (its directory's name; files exported before
    this recorded the absolute path), ``global_step``, ``completed_unix``."""
    format_version: int
    """0 for files written before the format had a version."""


def read_exported(file: str | os.PathLike, *, prefix: str | None = None, weights_only: bool = True) -> Exported:
    """Read an exported file: its model state dict (``prefix`` stripped as in ``strip_prefix``), and,
    from format version 1 on, the model config and which checkpoint it came from."""
    try:
        raw = torch.load(file, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if not weights_only:
            raise
        raise ValueError(f"{str(file)!r} holds objects torch.load(weights_only=True) refuses (a --full export "
                         f"keeps Lightning's state as saved); if you trust the file, pass weights_only=False") from err
    if not isinstance(raw, Mapping):
        raise ValueError(f"{str(file)!r} is not a state-dict file (it holds a {type(raw).__name__}); "
                         f"pass a file written by `lightning-disttrain export` or export_consolidated")
    fmt = raw.get("format")
    if isinstance(fmt, str):
        if fmt != EXPORT_FORMAT:
            raise ValueError(f"{str(file)!r} has format {fmt!r}, not {EXPORT_FORMAT!r}; load it with the "
                             f"reader for that format")
        version = raw.get("format_version")
        if not isinstance(version, int) or version > EXPORT_FORMAT_VERSION:
            raise ValueError(f"{str(file)!r} is {EXPORT_FORMAT} version {version!r}, newer than the "
                             f"{EXPORT_FORMAT_VERSION} this lightning-disttrain reads; upgrade lightning-disttrain")
        return Exported(strip_prefix(raw[MODEL_KEY], prefix), raw.get("model_config"), raw.get(HPARAMS_KEY),
                        raw.get("source"), version)
    if MODEL_KEY in raw and isinstance(raw[MODEL_KEY], Mapping):  # a full export from before version 1
        hparams = raw.get(HPARAMS_KEY)
        return Exported(strip_prefix(raw[MODEL_KEY], prefix), _model_config(hparams),
                        dict(hparams) if isinstance(hparams, Mapping) else None, None, 0)
    return Exported(strip_prefix(raw, prefix), None, None, None, 0)  # a plain {name: tensor} from before version 1


def load_consolidated(file: str | os.PathLike, *, prefix: str | None = None,
                      weights_only: bool = True) -> dict[str, torch.Tensor]:
    """The model state dict in an exported file (either shape, any format version), ready for
    ``module.load_state_dict``.

    ``prefix`` is stripped as in ``strip_prefix``; a full export keeps LightningModule names unless
    you pass ``prefix="model."``. ``read_exported`` also gives the config and the source checkpoint.
    """
    return read_exported(file, prefix=prefix, weights_only=weights_only).state_dict


def load_consolidated_into(module: torch.nn.Module, state_or_file: str | os.PathLike | Mapping[str, Any],
                           *, strict: bool = True) -> None:
    """Load a consolidated state dict into a (possibly FSDP2-sharded) module, e.g. as the initial
    weights of a new run. Collective when distributed: only rank 0 reads the file; DCP's
    ``set_model_state_dict`` broadcasts each tensor and keeps each rank's shard.

    The keys must be ``module``'s own names: for a LightningModule (``model.`` prefixed),
    export with ``prefix=None`` or load into ``lightning_module.model``.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    state: Mapping[str, Any] = {}
    if rank0:
        state = load_consolidated(state_or_file) if not isinstance(state_or_file, Mapping) else state_or_file
    if not distributed:
        module.load_state_dict(state, strict=strict)
        return
    set_model_state_dict(module, dict(state), options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=strict))


# ---- command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-disttrain export",
        description="Consolidate a lightning-disttrain checkpoint directory (DCP shards) into one "
                    "torch.save file, for inference or sharing, or (--format hf) into a Hugging Face "
                    "model directory. Runs in one process.")
    p.add_argument("ckpt_dir", help="checkpoint directory (or a directory of them with --latest); with "
                                    "--format hf also a file written by export")
    p.add_argument("out_file", help="output file, e.g. model.pt (with --format hf: a directory)")
    p.add_argument("--format", choices=("torch", "hf"), default="torch",
                   help="torch: one torch.save file (GPT.from_exported loads it); hf: config.json + "
                        "model.safetensors (+ GPT-2's tokenizer files for its 50,257-token vocabulary) that "
                        "transformers' from_pretrained loads, as GPT-2 or Llama (models/hf.py)")
    p.add_argument("--latest", action="store_true",
                   help="ckpt_dir is a directory of checkpoints: export the newest complete one")
    p.add_argument("--full", action="store_true",
                   help="also export optimizer and Lightning state (a single-file Lightning checkpoint)")
    p.add_argument("--keep-prefix", action="store_true",
                   help=f"keep the LightningModule prefix ({DEFAULT_PREFIX!r}) on the model's keys")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="cast floating-point weights")
    p.add_argument("--no-verify", action="store_true", help="skip checking the files against manifest.json")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle the checkpoint without restrictions (DCP's .metadata, and with --full meta.pt "
                        "with weights_only=False): unpickling can run code, so only for checkpoints whose "
                        "writer you trust. Without it anything beyond plain data is refused")
    p.add_argument("--allow-failed", action="store_true",
                   help="export a checkpoint the eval regression gate failed (its evals.json says so); without "
                        "it such a checkpoint is refused, and skipped by --latest")
    return p


def export_main(argv: Sequence[str] | None = None) -> Path:
    """``lightning-disttrain export CKPT_DIR OUT_FILE [--latest] [--full] [--format hf] ...``; returns
    the file (with ``--format hf``: the directory) written.

    Prints which checkpoint it exported (real directory, global step, completion time), so that a
    link (``last.ckpt``) or ``--latest`` never leaves a doubt about which run and step went out.
    """
    args = build_parser().parse_args(argv)
    given = Path(args.ckpt_dir)
    ckpt_dir, via = given, ""
    if args.latest:
        found = find_latest_checkpoint(given, include_failed=args.allow_failed)
        if found is None:
            raise SystemExit(f"no complete checkpoint in {str(given)!r}")
        ckpt_dir, via = found, f", the newest complete checkpoint in {str(given)!r}"
    else:
        if given.is_symlink():
            via = f", the target of {str(given)!r}"
        if LAST_NAME.match(given.name):
            _warn_if_not_newest(given)
        if given.is_dir() and (why := gate_failure(given)) and not args.allow_failed:
            raise SystemExit(f"error: {str(given)!r} was failed by the eval regression gate ({why}); "
                             f"pass --allow-failed to export it anyway")
    with warnings.catch_warnings():
        # DCP warns that it "assumes the intent" of a single-process load; that is the intent.
        warnings.filterwarnings("ignore", message=".*torch.distributed is.*uninitialized.*")
        if args.format == "hf":
            return _export_hf(args, ckpt_dir, via)
        try:
            out = export_consolidated(ckpt_dir, args.out_file, model_only=not args.full,
                                      prefix=None if args.keep_prefix else DEFAULT_PREFIX,
                                      verify=not args.no_verify,
                                      dtype=getattr(torch, args.dtype) if args.dtype else None,
                                      trust_checkpoint=args.trust_checkpoint)
        except UntrustedCheckpointError as err:
            raise SystemExit(f"error: {err}") from err
    size = out.stat().st_size / 2**20
    print(f"exported {describe_checkpoint(ckpt_dir)}{via} -> {out} "
          f"({size:.1f} MiB{', model only' if not args.full else ''})")
    return out


def _export_hf(args: argparse.Namespace, source: Path, via: str) -> Path:
    from lightning_disttrain.checkpoint.hf_export import export_hf

    if args.full or args.keep_prefix:
        raise SystemExit("--full and --keep-prefix apply to the torch format only; --format hf writes the model")
    try:
        out = export_hf(source, args.out_file, verify=not args.no_verify,
                        dtype=getattr(torch, args.dtype) if args.dtype else None,
                        trust_checkpoint=args.trust_checkpoint)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 2**20
    what = describe_checkpoint(source) if source.is_dir() else repr(str(source.resolve()))
    print(f"exported {what}{via} -> {out} (Hugging Face format, {size:.1f} MiB)")
    return out


def _warn_if_not_newest(path: Path) -> None:
    # A "last" name can be stale: save_last=True with Lightning's version counter leaves last.ckpt
    # from an earlier run beside a newer last-v1.ckpt.
    real, candidates = path.resolve(), list_checkpoints(path.parent)  # newest first
    this = next((c for c in candidates if c.resolved == real), None)
    newer = [c for c in candidates if this is not None and c.complete and c.timestamp > this.timestamp]
    if newer:
        warnings.warn(f"{str(path)!r} is not the newest checkpoint beside it: {describe_checkpoint(newer[0].resolved)} "
                      f"completed later. Exporting {str(path)!r} as asked; to export the newest, run "
                      f"`lightning-disttrain export {str(path.parent)!r} OUT --latest`", stacklevel=3)


if __name__ == "__main__":
    export_main()
