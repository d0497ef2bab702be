"""The recommended layout as a LightningCLI YAML (``lightning-disttrain plan --write-config``).

Degrees go to ``NDParallelStrategy`` (DDP to Lightning's ``ddp``; context parallel to ``cp``, each
sequence of the data module's batch split over the cp ranks), the ZeRO stage to
``reshard_after_forward``, a pipeline's schedule arguments to ``pp_schedule`` / ``pp_microbatches`` /
``pp_stages_per_rank`` (the ones the plan's pipeline terms were computed from), the activation
checkpointing policy to ``SelectiveActivationCheckpointing(policy, every_k)``, fp8 to
``Float8Training``, the batch to ``TokenDataModule.batch_size`` (the micro batch, times the
pipeline's micro-batches: the strategy splits each batch into them) and ``accumulate_grad_batches``,
the token budget to ``max_steps``, the Young/Daly interval (at most ``max_steps``) to
``ModelCheckpoint(every_n_train_steps)``, the planned vocabulary to ``GPTModule(vocab_size)`` with
the package's tokenizer that fits it (``tokenizer_for``). The data source is a placeholder to replace.

``layout_from_config`` reads such a YAML back (degrees, ZeRO stage, pipeline arguments,
checkpointing policy): the layout the plan describes for a config, e.g. to compare it with what
``NDParallelStrategy`` builds from the same YAML.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from lightning_disttrain.data.tokenizer import GPT2_N_VOCAB, ByteTokenizer
from lightning_disttrain.models.gpt import PRESETS
from lightning_disttrain.planning.layouts import Candidate
from lightning_disttrain.planning.model_shape import SHAPES, config_for
from lightning_disttrain.planning.planner import Plan
from lightning_disttrain.planning.spec import DEGREES, Layout

STRATEGY = "lightning_disttrain.strategies.NDParallelStrategy"
AC_CALLBACK = "lightning_disttrain.callbacks.SelectiveActivationCheckpointing"

_PRECISION = {"bf16": "bf16-mixed", "fp8": "bf16-mixed", "fp32": "32-true", "bf16-pure": "bf16-true"}


def strategy_config(layout: Layout) -> str | dict:
    """``trainer.strategy`` for ``layout``."""
    if layout.zero == 0:
        return "ddp"
    init: dict = {k: getattr(layout, k) for k in DEGREES if getattr(layout, k) > 1}
    init["dp_shard"] = layout.dp_shard
    if layout.zero == 2:
        init["reshard_after_forward"] = False
    if layout.accumulate_unsharded_grads:
        init["accumulate_unsharded_grads"] = True
    if layout.pp > 1:
        options = layout.pipeline
        init["pp_schedule"] = options.schedule
        init["pp_microbatches"] = options.num_microbatches(layout.pp)
        if options.stages_per_rank is not None:
            init["pp_stages_per_rank"] = options.stages_per_rank
    return {"class_path": STRATEGY, "init_args": init}


def find_candidate(plan: Plan, name: str) -> Candidate:
    """The candidate of ``plan`` named ``name`` (as the table prints it, case-insensitive)."""
    for c in plan.candidates:
        if c.layout.name.lower() == name.strip().lower():
            return c
    raise ValueError(f"no layout named {name!r} in this plan; the layouts are: "
                     + "; ".join(c.layout.name for c in plan.candidates))


def tokenizer_for(vocab: int) -> str:
    """The package's tokenizer for a model of ``vocab`` tokens: GPT-2's BPE (50,257) when the
    vocabulary holds it, else bytes (257). A larger vocabulary (Llama 3's 128,256) stays the
    model's, as planned (``GPTModule(vocab_size=...)``): the tokenizer uses its first ids, the
    memory and speed are the plan's; the package has no tokenizer of that size."""
    if vocab >= GPT2_N_VOCAB:
        return "gpt2"
    if vocab >= ByteTokenizer.n_vocab:
        return "bytes"
    raise ValueError(f"vocab_size={vocab} is smaller than every tokenizer of this package (bytes: "
                     f"{ByteTokenizer.n_vocab}, gpt2: {GPT2_N_VOCAB}); plan with --override vocab_size=257 or more")


def run_steps(plan: Plan, chosen: Candidate) -> tuple[int, int]:
    """``max_steps`` (the token budget's steps, ``--tokens``; else 1000) and the checkpoint cadence:
    the Young/Daly interval in steps, at most ``max_steps``. A run shorter than the interval still
    saves once, at its last step (where the interval is longer than the run, that is the one
    checkpoint worth its cost)."""
    max_steps = every = 1000
    if plan.cost is not None and chosen is plan.chosen:
        max_steps = math.ceil(plan.cost.hours * 3600 / (1 + plan.failures.overhead) / plan.speed.step_seconds)
    if plan.speed is not None and plan.failures is not None and chosen is plan.chosen:
        every = max(1, round(plan.failures.interval_seconds / plan.speed.step_seconds))
    return max_steps, min(every, max_steps)


def config_dict(plan: Plan, model_name: str, model_overrides: dict, candidate: Candidate | None = None) -> dict:
    """The LightningCLI config of ``plan``'s recommendation, or of ``candidate`` (one of its
    layouts); a ValueError when there is none, or the candidate cannot run as planned."""
    if candidate is None and plan.chosen is None:
        raise ValueError(f"no layout to write: {plan.reason}")
    chosen = candidate or plan.chosen
    if not chosen.recommendable or chosen.accumulation is None:
        raise ValueError(f"{chosen.layout.name} cannot be written: {chosen.note}")
    c, w, layout = plan.cluster, plan.workload, chosen.layout
    strategy = strategy_config(layout)
    callbacks = []
    if layout.ac != "none":
        init = {"policy": layout.ac} | ({"every_k": layout.ac_every_k} if layout.ac == "block" else {})
        callbacks.append({"class_path": AC_CALLBACK, "init_args": init})
    if w.precision == "fp8":
        callbacks.append({"class_path": "lightning_disttrain.callbacks.Float8Training"})
    callbacks.append({"class_path": "lightning_disttrain.callbacks.MFUMonitor"})
    max_steps, every = run_steps(plan, chosen)
    callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                      "init_args": {"dirpath": "runs/planned/checkpoints", "every_n_train_steps": every,
                                    "save_last": "link", "enable_version_counter": False}})
    vocab = config_for(model_name, model_overrides).vocab_size
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
            "accumulate_grad_batches": chosen.accumulation, "gradient_clip_val": 1.0,
            "log_every_n_steps": 10, "default_root_dir": "runs/planned", "callbacks": callbacks,
            # named, as in the shipped configs: Lightning's default logger warns about tensorboardX
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": "runs/planned", "name": "logs"}},
        },
        "model": {"class_path": "lightning_disttrain.GPTModule",
                  "init_args": {"config": model_name, "vocab_size": vocab, "model_overrides": overrides or None,
                                "warmup_steps": min(700, max_steps // 10),
                                **({"optimizer": w.optimizer} if w.optimizer != "adamw" else {})}},
        "data": {"class_path": "lightning_disttrain.TokenDataModule",
                 "init_args": {"source": "REPLACE/with/your/shards_*.bin", "tokenizer": tokenizer_for(vocab),
                               "seq_len": w.seq_len, "batch_size": w.micro_batch * layout.microbatches}},
    }


