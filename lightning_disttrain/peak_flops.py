"""FLOP figures for MFU: peak dense FLOP/s per device (a table by CUDA device name, a CPU
measurement), and a counter of a model's forward FLOPs.

Dense figures only. NVIDIA's datasheets print the tensor-core numbers "with sparsity" (2:4
structured sparsity, which training does not use) in the headline column; every figure here is
the dense one, i.e. half of that. Lightning's own table (``lightning.fabric.utilities.throughput``)
mixes both (its H200 and H100 NVL rows are the sparse numbers) and does not know the plain
``"NVIDIA H200"`` name, hence this one.

Names are matched on what ``torch.cuda.get_device_name()`` returns, e.g. ``"NVIDIA H100 80GB
HBM3"`` (the SXM part: only the SXM module has HBM3 at 80 GB), ``"NVIDIA H100 PCIe"``,
``"NVIDIA H100 NVL"``, ``"NVIDIA H200"``, ``"NVIDIA A100-SXM4-80GB"``, ``"NVIDIA L4"``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from lightning_disttrain import _torch_compat as torch_compat

T = 1e12


@dataclass(frozen=True)
class ChipPeak:
    """Dense tensor-core peaks of one chip, FLOP/s per device."""

    chip: str
    bf16: float
    """bf16 (and fp16: the same on all of these) dense peak."""
    fp8: float | None
    """fp8 dense peak; None where the chip has no fp8 tensor cores (Ampere)."""
    source: str


# Sources: NVIDIA datasheets (A100 "nvidia-a100-datasheet-us-nvidia-1758950-r4"; H100 SXM/NVL
# "h100-datasheet-2430615"; H100 PCIe "h100-pcie-datasheet"; H200 "hpc-datasheet-sc23-h200";
# HGX B200 / GB200 NVL72 product pages (per-GPU = system / 8 resp. / 72); L4, L40S and A10
# datasheets). Each sparse headline figure halved.
CHIPS: dict[str, ChipPeak] = {c.chip: c for c in (
    ChipPeak("A100", bf16=312 * T, fp8=None, source="A100 datasheet (SXM and PCIe, 40/80GB: same peak)"),
    ChipPeak("H100 SXM", bf16=989.4 * T, fp8=1978.9 * T, source="H100 datasheet, SXM (1979/3958 sparse)"),
    ChipPeak("H100 PCIe", bf16=756 * T, fp8=1513 * T, source="H100 PCIe datasheet (1513/3026 sparse)"),
    ChipPeak("H100 NVL", bf16=835.5 * T, fp8=1670.5 * T, source="H100 datasheet, NVL per GPU (1671/3341 sparse)"),
    ChipPeak("GH200", bf16=989.4 * T, fp8=1978.9 * T, source="GH200 datasheet: the H100 SXM's Hopper GPU"),
    ChipPeak("H200", bf16=989.4 * T, fp8=1978.9 * T, source="H200 datasheet, SXM (1979/3958 sparse)"),
    ChipPeak("H200 NVL", bf16=835.5 * T, fp8=1670.5 * T, source="H200 datasheet, NVL (1671/3341 sparse)"),
    ChipPeak("B200", bf16=2250 * T, fp8=4500 * T, source="HGX B200: 36/72 PF sparse per 8 GPUs"),
    ChipPeak("GB200", bf16=2500 * T, fp8=5000 * T, source="GB200 NVL72: 360/720 PF sparse per 72 GPUs"),
    ChipPeak("L4", bf16=121 * T, fp8=242.5 * T, source="L4 datasheet (242/485 sparse)"),
    ChipPeak("L40S", bf16=362.05 * T, fp8=733 * T, source="L40S datasheet (733/1466 sparse)"),
    ChipPeak("A10G", bf16=125 * T, fp8=None, source="A10 datasheet (AWS's A10G variant; 250 sparse)"),
)}

# First match wins, so longer names come before their prefixes ("gh200"/"gb200" contain
# "h200"/"b200"; "h200 nvl" before "h200"). \b keeps "l4" from matching "l40s".
_NAME_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), chip) for p, chip in (
    (r"\bgb200\b", "GB200"),
    (r"\bgh200\b", "GH200"),
    (r"\bb200\b", "B200"),
    (r"\bh200\b.*\bnvl\b", "H200 NVL"),
    (r"\bh200\b", "H200"),
    (r"\bh100\b.*\bnvl\b", "H100 NVL"),
    (r"\bh100\b.*\bpcie\b", "H100 PCIe"),
    (r"\bh100\b", "H100 SXM"),  # "H100 80GB HBM3", "H100 SXM5 80GB": only PCIe/NVL say so
    (r"\ba100\b", "A100"),
    (r"\bl40s\b", "L40S"),
    (r"\bl4\b", "L4"),
    (r"\ba10g\b", "A10G"),
))

_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "bf16", "float16": "bf16", "half": "bf16",
           "fp8": "fp8", "float8": "fp8"}


def chip_of(device_name: str) -> ChipPeak | None:
    """The table row for a CUDA device name, or None when the chip is not in the table."""
    name = device_name.lower().replace("_", " ")
    for pattern, chip in _NAME_RULES:
        if pattern.search(name):
            return CHIPS[chip]
    return None


def _dtype_key(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float16):
            return "bf16"
        if dtype.is_floating_point and dtype.itemsize == 1:
            return "fp8"
        dtype = str(dtype).removeprefix("torch.")
    key = _DTYPES.get(str(dtype).lower())
    if key is None:
        raise ValueError(f"peak_flops has dense figures for bf16/fp16 and fp8 only, not {dtype!r}; "
                         f"pass the peak yourself (MFUMonitor(peak_flops=...)) for other dtypes")
    return key


def peak_flops(device_name: str, dtype: str | torch.dtype = "bf16") -> float | None:
    """Dense peak FLOP/s of one device called ``device_name`` for ``dtype`` ("bf16", "fp16",
    "fp8" or a torch dtype). None when the chip is unknown or has no tensor cores for ``dtype``
    (e.g. fp8 on an A100): then measure or pass the peak yourself."""
    key = _dtype_key(dtype)
    chip = chip_of(device_name)
    if chip is None:
        return None
    return chip.bf16 if key == "bf16" else chip.fp8


_CPU_PEAK: dict[int, float] = {}


def measure_cpu_peak_flops(n: int = 1024, min_seconds: float = 0.25) -> float:
    """FLOP/s of the best fp32 ``n x n`` matmul on this CPU with torch's current thread count.

    Measured once per process and thread count: CPUs have no datasheet peak worth the name
    (turbo, AVX frequency offsets, other processes), so the MFU denominator on CPU is what a large
    fp32 matmul reaches here, and is labelled as measured wherever it is shown.
    """
    threads = torch.get_num_threads()
    if threads in _CPU_PEAK:
        return _CPU_PEAK[threads]
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up: thread pool start, page faults
    best, spent, reps = float("inf"), 0.0, 0
    while spent < min_seconds or reps < 3:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    _CPU_PEAK[threads] = 2 * n**3 / best
    return _CPU_PEAK[threads]


def table_peak(device_name: str, float8: bool = False) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from) for a CUDA device: the dense fp8 figure with ``float8``,
    else the dense bf16 one; (None, why) when the table has no figure."""
    dtype = "fp8" if float8 else "bf16"
    chip = chip_of(device_name)
    peak = None if chip is None else (chip.fp8 if float8 else chip.bf16)
    if peak is None:
        return None, f"no dense {dtype} peak known for {device_name!r}"
    return peak, f"table: {chip.chip} {dtype} dense"


