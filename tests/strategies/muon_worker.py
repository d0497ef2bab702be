"""The hybrid Muon optimizer under fsdp2 (DTensor gradients) vs one process: per-step losses, the
Muon matrices' full weights after each step, and each optimizer step's collectives (CommDebugMode)
and time, from the Muon part's start to the AdamW part's end (the closure's forward and backward,
which Lightning runs inside ``optimizer.step``, are outside).

    python multi_worker.py OUT_DIR DEVICES muon_worker:RUN

RUN: a strategy name (``fsdp2``, ``fsdp2_zero2``, ``auto``), ``hsdp2x2`` (dp_replicate=2 x
dp_shard=2), ``tp2`` (tensor parallel over 2 ranks) or ``fsdp2tp2x2`` (dp_shard=2 x tp=2);
``STRATEGY+fp32``: the Newton-Schulz iteration in fp32; ``STRATEGY+torch``:
``torch.optim.Muon`` on the DTensors (the path before issue 41; measurements only); ``resume`` /
``reshard``: a DCP checkpoint of Muon's state resumed on the same layout / on another
(``resume_run``).
"""

import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_disttrain import GPTModule  # noqa: E402  (registers fsdp2)
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 6, 8, 16, 64


class Losses(L.Callback):
    monitor = "train/loss"  # read at every step: GPTModule then logs (and averages) the loss every step

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train/loss"].item())  # sync_dist: the global mean


class OptimizerSteps(L.Callback):
    """Per optimizer step: the collectives and seconds of the Muon and AdamW parts' steps, and the
    Muon matrices' full weights after it by name (gathered outside the measured span)."""

    def __init__(self):
        self.collectives, self.seconds, self.weights = [], [], []

    def on_train_start(self, trainer, pl_module):
        parts = trainer.optimizers[0].optimizers
        self.muon, self.parts = parts[0], parts
        self.names = {id(p): n for n, p in pl_module.named_parameters()}  # a pipeline stage: its own layers
        parts[0].register_step_pre_hook(self._start)
        parts[-1].register_step_post_hook(self._stop)

    def _start(self, *_):
        self.mode = CommDebugMode()
        self.mode.__enter__()
        self.t0 = time.perf_counter()

    def _stop(self, *_):
        self.seconds.append(time.perf_counter() - self.t0)
        self.mode.__exit__(None, None, None)
        self.collectives.append(self.mode.get_total_counts())
        muon = self.parts[:-1]  # the matrices' Muon (and the experts' stacks'), not AdamW
        full = {self.names[id(p)]: p.full_tensor() if isinstance(p, DTensor) else p
                for part in muon for g in part.param_groups for p in g["params"]}
        self.weights.append({n: w.detach().flatten().tolist() for n, w in full.items()})


class TorchMuonModule(GPTModule):
    """``torch.optim.Muon`` on the DTensors in place of the package's Muon (the path before issue 41)."""

    def configure_optimizers(self):
        out = super().configure_optimizers()
        parts = out["optimizer"].optimizers
        parts[0] = torch.optim.Muon(parts[0].param_groups)  # the same groups (lr, schedule's initial_lr)
        return out


class Fp32MuonModule(GPTModule):
    """The package's Muon with its Newton-Schulz iteration in fp32 (``ShardedMuon.ns_dtype``, and
    ``ExpertMuon``'s for a mixture of experts' stacks)."""

    def configure_optimizers(self):
        out = super().configure_optimizers()
        for part in out["optimizer"].optimizers:
            if hasattr(part, "ns_dtype"):
                part.ns_dtype = torch.float32
        return out


LAYOUTS = {"pp2": dict(pp=2, pp_schedule="1F1B", pp_microbatches=2), "cp2": dict(cp=2, dp_shard=1),
           "offload": dict(cpu_offload=True), "ep2": dict(ep=2),
           "pp2fsdp2": dict(pp=2, dp_shard=2, pp_schedule="1F1B", pp_microbatches=2),
           "cp2dp2": dict(cp=2, dp_shard=2), "ep2fsdp4": dict(dp_shard=4, ep=2)}
MOE = dict(mlp="swiglu", mlp_hidden=64, moe_num_experts=4, moe_top_k=2, moe_hidden=32, moe_bias_update_speed=0.01)
"""The other layouts Muon runs under (2 and 4 ranks), by run name."""

RESUME_AT = 3
"""Resume runs: the first fit saves here (and trains on to STEPS); the second resumes from it to STEPS."""


