"""Initial weights under every layout and shipped config, built on the meta device (``empty_init``;
the shipped configs with the strategy's default, which builds GPTModule there):
each rank writes the full tensors it can see at ``on_train_start`` (``init/RUN.rankR.pt``) and the
losses of the first steps; ``tests/strategies/test_layout_independent_init.py`` compares them with
one eager process.

Runs named ``config-<name>`` take the strategy, precision and model of ``configs/<name>.yaml``
(with the strategy's default ``empty_init``, 2 ranks, this file's tiny vocabulary and random tokens; the 124M model
of ``gpt2-124m-fineweb`` shrinks to ``tiny`` on CPU); configs that initialise alike (the same
strategy, precision and model: ``muon-clip`` and ``quickstart`` differ in the optimizer) share one run. The others are layouts the configs do not
cover: CPU offload, interleaved pipeline, HSDP, and 2-D / 3-D combinations on 4 ranks.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import lightning as L
import torch
import yaml
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightning_disttrain.strategies  # noqa: E402,F401  (registers the strategy names)
from lightning_disttrain.module import GPTModule  # noqa: E402
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
GLOBAL_BATCH, STEPS, SEQ, VOCAB, SEED = 8, 3, 16, 64, 7
CLIP = 0.5  # gradient clipping in every run: the norm over CPU-offloaded and mesh-sharded gradients
UNTIED = {"tie_embeddings": False}
MOE = {"moe_bias_update_speed": 0.001, "moe_aux_loss_coef": 0.0}

# name -> (NDParallelStrategy kwargs, model preset, model overrides); empty_init=True is added.
LAYOUTS = {
    "fsdp2_offload": (dict(cpu_offload=True), "tiny", {}),
    "tp2_no_sp": (dict(tp=2, sequence_parallel=False, loss_parallel=False), "tiny", {}),
    "pp2_interleaved": (dict(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=4), "tiny", UNTIED),
    "hsdp": (dict(dp_replicate=2, dp_shard=2), "tiny", {}),
    "hsdp_offload": (dict(dp_replicate=2, dp_shard=2, cpu_offload=True), "tiny", {}),
    "tp2_fsdp2": (dict(tp=2, dp_shard=2), "tiny", {}),
    "pp2_fsdp2": (dict(pp=2, dp_shard=2, pp_microbatches=2), "tiny", UNTIED),
    "pp2_tp2": (dict(pp=2, tp=2, pp_microbatches=4), "tiny", UNTIED),
    "ep2_fsdp4": (dict(dp_shard=4, ep=2), "tiny-moe", MOE),
}


def _initialising_part(name: str) -> str:
    """What of ``configs/<name>.yaml`` decides the initial weights: the strategy, the precision, the
    model's preset and overrides (not its optimizer or the callbacks)."""
    spec = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    model = spec["model"]["init_args"]
    return repr((spec["trainer"].get("strategy"), spec["trainer"].get("precision"), model.get("config", "tiny"),
                 model.get("model_overrides")))


SAME_AS = {c: next(o for o in CONFIGS if _initialising_part(o) == _initialising_part(c)) for c in CONFIGS}
"""Each config -> the first config that initialises the same way (its run covers both)."""
TWO_RANK = [f"config-{c}" for c in CONFIGS if SAME_AS[c] == c] + ["fsdp2_offload", "tp2_no_sp", "pp2_interleaved"]
FOUR_RANK = ["hsdp", "hsdp_offload", "tp2_fsdp2", "pp2_fsdp2", "pp2_tp2", "ep2_fsdp4"]


