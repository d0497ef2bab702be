"""MFUMonitor's FLOPs: measured when the module gives none, checked against independent counts and
a wall clock taken by the test; MFU against the bf16 peak and ``perf/mfu_fp8`` only with float8."""

from __future__ import annotations

import copy
import time

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from lightning_disttrain.callbacks import Float8Training, MFUMonitor, SelectiveActivationCheckpointing
from lightning_disttrain.callbacks.mfu import table_peak
from lightning_disttrain.module import GPTModule

import hf_models  # tests/ is on sys.path (conftest.py)
from test_mfu import BATCH, SEQ, VOCAB, TokenData, _trainer


class HFTokens(pl.LightningDataModule):
    def __init__(self, batch_size: int = BATCH, n: int = 4):
        super().__init__()
        self.batch_size, self.n = batch_size, n

    def train_dataloader(self):
        xs, ys = zip(*hf_models.token_batches(self.n, self.batch_size))
        return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=self.batch_size)


# ---- FLOPs measured on the first micro-batch -------------------------------------------------


def test_measured_flops_of_a_hugging_face_gpt2_match_the_analytic_count_and_leave_the_run_unchanged():
    # GPT-2 has no flops_per_token: the monitor measures. With dropout on, an extra forward
    # (or anything else drawing random numbers) would change the trained weights.
    def fit(callbacks):
        module = hf_models.HFCausalLM("gpt2", dropout=0.1)
        torch.manual_seed(1)
        _trainer(callbacks, steps=3).fit(module, datamodule=HFTokens())
        return module

    monitor = MFUMonitor(window=2, peak_flops=1e12, warn_below=0.0)
    measured, plain = fit([monitor]), fit([])
    for (n, p), (_, q) in zip(measured.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert monitor.flops_source.startswith("measured: FlopCounterMode")
    # 6N + 12·L·H·Dh·T, from the model's weights: N = every projection's weight (transformers'
    # Conv1D) plus the head (tied to wte, so one V x d matmul per token).
    model, cfg = measured.model, measured.model.config
    n = sum(m.weight.numel() for m in model.modules() if type(m).__name__ == "Conv1D")
    n += model.lm_head.weight.numel()
    expected = 6 * n + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * hf_models.SEQ
    assert 12 * cfg.n_layer * cfg.n_embd * hf_models.SEQ / expected > 0.05  # > the tolerance: attention counts
    assert monitor.flops_per_token[hf_models.SEQ] == pytest.approx(expected, rel=0.02)
    m = monitor.metrics
    assert m["perf/tflops_per_device"] == pytest.approx(expected * m["perf/tokens_per_sec"] / 1e12, rel=0.02)


def test_measured_flops_of_gpt_module_match_its_analytic_figure_also_under_activation_checkpointing():
    # Full checkpointing runs every block's forward again inside backward: hardware FLOPs, not
    # model FLOPs. The measurement must not count them.
    monitor = MFUMonitor(window=2, peak_flops=1e12, warn_below=0.0, flops_per_token="measure")
    module = GPTModule("tiny", vocab_size=VOCAB)
    _trainer([SelectiveActivationCheckpointing(policy="full"), monitor], steps=2).fit(module, datamodule=TokenData())
    assert monitor.flops_source.startswith("measured")
    assert monitor.flops_per_token[SEQ] == pytest.approx(module.flops_per_token(SEQ), rel=0.02)


def test_the_modules_analytic_figure_is_used_when_it_has_one():
    monitor = MFUMonitor(window=2, peak_flops=1e12, warn_below=0.0)
    module = GPTModule("tiny", vocab_size=VOCAB)
    _trainer([monitor], steps=2).fit(module, datamodule=TokenData())
    assert monitor.flops_source == "analytic: GPTModule.flops_per_token"
    assert monitor.flops_per_token == {SEQ: module.flops_per_token(SEQ)}


# ---- independent checks of the logged figures ------------------------------------------------


class WallClock(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.t0 = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        self.elapsed = time.perf_counter() - self.t0


def test_tokens_per_sec_agree_with_a_wall_clock_taken_by_the_test():
    steps = 4
    clock, monitor = WallClock(), MFUMonitor(window=steps, peak_flops=1e12, warn_below=0.0)
    _trainer([clock, monitor], steps=steps).fit(GPTModule("tiny", vocab_size=VOCAB), datamodule=TokenData())
    by_clock = steps * BATCH * SEQ / clock.elapsed
    assert 0.5 * by_clock < monitor.metrics["perf/tokens_per_sec"] < 2 * by_clock


def test_flop_total_over_the_window_agrees_with_a_flop_counter_run_by_the_test():
    steps, accumulate = 3, 2
    monitor = MFUMonitor(window=steps, peak_flops=1e12, warn_below=0.0)
    module = GPTModule("tiny", vocab_size=VOCAB)
    reference = copy.deepcopy(module)
    _trainer([monitor], steps=steps, accumulate_grad_batches=accumulate).fit(module, datamodule=TokenData())
    m = monitor.metrics
    logged_total = m["perf/tflops_per_device"] * 1e12 * m["perf/step_time_s"] * steps
    # Forward and backward of one micro-batch, all counted (attention as bmm's through the math
    # backend: counted forward and backward alike), times the micro-batches of the window.
    reference.configure_model()
    x, y = next(iter(TokenData().train_dataloader()))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = reference(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
    assert logged_total == pytest.approx(counter.get_total_flops() * steps * accumulate, rel=0.02)


# ---- the peak MFU is reported against --------------------------------------------------------

H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("converts", [False, True])
def test_mfu_is_against_the_bf16_peak_and_mfu_fp8_needs_float8_layers(converts):
    # No GPU here: the peaks come from the table by device name, as on an H100.
    bf16, _ = table_peak(H100)
    fp8, _ = table_peak(H100, float8=True)
    monitor = MFUMonitor(window=2, warn_below=0.0, peak_flops=bf16, peak_flops_fp8=fp8)
    float8 = Float8Training() if converts else Float8Training(module_filter=lambda module, fqn: False)
    _trainer([float8, monitor], steps=2).fit(GPTModule("tiny", vocab_size=VOCAB), datamodule=TokenData())
    assert bool(float8.converted) == converts
    m = monitor.metrics
    flops = m["perf/tflops_per_device"] * 1e12
    assert m["perf/mfu"] == pytest.approx(flops / bf16)  # Float8Training present or not
    if converts:
        assert m["perf/mfu_fp8"] == pytest.approx(flops / fp8) and m["perf/peak_tflops_fp8"] == fp8 / 1e12
    else:
        assert "perf/mfu_fp8" not in m and monitor.peak_fp8 is None


def test_forward_flop_counter_skips_backward_and_its_recomputation():
    # Left open over backward (a strategy that runs backward inside training_step), the counter
    # still counts the forward once: not the gradients, not checkpointing's recomputation.
    from lightning_disttrain.peak_flops import forward_flop_counter
    from lightning_disttrain.models.gpt import GPT, GPTConfig
    from lightning_disttrain.parallel.activation import apply_activation_checkpointing

    model = GPT(GPTConfig.from_name("tiny", vocab_size=VOCAB))
    apply_activation_checkpointing(model.blocks, policy="full")
    x = torch.randint(0, VOCAB, (2, SEQ))
    with forward_flop_counter() as forward:
        model(x)
    with forward_flop_counter() as both:
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    assert both.get_total_flops() == forward.get_total_flops() > 0
    # CPU's fused attention kernel is counted (torch's own registry misses it).
    assert any("flash_attention_for_cpu" in str(op) for op in forward.get_flop_counts()["Global"])


@pytest.mark.parametrize(("dims", "layout"), [(dict(tp=2, pp=1), r"tensor parallel \(tp=2\)"),
                                              (dict(tp=1, pp=2), r"pipeline parallel \(pp=2\)")])
def test_measuring_under_tensor_or_pipeline_parallel_is_refused_with_the_fix(dims, layout):
    # FlopCounterMode would see DTensor ops whole and local-shard ops per shard, and under pp
    # only this rank's stages: no sound total.
    from types import SimpleNamespace

    import lightning.pytorch as pl

    from lightning_disttrain.callbacks import MFUMonitor

    trainer = SimpleNamespace(strategy=SimpleNamespace(_parallel_dims=SimpleNamespace(**dims)))
    with pytest.raises(ValueError, match=rf"cannot measure FLOPs per token under {layout}; "
                                         r"define flops_per_token\(seq_len\) on LightningModule"):
        MFUMonitor().on_fit_start(trainer, pl.LightningModule())
