"""Shared by the callback tests: a short ``lightning-disttrain fit`` from a YAML file, in-process."""

from __future__ import annotations

from pathlib import Path

import yaml

from lightning_disttrain.cli import DistTrainCLI


def fit_from_yaml(tmp_path: Path, callback: dict, data_class: type, vocab_size: int, max_steps: int = 2,
                  csv_logger: bool = False) -> DistTrainCLI:
    """Fit GPTModule('tiny') with one callback given by ``class_path`` (+ ``init_args``) in a YAML."""
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}}
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": max_steps, "log_every_n_steps": 1,
                    "logger": logger if csv_logger else False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path), "callbacks": [callback]},
        "model": {"class_path": "lightning_disttrain.module.GPTModule",
                  "init_args": {"config": "tiny", "vocab_size": vocab_size}},
        "data": {"class_path": f"{data_class.__module__}.{data_class.__qualname__}"},
    }
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    return DistTrainCLI(args=["fit", "--config", str(path)])
