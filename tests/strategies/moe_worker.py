"""A mixture-of-experts GPT under fsdp2 and expert parallel against one process: ``fit_run(RUN,
DEVICES)`` (run by ``tests/multi_worker.py`` in the suite's shared launches; the baseline in the
test process). Runs: ``single``, ``fsdp2``, ``ep`` (ep=2, every rank's FSDP-shard of the experts is
its whole half: 2 ranks) and ``ep_fsdp2`` (ep=2 x FSDP over the other 2 ranks, with selective
activation checkpointing: 4 ranks).

The same global batch of 8 per step on 1 or 2 ranks (fsdp2_worker's data and sampler). Recorded:
per-step losses (mean over the data-parallel ranks), every layer's ``expert_bias`` after training
(the bias update all-reduces the per-expert counts: both ranks must hold the single process's
bias) and the sums of every parameter."""

from __future__ import annotations

import lightning as L
from torch.distributed.tensor import DTensor

import fsdp2_worker as base
from lightning_disttrain.callbacks import SelectiveActivationCheckpointing
from lightning_disttrain.models.moe import moe_layers
from lightning_disttrain.strategies import NDParallelStrategy

STEPS = base.STEPS
MOE = dict(base.MODEL, n_layer=2, mlp="swiglu", mlp_hidden=64, moe_num_experts=4, moe_top_k=2,
           moe_shared_experts=1, moe_hidden=32, moe_bias_update_speed=0.01)


class MoEGPT(base.RecordedGPT):
    def __init__(self):
        super(base.RecordedGPT, self).__init__("tiny", vocab_size=base.VOCAB, model_overrides=MOE, lr=3e-3,
                                               weight_decay=0.1, schedule="constant", warmup_steps=0)
        self.micro_losses, self.norms_before, self.norms_after = [], [], []
        self.initial_checksum, self.micro_batch = None, base.GLOBAL_BATCH


def fit_run(run: str, devices: int) -> dict:
    L.seed_everything(0)
    model = MoEGPT()
    model.micro_batch = base.GLOBAL_BATCH // devices
    strategy = {"single": "auto", "fsdp2": "fsdp2", "ep": NDParallelStrategy(ep=2), "ep_sac": NDParallelStrategy(ep=2),
                "ep_fsdp2": NDParallelStrategy(ep=2)}[run]
    callbacks = [SelectiveActivationCheckpointing(policy="selective")] if run in ("ep_fsdp2", "ep_sac") else []
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", callbacks=callbacks,
                        max_steps=STEPS, gradient_clip_val=base.CLIP, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    trainer.fit(model)
    experts = model.model.blocks["0"].mlp.experts.w1 if run.startswith("ep") else None
    return {"losses": model.step_losses(1), "steps": trainer.global_step,
            "expert_local_shape": list(experts.to_local().shape) if isinstance(experts, DTensor) else None,
            "expert_placements": str(experts.placements) if isinstance(experts, DTensor) else None,
            "layout": getattr(trainer.strategy, "parallelized_steps", []),
            "bias": {str(i): layer.expert_bias.tolist() for i, layer in moe_layers(model.model).items()},
            "params": {n: float(base._full(p.detach()).double().sum()) for n, p in model.model.named_parameters()}}
