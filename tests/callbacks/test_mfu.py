"""MFUMonitor and the peak table: analytic FLOPs vs counted ones, device-name matching, logging
through a CSVLogger, the low-MFU diagnosis, the CLI and fsdp2 on two CPU processes."""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric.utilities.throughput import _CUDA_FLOPS
from lightning.pytorch.loggers import CSVLogger
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from lightning_disttrain.callbacks import MFUMonitor, peak_flops, step_clock
from lightning_disttrain.callbacks import mfu
from lightning_disttrain.callbacks.mfu import diagnose, table_peak
from lightning_disttrain.peak_flops import chip_of, measure_cpu_peak_flops
from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.module import GPTModule

# Also imported by the 2-rank scripts below, outside pytest: make tests/ importable there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_fit import fit_from_yaml  # noqa: E402

VOCAB = 256
SEQ = 32
BATCH = 4


# ---- FLOPs per token -------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_analytic_flops_per_token_match_flop_counter_within_2_percent(tied):
    # T=256 with a narrow model: the attention term 12·L·H·Dh·T is ~26% of the total, so a
    # wrong attention count could not hide inside the tolerance.
    T = 256
    cfg = GPTConfig.from_name("tiny", vocab_size=VOCAB, n_layer=2, n_embd=64, n_head=4, block_size=T,
                              tie_embeddings=tied)
    model = GPT(cfg)
    x = torch.randint(0, VOCAB, (2, T))
    # The math backend: attention as bmm's, which FlopCounterMode counts at full (not causal-
    # halved) cost, as the formula does. (CPU's fused SDPA kernel is not counted at all, and the
    # CUDA flash backward is counted with its recomputation of QK^T: hardware, not model, FLOPs.)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    analytic = model.flops_per_token(T) * x.numel()
    attention = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T * x.numel()
    assert attention / analytic > 0.2
    assert counter.get_total_flops() == pytest.approx(analytic, rel=0.02)


# ---- the peak table --------------------------------------------------------------------------


@pytest.mark.parametrize("name,chip", [
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA A100-SXM4-80GB", "A100"),
    ("NVIDIA A100-SXM4-40GB", "A100"),
    ("NVIDIA A100-PCIE-40GB", "A100"),
    ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA GB200", "GB200"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA A10G", "A10G"),
])
def test_device_names_match_their_chip(name, chip):
    assert chip_of(name).chip == chip


@pytest.mark.parametrize("name", ["NVIDIA L40", "Tesla T4", "NVIDIA GeForce RTX 4090", "AMD Instinct MI300X", ""])
def test_unknown_chips_have_no_peak(name):
    assert chip_of(name) is None and peak_flops(name, "bf16") is None
    peak, why = table_peak(name)
    assert peak is None and repr(name) in why


def test_peaks_are_dense_and_by_dtype():
    assert peak_flops("NVIDIA H200", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H200", torch.float8_e4m3fn) == 1978.9e12
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == peak_flops("NVIDIA H200", "fp16")
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp8") is None  # Ampere: no fp8 tensor cores
    assert peak_flops("NVIDIA L4", "fp8") == 242.5e12  # datasheet: 485 with sparsity
    # Lightning's dense rows agree; its H200 and H100 NVL rows are the sparse figures (2x ours).
    for name, lightning_row in (("NVIDIA H100 80GB HBM3", "h100 sxm"), ("NVIDIA H100 PCIe", "h100 pcie"),
                                ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L4", "l4")):
        assert peak_flops(name) == _CUDA_FLOPS[lightning_row][torch.bfloat16]
    assert _CUDA_FLOPS["h200 sxm1"][torch.bfloat16] > 2 * 0.99 * peak_flops("NVIDIA H200")
    with pytest.raises(ValueError, match="bf16/fp16 and fp8 only"):
        peak_flops("NVIDIA H200", torch.float32)


def test_table_has_bf16_and_fp8_peaks():
    assert table_peak("NVIDIA H100 80GB HBM3", float8=True) == (1978.9e12, "table: H100 SXM fp8 dense")
    assert table_peak("NVIDIA H100 80GB HBM3") == (989.4e12, "table: H100 SXM bf16 dense")
    assert table_peak("NVIDIA A100-SXM4-80GB", float8=True)[0] is None


def test_cpu_peak_is_measured_once():
    first = measure_cpu_peak_flops()
    assert first > 1e8  # any CPU does more than 0.1 GFLOP/s in fp32 matmuls
    assert measure_cpu_peak_flops() == first


# ---- the callback in a Trainer ---------------------------------------------------------------


def _tokens(n=32, seq=SEQ):
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, VOCAB, (n, seq + 1), generator=g)
    return t[:, :-1], t[:, 1:]


class TokenData(pl.LightningDataModule):
    def __init__(self, batch_size: int = BATCH, n: int = 32):
        super().__init__()
        self.batch_size, self.n = batch_size, n

    def train_dataloader(self):
        return DataLoader(TensorDataset(*_tokens(self.n)), batch_size=self.batch_size)


def _trainer(callbacks, tmp_path=None, steps=6, **kwargs):
    logger = CSVLogger(tmp_path, name="mfu") if tmp_path is not None else False
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=logger, log_every_n_steps=1,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=callbacks, **kwargs)


