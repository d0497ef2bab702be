"""Float8Training: which Linears are converted, numerics vs a baseline, master weights, optimizer,
a registry strategy, the CLI, and fsdp2 on two CPU processes (float8 emulated on CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_disttrain.callbacks import Float8Training
from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.module import GPTModule
from lightning_disttrain.parallel.float8 import (
    Float8Options,
    check_float8_support,
    convert_to_float8,
    float8_fqns,
    linear_name,
)
from lightning_disttrain.parallel.recipe import parallelize
from lightning_disttrain.parallel.transforms import TransformContext, TransformRegistry

# Also imported by the 2-rank scripts below, outside pytest: make tests/ importable there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The float8-vs-baseline training harness is a benchmark, not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import hf_models  # noqa: E402
from cli_fit import fit_from_yaml  # noqa: E402
from dist_utils import in_this_process  # noqa: E402
from float8_compare import compare_float8_to_baseline  # noqa: E402

VOCAB = 256  # a multiple of 16, so the head would qualify on shape alone: excluded by rule
BLOCK_LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2")


def _block_fqns(blocks, prefix="blocks"):
    return [f"{prefix}.{i}.{name}" for i in blocks for name in BLOCK_LINEARS]


def tiny_gpt(**overrides) -> GPT:
    return GPT(GPTConfig.from_name("tiny", vocab_size=VOCAB, **overrides))  # 4 blocks, n_embd 128


# ---- the filter ----------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_default_filter_converts_every_block_linear_and_nothing_else(tied):
    model = tiny_gpt(tie_embeddings=tied)
    converted = convert_to_float8(model, Float8Options(), device="cpu")
    assert converted == _block_fqns(range(4))
    assert float8_fqns(model) == converted
    # Embeddings, norms and the head kept their types.
    assert type(model.lm_head) is nn.Linear and type(model.wte) is nn.Embedding
    assert all(type(b.attn_norm) is nn.LayerNorm for b in model.blocks)
    assert (model.lm_head.weight is model.wte.weight) == tied


def test_tied_head_is_recognised_by_its_weight_not_its_name():
    # With no name exclusions an untied head is converted, a tied one still is not.
    untied = convert_to_float8(tiny_gpt(tie_embeddings=False), Float8Options(exclude_names=()), device="cpu")
    tied = convert_to_float8(tiny_gpt(tie_embeddings=True), Float8Options(exclude_names=()), device="cpu")
    assert untied == _block_fqns(range(4)) + ["lm_head"]
    assert tied == _block_fqns(range(4))


def test_exclude_first_last_blocks_and_user_filter():
    edges = convert_to_float8(tiny_gpt(), Float8Options(exclude_first_last_blocks=True), device="cpu")
    assert edges == _block_fqns([1, 2])
    no_w2 = convert_to_float8(tiny_gpt(), Float8Options(module_filter=lambda m, fqn: not fqn.endswith("mlp.w2")),
                              device="cpu")
    assert no_w2 == [f for f in _block_fqns(range(4)) if not f.endswith("mlp.w2")]
    both = convert_to_float8(tiny_gpt(), Float8Options(exclude_first_last_blocks=True,
                                                       module_filter=lambda m, fqn: "attn" in fqn), device="cpu")
    assert both == [f for f in _block_fqns([1, 2]) if "attn" in f]


class _MoELike(nn.Module):
    """Names an MoE layer and a LLaMA MLP use, plus shapes float8 GEMMs cannot take."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 64)
        self.norm = nn.LayerNorm(64)
        self.router = nn.Sequential(nn.Linear(64, 64))      # router.0
        self.moe = nn.ModuleDict({"gate": nn.Linear(64, 16), "expert": nn.Linear(64, 128)})
        self.gate_proj = nn.Linear(64, 128)                 # LLaMA MLP: converted
        self.odd_out = nn.Linear(64, 40)                    # 40 % 16 != 0
        self.odd_in = nn.Linear(24, 64)                     # 24 % 16 != 0
        self.output = nn.Linear(64, 64)                     # a head


def test_routers_gates_heads_and_odd_shapes_are_excluded():
    model = _MoELike()
    assert convert_to_float8(model, Float8Options(), device="cpu") == ["moe.expert", "gate_proj"]


