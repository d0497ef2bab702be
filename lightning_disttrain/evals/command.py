"""``lightning-disttrain eval CKPT --tasks piqa,lambada_openai ...``: evaluate a saved checkpoint.

CKPT is a checkpoint directory (DCP, verified against its manifest; ``--latest``: the newest
complete one in a directory of them) or a file written by ``lightning-disttrain export``. The
model is a ``GPTModule`` rebuilt from the hyper-parameters stored with it; the tokenizer is the
run's (the data module's hyper-parameters in the checkpoint), or ``--tokenizer``.

On any number of devices: ``--devices N`` starts N processes (Lightning's launcher, as ``fit``
does) and the model runs under ``--strategy`` (default ``fsdp2`` for N > 1): every rank loads the
consolidated weights, the strategy shards them, and the items are split across the ranks as in
``CheckpointEval``. The evaluation runs from a callback at the start of a one-batch
``trainer.validate`` (the first point where Lightning has set the strategy up).

Errors (a bad path, task or file; a file that is not a checkpoint, said in the same line as
``--ckpt_path`` of the other commands): ``error: eval: <message>``, exit status 2.

Results: a table, ``--output FILE.json`` (metrics, items, seconds per task), and with
``--write-into-checkpoint`` the checkpoint's ``evals.json`` (listed in its manifest).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_disttrain.evals.suite import EvalResults, EvalSuite


DEFAULT_TASKS = "lambada_openai,piqa,arc_easy,winogrande,copa"
"""The command's default tasks: scored on the bundled samples when no data directory is given."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-disttrain eval",
                                description="Evaluate a saved checkpoint on zero-shot tasks and held-out loss.")
    p.add_argument("ckpt", help="checkpoint directory, a directory of them with --latest, or an exported file")
    p.add_argument("--tasks", default=DEFAULT_TASKS,
                   help="comma-separated: heldout (needs --heldout FILE), lambada_openai, piqa, arc_easy, arc_challenge, "
                        "winogrande, copa, openbook_qa, hellaswag, or NAME=FILE.jsonl / NAME=hub:org/dataset "
                        f"(default: {DEFAULT_TASKS})")
    p.add_argument("--data-dir", default=None,
                   help="directory of JSONL sets (llm-foundry's layout), 'bundled' (50 items per set, shipped with "
                        "the package) or 'hub' (the full sets via `datasets`); default: $LDT_EVAL_DATA, else bundled")
    p.add_argument("--limit", type=int, default=None, help="the first N items of each task")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=None, help="default: the model's block size")
    p.add_argument("--heldout", default=None, help="held-out corpus for the heldout task: a .txt, .bin or .pt file")
    p.add_argument("--heldout-windows", type=int, default=32)
    p.add_argument("--heldout-seq-len", type=int, default=None)
    p.add_argument("--tokenizer", default=None, help="gpt2 or bytes (default: the run's, from the checkpoint)")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--strategy", default=None, help="default: fsdp2 for more than one device")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--output", default=None, help="write the results to this JSON file")
    p.add_argument("--write-into-checkpoint", action="store_true",
                   help="store the results as the checkpoint directory's evals.json (listed in its manifest)")
    p.add_argument("--latest", action="store_true", help="CKPT is a directory of checkpoints: the newest complete one")
    p.add_argument("--allow-failed", action="store_true", help="with --latest, also consider checkpoints the eval gate failed")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="read the checkpoint's DCP .metadata with plain unpickling, which can run code: only for "
                        "checkpoints whose writer you trust (without it anything beyond plain data is refused)")
    return p


def _resolve(args: argparse.Namespace) -> Path:
    from lightning_disttrain.checkpoint.discovery import find_latest_checkpoint

    path = Path(args.ckpt)
    if args.latest:
        found = find_latest_checkpoint(path, include_failed=args.allow_failed)
        if found is None:
            raise ValueError(f"no complete checkpoint in {str(path)!r}; pass the path of one")
        return found
    if not path.exists():
        raise ValueError(f"{str(path)!r} does not exist; pass a checkpoint directory or a file written by export")
    return path


def load_module(path: Path, trust_checkpoint: bool = False) -> tuple[Any, dict[str, Any]]:
    """The GPTModule with the weights of ``path`` (a checkpoint directory or an exported file), and
    the data module's hyper-parameters stored with it (``{}`` when none). Nothing from the file is
    unpickled beyond plain data unless ``trust_checkpoint``."""
    from lightning_disttrain.checkpoint.consolidate import DEFAULT_PREFIX, _read_dcp, read_exported, strip_prefix
    from lightning_disttrain.checkpoint.dcp_io import MODEL_KEY, load_meta
    from lightning_disttrain.checkpoint.manifest import verify_checkpoint
    from lightning_disttrain.checkpoint.safe_load import check_checkpoint_file
    from lightning_disttrain.module import GPTModule

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is.*uninitialized.*")
        if path.is_dir():
            verify_checkpoint(path)
            meta = load_meta(path, weights_only=True)
            hparams = dict(meta.get("hyper_parameters") or {})
            if "config" not in hparams:
                raise ValueError(f"{str(path)!r} was not saved from a GPTModule (no `config` hyper-parameter); "
                                 f"the eval command rebuilds GPTModule checkpoints only")
            state = strip_prefix(_read_dcp(path, {MODEL_KEY}, trust_checkpoint)[MODEL_KEY], DEFAULT_PREFIX)
            data_hparams = dict(meta.get("datamodule_hyper_parameters") or {})
        else:
            check_checkpoint_file(path)  # not a checkpoint: the line every command gives, no unpickling advice
            exported = read_exported(path, prefix=DEFAULT_PREFIX)
            if exported.model_config is None:
                raise ValueError(f"{str(path)!r} carries no model config; re-export it with `lightning-disttrain export`")
            hparams, state, data_hparams = {"config": exported.model_config}, exported.state_dict, {}
    allowed = inspect.signature(GPTModule.__init__).parameters
    kwargs = {k: v for k, v in hparams.items() if k in allowed and k != "self"}
    kwargs.update(init_from=None, init_device=None)  # the weights come from the checkpoint
    module = GPTModule(**kwargs)
    module.configure_model()
    module.model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return module, data_hparams


