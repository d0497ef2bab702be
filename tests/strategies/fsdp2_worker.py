"""Training runs through ``L.Trainer`` for the FSDP2 strategy tests; one process per rank.

    python fsdp2_worker.py OUT_DIR DEVICES RUN [RUN ...]

Started once by the test; ``L.Trainer(devices=DEVICES)`` re-launches it on the other ranks
(Lightning's subprocess launcher). Each RUN (see ``RUNS``) is one ``trainer.fit`` of a tiny
GPTModule over the same data with the same GLOBAL batch; every rank writes
``OUT_DIR/RUN.rankR.json`` with the per-step global-mean losses, gradient norms before and after
clipping, a checksum of the initial weights, the reduce-scatter count and layout facts.
Importable too: the single-process baseline runs in the test process with ``fit_run``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightning_disttrain.strategies  # noqa: E402,F401  (registers fsdp2 / fsdp2_zero2 / hsdp)
from dist_utils import worker_main  # noqa: E402
from lightning_disttrain.module import GPTModule  # noqa: E402
from lightning_disttrain.models.gpt import GPT  # noqa: E402
from lightning_disttrain.parallel.plan import ParallelPlan  # noqa: E402
from lightning_disttrain.strategies import FSDP2Strategy, NDParallelStrategy  # noqa: E402

GLOBAL_BATCH = 8
STEPS = 4  # several steps: enough for a parity test (the optimizer state in use, clipping each step)
SEQ = 16
VOCAB = 64
CLIP = 0.3  # below the initial gradient norm (~0.5-1), so clipping is active in every run
MODEL = dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=2, mlp_hidden=128, block_size=SEQ)

# name -> (strategy, accumulate_grad_batches); the per-rank micro-batch follows from GLOBAL_BATCH.
RUNS = {
    "flat_fsdp2": ("fsdp2", 1),          # FlatGPT: no submodule owns every parameter
    "single": ("auto", 1),
    "single_untied": ("auto", 1),
    "fsdp2_untied": ("fsdp2", 1),         # untied head: wte and [ln_f, lm_head] are units of their own
    "fsdp2": ("fsdp2", 1),
    "fsdp2_zero2": ("fsdp2_zero2", 1),
    "fsdp2_accum4": ("fsdp2", 4),        # 4 micro-batches of GLOBAL_BATCH/(4*N) per rank
    "fsdp2_accum4_unsharded": ("fsdp2_unsharded", 4),  # accumulate_unsharded_grads=True
    "hsdp_accum4": ("ddp_like", 4),      # HSDP 2x1: all-reduce across replicas on the last micro-batch only
    "hsdp": ("hsdp", 1),
    "fsdp2_meta": ("fsdp2_meta", 1),     # empty_init: configure_model on the meta device
    "fsdp2_compile": ("fsdp2_compile", 1),  # compile=True path (eager backend: no C++ toolchain)
    "fsdp2_bf16": ("fsdp2", 1),          # precision="bf16-mixed": bf16 compute, fp32 reduction
    "ddp_like": ("ddp_like", 1),         # dp_replicate=N, dp_shard=1: FSDP2 only all-reduces
    "fsdp2_reshard2": ("fsdp2_reshard2", 1),  # reshard_after_forward=2: to pairs of ranks (4 ranks)
    "fsdp2_tp": ("fsdp2_tp", 1),         # FSDP2 x TP 2x2 (4 ranks): 2 data-parallel replicas of 2 TP ranks
    "hsdp_tp": ("hsdp_tp", 1),           # HSDP (2 replicas, shard 1) x TP 2 (4 ranks)
}

# Count FSDP's reduce-scatters: it calls torch.distributed.reduce_scatter_single for each unit's
# gradients; the wrapper only counts and calls through.
_REDUCE_SCATTERS = [0]
_orig_reduce_scatter = dist.reduce_scatter_single


def _counting_reduce_scatter(*args, **kwargs):
    _REDUCE_SCATTERS[0] += 1
    return _orig_reduce_scatter(*args, **kwargs)


dist.reduce_scatter_single = _counting_reduce_scatter


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _grad_norm(module: torch.nn.Module) -> float:
    # Independent of the code under test: gather every gradient whole, then one plain norm.
    sq = sum(_full(p.grad).double().square().sum() for p in module.parameters() if p.grad is not None)
    return float(sq.sqrt())


def weights_checksum(module: torch.nn.Module) -> list[float]:
    """Per-parameter (sum, weighted sum) of the full tensors, in named_parameters order."""
    out = []
    for _, p in module.named_parameters():
        full = _full(p.detach()).double().flatten()
        out += [float(full.sum()), float((full * torch.linspace(-1, 1, full.numel(), dtype=full.dtype)).sum())]
    return out


class RecordedGPT(GPTModule):
    """GPTModule that records, per optimizer step, what the tests compare."""

    def __init__(self, untied: bool = False, **kwargs):
        overrides = {**MODEL, "tie_embeddings": False} if untied else MODEL
        super().__init__("tiny", vocab_size=VOCAB, model_overrides=overrides, lr=3e-3, weight_decay=0.1,
                         schedule="constant", warmup_steps=0, **kwargs)
        self.micro_losses: list[torch.Tensor] = []
        self.norms_before: list[float] = []
        self.norms_after: list[float] = []
        self.initial_checksum: list[float] | None = None
        self.micro_batch = GLOBAL_BATCH

    def _net(self) -> torch.nn.Module:
        return self.model

    def on_fit_start(self) -> None:
        self.initial_checksum = weights_checksum(self._net())
        _REDUCE_SCATTERS[0] = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.micro_losses.append(loss.detach().clone())
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.norms_before.append(_grad_norm(self._net()))
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.norms_after.append(_grad_norm(self._net()))

    def train_dataloader(self):
        return self._loader(dataset())

    def _loader(self, ds):
        # Our own DistributedSampler from the strategy's distributed_sampler_kwargs (the thing under
        # test): Lightning's injected one always shuffles training data, a single process does not.
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
        sampler = DistributedSampler(ds, shuffle=False, **kwargs) if kwargs else None
        return DataLoader(ds, batch_size=self.micro_batch, sampler=sampler, shuffle=False)

    def step_losses(self, accumulate: int) -> list[float]:
        """Mean over the data-parallel ranks (all-reduce) and over each step's micro-batches."""
        losses = torch.stack(self.micro_losses)
        if dist.is_initialized():
            dp = self.trainer.strategy.parallel_dims.get_mesh("dp")
            dist.all_reduce(losses, op=dist.ReduceOp.SUM, group=dp.get_group())
            losses /= dp.size()
        return losses.view(-1, accumulate).mean(dim=1).tolist()