def test_exclusions_match_the_linears_own_name_not_its_parents():
    # HF BERT's FFN output projection is encoder.layer.N.output.dense: a parent named "output"
    # does not make it a head. Heads and routers are matched by their own name.
    class BertWithHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = hf_models.bert()
            self.output = nn.Linear(64, 128)       # torchtitan's head name
            self.lm_head = nn.Linear(64, 128)      # HF's head name
            self.moe = nn.ModuleDict({"gate": nn.Linear(64, 16), "router": nn.Sequential(nn.Linear(64, 16))})

    model = BertWithHeads()
    converted = convert_to_float8(model, Float8Options(), device="cpu")
    per_layer = ["attention.self.query", "attention.self.key", "attention.self.value",
                 "attention.output.dense", "intermediate.dense", "output.dense"]
    assert converted == [f"bert.encoder.layer.{i}.{n}" for i in range(2) for n in per_layer] + ["bert.pooler.dense"]
    assert type(model.output) is nn.Linear and type(model.lm_head) is nn.Linear
    assert type(model.moe["gate"]) is nn.Linear and type(model.moe["router"][0]) is nn.Linear
    assert [linear_name(f) for f in ("output", "a.output.dense", "moe.router.0", "0")] == [
        "output", "dense", "router", "0"]


def test_options_fail_early_with_the_fix():
    with pytest.raises(ValueError, match="use one of"):
        Float8Training(recipe="tensorwize")
    with pytest.raises(ValueError, match="needs recipe='tensorwise'"):
        Float8Training(recipe="rowwise", fsdp_float8_all_gather=True)


def test_unsupported_devices_fail_with_the_fix():
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9.*bf16-mixed"):
        check_float8_support("cuda", capability=(8, 0))  # A100
    check_float8_support("cuda", capability=(8, 9))  # L4 / L40S
    check_float8_support("cuda", capability=(9, 0))  # H100 / H200
    check_float8_support("cpu")
    with pytest.raises(ValueError, match="remove Float8Training"):
        check_float8_support("mps")


# ---- numerics --------------------------------------------------------------------------------


