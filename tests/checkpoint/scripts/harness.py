"""Pieces shared by the checkpoint scenario scripts: strategy, module, data, recorder.

Every scenario runs the project's own ``NDParallelStrategy`` (FSDP2 over all ranks, DCP
checkpoints through its ``DCPCheckpointMixin``) and ``GPTModule``: there is no stand-in.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from lightning_disttrain.checkpoint.dcp_io import unwrap_optimizer
from lightning_disttrain.module import GPTModule
from lightning_disttrain.strategies.nd_parallel import NDParallelStrategy

VOCAB = 257
SEQ_LEN = 32
MICRO_BATCH = 2
N_SAMPLES = 4096


def build_strategy(async_save: bool = False, tp: int = 1, pp: int = 1, ep: int = 1) -> NDParallelStrategy:
    # pp=2: 1F1B over the 2 ranks, each batch of MICRO_BATCH split into 2 micro-batches
    pipeline = dict(pp=pp, pp_schedule="1F1B", pp_microbatches=2) if pp > 1 else {}
    return NDParallelStrategy(async_save=async_save, tp=tp, ep=ep, **pipeline)


def strategy_kind(strategy) -> str:
    return type(strategy).__name__


MOE = dict(mlp="swiglu", moe_num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_hidden=32,
           moe_bias_update_speed=0.01)
"""The expert-parallel jobs' mixture of experts (the balancing bias is state a resume must restore)."""


def build_module(total_steps: int = 12, untied: bool = False, moe: bool = False) -> GPTModule:
    # dropout > 0 so that RNG restore matters; an LR schedule so that scheduler restore matters.
    # untied: the pipeline-parallel jobs (the first and the last stage cannot share a weight)
    overrides = {"dropout": 0.1, **({"tie_embeddings": False} if untied else {}), **(MOE if moe else {})}
    return GPTModule(config="tiny", vocab_size=VOCAB, model_overrides=overrides, lr=3e-3,
                     schedule="cosine", warmup_steps=3, max_steps=total_steps)


# ---- data: the project's TokenDataModule over a synthetic shard ---------------------------------
# Window w of the shard starts with tokens (w % 256, w // 256), so a batch tells which global
# samples it holds; the order of windows is TokenDataModule's seeded global-sample order.

DATA_SEED = 1337


def write_indexed_shard(directory: str | Path, n_windows: int = N_SAMPLES) -> Path:
    from lightning_disttrain.data.shards import write_shard

    g = torch.Generator().manual_seed(10_000)
    tokens = torch.randint(0, VOCAB, (n_windows * SEQ_LEN + 1,), generator=g)
    w = torch.arange(n_windows)
    tokens[w * SEQ_LEN], tokens[w * SEQ_LEN + 1] = w % 256, w // 256
    Path(directory).mkdir(parents=True, exist_ok=True)
    return write_shard(Path(directory) / "indexed_train_000000.bin", tokens.numpy().astype("uint16"))


def sample_ids(x: torch.Tensor) -> list[int]:
    return (x[:, 0] + 256 * x[:, 1]).tolist()


def expected_windows(start: int, count: int) -> list[int]:
    """The windows of global samples [start, start + count) in TokenDataModule's order."""
    from lightning_disttrain.data.sampling import global_windows

    return global_windows(DATA_SEED, start, count, N_SAMPLES).tolist()


def build_data(data_dir: str):
    from lightning_disttrain.data import TokenDataModule

    return TokenDataModule(source=str(data_dir), tokenizer="bytes", seq_len=SEQ_LEN, batch_size=MICRO_BATCH,
                           val_batches=0, seed=DATA_SEED)


# ---- recording ---------------------------------------------------------------------------------