def _class(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def config_layout(name: str) -> tuple[object, str, dict, dict]:
    """(strategy, preset, model overrides, trainer kwargs) of ``configs/<name>.yaml``, as shipped: the
    strategy's default empty_init (the meta device on more than one rank)."""
    spec = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    trainer, model = spec["trainer"], spec["model"]["init_args"]
    strategy = trainer.get("strategy", "auto")
    if isinstance(strategy, str):
        from lightning.pytorch.strategies import StrategyRegistry

        entry = StrategyRegistry[strategy]
        strategy = entry["strategy"](**entry["init_params"])
    else:
        # fault_tolerance joins replica groups through a lighthouse; the layout inside a group,
        # which is what initialises the weights, is the rest of the arguments.
        init_args = {k: v for k, v in strategy.get("init_args", {}).items() if k != "fault_tolerance"}
        strategy = _class(strategy["class_path"])(**init_args)
    preset = model.get("config", "tiny")
    preset = "tiny" if preset not in ("tiny", "tiny-moe") else preset  # gpt2-124m: too large for CPU tests
    kwargs = {"precision": trainer.get("precision", "32-true")}
    return strategy, preset, dict(model.get("model_overrides") or {}), kwargs


def reference_model(preset: str, overrides: dict, cls: type[GPTModule] = GPTModule) -> GPTModule:
    """The module every run builds (before the strategy sees it); ``cls``: ``Recorded`` to train it."""
    return cls(preset, vocab_size=VOCAB, model_overrides={"block_size": SEQ, **overrides}, lr=3e-3,
               weight_decay=0.1, schedule="constant", warmup_steps=0)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class Recorded(GPTModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []
        self.micro = GLOBAL_BATCH

    def train_dataloader(self):
        ds = dataset()
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
        sampler = DistributedSampler(ds, shuffle=False, **kwargs) if kwargs else None
        return DataLoader(ds, batch_size=self.micro, sampler=sampler, shuffle=False)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))


class WeightsAtStart(L.Callback):
    """Every parameter and buffer this rank holds, made whole (DTensor.full_tensor), at train start."""

    def __init__(self, out: Path, run: str) -> None:
        self.out, self.run = out, run

    def path(self, rank: int) -> Path:
        return self.out / f"{self.run}.rank{rank}.pt"

    def on_train_start(self, trainer, pl_module):
        # The first values of this rank's training stream (what dropout draws from), put back.
        state = torch.get_rng_state()
        self.stream_head = torch.rand(4).tolist()
        torch.set_rng_state(state)
        full = {}
        for name, t in list(pl_module.named_parameters()) + list(pl_module.named_buffers()):
            t = t.detach()
            full[name] = (t.full_tensor() if isinstance(t, DTensor) else t).cpu().clone()
        torch.save(full, self.path(trainer.global_rank))


def build(run: str, devices: int):
    if run.startswith("config-"):
        strategy, preset, overrides, kwargs = config_layout(run.split("-", 1)[1])
    else:
        options, preset, overrides = LAYOUTS[run]
        strategy, kwargs = NDParallelStrategy(**options, empty_init=True), {"precision": "32-true"}
    return strategy, preset, overrides, kwargs


def fit_run(run: str, devices: int) -> dict:
    strategy, preset, overrides, kwargs = build(run, devices)
    out = Path(os.environ["LDT_LAUNCH_OUT"]) / "init"
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(SEED)
    model = reference_model(preset, overrides, Recorded)
    recorder = WeightsAtStart(out, run)
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=STEPS, callbacks=[recorder],
                        gradient_clip_val=CLIP,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, **kwargs)
    dims = trainer.strategy._make_parallel_dims(devices)
    model.micro = GLOBAL_BATCH // dims.dp_size
    trainer.fit(model)
    dims = trainer.strategy.parallel_dims
    return {"file": str(recorder.path(trainer.global_rank)), "losses": model.losses, "dp_rank": dims.dp_rank,
            "pp_rank": dims.local_rank("pp"),
            "cp_rank": dims.local_rank("cp"),
            "stream_head": recorder.stream_head,
            "dims": dims.degrees, "steps": trainer.global_step,
            "precision": kwargs["precision"], "preset": preset, "overrides": overrides}
