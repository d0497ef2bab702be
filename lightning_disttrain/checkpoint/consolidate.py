"""Consolidated single-file state dicts: export a DCP checkpoint for inference and sharing, and
load one back (into a plain model, or as the initial weights of a new sharded run).

Exporting runs in one process without a process group: DCP's single-process read assembles each
tensor from all shards, whatever the world size that wrote them.

Two export shapes:

- ``model_only=True`` (default): ``{name: tensor}`` of the model, with the LightningModule
  attribute prefix (``model.``) stripped, so a plain ``GPT(config).load_state_dict(...)`` takes it.
- ``model_only=False``: a Lightning-style single-file checkpoint: ``state_dict`` (LightningModule
  names), ``optimizer_states`` (as DCP's full optimizer state dicts, keyed by parameter name:
  load them with ``set_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=True))``)
  and the Lightning state (loops, schedulers, callbacks, hyper-parameters, data position).
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_disttrain.checkpoint.dcp_io import MODEL_KEY, load_meta
from lightning_disttrain.checkpoint.manifest import verify_checkpoint

DEFAULT_PREFIX = "model."


def _read_dcp(ckpt_dir: Path, keys: set[str] | None) -> dict[str, Any]:
    # DCP's own single-process reader (what dcp_to_torch_save uses): rebuilds full tensors from
    # the metadata without a model or a process group. `keys` picks top-level entries, so a
    # model-only export never reads the optimizer's shards.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(ckpt_dir),
                     planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    return state


def strip_prefix(state_dict: Mapping[str, Any], prefix: str | None = DEFAULT_PREFIX) -> dict[str, Any]:
    """Drop ``prefix`` from every key, when every key has it (else return the keys unchanged)."""
    if prefix and state_dict and all(k.startswith(prefix) for k in state_dict):
        return {k[len(prefix):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def export_consolidated(ckpt_dir: str | os.PathLike, out_file: str | os.PathLike, *, model_only: bool = True,
                        prefix: str | None = DEFAULT_PREFIX, verify: bool = True,
                        dtype: torch.dtype | None = None) -> Path:
    """Write one ``torch.save`` file from a checkpoint directory; returns its path.

    Args:
        ckpt_dir: a checkpoint directory (verified against its manifest unless ``verify=False``).
        out_file: where to write; parent directories are created.
        model_only: only the model's weights (see the module docstring for both shapes).
        prefix: stripped from the model's keys when all have it (``model_only`` only); None keeps them.
        dtype: cast floating-point weights (e.g. ``torch.bfloat16`` to halve a release file).
    """
    ckpt_dir, out_file = Path(ckpt_dir), Path(out_file)
    if verify:
        verify_checkpoint(ckpt_dir)
    state = _read_dcp(ckpt_dir, {MODEL_KEY} if model_only else None)
    if MODEL_KEY not in state:
        raise ValueError(f"{str(ckpt_dir)!r} holds no model state under {MODEL_KEY!r}; "
                         f"pass a directory written by trainer.save_checkpoint under a lightning-disttrain strategy")
    model = state[MODEL_KEY]
    if dtype is not None:
        model = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in model.items()}
    if model_only:
        out: dict[str, Any] = strip_prefix(model, prefix)
    else:
        optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
        out = {**load_meta(ckpt_dir, weights_only=False), MODEL_KEY: model,
               "optimizer_states": [state[k] for k in optimizers]}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, out_file)
    return out_file


def load_consolidated(file: str | os.PathLike, *, prefix: str | None = None,
                      weights_only: bool = True) -> dict[str, torch.Tensor]:
    """The model state dict in an exported file (either shape), ready for ``module.load_state_dict``.

    ``prefix`` is stripped as in ``strip_prefix``; a full export keeps LightningModule names unless
    you pass ``prefix="model."``.
    """
    state = torch.load(file, map_location="cpu", weights_only=weights_only)
    if MODEL_KEY in state and isinstance(state[MODEL_KEY], Mapping):
        state = state[MODEL_KEY]
    return strip_prefix(state, prefix)


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
                    "torch.save file, for inference or sharing. Runs in one process.")
    p.add_argument("ckpt_dir", help="checkpoint directory (or a directory of them with --latest)")
    p.add_argument("out_file", help="output file, e.g. model.pt")
    p.add_argument("--latest", action="store_true",
                   help="ckpt_dir is a directory of checkpoints: export the newest complete one")
    p.add_argument("--full", action="store_true",
                   help="also export optimizer and Lightning state (a single-file Lightning checkpoint)")
    p.add_argument("--keep-prefix", action="store_true",
                   help=f"keep the LightningModule prefix ({DEFAULT_PREFIX!r}) on the model's keys")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="cast floating-point weights")
    p.add_argument("--no-verify", action="store_true", help="skip checking the files against manifest.json")
    return p


def export_main(argv: Sequence[str] | None = None) -> Path:
    """``lightning-disttrain export CKPT_DIR OUT_FILE [--latest] [--full] ...``; returns the file written."""
    args = build_parser().parse_args(argv)
    ckpt_dir = Path(args.ckpt_dir)
    if args.latest:
        from lightning_disttrain.checkpoint.discovery import find_latest_checkpoint

        found = find_latest_checkpoint(ckpt_dir)
        if found is None:
            raise SystemExit(f"no complete checkpoint in {str(ckpt_dir)!r}")
        ckpt_dir = found
    with warnings.catch_warnings():
        # DCP warns that it "assumes the intent" of a single-process load; that is the intent.
        warnings.filterwarnings("ignore", message=".*torch.distributed is.*uninitialized.*")
        out = export_consolidated(ckpt_dir, args.out_file, model_only=not args.full,
                                  prefix=None if args.keep_prefix else DEFAULT_PREFIX,
                                  verify=not args.no_verify,
                                  dtype=getattr(torch, args.dtype) if args.dtype else None)
    size = out.stat().st_size / 2**20
    print(f"exported {ckpt_dir} -> {out} ({size:.1f} MiB{', model only' if not args.full else ''})")
    return out


if __name__ == "__main__":
    export_main()
