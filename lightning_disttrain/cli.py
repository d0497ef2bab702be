"""The ``lightning-disttrain`` command.

``fit | validate | test | predict --config X.yaml`` go through ``LightningCLI``: the model, data,
strategy, loggers and callbacks are chosen by ``class_path`` (or a registered strategy name such
as ``fsdp2``) in the YAML. ``prepare`` tokenizes text into llm.c shards; ``export`` writes a
consolidated single-file state dict from a sharded checkpoint.
"""

from __future__ import annotations

import sys

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_disttrain  # noqa: F401  (registers strategy names; callbacks importable by class_path)

_TOOLS = {
    "prepare": ("lightning_disttrain.data.prepare", "prepare_main", "tokenize text into llm.c .bin shards"),
    "export": ("lightning_disttrain.checkpoint.consolidate", "export_main",
               "export a sharded checkpoint as one consolidated state-dict file"),
}


class DistTrainCLI(LightningCLI):
    """LightningCLI with any LightningModule / LightningDataModule selectable by ``class_path``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(L.LightningModule, L.LightningDataModule, *args, **kwargs)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _TOOLS:
        import importlib

        module, fn, _ = _TOOLS[argv[0]]
        getattr(importlib.import_module(module), fn)(argv[1:])
        return
    if argv and argv[0] in ("-h", "--help"):
        print("usage: lightning-disttrain {fit,validate,test,predict,prepare,export} ...\n")
        for name, (_, _, doc) in _TOOLS.items():
            print(f"  {name:9s} {doc}")
        print("  fit, validate, test, predict: LightningCLI subcommands (lightning-disttrain fit --help)\n")
    DistTrainCLI(args=argv)


if __name__ == "__main__":
    main()