def write_config(path: str | Path, plan: Plan, model_name: str, model_overrides: dict, command: str,
                 candidate: Candidate | None = None) -> Path:
    """Write ``config_dict`` to ``path`` with a header saying where it came from."""
    data = config_dict(plan, model_name, model_overrides, candidate)
    chosen = candidate or plan.chosen
    why = plan.reason if chosen is plan.chosen else (
        f"{chosen.layout.name}, chosen by --layout: needs {chosen.memory.total / 1e9:.1f} GB per GPU, "
        f"{chosen.memory.headroom / 1e9:.1f} GB to spare" + ("" if chosen.memory.fits else " (does NOT fit)"))
    trainer, init = data["trainer"], data["model"]["init_args"]
    vocab, tokenizer = init["vocab_size"], data["data"]["init_args"]["tokenizer"]
    n_tokens = GPT2_N_VOCAB if tokenizer == "gpt2" else ByteTokenizer.n_vocab
    every = trainer["callbacks"][-1]["init_args"]["every_n_train_steps"]
    header = (f"# Written by: {command}\n# {why}\n"
              f"# Set data.source before running: shards made with `lightning-disttrain prepare --tokenizer {tokenizer}`.\n"
              + (f"# vocab_size {vocab} as planned; the {tokenizer} tokenizer uses the first {n_tokens} of those ids "
                 f"(this package has no {vocab}-token tokenizer).\n" if vocab != n_tokens else "")
              + f"# max_steps {trainer['max_steps']}: "
              + ("a placeholder (pass --tokens for the budget's steps)" if plan.cost is None else
                 "the --tokens budget" if chosen is plan.chosen else
                 "a placeholder (the --tokens budget's steps are computed for the recommended layout)")
              + f"; a checkpoint every {every} steps"
              + (" (the Young/Daly interval)" if every < trainer["max_steps"] else ", the last one") + ".\n")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return path


