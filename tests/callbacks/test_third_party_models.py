"""The callbacks on model code we did not write: Hugging Face GPT-2 (``Conv1D`` projections, tied
head) and LLaMA (``nn.Linear``, untied head) inside a plain LightningModule, on one process and
under ``strategy="fsdp2"`` on two CPU processes."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from lightning_disttrain.callbacks import Float8Training, MFUMonitor, SelectiveActivationCheckpointing
from lightning_disttrain.parallel.activation import checkpoint_config_of
from lightning_disttrain.parallel.float8 import float8_fqns

# Also imported by the 2-rank script below, outside pytest: make tests/ importable there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models  # noqa: E402
from dist_utils import in_this_process  # noqa: E402

LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class Tokens(pl.LightningDataModule):
    """Four fixed batches of 4; on W ranks rank r takes samples r, r+W, ...: together the ranks'
    batches are the single-process batches (Lightning's distributed sampler would shuffle)."""

    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        xs, ys = zip(*hf_models.token_batches(4, 4))
        data = TensorDataset(torch.cat(xs), torch.cat(ys))
        if self.trainer is not None and self.trainer.world_size > 1:
            data = Subset(data, range(self.trainer.global_rank, len(data), self.trainer.world_size))
        return DataLoader(data, batch_size=self.batch_size)


def _fit(module, callbacks, steps=3, devices=1, strategy="auto"):
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, precision="32-true", callbacks=callbacks)
    trainer.fit(module, datamodule=Tokens(batch_size=4 // devices))
    return trainer


def _analytic_flops_per_token(model, seq_len: int) -> float:
    """6N + 12·L·H·Dh·T with N the weights of every projection and the head (LLaMA: nn.Linear)."""
    cfg = model.config
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len


def test_gpt2_trains_with_all_three_callbacks_exactly_as_without_them():
    # Selective checkpointing used to fail in GPT-2's backward ("aten.slice.Tensor encountered
    # during backward but not found in storage"); Float8Training finds no nn.Linear to convert
    # (GPT-2's projections are transformers' Conv1D) and must say so.
    plain = hf_models.HFCausalLM("gpt2")
    _fit(plain, [])
    module = hf_models.HFCausalLM("gpt2")
    sac, float8, mfu = SelectiveActivationCheckpointing(), Float8Training(), MFUMonitor(window=2, warn_below=0.0)
    with pytest.warns(UserWarning, match="0 Linear layers converted.*Conv1D"):
        _fit(module, [sac, float8, mfu])
    assert sac.checkpointed == [0, 1]
    assert all(checkpoint_config_of(b).policy == "selective" for b in module.model.transformer.h)
    assert float8.converted == [] and float8_fqns(module) == []
    assert mfu.flops_source.startswith("measured") and "perf/mfu_fp8" not in mfu.metrics
    assert module.losses == plain.losses
    for (n, p), (_, q) in zip(module.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_llama_trains_with_all_three_callbacks_like_float8_alone():
    # Checkpointing and the FLOP measurement must not change the numbers float8 gives.
    float8_only = hf_models.HFCausalLM("llama")
    _fit(float8_only, [Float8Training()])
    module = hf_models.HFCausalLM("llama")
    sac, float8 = SelectiveActivationCheckpointing(), Float8Training()
    mfu = MFUMonitor(window=2, warn_below=0.0, peak_flops=1e12, peak_flops_fp8=2e12)
    _fit(module, [sac, float8, mfu])
    assert sac.checkpointed == [0, 1]
    assert float8.converted == [f"model.model.layers.{i}.{n}" for i in range(2) for n in LLAMA_LINEARS]
    assert type(module.model.lm_head) is torch.nn.Linear  # the head stays in high precision
    assert module.losses == float8_only.losses
    assert mfu.flops_per_token[hf_models.SEQ] == pytest.approx(
        _analytic_flops_per_token(module.model, hf_models.SEQ), rel=0.02)
    assert mfu.metrics["perf/mfu_fp8"] == pytest.approx(mfu.metrics["perf/mfu"] / 2)


# ---- fsdp2 on two CPU processes --------------------------------------------------------------

WORKER, LAUNCH = "callbacks_worker", {2: ["llama"]}  # in the suite's shared 2-rank launch (tests/conftest.py)


@pytest.mark.slow
def test_llama_under_fsdp2_with_all_three_callbacks_trains_like_one_process(launched):
    import callbacks_worker

    ranks = launched(WORKER, 2)["llama"]
    single = in_this_process(callbacks_worker.fit_run, "llama", 1)
    for r in ranks:
        # Under the strategy the model-changing callbacks ran as its transforms, before sharding.
        order = [s for s in r["stages"] if s in ("dtype", "activation_checkpointing", "fsdp")]
        assert order == ["dtype", "activation_checkpointing", "fsdp"], r["stages"]
        assert r["sharded"] == "DTensor"
        assert r["checkpointed"] == single["checkpointed"] == [0, 1]
        assert r["converted"] == single["converted"] != []
        assert r["flops_source"].startswith("measured")
        assert r["flops_per_token"] == pytest.approx(single["flops_per_token"])
        assert r["tokens_per_step"] == pytest.approx(4 * hf_models.SEQ)  # both ranks' tokens
    mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert len(mean) == 4
    assert mean == pytest.approx(single["losses"], abs=1e-5, rel=0), (mean, single["losses"])