def _forward_only(formula):
    def count(*args, **kwargs) -> int:
        # A graph task is running: this op is part of a backward pass (activation checkpointing's
        # recomputation included), whose FLOPs the x3 already stands for.
        if torch_compat.current_graph_task_id() != -1:
            return 0
        return formula(*args, **kwargs)

    return torch_compat.pass_flop_formula_through(count)  # already shape-wrapped: FlopCounterMode uses it as is


def forward_flop_counter() -> FlopCounterMode:
    """A ``FlopCounterMode`` (enter it yourself) that counts forward matmul and attention FLOPs.

    Training FLOPs are 3 x this count: each forward matmul (attention's two included) has two of
    the same size in backward, the input's gradient and the weight's. Why count the forward and
    multiply rather than count forward and backward: ops run inside backward are not model FLOPs
    when activation checkpointing recomputes the forward there, and torch counts the backward of
    fused attention kernels inconsistently (CUDA flash: with its recomputation of QK^T; CPU: not
    at all). Ops run while a backward is in progress are therefore not counted, so a counter left
    open over backward and the optimizer still counts the forward only; the optimizer's own
    matmuls (Muon's Newton-Schulz iterations) are not model FLOPs, so stop it before the step.

    CPU's fused attention kernel (``_scaled_dot_product_flash_attention_for_cpu``) is missing from
    torch's FLOP registry; it is counted here with the formula of the CUDA kernels, and context
    parallel's ring attention (one operator) with the same formula over the blocks it computes. Norms,
    activations and the loss are not counted (the analytic 6·N formula leaves them out too).
    """
    aten = torch.ops.aten
    mapping = {op: _forward_only(formula) for op, formula in flop_registry.items()}
    sdpa = flop_registry[aten._scaled_dot_product_flash_attention]
    for name in ("_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_fused_attention_overrideable"):
        op = getattr(aten, name, None)
        if op is not None and op not in mapping:
            mapping[op] = _forward_only(sdpa)
    ring = getattr(torch.ops.ldt, "ring_attention", None)  # registered by models/ring_attention.py
    if ring is not None:
        mapping[ring] = _forward_only(_ring_attention_flops)
    return FlopCounterMode(display=False, custom_mapping=mapping)


def _ring_attention_flops(q, k, v, group_name, rank, size, scale, *args, **kwargs) -> int:
    """Context parallel's ring attention on one rank: the (2 x cp + 1) blocks of L x L (query,
    key) pairs it hands its kernels (``ring_attention.pairs_computed``), 4 FLOPs per pair and head
    dimension (QK^T and PV), as torch counts its fused attention kernels."""
    batch, heads, local, head_dim = q.shape
    chunk = local // 2
    return 4 * batch * heads * head_dim * (2 * size + 1) * chunk * chunk