def _csv_rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_logs_perf_metrics_per_optimizer_step_through_a_csv_logger(tmp_path):
    torch.manual_seed(0)
    monitor = MFUMonitor(window=3, warn_below=0.0)
    trainer = _trainer([monitor], tmp_path, steps=4, accumulate_grad_batches=2)
    module = GPTModule("tiny", vocab_size=VOCAB)
    trainer.fit(module, datamodule=TokenData())
    rows = [r for r in _csv_rows(trainer.logger) if r.get("perf/mfu")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]  # one row per optimizer step, not per batch
    keys = {"perf/tokens_per_sec", "perf/tokens_per_sec_per_device", "perf/tflops_per_device", "perf/mfu",
            "perf/peak_tflops", "perf/step_time_s", "perf/data_wait_frac", "perf/compute_frac", "perf/peak_rss_gib"}
    assert keys <= set(rows[-1]) and all(float(rows[-1][k]) >= 0 for k in keys)
    m = monitor.metrics
    tokens_per_step = 2 * BATCH * SEQ  # two micro-batches per optimizer step, one device
    assert m["perf/tokens_per_sec"] * m["perf/step_time_s"] == pytest.approx(tokens_per_step)
    flops = module.flops_per_token(SEQ) * m["perf/tokens_per_sec"]
    assert m["perf/tflops_per_device"] == pytest.approx(flops / 1e12)
    assert m["perf/mfu"] == pytest.approx(flops / monitor.peak)
    assert monitor.peak_source.startswith("measured") and m["perf/peak_tflops"] == pytest.approx(monitor.peak / 1e12)
    assert m["perf/data_wait_frac"] < 0.2 < m["perf/compute_frac"] <= 1.0  # in-memory data: no wait
    assert 0.01 < m["perf/peak_rss_gib"] < 64
    assert type(trainer.profiler).__name__ == "PassThroughProfiler"  # the timing wrapper is gone


def test_user_flops_and_peak_override_the_model_and_the_table(tmp_path):
    monitor = MFUMonitor(window=2, peak_flops=2e12, flops_per_token=1e6, warn_below=0.0)
    _trainer([monitor], steps=3).fit(GPTModule("tiny", vocab_size=VOCAB), datamodule=TokenData())
    m = monitor.metrics
    assert monitor.peak_source == "user"
    assert m["perf/mfu"] == pytest.approx(m["perf/tokens_per_sec"] * 1e6 / 2e12)


class ManualClock(step_clock.HostClock):
    """A clock that moves only when the test moves it; counts when its spans are read."""

    def __init__(self):
        self.now, self.reads, self.trainer = 0.0, [], None

    def mark(self):
        return self.now

    def seconds(self, start, end):
        self.reads.append(self.trainer.global_step)
        return end - start


def test_spans_are_read_off_the_clock_at_logged_steps_only_with_validation_subtracted(monkeypatch, tmp_path):
    """On a GPU the clock's marks are CUDA events and reading a span waits for the device: the
    monitor must read only at the steps it logs. Each micro-batch takes 1 s and each validation
    100 s on the clock, so a step's time is exactly its two micro-batches."""
    clock = ManualClock()
    monkeypatch.setattr(mfu, "clock_for", lambda device, device_timing=True: clock)

    class Timed(GPTModule):
        def training_step(self, batch, batch_idx):
            clock.now += 1.0
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            clock.now += 100.0
            return super().validation_step(batch, batch_idx)

    monitor = MFUMonitor(window=2, log_every_n_steps=2, warn_below=0.0, peak_flops=1e12)
    trainer = _trainer([monitor], tmp_path, steps=6, accumulate_grad_batches=2, val_check_interval=4,
                       limit_val_batches=1, num_sanity_val_steps=1)
    clock.trainer = trainer
    val = DataLoader(TensorDataset(*_tokens(BATCH)), batch_size=BATCH)
    trainer.fit(Timed("tiny", vocab_size=VOCAB), train_dataloaders=TokenData().train_dataloader(),
                val_dataloaders=val)
    assert clock.now == 12 + 100 * 4  # 12 micro-batches; sanity check, validation after steps 2, 4, 6
    assert sorted(set(clock.reads)) == [2, 4, 6]  # nothing read at steps 1, 3, 5, nor after the last log
    rows = [r for r in _csv_rows(trainer.logger) if r.get("perf/step_time_s")]
    assert [int(r["step"]) for r in rows] == [1, 3, 5]  # optimizer steps 2, 4, 6 (Lightning's step - 1)
    for r in rows:
        assert float(r["perf/step_time_s"]) == 2.0 and float(r["perf/compute_frac"]) == 1.0
        assert float(r["perf/tokens_per_sec"]) == 2 * BATCH * SEQ / 2.0


