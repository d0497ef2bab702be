"""Step time, tokens/s, training hours and cost from FLOPs per token and an assumed MFU.

    step time = FLOPs/token x tokens/step / (GPUs x peak x MFU)  x recompute x pipeline bubble

FLOPs per token are the model's (``GPT.flops_per_token``: 6·N_active + 12·L·H·Dh·T, PaLM
appendix B). The peak is the dense bf16 figure of the chip (``lightning_disttrain/peak_flops.py``). MFU is
assumed, not known before a run: ``DEFAULT_MFU`` with the public anchors below; pass ``--mfu``
with your own measurement (``MFUMonitor`` logs it) to replace it. Full activation recomputation
runs the forward twice (8 instead of 6 FLOPs per parameter and token: x4/3 time at the same
utilisation); selective recomputation re-runs only elementwise ops (counted as free). A 1F1B
pipeline with p stages and m micro-batches idles (p-1)/m of a step. fp8: the same MFU against the
bf16 peak, times ``FP8_SPEEDUP``.

Cost = $/GPU-hour x GPUs x hours x 1.2: 20% on top for profiling, debugging and restarts that a
FLOP count does not see. Failures (Young 1974 / Daly 2006): with a checkpoint costing C seconds
and a mean time between failures M of the whole job, checkpoint every sqrt(2·C·M); the expected
overhead is C/interval + (interval/2 + restart)/M of the run (half an interval of work lost per
failure, plus the restart). M = device MTBF / GPUs, with spot preemptions added as a rate per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_disttrain.young_daly import young_daly_interval

DEFAULT_MFU = 0.40
MFU_ANCHORS = (
    "Llama 3 405B on 16K H100: 38-43% bf16 MFU (Llama 3 paper, table 4)",
    "MegaScale, 175B on 12,288 GPUs: 55.2% MFU (Jiang et al. 2024)",
    "PaLM 540B on 6,144 TPU v4: 46.2% MFU (Chowdhery et al. 2022, table 3)",
)
"""Where ``DEFAULT_MFU`` comes from: well-tuned large runs reach 38-55%; 40% is the low end, for a
first run of a new setup."""
FP8_SPEEDUP = 1.3
FP8_ANCHOR = "torchao float8 rowwise: 1.34-1.43x end to end on Llama 3 at 2K-GPU scale (torchao README)"
OVERHEAD = 1.20
DEVICE_MTBF_HOURS = 50_000.0
MTBF_ANCHOR = ("Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. one per "
               "16,384 x 54 x 24 / 419 = 50,700 GPU-hours (Llama 3 paper, section 3.3.4)")
RESTART_SECONDS = 600.0
CHECKPOINT_WRITE_GBPS = 1.0
"""Assumed checkpoint write bandwidth per node (GB/s) when the checkpoint cost is not given."""


@dataclass(frozen=True)
class Throughput:
    step_seconds: float
    tokens_per_second: float
    mfu: float
    peak_flops: float
    flops_per_step: float


def throughput(flops_per_token: float, tokens_per_step: float, gpus: int, peak_flops: float, mfu: float = DEFAULT_MFU,
               *, full_recompute: bool = False, pp: int = 1, microbatches: int = 1, fp8: bool = False) -> Throughput:
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu} must be in (0, 1]; e.g. 0.4 for 40%")
    if peak_flops <= 0:
        raise ValueError(f"peak_flops={peak_flops} must be > 0")
    flops = flops_per_token * tokens_per_step
    seconds = flops / (gpus * peak_flops * mfu * (FP8_SPEEDUP if fp8 else 1.0))
    if full_recompute:
        seconds *= 4 / 3
    if pp > 1:
        seconds *= 1 + (pp - 1) / max(microbatches, 1)
    return Throughput(seconds, tokens_per_step / seconds, mfu, peak_flops, flops)


@dataclass(frozen=True)
class Failures:
    job_mtbf_hours: float
    checkpoint_seconds: float
    interval_seconds: float
    """Young/Daly: sqrt(2 x checkpoint cost x job MTBF)."""
    overhead: float
    """Fraction of the run added by checkpoints, lost work and restarts."""


def failures(gpus: int, nodes: int, checkpoint_seconds: float, device_mtbf_hours: float = DEVICE_MTBF_HOURS,
             preemptions_per_node_hour: float = 0.0, restart_seconds: float = RESTART_SECONDS) -> Failures:
    if device_mtbf_hours <= 0:
        raise ValueError(f"device MTBF {device_mtbf_hours} h must be > 0")
    if preemptions_per_node_hour < 0:
        raise ValueError(f"preemption rate {preemptions_per_node_hour} per node-hour must be >= 0")
    rate = gpus / device_mtbf_hours + nodes * preemptions_per_node_hour  # failures per hour, whole job
    mtbf_s = 3600 / rate
    tau = young_daly_interval(checkpoint_seconds, mtbf_s)
    overhead = checkpoint_seconds / tau + (tau / 2 + restart_seconds) / mtbf_s
    return Failures(mtbf_s / 3600, checkpoint_seconds, tau, overhead)


@dataclass(frozen=True)
class Cost:
    hours: float
    """Wall-clock hours of training for the token budget, failures' overhead included."""
    gpu_hours: float
    on_demand: float | None
    """$ at the on-demand price, x1.2; None without a price."""
    spot: float | None
    """$ at the spot price (its preemptions in the overhead), x1.2; None without a spot price."""
    spot_hours: float | None

    @property
    def spot_savings(self) -> float | None:
        if self.on_demand is None or self.spot is None:
            return None
        return self.on_demand - self.spot


def cost(token_budget: float, tokens_per_second: float, gpus: int, overhead: float, price: float | None = None,
         spot_price: float | None = None, spot_overhead: float | None = None) -> Cost:
    if token_budget <= 0:
        raise ValueError(f"token budget {token_budget} must be > 0 (e.g. 2e11 for 200B tokens)")
    base_hours = token_budget / tokens_per_second / 3600
    hours = base_hours * (1 + overhead)
    on_demand = None if price is None else price * gpus * hours * OVERHEAD
    spot_hours = None if spot_price is None else base_hours * (1 + (spot_overhead if spot_overhead is not None
                                                                     else overhead))
    spot = None if spot_hours is None else spot_price * gpus * spot_hours * OVERHEAD
    return Cost(hours, hours * gpus, on_demand, spot, spot_hours)
