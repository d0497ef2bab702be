"""The recommended layout as a LightningCLI YAML (``lightning-disttrain plan --write-config``).

Degrees go to ``NDParallelStrategy`` (DDP to Lightning's ``ddp``), the ZeRO stage to
``reshard_after_forward``, the activation checkpointing policy to ``SelectiveActivationCheckpointing``,
fp8 to ``Float8Training``, the batch to ``TokenDataModule.batch_size`` (the micro batch) and
``accumulate_grad_batches``, the token budget to ``max_steps``, and the Young/Daly interval to
``ModelCheckpoint(every_n_train_steps)``. The data source is a placeholder to replace.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from lightning_disttrain.models.gpt import PRESETS
from lightning_disttrain.planning.model_shape import SHAPES
from lightning_disttrain.planning.planner import Plan

_PRECISION = {"bf16": "bf16-mixed", "fp8": "bf16-mixed", "fp32": "32-true", "bf16-pure": "bf16-true"}


def config_dict(plan: Plan, model_name: str, model_overrides: dict) -> dict:
    """The LightningCLI config of ``plan``'s recommendation (raises ValueError when nothing fits)."""
    if plan.chosen is None:
        raise ValueError(f"no layout to write: {plan.reason}")
    c, w, layout = plan.cluster, plan.workload, plan.chosen.layout
    if layout.zero == 0:
        strategy: str | dict = "ddp"
    else:
        init = {k: getattr(layout, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep") if getattr(layout, k) > 1}
        init["dp_shard"] = layout.dp_shard
        if layout.zero == 2:
            init["reshard_after_forward"] = False
        strategy = {"class_path": "lightning_disttrain.strategies.NDParallelStrategy", "init_args": init}
    callbacks = []
    if layout.ac != "none":
        callbacks.append({"class_path": "lightning_disttrain.callbacks.SelectiveActivationCheckpointing",
                          "init_args": {"policy": layout.ac}})
    if w.precision == "fp8":
        callbacks.append({"class_path": "lightning_disttrain.callbacks.Float8Training"})
    callbacks.append({"class_path": "lightning_disttrain.callbacks.MFUMonitor"})
    every = 1000
    if plan.speed is not None and plan.failures is not None:
        every = max(1, round(plan.failures.interval_seconds / plan.speed.step_seconds))
    callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                      "init_args": {"dirpath": "runs/planned/checkpoints", "every_n_train_steps": every,
                                    "save_last": "link", "enable_version_counter": False}})
    max_steps = 1000
    if plan.cost is not None:
        max_steps = math.ceil(plan.cost.hours * 3600 / (1 + plan.failures.overhead) / plan.speed.step_seconds)
    if model_name not in PRESETS:  # a planner shape: a GPT preset with every field of the shape set
        model_overrides = {**SHAPES[model_name], **model_overrides}
        model_name = "gpt2-124m"
    overrides = {k: v for k, v in model_overrides.items() if k != "vocab_size"}
    if layout.pp > 1:
        overrides["tie_embeddings"] = False
    return {
        "seed_everything": 1337,
        "trainer": {
            "accelerator": "cpu" if c.gpu == "cpu" else "gpu", "devices": c.gpus_per_node, "num_nodes": c.nodes,
            "strategy": strategy, "precision": _PRECISION[w.precision], "max_steps": max_steps,
            "accumulate_grad_batches": plan.chosen.accumulation, "gradient_clip_val": 1.0,
            "log_every_n_steps": 10, "default_root_dir": "runs/planned", "callbacks": callbacks,
        },
        "model": {"class_path": "lightning_disttrain.GPTModule",
                  "init_args": {"config": model_name, "model_overrides": overrides or None,
                                "warmup_steps": min(700, max_steps // 10)}},
        "data": {"class_path": "lightning_disttrain.TokenDataModule",
                 "init_args": {"source": "REPLACE/with/your/shards_*.bin", "tokenizer": "gpt2",
                               "seq_len": w.seq_len, "batch_size": w.micro_batch}},
    }


def write_config(path: str | Path, plan: Plan, model_name: str, model_overrides: dict, command: str) -> Path:
    """Write ``config_dict`` to ``path`` with a header saying where it came from."""
    data = config_dict(plan, model_name, model_overrides)
    header = (f"# Written by: {command}\n# {plan.reason}\n"
              f"# The model's vocabulary comes from the data module's tokenizer; set data.source before running.\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return path
