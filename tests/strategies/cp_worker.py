"""Context-parallel training runs through ``L.Trainer``; one process per rank.

    python cp_worker.py OUT_DIR DEVICES RUN [RUN ...]

A GPT with RoPE and grouped-query attention (4 query heads, 2 key/value heads) over sequences of
16 tokens; the cp ranks of a replica load the same samples and the strategy gives each its
load-balanced shard of every sequence. Each rank writes ``OUT_DIR/RUN.rankR.json`` with the
per-step losses (the mean over every rank: each holds the same number of tokens, TP ranks the
same loss) and what the strategy did. Importable: the single-process baseline runs in the test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp2_worker as base  # noqa: E402
from dist_utils import worker_main  # noqa: E402
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402

VARIANT = dict(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, mlp="swiglu", mlp_hidden=64, norm="rmsnorm",
               pos_emb="rope", tie_embeddings=False, block_size=base.SEQ)

# run -> NDParallelStrategy degrees
RUNS = {
    "cp2": dict(cp=2, dp_shard=1),
    "cp4": dict(cp=4, dp_shard=1),
    "cp2_dp2": dict(cp=2, dp_shard=2),
    "cp2_tp2": dict(cp=2, tp=2, dp_shard=1),
    "cp2_sac": dict(cp=2, dp_shard=1),
    "cp2_learned": dict(cp=2, dp_shard=1),
    "cp2_compile": dict(cp=2, dp_shard=1, compile={"backend": "eager"}),
    "cp2_pp2": dict(cp=2, pp=2, dp_shard=1),
    # 8 ranks, cp x pp x tp with sequence parallel (the default): the second stage's input is 1/tp of
    # the cp shard, its positions those the strategy sharded (issue 43)
    "cp2_pp2_tp2": dict(cp=2, pp=2, tp=2, dp_shard=1),
    "cp2_pp2_tp2_learned": dict(cp=2, pp=2, tp=2, dp_shard=1),
}


class CPGPT(base.RecordedGPT):
    def __init__(self, pos_emb: str = "rope") -> None:
        base.GPTModule.__init__(self, "tiny", vocab_size=base.VOCAB, model_overrides={**VARIANT, "pos_emb": pos_emb},
                                lr=3e-3, weight_decay=0.1, schedule="constant", warmup_steps=0)
        self.micro_losses, self.norms_before, self.norms_after = [], [], []
        self.initial_checksum, self.micro_batch = None, base.GLOBAL_BATCH

    def pipeline_training_step(self, batch, batch_idx, loss, aux_loss=None):
        self.micro_losses.append(loss.detach().clone())  # under pp: the batch's loss, on every rank
        return super().pipeline_training_step(batch, batch_idx, loss, aux_loss)

    def train_dataloader(self):
        # A resumed fit (global_step restored before this runs) starts after the batches trained.
        ds = base.dataset()
        start = self.trainer.global_step * base.GLOBAL_BATCH
        return self._loader(TensorDataset(*(t[start:] for t in ds.tensors)))

    def step_losses(self, accumulate: int = 1) -> list[float]:
        losses = torch.stack(self.micro_losses)
        if dist.is_initialized():
            dist.all_reduce(losses)
            losses /= dist.get_world_size()
        return losses.tolist()


def _trainer(strategy, devices: int, callbacks=(), max_steps: int = base.STEPS, ckpt_dir: Path | None = None):
    callbacks = list(callbacks)
    if ckpt_dir is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=RESUME_AT, save_top_k=-1,
                                         filename="step={step}", auto_insert_metric_name=False))
    return L.Trainer(callbacks=callbacks, strategy=strategy, devices=devices, accelerator="cpu", max_steps=max_steps,
                     gradient_clip_val=base.CLIP, logger=False, enable_checkpointing=ckpt_dir is not None,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def _fit(model: CPGPT, strategy, devices: int, dp: int, **kwargs) -> tuple[L.Trainer, list[float]]:
    model.micro_batch = base.GLOBAL_BATCH // dp
    trainer = _trainer(strategy, devices, **{k: v for k, v in kwargs.items() if k != "ckpt_path"})
    trainer.fit(model, ckpt_path=kwargs.get("ckpt_path"))
    return trainer, model.step_losses()


RESUME_AT = base.STEPS // 2
"""``resume`` / ``reshard``: the step whose checkpoint the second fit resumes from (half way)."""

PLANNED_MODELS = {"gpt2": {}, "llama-gqa": dict(mlp="swiglu", norm="rmsnorm", pos_emb="rope", bias=False, n_kv_head=2)}


def planned_activations(devices: int, seq: int = 64, batch: int = 2) -> list[dict]:
    """What three blocks keep for backward on this cp rank (cp = every rank of the launch, fp32,
    CPU), measured with ``activation_bytes`` as tests/planning/test_activations.py does for one
    process, beside the planner's terms (``planning.activations``) for the same shard."""
    from lightning_disttrain.models.context_parallel import ContextParallel, local_positions
    from lightning_disttrain.models.gpt import Block, GPTConfig, rope_tables
    from lightning_disttrain.parallel.activation import activation_bytes, apply_activation_checkpointing
    from lightning_disttrain.planning import shape_of
    from lightning_disttrain.planning.activations import stage_bytes

    assert dist.is_initialized(), "run 'activations' after a fit of the launch (it uses its process group)"
    rank, local = dist.get_rank(), seq // devices
    out = []
    for name, fields in PLANNED_MODELS.items():
        for policy in ("none", "selective", "full", "block"):
            torch.manual_seed(0)
            c = GPTConfig(**{"n_layer": 3, "n_head": 4, "n_embd": 128, "block_size": 128, **fields})
            blocks = torch.nn.ModuleDict({str(i): Block(c, i) for i in range(c.n_layer)})
            for block in blocks.values():
                block.attn.context_parallel = ContextParallel(dist.group.WORLD, rank, devices)
            apply_activation_checkpointing(blocks, policy, every_k=2)
            rope = tuple(t[local_positions(seq, rank, devices)] for t in rope_tables(c)) if c.pos_emb == "rope" else None
            x = torch.randn(batch, local, c.n_embd, requires_grad=True)

            def forward():
                y = x * 1.0
                for block in blocks.values():
                    y = block(y, rope)
                return y

            y, alive = activation_bytes(forward, settle_s=5.0)
            shape, kw = shape_of(c, seq), dict(e=4, cp=devices, cpu=True, seq_len=seq)
            planned = stage_bytes(shape, range(3), policy, 2, **kw) * local * batch
            out.append({"model": name, "policy": policy, "measured": alive - y.numel() * 4, "planned": planned,
                        "kv_shard": batch * local * shape.kv_dim * 4})
    return out


