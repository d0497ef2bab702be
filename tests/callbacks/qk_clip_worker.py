"""QK-clip (``callbacks.QKClip``) on a small grouped-query GPT trained hard enough for its logits to
grow, under each layout against one process: per step the loss, the step's largest logit (before
its clip) and how many heads were clipped; then the final weights' largest logit per head on a
fixed batch, computed in one process from the gathered weights.

    python multi_worker.py OUT_DIR DEVICES qk_clip_worker:RUN

RUN: ``one`` / ``one_noclip`` (one process, with / without the clip), ``one_muon`` (MuonClip, one
process), ``tp2``, ``cp2``, ``pp2``, ``fsdp2``, ``fsdp2_muon`` (2 ranks); ``fsdp2_tp2`` (4 ranks) and
its reference ``one_mha``: multi-head attention with biases (the key rows scaled too);
``fsdp2_accum`` (2 ranks) and ``one_accum``: two micro-batches per optimizer step.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_disttrain import GPTModule
from lightning_disttrain.callbacks import QKClip
from lightning_disttrain.strategies import NDParallelStrategy

STEPS, GLOBAL_BATCH, SEQ, VOCAB, TAU = 8, 8, 16, 64, 0.25
MODEL = dict(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, block_size=SEQ, dropout=0.0, tie_embeddings=False)  # pp2: untied
MHA = dict(MODEL, n_kv_head=4, bias=True)
ACCUMULATE = 2
STRATEGIES = {"tp2": dict(tp=2), "cp2": dict(cp=2, dp_shard=1), "fsdp2": dict(dp_shard=2), "fsdp2_accum": dict(dp_shard=2),
              "fsdp2_muon": dict(dp_shard=2), "fsdp2_tp2": dict(dp_shard=2, tp=2),
              "pp2": dict(pp=2, pp_schedule="1F1B", pp_microbatches=2)}


def dataset() -> TensorDataset:
    # a repeated pattern the model learns fast: its attention sharpens and the logits grow
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    tokens = base.repeat(GLOBAL_BATCH * STEPS // 4, 1)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class Steps(L.Callback):
    """Per step, after QKClip's hook: the loss (every rank's mean), the step's largest logit and
    the clipped heads (QKClip reads them at every logging step: every step here)."""

    monitor = "train/loss"  # GPTModule then logs (and averages over the ranks) the loss at every step

    def __init__(self, clip: QKClip | None):
        self.clip, self.losses, self.max_logits, self.clipped = clip, [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train/loss"].item())
        if self.clip is not None and trainer.global_step > len(self.max_logits):  # an optimizer step ended
            self.max_logits.append(self.clip.max_logit)
            self.clipped.append(self.clip.clipped_heads)


class Module(GPTModule):
    def train_dataloader(self):
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
        ds = dataset()
        sampler = DistributedSampler(ds, shuffle=False, **kwargs) if kwargs else None
        micro = GLOBAL_BATCH // (kwargs["num_replicas"] if kwargs else 1) // self.accumulate
        return DataLoader(ds, batch_size=micro, sampler=sampler, shuffle=False)

    def configure_optimizers(self):
        out = super().configure_optimizers()
        if self.hparams.optimizer == "muon":  # the iteration in fp32: parity with one process to fp32 rounding
            out["optimizer"].optimizers[0].ns_dtype = torch.float32
        return out


def final_max_logits(module: GPTModule) -> list[list[float]]:
    """Each head's largest logit on the first batch with the run's final weights (one process)."""
    from lightning_disttrain.models.gpt import GPT

    config = module.model.config
    state = {}
    for name, p in module.model.state_dict().items():
        state[name] = p.full_tensor() if isinstance(p, DTensor) else p
    return max_logits_of(GPT(config), state)


def max_logits_of(model, state: dict | None) -> list[list[float]]:
    if state is not None:
        model.load_state_dict(state, strict=False)  # a pipeline stage holds part of the layers: see the caller
    attns = [b.attn for b in model.blocks]
    for a in attns:
        a.track_max_logit, a.max_logit = True, None
    model.train()
    with torch.no_grad():
        model(dataset().tensors[0][:GLOBAL_BATCH])
    return [a.max_logit.tolist() for a in attns]


def fit_run(run: str, devices: int) -> dict:
    clip = None if run == "one_noclip" else QKClip(tau=TAU)
    optimizer = "muon" if run.endswith("muon") else "adamw"
    accumulate = ACCUMULATE if run.endswith("accum") else 1
    L.seed_everything(0)
    module = Module("tiny", vocab_size=VOCAB, optimizer=optimizer, lr=2e-2, muon_lr=0.1, warmup_steps=0,
                    model_overrides=MHA if run in ("fsdp2_tp2", "one_mha") else MODEL)
    module.accumulate = accumulate
    steps = Steps(clip)
    strategy = NDParallelStrategy(**STRATEGIES[run]) if devices > 1 else "auto"
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=STEPS,
                        callbacks=[c for c in (clip, steps) if c is not None], logger=False, log_every_n_steps=1,
                        accumulate_grad_batches=accumulate,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0)
    trainer.fit(module)
    out = {"losses": steps.losses, "max_logits": steps.max_logits, "clipped": steps.clipped,
           "tracking_off": all(not a.track_max_logit for a in module.model.modules() if hasattr(a, "track_max_logit"))}
    if not run.startswith("pp"):
        out["final"] = final_max_logits(module)
    return out
