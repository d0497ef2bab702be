"""Consolidated single-file exports: a DCP checkpoint written out for inference and sharing, and
loaded back (``gpt_from_exported``, a plain model, or the initial weights of a new sharded run).

Exporting runs in one process without a process group: DCP's single-process read assembles each
tensor from all shards, whatever the world size that wrote them.

The file (format version 1) is one ``torch.save`` dict, readable with ``weights_only=True``::

    format            "lightning-disttrain/consolidated"
    format_version    1; readers refuse a higher number (written by a newer lightning-disttrain)
    contents          "model" (weights only) or "full" (see below)
    state_dict        {name: tensor}
    model_config      the model's config as plain data, or None: for ``GPTModule`` the
                      ``GPTConfig`` fields (its ``hyper_parameters["config"]``), which
                      ``gpt_from_exported`` builds the model from
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

import os
import pickle
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain.checkpoint.dcp_io import META_NAME, MODEL_KEY, load_meta
from lightning_disttrain.checkpoint.safe_load import UntrustedCheckpointError, reader_for, unwrap_checkpoint_exception
from lightning_disttrain.checkpoint.manifest import (
    CheckpointVerificationError,
    Manifest,
    read_manifest,
    verify_checkpoint,
)
from lightning_disttrain.models.gpt import GPT, GPTConfig

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

    state: dict[str, Any] = {}
    # The metadata on its own first: inside DCP a refusal is logged, retried as rank-local
    # metadata and folded into another error's text.
    reader_for(ckpt_dir, trust_checkpoint).read_metadata()
    try:
        torch_compat.load_state_dict_no_dist(state, reader_for(ckpt_dir, trust_checkpoint),
                                             torch_compat.empty_state_dict_load_planner(keys=keys))
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
                      f"does not unpickle them; load the export with gpt_from_exported(file, config=...)",
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


def gpt_from_exported(path: str | os.PathLike, *, config: GPTConfig | None = None,
                      weights_only: bool = True) -> GPT:
    """The GPT in the file ``path`` written by ``lightning-disttrain export`` /
    ``export_consolidated``, built from the config stored with its
    weights, ready for inference.

    The model comes back in eval mode (dropout off; call ``.train()`` to fine-tune it), in the
    dtype the weights were exported in, with ``trim_logits`` set: ``model(idx)`` gives logits
    over the ``vocab_size`` real tokens, without the padding columns. ``config`` is needed only
    for files that carry none (exported before the export format had a version, or from a
    LightningModule without a ``config`` hyper-parameter); when given it overrides the stored one.
    ``weights_only=False`` unpickles arbitrary objects (a ``--full`` export's Lightning state):
    trusted files only.

    (Here, not a ``GPT`` classmethod: ``models/`` sits below ``checkpoint/`` and does not import it.)
    """
    exported = read_exported(path, prefix=DEFAULT_PREFIX, weights_only=weights_only)
    if config is None:
        if exported.model_config is None:
            raise ValueError(
                f"{str(path)!r} carries no model config (exported before the format had a version, or "
                f"from a LightningModule without a `config` hyper-parameter); pass it: "
                f"gpt_from_exported(path, config=GPTConfig.from_name(...)), or re-export the checkpoint")
        try:
            config = GPTConfig(**exported.model_config)
        except TypeError as err:
            raise ValueError(f"the model config stored in {str(path)!r} is not a GPTConfig ({err}); pass "
                             f"config=GPTConfig(...), or build that LightningModule's own model") from err
    model = GPT(config)
    dtypes = {t.dtype for t in exported.state_dict.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        model.to(dtypes.pop())
    model.load_state_dict(exported.state_dict)
    model.trim_logits = True
    return model.eval()


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