def _tokenizer_name(args, module, data_hparams: dict[str, Any]) -> str:
    for name in (args.tokenizer, data_hparams.get("tokenizer"), module.hparams.get("tokenizer_name")):
        if name:
            return name
    return "bytes" if module.config.vocab_size == 257 else "gpt2"


def evaluate_checkpoint(args: argparse.Namespace) -> EvalResults | None:
    """Run the command; the results on global rank 0 (None on the other ranks)."""
    from torch.utils.data import DataLoader

    import lightning_disttrain.strategies  # noqa: F401  (registers fsdp2)
    from lightning_disttrain.data import get_tokenizer
    from lightning_disttrain.evals.tasks import BUNDLED, ENV_DATA_DIR, HELDOUT, load_task

    path = _resolve(args)
    data_dir = args.data_dir or os.environ.get(ENV_DATA_DIR) or BUNDLED
    suite = EvalSuite(tasks=args.tasks, data_dir=data_dir, limit=args.limit, batch_size=args.batch_size,
                      max_length=args.max_length, heldout=args.heldout or "val", heldout_windows=args.heldout_windows,
                      heldout_seq_len=args.heldout_seq_len)
    # Everything that can be checked without the model is checked here, in the one process the user
    # started, before Lightning launches the other ranks: a bad task or file is one error, at once.
    if HELDOUT in suite.names and not args.heldout:
        raise ValueError("the heldout task needs --heldout FILE here (a .txt, .bin or .pt corpus; the eval command "
                         "has no data module to take a validation set from)")
    for spec, name in zip(suite.tasks, suite.names):
        if name != HELDOUT:
            load_task(spec, data_dir, args.limit)
    module, data_hparams = load_module(path, trust_checkpoint=getattr(args, "trust_checkpoint", False))
    tokenizer = get_tokenizer(_tokenizer_name(args, module, data_hparams))
    runner = _RunSuite(suite, tokenizer)
    strategy = args.strategy or ("fsdp2" if args.devices > 1 else "auto")
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[runner], limit_val_batches=1, num_sanity_val_steps=0, use_distributed_sampler=False)
    one = torch.zeros(1, dtype=torch.long)
    trainer.validate(module, dataloaders=DataLoader([(one, one)], batch_size=1), verbose=False)
    if not trainer.is_global_zero:
        return None
    from lightning_disttrain.checkpoint.manifest import read_manifest
    from lightning_disttrain.evals.results import evals_record, print_results, write_evals

    results = runner.results
    manifest = read_manifest(path) if path.is_dir() else None
    print_results(results, manifest.global_step if manifest else None, f" ({path})")  # no step: an exported file
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**results.to_dict(), "checkpoint": str(path)}, indent=1))
    if args.write_into_checkpoint:
        if not path.is_dir():
            raise ValueError("--write-into-checkpoint needs a checkpoint directory, not an exported file")
        write_evals(path, evals_record(results, step=manifest.global_step, epoch=manifest.epoch, checkpoint=path.name,
                                       gate=None, config={"tasks": suite.tasks, "limit": suite.limit}))
    return results


class _RunSuite(L.Callback):
    """Runs the suite once the strategy has set the model up (``on_validation_start``)."""

    def __init__(self, suite: EvalSuite, tokenizer) -> None:
        self.suite, self.tokenizer, self.results = suite, tokenizer, None

    def on_validation_start(self, trainer, pl_module) -> None:
        self.results = self.suite.run_module(pl_module, trainer, tokenizer=self.tokenizer)


class EvalError(SystemExit):
    """The command's failure: its line is printed to stderr, the exit status is 2 (as for ``export``,
    ``plan``, ``prepare`` and a configuration error); ``str()`` is that line, for callers from Python."""

    def __init__(self, line: str) -> None:
        super().__init__(2)
        self.line = line

    def __str__(self) -> str:
        return self.line


def eval_main(argv: Sequence[str] | None = None) -> EvalResults | None:
    args = build_parser().parse_args(argv)
    try:
        return evaluate_checkpoint(args)
    except (ValueError, FileNotFoundError) as err:
        if _launched_rank():
            raise SystemExit(1) from None  # rank 0 meets the same error and reports it, once
        if os.environ.get("LDT_DEBUG", "0") not in ("", "0"):
            raise
        line = f"error: eval: {err}"
        print(line, file=sys.stderr, flush=True)
        raise EvalError(line) from None


def _launched_rank() -> bool:
    """Whether this process is a rank other than 0 (launched by Lightning for ``--devices N``)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", None)
    return int(rank if rank is not None else os.environ.get("LOCAL_RANK", "0") or 0) != 0
