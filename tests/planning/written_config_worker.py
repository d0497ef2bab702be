"""The YAMLs ``plan --write-config`` writes, fitted as written inside the suite's shared launches
(tests/conftest.py): ``fit_run(NAME, DEVICES)`` writes the YAML of ``RUNS[NAME]`` with the
``plan`` command and fits it 2 steps through ``DistTrainCLI`` (the class behind
``lightning-disttrain fit --config``), overriding only what a test machine needs (see
tests/planning/test_written_configs.py). Every rank runs in the run's own directory, where the
YAML's relative paths (``runs/planned``) land, as they would in a user's working directory."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from dist_utils import lightning_info_lines
from test_written_configs import RUNS, plan_args


def fit_run(name: str, devices: int) -> dict:
    from lightning_disttrain.cli import DistTrainCLI, main

    model, gpus, nodes, layout, _ = RUNS[name]
    assert gpus * nodes == devices, f"{name}: a {gpus} x {nodes} cluster runs on {gpus * nodes} ranks, not {devices}"
    out = Path(os.environ["LDT_LAUNCH_OUT"]) / f"written_{name}"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.rank{os.environ.get('LOCAL_RANK', '0')}.yaml"  # the process group may not exist yet
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main([*plan_args(model, gpus, nodes), "--write-config", str(path), "--layout", layout])
    assert f"wrote {path}" in printed.getvalue(), printed.getvalue()[-2000:]
    cwd = os.getcwd()
    os.chdir(out)
    try:
        with lightning_info_lines() as log:
            cli = DistTrainCLI(args=[
                "fit", "--config", str(path), "--trainer.max_steps", "2", "--trainer.num_nodes", "1",
                "--trainer.devices", str(devices), "--trainer.enable_progress_bar", "false",
                "--data.init_args.source", "embedded", "--data.init_args.tokenizer", "bytes",
                "--data.init_args.val_batches", "0", "--data.init_args.cache_dir", str(out / "cache"),
                "--data.init_args.max_docs", "60"])
    finally:
        os.chdir(cwd)
    return {"steps": cli.trainer.global_step, "log": log,
            "layout": list(getattr(cli.trainer.strategy, "parallelized_steps", []))}  # DDP: Lightning's
