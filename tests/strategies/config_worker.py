"""The shipped parallel configs (configs/{tensor,pipeline,expert,context}-parallel.yaml) as a user runs
them with ``lightning-disttrain fit --config``, shortened (4 steps, validation of one batch at
step 4, 40 documents, a 4-token sample), through ``DistTrainCLI`` inside the suite's shared
2-rank launch: ``fit_run(CONFIG, DEVICES)``. Every path of the config is moved under the launch's
directory; rank 0 reports what the strategy and the sample callback logged and where the CSV log
and the checkpoint are."""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from dist_utils import lightning_info_lines

REPO = Path(__file__).resolve().parents[2]


def fit_run(run: str, devices: int) -> dict:
    from lightning_disttrain.cli import DistTrainCLI

    out = Path(os.environ["LDT_LAUNCH_OUT"]) / f"config_{run}"
    out.mkdir(parents=True, exist_ok=True)
    text = (REPO / "configs" / f"{run}.yaml").read_text().replace("runs/", f"{out}/runs/")
    # The sample at the end, shorter: 64 tokens regenerated token by token under TP's DTensors took
    # ~10 s of the suite here (8: ~1.4 s of the tensor-parallel run); 4 show the same thing.
    text = re.sub(r"max_new_tokens: \d+", "max_new_tokens: 4", text)
    path = out / f"{run}.rank{os.environ.get('LOCAL_RANK', '0')}.yaml"  # the process group may not exist yet
    path.write_text(text)
    with lightning_info_lines() as log:
        cli = DistTrainCLI(args=["fit", "--config", str(path), "--trainer.max_steps", "4",
                                 "--trainer.val_check_interval", "4", "--trainer.log_every_n_steps", "2",
                                 "--data.init_args.max_docs", "40", "--data.init_args.cache_dir", str(out / "cache"),
                                 # one validation batch logs val/loss as four do (and caps the sanity
                                 # check at one: 2 evaluation steps instead of 6)
                                 "--data.init_args.val_batches", "1"])
    assert yaml.safe_load(text)["trainer"]["default_root_dir"].startswith(str(out))
    return {"steps": cli.trainer.global_step, "log": log, "runs": str(out / "runs" / run),
            "layout": cli.trainer.strategy.parallelized_steps}
