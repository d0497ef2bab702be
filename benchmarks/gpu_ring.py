"""Ring attention's CUDA kernels on one GPU (gpu_paths.py section ``ring_attention``, issue 43).

Context parallel needs several GPUs, but what is CUDA-only in it is not the ring: it is the block
kernels that return each query's log-sum-exp and take a given one in backward
(``_torch_compat.attention_with_lse``: FlashAttention in bf16/fp16, the memory-efficient kernel in
fp32 or for head_dim > 256). So every rank of a ring runs here in one process, one thread each
(``ring_attention.LocalRing``: the transfers are clones on the GPU), on the shards context
parallel gives it, and the result is compared with one causal SDPA over the whole sequence,
forward and backward:

- ``bf16_long``: 32,768 tokens, 32 query / 8 key-value heads of 128 (Llama-3-8B's attention),
  4 ranks: the flash path. Passes when the ring's largest error against an fp32 reference is at
  most 2x bf16 SDPA's own (and the same for each gradient).
- ``fp32``: 8,192 tokens, the same heads, 4 ranks: the memory-efficient path; passes within 1e-4
  (max abs) of fp32 SDPA.
- ``bf16_wide``: 4,096 tokens, 8 heads of 256 (flash's widest), 2 ranks: as ``bf16_long``.

Each case also records the ring's time (forward + backward of every rank, serialised on one GPU)
against SDPA's, and the GPU memory the ring's ranks peaked at together. ``--smoke``: the same on
CPU at tiny shapes (CPU's flash kernel).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F

from lightning_disttrain.models.context_parallel import shard_sequence
from lightning_disttrain.models.ring_attention import LocalRing, ring_backward, ring_forward

CASES = {  # name -> (tokens, query heads, kv heads, head_dim, ranks, dtype)
    "bf16_long": (32768, 32, 8, 128, 4, torch.bfloat16),
    "fp32": (8192, 32, 8, 128, 4, torch.float32),
    "bf16_wide": (4096, 8, 8, 256, 2, torch.bfloat16),
}
SMOKE = {"bf16_long": (64, 4, 2, 16, 4, torch.bfloat16), "fp32": (64, 4, 2, 16, 4, torch.float32),
         "bf16_wide": (32, 2, 2, 32, 2, torch.bfloat16)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _sdpa(q, k, v, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1))
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))


def _ring(q, k, v, grad, size: int):
    scale = 1 / math.sqrt(q.size(-1))

    def shard(t, r):
        return shard_sequence(t, 2, r, size)

    outs = LocalRing(size).run(lambda r, shift: ring_forward(shard(q, r), shard(k, r), shard(v, r), r, size, shift, scale))
    grads = LocalRing(size).run(lambda r, shift: ring_backward(shard(grad, r), shard(q, r), shard(k, r), shard(v, r),
                                                               *outs[r], r, size, shift, scale))
    return [(outs[r][0], *grads[r]) for r in range(size)]


def _max_err(ring, reference, size: int) -> list[float]:
    """Per tensor (out, dq, dk, dv): the largest |ring - reference| over every rank's shard."""
    return [max(float((ring[r][i].float() - shard_sequence(ref, 2, r, size).float()).abs().max()) for r in range(size))
            for i, ref in enumerate(reference)]


def case(name: str, device: torch.device, smoke: bool) -> dict[str, Any]:
    tokens, heads, kv_heads, head_dim, size, dtype = (SMOKE if smoke else CASES)[name]
    g = torch.Generator(device=device).manual_seed(0)

    def bthd(h: int) -> torch.Tensor:  # (B, H, T, D) stored as (B, T, H, D): the layout the model hands the ring
        return torch.randn(1, tokens, h, head_dim, device=device, generator=g).transpose(1, 2)

    q, k, v, grad = bthd(heads), bthd(kv_heads), bthd(kv_heads), bthd(heads)
    exact = _sdpa(q, k, v, grad)  # fp32
    low = [t.to(dtype) for t in (q, k, v, grad)]
    _sync(device)
    t0 = time.perf_counter()
    sdpa = _sdpa(*low)
    _sync(device)
    sdpa_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    _ring(*low, size)  # warm-up (threads, kernels)
    _sync(device)
    t0 = time.perf_counter()
    ring = _ring(*low, size)
    _sync(device)
    ring_s = time.perf_counter() - t0
    ring_err = _max_err(ring, exact, size)
    out = {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "ranks": size,
           "dtype": str(dtype), "ring_max_err_vs_fp32 [out, dq, dk, dv]": ring_err,
           "ring_s": ring_s, "sdpa_s": sdpa_s}
    if device.type == "cuda":
        out["ring_peak_gb_all_ranks"] = (torch.cuda.max_memory_allocated() - before) / 1e9
    if dtype == torch.float32:
        ok = all(e <= 1e-4 for e in ring_err)
        out["tolerance"] = "1e-4 max abs against fp32 SDPA"
    else:
        sdpa_err = [float((a.float() - b.float()).abs().max()) for a, b in zip(sdpa, exact)]
        out["sdpa_max_err_vs_fp32 [out, dq, dk, dv]"] = sdpa_err
        ok = all(r <= 2 * s + 1e-6 for r, s in zip(ring_err, sdpa_err))
        out["tolerance"] = "each error at most 2x bf16 SDPA's own against fp32"
    out["passed"] = ok
    if not ok:
        raise AssertionError(f"ring attention {name}: {out}")
    return out


def measure(device: torch.device, smoke: bool) -> dict[str, Any]:
    return {name: case(name, device, smoke) for name in CASES}


if __name__ == "__main__":
    import json

    print(json.dumps(measure(torch.device("cpu"), smoke=True), indent=1, default=str))