class FlatGPT(RecordedGPT):
    """The GPT's parts as direct attributes of the LightningModule, so FSDP's root is the
    LightningModule itself; ``training_step`` calls the parts directly (not ``self(...)``), which
    only works if the strategy enters it through ``__call__``; validation calls ``self(x)``."""

    def configure_model(self) -> None:
        if getattr(self, "blocks", None) is not None:
            return
        gpt = GPT(self.config)  # the same RNG draws as GPTModule's build: the same initial weights
        self.wte, self.wpe, self.blocks, self.ln_f, self.lm_head = gpt.wte, gpt.wpe, gpt.blocks, gpt.ln_f, gpt.lm_head

    def init_weights(self) -> None:
        # GPT's own (by parameter name, below the model: the same names here), for the meta-device
        # build the strategy's default makes on more than one rank.
        GPT.init_weights(self)

    def _net(self) -> torch.nn.Module:
        return self

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(blocks=self.blocks)

    def forward(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            h = block(h)
        loss = self.loss_fn(self.lm_head(self.ln_f(h)), y)
        self.micro_losses.append(loss.detach().clone())
        return loss


def _strategy(name: str):
    if name == "ddp_like":
        return NDParallelStrategy(dp_replicate=2, dp_shard=1)
    if name == "hsdp":
        return FSDP2Strategy(hsdp=(2, -1))  # "hsdp" by name on one node is plain FSDP2
    if name == "fsdp2_tp":
        return NDParallelStrategy(dp_shard=2, tp=2)
    if name == "hsdp_tp":
        return NDParallelStrategy(dp_replicate=2, dp_shard=1, tp=2)
    if name == "fsdp2_reshard2":
        return FSDP2Strategy(reshard_after_forward=2)
    if name == "fsdp2_unsharded":
        return FSDP2Strategy(accumulate_unsharded_grads=True)
    if name == "fsdp2_meta":
        return FSDP2Strategy(empty_init=True)
    if name == "fsdp2_compile":
        return FSDP2Strategy(compile={"backend": "eager"})
    return name


class TransformProbe(L.Callback):
    """Registers transforms at several stages the way callbacks do (in ``setup``) and records the
    order they run in and whether FSDP had already wrapped anything at that point."""

    def __init__(self) -> None:
        self.records: list[list] = []

    def setup(self, trainer, pl_module, stage):
        registry = getattr(trainer.strategy, "transforms", None)
        if registry is None:
            return
        for stage_name in ("fsdp", "activation_checkpointing", "dtype"):  # registered out of order
            registry.register(stage_name, self._probe(stage_name), name=f"probe_{stage_name}", owner=self)

    def _probe(self, stage_name: str):
        def probe(module, ctx):
            from torch.distributed.fsdp import FSDPModule

            sharded = any(isinstance(m, FSDPModule) for m in module.modules())
            self.records.append([stage_name, sharded, ctx.precision, ctx.dims.dp_size])
        return probe


def _unit_reshard(model) -> dict:
    """Each FSDP unit's reshard-after-forward setting, by the unit's module name."""
    from torch.distributed.fsdp import FSDPModule

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            group = state._fsdp_param_group
            out[name or "<root>"] = None if group is None else group.post_forward_mesh_info is not None
    return out


CLI_BY_NAME = """
seed_everything: 0
trainer:
  strategy: fsdp2
  devices: {devices}
  accelerator: cpu
  max_steps: 3
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: cli_worker.ReportStrategy
      init_args: {{out_dir: {out}}}
model:
  class_path: lightning_disttrain.GPTModule
  init_args:
    config: tiny
    model_overrides: {{n_layer: 2, n_embd: 32, n_head: 2, n_kv_head: 2, mlp_hidden: 128, block_size: 16}}
    schedule: constant
data:
  class_path: cli_worker.RandomTokenData
"""
"""``cli_by_name``: the strategy named in a LightningCLI YAML (``strategy: fsdp2``), the classes by class_path."""


def cli_by_name(devices: int) -> dict:
    import json
    import os

    from lightning_disttrain.cli import DistTrainCLI

    out = Path(os.environ["LDT_LAUNCH_OUT"]) / "cli_by_name"
    out.mkdir(parents=True, exist_ok=True)
    config = out / f"fit.rank{os.environ.get('LOCAL_RANK', '0')}.yaml"  # the process group may not exist yet
    config.write_text(CLI_BY_NAME.format(devices=devices, out=out))
    DistTrainCLI(args=["fit", "--config", str(config)])
    return json.loads((out / f"cli.rank{dist.get_rank()}.json").read_text())


def fit_run(run: str, devices: int) -> dict:
    if run == "cli_by_name":
        return cli_by_name(devices)
    strategy_name, accumulate = RUNS[run]
    dp = devices // (2 if strategy_name.endswith("_tp") else 1)  # TP ranks of one replica share its batch
    micro = GLOBAL_BATCH // (dp * accumulate)
    L.seed_everything(0)
    model = FlatGPT() if run.startswith("flat") else RecordedGPT(untied=run.endswith("untied"))
    probe = TransformProbe()
    trainer = L.Trainer(callbacks=[probe],
        strategy=_strategy(strategy_name), devices=devices, accelerator="cpu", num_nodes=1,
        precision="bf16-mixed" if run == "fsdp2_bf16" else "32-true",
        max_steps=STEPS, accumulate_grad_batches=accumulate, gradient_clip_val=CLIP,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0)
    model.micro_batch = micro
    trainer.fit(model)
    # A second stage with the same Trainer and module: the strategy keeps its mesh and sharding.
    val_set = TensorDataset(*(t[: 2 * GLOBAL_BATCH] for t in dataset().tensors))
    val = trainer.validate(model, dataloaders=model._loader(val_set), verbose=False)
    result = {
        "val_loss": val[0]["val/loss"],
        "losses": model.step_losses(accumulate),
        "norms_before": model.norms_before,
        "norms_after": model.norms_after,
        "initial_checksum": model.initial_checksum,
        "micro_batches": len(model.micro_losses),
        "optimizer_steps": trainer.global_step,
    }
    strategy = trainer.strategy
    if isinstance(strategy, NDParallelStrategy):
        from torch.distributed.fsdp import FSDPModule

        blocks = model._net().blocks
        w = blocks[0].attn.wq.weight
        result.update(
            # after trainer.validate: the units that keep parameters gathered for backward must
            # have been resharded, or evaluation would leave them gathered
            sharded_after_validate=all(isinstance(p, DTensor) for p in model.parameters()),
            reduce_scatters=_REDUCE_SCATTERS[0],
            fsdp_units=sum(isinstance(m, FSDPModule) for m in model.modules()),
            sampler=strategy.distributed_sampler_kwargs,
            dims=strategy.parallel_dims.degrees,
            placements=[str(p) for p in w.placements],
            mesh_dims=list(w.device_mesh.mesh_dim_names),
            local_rows=w.to_local().shape[0],
            lightning_module_mesh=list(model.device_mesh.mesh_dim_names),
            root_is_lightning_module=strategy._root_is_lightning_module,
            transform_log=probe.records,
            transform_names=strategy.transforms.names(),
            unit_reshard=_unit_reshard(model),
            compiled_blocks=sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks),
            recompile_watcher=strategy._recompile_watcher is not None,
            clip_fn=getattr(trainer.precision_plugin.clip_grad_by_norm, "__qualname__", ""),
            parallelized_steps=strategy.parallelized_steps,
        )
    return result


if __name__ == "__main__":
    worker_main(fit_run)