def full_state(module, optimizers, this_stage: bool = False) -> dict:
    """Full (gathered) model and optimizer state; collective, complete on rank 0. ``this_stage``
    (pipeline parallel): every rank returns the whole tensors of the stage it holds instead."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=not this_stage)
    return {"model": get_model_state_dict(module, options=opts),
            "optimizers": [get_optimizer_state_dict(module, unwrap_optimizer(o), options=opts) for o in optimizers]}


PROBE_INPUT_SEED = 7


def probe_input() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(PROBE_INPUT_SEED))


@torch.no_grad()
def probe_logits(module) -> torch.Tensor:
    was_training = module.training
    module.eval()
    logits = module(probe_input().to(module.device)).float().cpu()
    module.train(was_training)
    return logits


def _pp(trainer) -> int:
    dims = getattr(trainer.strategy, "parallel_dims", None)
    return dims.pp if dims is not None else 1


def save_state(trainer, module, path: Path) -> None:
    """The full state to ``path`` (rank 0); under pipeline parallel each rank writes its stage's
    to ``path.rankR.pt`` (``merge_stage_states`` joins them)."""
    if _pp(trainer) > 1:
        state = full_state(module, trainer.optimizers, this_stage=True)
        torch.save(state, path.with_suffix(f".rank{trainer.global_rank}.pt"))
        return
    state = full_state(module, trainer.optimizers)
    if trainer.is_global_zero:
        torch.save(state, path)


def merge_stage_states(paths: list[Path]) -> dict:
    """One full state from the per-stage files ``save_state`` wrote (``paths`` in stage order): the
    union of the model tensors and optimizer states; parameter groups with the union of their FQNs."""
    parts = [torch.load(p, weights_only=False) for p in paths]
    model = {k: v for part in parts for k, v in part["model"].items()}
    optimizers = []
    for opts in zip(*(part["optimizers"] for part in parts)):
        # stage after stage: the unsplit model's order, for one stage per rank
        groups = [dict(group, params=list(dict.fromkeys(fqn for o in opts for fqn in o["param_groups"][g]["params"])))
                  for g, group in enumerate(opts[0]["param_groups"])]
        optimizers.append({"state": {k: v for o in opts for k, v in o["state"].items()}, "param_groups": groups})
    return {"model": model, "optimizers": optimizers}


class Recorder(L.Callback):
    """Per-step losses (as float.hex, for bitwise comparison), sample ids, and async probes."""

    def __init__(self, probe_dir: str | None = None, dump_state_to: Path | None = None,
                 logits_to: Path | None = None, full_state_to: Path | None = None,
                 init_from: str | None = None, start_logits_to: Path | None = None) -> None:
        self.losses: list[list] = []
        self.samples: list[list] = []
        self.probes: list[dict] = []
        self.start_step: int | None = None
        self.probe_dir, self.dump_state_to = probe_dir, dump_state_to
        self.logits_to, self.full_state_to = logits_to, full_state_to
        self.init_from, self.start_logits_to = init_from, start_logits_to

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step
        # Distinct streams per data-parallel rank, so that restoring "each rank its own" is actually
        # tested (the TP ranks of one replica share one stream). A resumed run overwrites this with
        # the checkpoint's state before its first batch.
        torch.manual_seed(1000 + trainer.strategy.distributed_sampler_kwargs["rank"])
        if self.init_from is not None:  # a consolidated export as the initial weights of a sharded run
            from lightning_disttrain.checkpoint import load_consolidated_into

            load_consolidated_into(pl_module.model, self.init_from)
        if self.start_logits_to is not None:
            logits = probe_logits(pl_module)
            if trainer.is_global_zero:
                torch.save(logits, self.start_logits_to)
        if self.dump_state_to is not None:  # what the checkpoint restored, before any step
            save_state(trainer, pl_module, self.dump_state_to)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append([trainer.global_step, float(loss.detach().float().item()).hex()])
        self.samples.append([trainer.global_step, sample_ids(batch[0].cpu())])
        if self.probe_dir and Path(self.probe_dir).is_dir():
            self.probes.append({"step": trainer.global_step, "time": __import__("time").time(), "dirs": {
                d.name: {"manifest": (d / "manifest.json").exists(), "metadata": (d / ".metadata").exists()}
                for d in sorted(Path(self.probe_dir).iterdir()) if d.is_dir() and not d.is_symlink()}})

    def on_train_end(self, trainer, pl_module) -> None:
        if self.full_state_to is not None:
            save_state(trainer, pl_module, self.full_state_to)
        if self.logits_to is not None:
            logits = probe_logits(pl_module)
            if trainer.is_global_zero:
                torch.save(logits, self.logits_to)