def _loader(trainer: L.Trainer, start: int = 0) -> DataLoader:
    """Steps ``start``..STEPS of the run's data, this rank's part of each global batch."""
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    # Data-parallel rank r takes slice r of every global batch (Lightning's own sampler would
    # shuffle; the tensor-parallel ranks of one replica read the same), so each step's global batch
    # is the same 8 samples as the one-process run's; a resumed fit starts at its first untrained step.
    ranks = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    rank, micro = ranks["rank"], GLOBAL_BATCH // ranks["num_replicas"]
    order = [s * GLOBAL_BATCH + rank * micro + i for s in range(start, STEPS) for i in range(micro)]
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=micro, sampler=order)


def _fit(strategy, devices: int, impl: str = "", ckpt_dir: Path | None = None, ckpt_path=None, moe: bool = False):
    module_class = {"torch": TorchMuonModule, "fp32": Fp32MuonModule, "": GPTModule}[impl]
    # untied: a pipeline's first and last stages cannot share the embedding (the same model in every run)
    overrides = dict(n_layer=2, n_embd=32, n_head=2, block_size=SEQ, tie_embeddings=False)
    if isinstance(strategy, str) and strategy.startswith("moe_"):
        strategy, moe = strategy[len("moe_"):], True
    if moe:  # a mixture of experts: the routed experts' stacks on ExpertMuon, the other matrices on ShardedMuon
        overrides = {**overrides, **MOE}
    module = module_class("tiny", vocab_size=VOCAB, optimizer="muon", lr=1e-3, muon_lr=0.02,
                          model_overrides=overrides)
    # built when fit asks for it: a resumed fit (global_step restored by then) starts after the trained steps
    module.train_dataloader = lambda: _loader(module.trainer, module.trainer.global_step)
    losses, steps = Losses(), OptimizerSteps()
    callbacks = [losses, steps]
    if isinstance(strategy, str) and strategy.endswith("_float8"):  # torchao float8 Linears (FSDP2: float8 all-gathers)
        from lightning_disttrain.callbacks import Float8Training

        strategy = strategy[:-len("_float8")]
        callbacks.append(Float8Training())
    if ckpt_dir is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=RESUME_AT, save_top_k=-1,
                                         filename="step={step}", auto_insert_metric_name=False))
    if strategy == "hsdp2x2":
        strategy = NDParallelStrategy(dp_replicate=2)
    elif strategy == "tp2":
        strategy = NDParallelStrategy(tp=2)
    elif strategy == "fsdp2tp2x2":
        strategy = NDParallelStrategy(dp_shard=2, tp=2)
    elif strategy in LAYOUTS:
        strategy = NDParallelStrategy(**LAYOUTS[strategy])
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=STEPS,
                        callbacks=callbacks, logger=False, enable_checkpointing=ckpt_dir is not None,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, losses, steps


def resume_run(run: str, devices: int) -> dict:
    """A mixture of experts (so the experts' ``ExpertMuon`` state travels too), fp32 Newton-Schulz:
    fsdp2 x2 trains STEPS uninterrupted, saving at RESUME_AT through the strategy (DCP,
    ``ModelCheckpoint``); ``resume``: fsdp2 x2 resumes from that checkpoint; ``reshard``: HSDP over
    the same ranks does (dp_replicate=2 x dp_shard=1: every weight and Muon momentum replicated, not
    sharded). Returns the resumed steps and the uninterrupted run's."""
    out = Path(os.environ.get("LDT_LAUNCH_OUT", "/tmp")) / f"muon_{run}_{devices}"
    L.seed_everything(0)
    _, first, first_steps = _fit("fsdp2", devices, "fp32", ckpt_dir=out, moe=True)
    L.seed_everything(0)
    strategy = "fsdp2" if run == "resume" else NDParallelStrategy(dp_replicate=2, dp_shard=1)
    trainer, losses, steps = _fit(strategy, devices, "fp32", ckpt_path=str(out / f"step={RESUME_AT}.ckpt"), moe=True)
    momentum = [s["momentum_buffer"] for part in steps.parts[:-1] for s in part.state.values()]
    placements = sorted({str(tuple(m.placements)) for m in momentum if isinstance(m, DTensor)})
    return {"losses": losses.losses, "weights": steps.weights, "muon": [type(p).__name__ for p in steps.parts],
            "momentum_placements": placements, "momenta": len(momentum), "global_step": trainer.global_step,
            "uninterrupted": {"losses": first.losses, "weights": first_steps.weights}}


def fit_run(run: str, devices: int) -> dict:
    if run in ("resume", "reshard"):
        return resume_run(run, devices)
    strategy, _, impl = run.partition("+")
    L.seed_everything(0)
    trainer, losses, steps = _fit(strategy, devices, impl)
    placements = sorted({str(tuple(p.placements)) for g in steps.muon.param_groups for p in g["params"]
                         if isinstance(p, DTensor)})
    return {"losses": losses.losses, "collectives": steps.collectives, "step_seconds": steps.seconds,
            "weights": steps.weights, "muon": type(steps.muon).__name__, "placements": placements}