def layout_from_config(config: dict) -> tuple[Layout, int]:
    """The plan's ``Layout`` of a LightningCLI config (a dict of its YAML) and the data module's
    batch size: ``trainer.strategy`` (``ddp``, ``fsdp2``, ``NDParallelStrategy``'s degrees, ZeRO
    stage and pipeline arguments) and a ``SelectiveActivationCheckpointing`` callback."""
    trainer = config.get("trainer") or {}
    world = int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))
    strategy = trainer.get("strategy", "auto")
    ac, every_k = "none", 2
    for cb in trainer.get("callbacks") or []:
        if isinstance(cb, dict) and cb.get("class_path", "").rsplit(".", 1)[-1] == "SelectiveActivationCheckpointing":
            args = cb.get("init_args") or {}
            ac, every_k = args.get("policy", "selective"), args.get("every_k", 2)
    batch = int(((config.get("data") or {}).get("init_args") or {}).get("batch_size", 1))
    if strategy in ("ddp", "auto") or world == 1 and not isinstance(strategy, dict):
        return Layout(dp_replicate=world, dp_shard=1, zero=0, ac=ac, ac_every_k=every_k), batch
    if strategy == "fsdp2":
        return Layout(dp_shard=world, zero=3, ac=ac, ac_every_k=every_k), batch
    if not isinstance(strategy, dict) or strategy.get("class_path", "").rsplit(".", 1)[-1] != "NDParallelStrategy":
        raise ValueError(f"trainer.strategy {strategy!r}: the planner reads ddp, fsdp2 and NDParallelStrategy")
    init = strategy.get("init_args") or {}
    degrees = {k: int(init.get(k, 1)) for k in DEGREES if k != "dp_shard"}
    dp_shard = int(init.get("dp_shard", -1))
    if dp_shard == -1:
        dp_shard = world // (degrees["dp_replicate"] * degrees["tp"] * degrees["cp"] * degrees["pp"])
    reshard = init.get("reshard_after_forward", True)
    return Layout(**degrees, dp_shard=dp_shard, zero=3 if reshard is True else 2, ac=ac, ac_every_k=every_k,
                  accumulate_unsharded_grads=bool(init.get("accumulate_unsharded_grads", False)),
                  pp_schedule=init.get("pp_schedule", "1F1B"), pp_microbatches=init.get("pp_microbatches"),
                  pp_stages_per_rank=init.get("pp_stages_per_rank")), batch
