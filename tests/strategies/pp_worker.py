"""Pipeline-parallel training runs through ``L.Trainer``; one process per rank.

    python pp_worker.py OUT_DIR DEVICES RUN [RUN ...]

Every rank of a pipeline reads the same batches (the sampler counts data-parallel ranks only).
Each rank writes ``OUT_DIR/RUN.rankR.json``: the per-step losses it logged (the mean over the
step's micro-batches, sent from the last stage), the validation loss, the sum of every parameter
it holds after training (by FQN, whole) and what the strategy did. Importable: the test runs the
one-process baseline with ``fit_run(RUN, 1)``.

``moe_*`` runs train a mixture of experts (the "tiny-moe" preset at this file's width) with its
balance and z losses on: their losses are the differentiated ones (cross-entropy + the auxiliary
losses of every stage), with the auxiliary part and each layer's balancing bias recorded too.
Every run records FSDP's reduce-scatters per training batch (``fsdp2_worker`` counts the calls of
``torch.distributed.reduce_scatter_single``, through which FSDP reduces each unit's gradients).
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp2_worker as base  # noqa: E402
from dist_utils import worker_main  # noqa: E402
from fsdp2_worker import CLIP, GLOBAL_BATCH, SEQ, STEPS, VOCAB, dataset  # noqa: E402
from lightning_disttrain.callbacks import MFUMonitor, SelectiveActivationCheckpointing  # noqa: E402
from lightning_disttrain.models.moe import moe_layers  # noqa: E402
from lightning_disttrain.module import GPTModule  # noqa: E402
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402

MODEL = dict(n_layer=4, n_embd=32, n_head=2, n_kv_head=2, mlp_hidden=64, block_size=SEQ, tie_embeddings=False)
# "tiny-moe": block 0 dense, blocks 1-3 four experts, top-2. Loss weights large enough that the
# auxiliary losses move the loss by ~0.2 and the routers' gradients visibly.
MOE = dict(MODEL, moe_hidden=32, moe_aux_loss_coef=0.05, moe_z_loss_coef=0.01, moe_bias_update_speed=0.01)

RUNS: dict[str, tuple[dict, int]] = {
    # name: (NDParallelStrategy kwargs, accumulate_grad_batches)
    "single": ({}, 1),
    "single_accum": ({}, 2),
    "pp2_gpipe_accum": (dict(pp=2, pp_schedule="GPipe", pp_microbatches=2), 2),  # + gradient accumulation
    # + selective activation checkpointing and per-block compile (eager backend) inside the stage
    "pp2_1f1b": (dict(pp=2, pp_schedule="1F1B", pp_microbatches=4, compile={"backend": "eager"}), 1),
    "pp2_interleaved": (dict(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=4), 1),
    # + full recompute of every block: the zero-bubble split backward (inputs, then weights) through it
    "pp2_zbv": (dict(pp=2, pp_schedule="ZBVZeroBubble", pp_microbatches=4), 1),
    "pp2_fsdp2": (dict(pp=2, dp_shard=2, pp_schedule="1F1B", pp_microbatches=2), 1),  # + MFUMonitor
    "pp2_tp2": (dict(pp=2, tp=2, pp_schedule="1F1B", pp_microbatches=2), 1),
    "pp2_fsdp2_tp2": (dict(pp=2, dp_shard=2, tp=2, pp_schedule="Interleaved1F1B", pp_microbatches=4), 1),
    # pp x FSDP with gradient accumulation (4 ranks): by default a reduce-scatter per unit at every
    # schedule step; with accumulate_unsharded_grads one per unit per optimizer step
    "pp2_fsdp2_accum": (dict(pp=2, dp_shard=2, pp_schedule="1F1B", pp_microbatches=2), 2),
    "pp2_fsdp2_accum_unsharded": (dict(pp=2, dp_shard=2, pp_schedule="1F1B", pp_microbatches=2,
                                       accumulate_unsharded_grads=True), 2),
    # mixture of experts (MOE): the stage is the model (1F1B), and views of it (interleaved, stage 0
    # without an MoE layer) with gradient accumulation
    "moe_single": ({}, 1),
    "moe_single_accum": ({}, 2),
    "moe_pp2_1f1b": (dict(pp=2, pp_schedule="1F1B", pp_microbatches=2), 1),
    "moe_pp2_interleaved_accum": (dict(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=4), 2),
}
CHECKPOINTING = {"pp2_1f1b": "selective", "pp2_zbv": "full"}
BASELINE = {name: ("moe_" if name.startswith("moe_") else "") + ("single_accum" if accumulate == 2 else "single")
            for name, (_, accumulate) in RUNS.items()}


class PPGPT(GPTModule):
    def __init__(self, moe: bool = False) -> None:
        super().__init__("tiny-moe" if moe else "tiny", vocab_size=VOCAB, model_overrides=MOE if moe else MODEL,
                         lr=3e-3, weight_decay=0.1, schedule="constant", warmup_steps=0)
        self.logged: list[float] = []
        self.aux_logged: list[float] = []
        self.reduce_scatters: list[int] = []
        self.micro_batch = GLOBAL_BATCH

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)  # cross-entropy + the MoE auxiliary losses
        self.logged.append(float(loss.detach()))
        if self.config.moe_num_experts:
            self.aux_logged.append(float(self.model.moe_aux_loss.detach()))
        return loss

    def pipeline_training_step(self, batch, batch_idx, loss, **kwargs):
        out = super().pipeline_training_step(batch, batch_idx, loss, **kwargs)
        self.logged.append(float(out.detach()))  # what the module differentiated, as training_step's
        if self.config.moe_num_experts:
            self.aux_logged.append(float(kwargs.get("aux_loss", 0.0)))
        return out

    def on_train_batch_start(self, batch, batch_idx):
        self._scatters_before = base._REDUCE_SCATTERS[0]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.reduce_scatters.append(base._REDUCE_SCATTERS[0] - self._scatters_before)

    _loader = base.RecordedGPT._loader  # the strategy's sampler arguments, no shuffling

    def train_dataloader(self):
        return self._loader(dataset())


def param_sums(module: torch.nn.Module) -> dict[str, float]:
    return {n: float((p.full_tensor() if isinstance(p, DTensor) else p).detach().double().sum())
            for n, p in module.named_parameters()}


def fit_run(run: str, devices: int) -> dict:
    kwargs, accumulate = RUNS[run]
    dims = kwargs.get("dp_shard", 1)
    L.seed_everything(0)
    model = PPGPT(moe=run.startswith("moe_"))
    model.micro_batch = GLOBAL_BATCH // (dims * accumulate)
    strategy = NDParallelStrategy(**kwargs) if devices > 1 else "auto"
    callbacks = []
    if run in CHECKPOINTING:
        callbacks.append(SelectiveActivationCheckpointing(policy=CHECKPOINTING[run]))
    if run == "pp2_fsdp2":  # analytic FLOPs per token; a stated peak (no CPU micro-benchmark)
        callbacks.append(MFUMonitor(peak_flops=1e12, window=2, log_every_n_steps=1))
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=STEPS, callbacks=callbacks,
                        accumulate_grad_batches=accumulate, gradient_clip_val=CLIP, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(model)
    val_set = TensorDataset(*(t[: 2 * GLOBAL_BATCH] for t in dataset().tensors))
    val = trainer.validate(model, dataloaders=model._loader(val_set), verbose=False)
    logged = torch.tensor(model.logged, dtype=torch.float64)
    if devices > 1:  # the logged loss is each data-parallel rank's: average them as self.log(sync_dist) does
        dp = trainer.strategy.parallel_dims.get_mesh("dp")
        dist.all_reduce(logged, group=dp.get_group())
        logged /= dp.size()
    losses = logged.view(-1, accumulate).mean(dim=1).tolist()
    result = {"losses": losses, "val_loss": val[0]["val/loss"], "params": param_sums(model.model),
              "steps": trainer.global_step, "reduce_scatters": model.reduce_scatters}
    if model.config.moe_num_experts:  # one data-parallel rank in these runs: no average needed
        result["aux_losses"] = torch.tensor(model.aux_logged).view(-1, accumulate).mean(dim=1).tolist()
        result["bias"] = {str(i): layer.expert_bias.tolist() for i, layer in moe_layers(model.model).items()}
    for callback in callbacks:
        if isinstance(callback, SelectiveActivationCheckpointing):
            result["checkpointed"] = callback.checkpointed  # block indices of this rank's stages
        else:
            m = callback.metrics  # tokens and FLOPs per optimizer step, from the window's rates
            result["mfu"] = {"tokens_per_step": m["perf/tokens_per_sec"] * m["perf/step_time_s"],
                             "flops_per_step": m["perf/tflops_per_device"] * 1e12 * trainer.world_size
                             * m["perf/step_time_s"], "flops_per_token": callback.flops_per_token}
    blocks = model.model.blocks
    result["compiled_blocks"] = sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    if devices > 1:
        result["parallelized_steps"] = trainer.strategy.parallelized_steps
        result["sampler"] = trainer.strategy.distributed_sampler_kwargs
    result["generated"] = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, temperature=0).tolist()
    return result


if __name__ == "__main__":
    worker_main(fit_run)
