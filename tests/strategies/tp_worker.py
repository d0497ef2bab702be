"""Tensor-parallel training runs through ``L.Trainer``; one process per rank.

    python tp_worker.py OUT_DIR DEVICES RUN [RUN ...]

Every TP rank of a replica reads the same batches (the strategy's sampler counts data-parallel
ranks only), so with dp=1 each rank sees the single process's global batch. Each rank writes
``OUT_DIR/RUN.rankR.json``: the per-step losses (already the global mean), what the strategy did
and layout facts. Importable: the tests run the single-process baselines with ``fit_run``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp2_worker as base  # noqa: E402
from dist_utils import worker_main  # noqa: E402
from lightning_disttrain.parallel.plan import ParallelPlan  # noqa: E402
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402

VARIANT = dict(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, mlp="swiglu", mlp_hidden=64, norm="rmsnorm",
               pos_emb="rope", qk_norm=True, tie_embeddings=False, block_size=base.SEQ, pad_vocab_multiple=48)
"""GQA (4 query, 2 key/value heads: 2 and 1 per TP rank), SwiGLU, RMSNorm, RoPE, QK-norm, untied head,
and a vocabulary of 64 padded to 96: rank 1's vocabulary shard holds 16 real and 32 padding columns,
which loss parallel must mask (the single process cuts them off)."""


class VariantGPT(base.RecordedGPT):
    def __init__(self) -> None:
        base.GPTModule.__init__(self, "tiny", vocab_size=base.VOCAB, model_overrides=VARIANT, lr=3e-3,
                                weight_decay=0.1, schedule="constant", warmup_steps=0)
        self.micro_losses, self.norms_before, self.norms_after = [], [], []
        self.initial_checksum, self.micro_batch = None, base.GLOBAL_BATCH


class MixerLM(L.LightningModule):
    """Not a GPT: an MLP token model whose author wrote its own tensor-parallel plan."""

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, 4 * dim)
            self.down = nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.down(F.relu(self.up(self.norm(x))))

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(base.VOCAB, 32)
        self.layers = nn.ModuleList(self.Block(32) for _ in range(2))
        self.head = nn.Linear(32, base.VOCAB)
        self.micro_losses: list[torch.Tensor] = []

    def parallel_plan(self) -> ParallelPlan:
        # Sequence parallel between the layers; the head's logits gathered (no loss parallel).
        return ParallelPlan(
            blocks=self.layers,
            tp_block_plan={"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                           "down": RowwiseParallel(output_layouts=Shard(1))},
            tp_root_plan={"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                          "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.micro_losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        return base.RecordedGPT._loader(self, base.dataset())

    micro_batch = base.GLOBAL_BATCH


# name -> (model class, strategy kwargs, callbacks)
RUNS = {
    "single": (base.RecordedGPT, None, ()),
    "single_variant": (VariantGPT, None, ()),
    "single_mixer": (MixerLM, None, ()),
    "tp2": (base.RecordedGPT, dict(tp=2), ()),
    "tp2_nosp": (base.RecordedGPT, dict(tp=2, sequence_parallel=False), ()),
    "tp2_nolp": (base.RecordedGPT, dict(tp=2, loss_parallel=False), ()),
    "tp2_variant": (VariantGPT, dict(tp=2), ()),
    "tp2_sac": (base.RecordedGPT, dict(tp=2), ("sac",)),
    "tp2_fullac": (base.RecordedGPT, dict(tp=2), ("full_ac",)),
    "single_float8": (base.RecordedGPT, None, ("float8",)),
    "tp2_float8": (base.RecordedGPT, dict(tp=2), ("float8",)),
    "tp2_mixer": (MixerLM, dict(tp=2), ()),
    "tp2_compile": (base.RecordedGPT, dict(tp=2, compile={"backend": "aot_eager"}), ("sac",)),
    "fsdp2_tp": (base.RecordedGPT, dict(dp_shard=2, tp=2), ()),
}


COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


class BackwardCollectives(L.Callback):
    """Counts the functional collectives (TP's all-gathers / reduce-scatters / all-reduces) that run
    during each backward: recomputing a checkpointed block would run its forward ones again."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = []

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] in COLLECTIVES:
                    counts[-1] += 1
                return func(*args, **(kwargs or {}))

        self._mode_cls, self._mode = Count, None

    def on_before_backward(self, trainer, pl_module, loss):
        self.counts.append(0)
        self._mode = self._mode_cls()
        self._mode.__enter__()

    def on_after_backward(self, trainer, pl_module):
        self._mode.__exit__(None, None, None)


def _callbacks(names) -> list:
    from lightning_disttrain.callbacks import Float8Training, SelectiveActivationCheckpointing

    out: list = [BackwardCollectives()]
    for n in names:
        if n == "sac":
            out.append(SelectiveActivationCheckpointing())
        elif n == "full_ac":
            out.append(SelectiveActivationCheckpointing(policy="full"))
        elif n == "float8":
            out.append(Float8Training(recipe="tensorwise"))
    return out


def fit_run(run: str, devices: int) -> dict:
    cls, strategy_kwargs, callbacks = RUNS[run]
    L.seed_everything(0)
    model = cls()
    dp = devices // strategy_kwargs.get("tp", 1) if strategy_kwargs else 1
    model.micro_batch = base.GLOBAL_BATCH // dp
    strategy = NDParallelStrategy(**strategy_kwargs) if strategy_kwargs else "auto"
    callbacks = _callbacks(callbacks)
    trainer = L.Trainer(strategy=strategy, devices=devices, accelerator="cpu", max_steps=base.STEPS,
                        gradient_clip_val=base.CLIP if cls is not MixerLM else None, callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model)
    losses = torch.stack(model.micro_losses)
    result = {"losses": losses.tolist(), "backward_collectives": callbacks[0].counts}
    if hasattr(model, "generate"):  # the same tokens on every rank, and as in one process
        result["generated"] = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, seed=1).tolist()
    if dist.is_initialized():
        group = trainer.strategy.dp_process_group  # each data-parallel replica's own batch, averaged
        dist.all_reduce(losses, group=group)
        losses /= dist.get_world_size(group)
        result["losses"] = losses.tolist()
        net = model.model if hasattr(model, "model") else model
        blocks = net.blocks if hasattr(net, "blocks") else net.layers
        w = next(p for n, p in blocks[0].named_parameters() if n.endswith(("wq.weight", "up.weight")))
        result.update(
            steps=trainer.strategy.parallelized_steps,
            sampler=trainer.strategy.distributed_sampler_kwargs,
            placements=[str(p) for p in w.placements] if isinstance(w, DTensor) else "plain",
            mesh_dims=list(w.device_mesh.mesh_dim_names) if isinstance(w, DTensor) else [],
            local_shape=list(w.to_local().shape) if isinstance(w, DTensor) else list(w.shape),
            tied=(net.lm_head.weight is net.wte.weight) if hasattr(net, "lm_head") else None,
            checkpointed=[getattr(b, "_ldt_activation_checkpoint", None) is not None for b in blocks],
            float8=[type(m).__name__ for n, m in blocks[0].named_modules() if n in ("attn.wq", "mlp.w2")],
        )
    return result


if __name__ == "__main__":
    worker_main(fit_run)