def _pattern_batches(n_batches=4, batch=8, seq=64, vocab=VOCAB):
    """Shifted copies of one random sequence: learnable, so the losses fall and can be compared."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, vocab, (seq + 1,), generator=g)
    out = []
    for _ in range(n_batches):
        rows = torch.stack([torch.roll(base, -int(s)) for s in torch.randint(0, seq, (batch,), generator=g)])
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


LOSS_GAP_TOLERANCE_PCT = 2.0
"""Mean loss of the last 5 of 20 steps, float8 vs fp32: measured +0.3% (tensorwise) here."""


def test_loss_gap_to_fp32_over_20_steps_is_small():
    cfg = GPTConfig.from_name("tiny", vocab_size=VOCAB, n_layer=2, n_embd=64, n_head=4, block_size=64)
    batches = _pattern_batches(n_batches=4, batch=4, seq=32)
    result = compare_float8_to_baseline(lambda: GPT(cfg), batches, steps=20, recipe="tensorwise", lr=3e-3)
    assert result.baseline == "fp32" and result.notes["emulated"]
    assert result.converted == _block_fqns(range(2))
    assert result.baseline_losses[-1] < 0.6 * result.baseline_losses[0]  # it learns: the gap means something
    assert result.float8_losses != result.baseline_losses  # float8 did change the numerics ...
    assert abs(result.gap_pct) < LOSS_GAP_TOLERANCE_PCT, result  # ... by little


class PatternData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4, seq_len: int = 32):
        super().__init__()
        self.batch_size, self.seq_len = batch_size, seq_len

    def train_dataloader(self):
        xs, ys = zip(*_pattern_batches(n_batches=4, batch=4, seq=self.seq_len))
        data = TensorDataset(torch.cat(xs), torch.cat(ys))
        if self.trainer is not None and self.trainer.world_size > 1:
            # Rank r takes samples r, r+W, ...: together the ranks' batches are the single-process
            # batches (Lightning's own distributed sampler always shuffles training data).
            data = Subset(data, range(self.trainer.global_rank, len(data), self.trainer.world_size))
        return DataLoader(data, batch_size=self.batch_size)


def _trainer(callbacks, strategy="auto", steps=3, **kwargs):
    return pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, **kwargs)


def test_in_a_trainer_master_weights_stay_fp32_and_the_optimizer_updates_them():
    torch.manual_seed(0)
    cb = Float8Training()
    module = GPTModule("tiny", vocab_size=VOCAB, lr=1e-2, warmup_steps=0)
    trainer = _trainer([cb], steps=2, precision="bf16-mixed", accumulate_grad_batches=2)
    initial = {}

    class Snapshot(pl.Callback):  # runs after Float8Training's on_fit_start: the swapped model
        def on_train_start(self, trainer, pl_module):
            initial.update({n: p.detach().clone() for n, p in pl_module.named_parameters()})

    trainer.callbacks.append(Snapshot())
    trainer.fit(module, datamodule=PatternData())
    assert cb.converted == _block_fqns(range(4), prefix="model.blocks")  # built in configure_model
    opt = trainer.optimizers[0]
    in_optimizer = {id(p) for group in opt.param_groups for p in group["params"]}
    for fqn in cb.converted:
        linear = module.get_submodule(fqn)
        assert type(linear).__name__ == "Float8Linear"
        w = linear.weight
        assert w.dtype == torch.float32 and w.grad.dtype == torch.float32
        assert id(w) in in_optimizer  # the optimizer holds the Float8Linear's own weight ...
        assert opt.state[w]["exp_avg"].dtype == torch.float32
        assert not torch.equal(w.detach(), initial[f"{fqn}.weight"])  # ... and updated it
    assert trainer.global_step == 2


def test_second_fit_on_the_same_module_does_not_convert_again():
    module = GPTModule("tiny", vocab_size=VOCAB, lr=1e-3)
    _trainer([Float8Training(exclude_first_last_blocks=True)], steps=1).fit(module, datamodule=PatternData())
    cb = Float8Training()  # would convert the edge blocks too, if it converted again
    _trainer([cb], steps=1).fit(module, datamodule=PatternData())
    assert float8_fqns(module) == cb.converted == _block_fqns([1, 2], prefix="model.blocks")


class RegistryStrategy(SingleDeviceStrategy):
    """The contract of a lightning-disttrain strategy: a ``transforms`` registry run in STAGES
    order after configure_model, before the optimizers (NDParallelStrategy does this with a mesh)."""

    def __init__(self):
        super().__init__(device=torch.device("cpu"))
        self.transforms = TransformRegistry()
        self.ctx = TransformContext(device=torch.device("cpu"))
        self.float8_before_optimizer = None

    def setup(self, trainer):
        parallelize(self.lightning_module, self.ctx, self.transforms)  # the recipe, without FSDP
        self.float8_before_optimizer = float8_fqns(self.lightning_module)
        super().setup(trainer)


def test_registers_at_the_dtype_stage_of_a_strategy_registry():
    strategy, cb = RegistryStrategy(), Float8Training(recipe="rowwise")
    _trainer([cb], strategy=strategy, steps=2).fit(GPTModule("tiny", vocab_size=VOCAB), datamodule=PatternData())
    assert strategy.transforms.names() == [("dtype", "Float8Training")]
    assert strategy.float8_before_optimizer == cb.converted == _block_fqns(range(4), prefix="model.blocks")
    assert strategy.ctx.extras == {"float8_fsdp_all_gather": False, "float8_recipe": "rowwise",
                                   "float8_converted": cb.converted}


def test_cli_yaml_class_path(tmp_path):
    cli = fit_from_yaml(tmp_path, {"class_path": "lightning_disttrain.callbacks.Float8Training",
                                   "init_args": {"recipe": "rowwise_with_gw_hp", "exclude_first_last_blocks": True}},
                        PatternData, VOCAB)
    [cb] = [c for c in cli.trainer.callbacks if isinstance(c, Float8Training)]
    assert cb.recipe == "rowwise_with_gw_hp" and cli.trainer.global_step == 2
    assert float8_fqns(cli.model) == _block_fqns([1, 2], prefix="model.blocks")


# ---- fsdp2 on two CPU processes --------------------------------------------------------------

WORKER, LAUNCH = "callbacks_worker", {2: ["float8"]}  # in the suite's shared 2-rank launch (tests/conftest.py)


@pytest.mark.slow
def test_under_fsdp2_weights_are_gathered_in_float8_and_training_matches_one_process(launched):
    import callbacks_worker

    ranks = launched(WORKER, 2)["float8"]
    single = in_this_process(callbacks_worker.fit_run, "float8", 1)
    for r in ranks:
        steps = [s.split(":")[0] for s in r["steps"]]
        assert steps == ["dtype", "fsdp"] and r["steps"][0] == "dtype: Float8Training", r["steps"]
        assert r["converted"] == _block_fqns(range(4), prefix="model.blocks")
        assert r["all_gather"] is True
        assert r["weight"] == ["DTensor", "WeightWithDynamicFloat8CastTensor", "torch.float32"]
        assert r["precomputed"]  # scales precomputed after the optimizer steps
    assert single["all_gather"] is False and single["weight"][1] == "Parameter"
    # Same global batches, same initial weights, fp32 outside the float8 matmuls: gathering the
    # weights in float8 with one all-reduced scale per weight trains like a single process. Not
    # bit-exact: activations are scaled by their amax per rank (over half the batch), and the
    # reduction order differs.
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert len(mean) == 4
    assert mean[0] == pytest.approx(single["losses"][0], rel=1e-3)
    assert mean == pytest.approx(single["losses"], rel=5e-3), (mean, single["losses"])