def fit_run(run: str, devices: int) -> dict:
    if run == "activations":
        return {"activations": planned_activations(devices)}
    L.seed_everything(0)
    if run in ("single", "single_learned"):
        trainer, losses = _fit(CPGPT("learned" if run.endswith("learned") else "rope"), "auto", 1, 1)
        return {"losses": losses}
    out = Path(os.environ.get("LDT_LAUNCH_OUT", "/tmp")) / f"cp_{run}_{devices}"
    ckpt = str(out / f"step={RESUME_AT}.ckpt")
    if run == "reshard":  # cp=2 saves at step RESUME_AT; dp=2 (cp=1) on the same 2 ranks resumes it
        _fit(CPGPT(), NDParallelStrategy(cp=2, dp_shard=1), devices, 1, ckpt_dir=out)
        L.seed_everything(0)
        trainer, losses = _fit(CPGPT(), NDParallelStrategy(dp_shard=2), devices, 2, ckpt_path=ckpt)
        return {"resumed": losses}
    if run == "resume":  # cp=2 saves at step RESUME_AT and resumes with cp=2
        _fit(CPGPT(), NDParallelStrategy(cp=2, dp_shard=1), devices, 1, ckpt_dir=out)
        L.seed_everything(0)
        trainer, losses = _fit(CPGPT(), NDParallelStrategy(cp=2, dp_shard=1), devices, 1,
                               ckpt_path=ckpt)
        return {"resumed": losses}
    degrees = RUNS[run]
    callbacks = []
    if run.endswith("sac"):
        from lightning_disttrain.callbacks import SelectiveActivationCheckpointing

        callbacks.append(SelectiveActivationCheckpointing())
    strategy = NDParallelStrategy(**degrees)
    dp = devices // (degrees["cp"] * degrees.get("tp", 1) * degrees.get("pp", 1))
    model = CPGPT("learned" if run.endswith("learned") else "rope")
    from lightning_disttrain import comm

    shift, shifts = comm.ring_shift, []

    def counted(tensors, group):  # ring attention's transfers (a recomputed block must not repeat them)
        shifts.append(len(tensors))
        return shift(tensors, group)

    comm.ring_shift = counted
    try:
        trainer, losses = _fit(model, strategy, devices, dp, callbacks=callbacks)
    finally:
        comm.ring_shift = shift
    x = torch.arange(base.SEQ).view(1, -1)
    return {"losses": losses, "steps": strategy.parallelized_steps, "tokens_seen": model.tokens_seen,
            "ring_shifts": len(shifts),
            "sampler": strategy.distributed_sampler_kwargs,
            "shard": strategy._shard_batch((x,))[0].view(-1).tolist()}


if __name__ == "__main__":
    worker_main(fit_run)