class SlowTokens(Dataset):
    """In-memory tokens that take ``delay`` seconds per sample to "load"."""

    def __init__(self, delay: float):
        self.x, self.y = _tokens(64)
        self.delay = delay

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(self.delay)
        return self.x[i], self.y[i]


def test_low_mfu_warning_names_the_dataloader_when_data_wait_dominates():
    monitor = MFUMonitor(window=3, warmup_steps=1)
    module = GPTModule("tiny", vocab_size=VOCAB)
    loader = DataLoader(SlowTokens(delay=0.1), batch_size=BATCH)  # 0.4 s per batch
    with pytest.warns(UserWarning, match=r"MFU .* is below 30%.*likely cause: dataloader"):
        _trainer([monitor], steps=5).fit(module, train_dataloaders=loader)
    assert monitor.metrics["perf/data_wait_frac"] > monitor.data_wait_threshold
    assert len(monitor.warnings) == 1  # once per cause, not once per step


def test_a_forward_without_matmuls_warns_that_no_flops_were_counted():
    class NoMatmul(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Embedding(VOCAB, VOCAB)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    monitor = MFUMonitor(peak_flops=1e12, warn_below=0.0)
    with pytest.warns(UserWarning, match=r"counted no matmul.*MFUMonitor\(flops_per_token="):
        _trainer([monitor], steps=1).fit(NoMatmul(), datamodule=TokenData())
    assert monitor.flops_per_token == {SEQ: 0.0}


def test_diagnosis_by_breakdown():
    def first(*args, **kw):
        return diagnose(*args, **kw)[0][0]

    assert first(0.6, 0.3, 8, 65536, "cuda") == "dataloader"
    assert first(0.01, 0.95, 8, 65536, "cuda") == "communication"
    assert first(0.01, 0.95, 1, 2048, "cuda") == "small batch"
    assert first(0.01, 0.95, 1, 65536, "cuda") == "kernel efficiency"
    assert first(0.05, 0.4, 1, 65536, "cuda") == "host overhead"
    assert [c for c, _ in diagnose(0.01, 0.95, 8, 2048, "cuda")] == ["communication", "small batch"]


def test_invalid_options_fail_at_construction():
    with pytest.raises(ValueError, match="window >= 1"):
        MFUMonitor(window=0)
    with pytest.raises(ValueError, match="positive FLOP/s"):
        MFUMonitor(peak_flops=0)


def test_cli_yaml_class_path(tmp_path):
    cli = fit_from_yaml(tmp_path, {"class_path": "lightning_disttrain.callbacks.MFUMonitor",
                                   "init_args": {"window": 2, "warn_below": 0.0}},
                        TokenData, VOCAB, max_steps=3, csv_logger=True)
    [monitor] = [c for c in cli.trainer.callbacks if isinstance(c, MFUMonitor)]
    assert monitor.window == 2
    assert len([r for r in _csv_rows(cli.trainer.logger) if r.get("perf/tokens_per_sec")]) == 3


# ---- fsdp2 on two CPU processes --------------------------------------------------------------

WORKER, LAUNCH = "callbacks_worker", {2: ["mfu"]}  # in the suite's shared 2-rank launch (tests/conftest.py)


@pytest.mark.slow
def test_under_fsdp2_tokens_count_every_data_parallel_rank(launched):
    for r in launched(WORKER, 2)["mfu"]:
        m = r["metrics"]
        assert r["dp"] == r["world"] == 2
        # Each rank's micro-batch is 2 x SEQ tokens; a step is 2 ranks' worth.
        assert m["perf/tokens_per_sec"] * m["perf/step_time_s"] == pytest.approx(2 * 2 * SEQ)
        assert m["perf/tokens_per_sec_per_device"] == pytest.approx(m["perf/tokens_per_sec"] / 2)
