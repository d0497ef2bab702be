"""Callbacks under ``strategy="fsdp2"`` on 2 ranks, run by ``tests/multi_worker.py`` in the suite's
shared 2-rank launch: ``fit_run(RUN, DEVICES)`` returns what each rank saw."""

from __future__ import annotations

import torch
import lightning.pytorch as pl

import lightning_disttrain.strategies  # noqa: F401  (registers fsdp2)
from lightning_disttrain.callbacks import MFUMonitor, SelectiveActivationCheckpointing
from lightning_disttrain.module import GPTModule
from lightning_disttrain.parallel.activation import checkpoint_config_of


def _trainer(devices: int, steps: int, callbacks: list) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, strategy="fsdp2", max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks)


def mfu(devices: int) -> dict:
    from test_mfu import VOCAB, TokenData

    torch.manual_seed(0)
    monitor = MFUMonitor(window=2, warn_below=0.0)
    _trainer(devices, 3, [monitor]).fit(GPTModule("tiny", vocab_size=VOCAB), datamodule=TokenData(batch_size=2))
    return {"metrics": monitor.metrics, "dp": monitor._dp, "world": monitor._world}


def activation_checkpointing(devices: int) -> dict:
    from test_activation_checkpointing import VOCAB, BackwardOpCounter, RandomTokenData

    torch.manual_seed(0)
    counter, cb = BackwardOpCounter(), SelectiveActivationCheckpointing(policy="selective")
    trainer = _trainer(devices, 2, [cb, counter])
    module = GPTModule("tiny", vocab_size=VOCAB, lr=1e-3)
    trainer.fit(module, datamodule=RandomTokenData())
    return {"steps": trainer.strategy.parallelized_steps, "checkpointed": cb.checkpointed,
            "configured": [checkpoint_config_of(b) is not None for b in module.model.blocks],
            "backward_ops": counter.steps}


def float8(devices: int) -> dict:
    from test_float8 import VOCAB, PatternData

    from lightning_disttrain.callbacks import Float8Training

    class Losses(pl.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    torch.manual_seed(0)
    cb, losses = Float8Training(), Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="fsdp2" if devices > 1 else "auto",
                         max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         use_distributed_sampler=False, enable_model_summary=False, callbacks=[cb, losses],
                         precision="32-true")
    module = GPTModule("tiny", vocab_size=VOCAB, lr=1e-3, warmup_steps=0)
    trainer.fit(module, datamodule=PatternData(batch_size=4 // devices))
    w = module.model.blocks[0].attn.wq.weight
    local = getattr(w, "_local_tensor", w)
    return {"steps": trainer.strategy.parallelized_steps if devices > 1 else [],
            "all_gather": cb.fsdp_float8_all_gather, "converted": cb.converted,
            "weight": [type(w).__name__, type(local).__name__, str(w.dtype)],
            "precomputed": getattr(local, "_precomputed_scale", None) is not None, "losses": losses.losses}


def llama(devices: int) -> dict:
    import hf_models
    from test_third_party_models import _fit

    from lightning_disttrain.callbacks import Float8Training

    module = hf_models.HFCausalLM("llama")  # untied head: tie_word_embeddings=False
    # rowwise_with_gw_hp: every float8 scale is per row of one token (or of one weight row), so
    # splitting the batch over ranks does not change them; tensorwise scales would see half the
    # batch per rank. Emulated float8 on CPU, on both sides.
    sac, fp8 = SelectiveActivationCheckpointing(), Float8Training(recipe="rowwise_with_gw_hp")
    mfu_cb = MFUMonitor(window=2, warn_below=0.0, peak_flops=1e12)
    trainer = _fit(module, [sac, fp8, mfu_cb], steps=4, devices=devices, strategy="fsdp2" if devices > 1 else "auto")
    steps = trainer.strategy.parallelized_steps if devices > 1 else []  # "<stage>: <what ran>", in order
    return {"losses": module.losses, "stages": [s.split(":")[0] for s in steps], "checkpointed": sac.checkpointed,
            "converted": fp8.converted, "flops_per_token": mfu_cb.flops_per_token[hf_models.SEQ],
            "flops_source": mfu_cb.flops_source,
            "tokens_per_step": mfu_cb.metrics["perf/tokens_per_sec"] * mfu_cb.metrics["perf/step_time_s"],
            "sharded": type(module.model.model.layers[0].mlp.up_proj.weight).__name__}


RUNS = {"mfu": mfu, "activation_checkpointing": activation_checkpointing, "float8": float8, "llama": llama}


def fit_run(run: str, devices: int) -> dict:
    return RUNS[run](devices)
