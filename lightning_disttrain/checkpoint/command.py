"""``lightning-disttrain export``: a checkpoint directory (DCP shards) as one ``torch.save`` file
(``checkpoint/consolidate.py``), or as a Hugging Face model directory (``checkpoint/hf_export.py``).

An entry point, at the top of the package's layers (``docs/architecture.md``): it imports both
writers; nothing in the package imports it but ``cli.py``.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_disttrain.checkpoint.consolidate import (
    DEFAULT_PREFIX,
    export_consolidated,
)
from lightning_disttrain.checkpoint.discovery import (
    LAST_NAME,
    describe_checkpoint,
    find_latest_checkpoint,
    gate_failure,
    list_checkpoints,
)
from lightning_disttrain.checkpoint.hf_export import export_hf
from lightning_disttrain.checkpoint.safe_load import UntrustedCheckpointError


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
                   help="torch: one torch.save file (gpt_from_exported loads it); hf: config.json + "
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
