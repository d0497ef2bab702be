"""Selective activation checkpointing with the fused SDPA kernels, on one GPU: how often the
attention forward runs per block, memory kept for backward, and step time, for the policies
``none`` / ``selective`` / ``full`` (``lightning_disttrain.parallel.activation``).

For each SDPA backend (flash, cuDNN, memory-efficient; whichever this GPU supports) and policy:
one eager training step (forward, cross-entropy, backward; bf16 autocast) of ``gpt2-124m`` at seq
1024, forward and backward each under its own ``torch.profiler``:

- attention forwards: the fused SDPA forward ops (``aten::_scaled_dot_product_*_attention``) that
  ran their kernel in each pass (``_events``), and on CUDA the GPU kernels of those ops. Which kernel names are "attention forward"
  is read off the forward pass itself (every kernel there with flash / fmha / sdpa / attention /
  cudnn in its name), then counted in the backward pass, so no kernel naming is guessed. Expected
  per block and step: none 1, selective 1 (SAC keeps the SDPA output: no recompute), full 2.
- memory: on CUDA, bytes allocated when the forward returns minus before it (what backward will
  read, logits included) and the step's peak over the start; on CPU ``activation_bytes``.
- time: median forward+backward wall time over ``steps`` steps (GPU drained before and after).

``compiled=True`` (gpu_paths.py's ``sac_compiled``): the same for the flash kernel only, each block
compiled after its checkpointing (the package's stage order), a fresh model (same seed) and fresh
dynamo state per policy. Eager timings carry SAC's per-op Python dispatch in both passes, which a
launch-bound eager step of gpt2-124m shows in full; compiled, the policy is traced into the graph.

On CPU (``--smoke``) the only fused kernel is ``_scaled_dot_product_flash_attention_for_cpu``;
the op counts are checked the same way, kernel counts and CUDA memory are absent.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.parallel.activation import (
    activation_bytes,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)

POLICIES = ("none", "selective", "full")
SDPA_FORWARD_OPS = (  # profiler names of the fused forward ops (ATTENTION_OPS in parallel/activation.py)
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
)
_ATTENTION_WORDS = ("flash", "fmha", "sdpa", "attention", "attn", "cudnn")
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_ALLOCATIONS = ("aten::empty", "aten::empty_like", "aten::empty_strided")


def _events(prof) -> tuple[Counter, Counter]:
    """(SDPA forward ops that ran their kernel, GPU kernels) by name, from one profiled pass.

    The profiler records an op each time it is dispatched, also when SAC's dispatch mode then
    serves it from its cache (backward of ``selective``: the op's children are ``aten::detach``
    of the cached outputs) and, in the forward under SAC, once more for the mode's own call of the
    kernel. So an op event counts as a run when it allocated its outputs itself: a direct child
    ``aten::empty*``.
    """
    ops, kernels = Counter(), Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += 1
        elif e.name in SDPA_FORWARD_OPS and any(c.name in _ALLOCATIONS for c in e.cpu_children):
            ops[e.name] += 1
    return ops, kernels


def _count_forward_attention(model: GPT, inputs, targets, device: torch.device) -> dict[str, Any]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    with autocast, profile(activities=activities) as fwd_prof:
        loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
        _sync(device)
    with profile(activities=activities) as bwd_prof:
        loss.backward()
        _sync(device)
    model.zero_grad(set_to_none=True)
    (fwd_ops, fwd_kernels), (bwd_ops, bwd_kernels) = _events(fwd_prof), _events(bwd_prof)
    attn_kernels = sorted(k for k in fwd_kernels if any(w in k.lower() for w in _ATTENTION_WORDS))
    n = model.config.n_layer
    out = {"ops_forward": sum(fwd_ops[o] for o in SDPA_FORWARD_OPS),
           "ops_in_backward": sum(bwd_ops[o] for o in SDPA_FORWARD_OPS),
           "op_names": sorted(o for o in SDPA_FORWARD_OPS if fwd_ops[o] or bwd_ops[o])}
    out["ops_per_block"] = (out["ops_forward"] + out["ops_in_backward"]) / n
    if device.type == "cuda":
        out |= {"kernel_names": attn_kernels,
                "kernels_forward": sum(fwd_kernels[k] for k in attn_kernels),
                "kernels_in_backward": sum(bwd_kernels[k] for k in attn_kernels),
                "kernels_in_backward_by_name": {k: bwd_kernels[k] for k in attn_kernels if bwd_kernels[k]}}
        out["kernels_per_block"] = (out["kernels_forward"] + out["kernels_in_backward"]) / n
    return out


def _step(model: GPT, inputs, targets, device: torch.device) -> None:
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(inputs)
    F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
    model.zero_grad(set_to_none=True)


def _memory(model: GPT, inputs, targets, device: torch.device) -> dict[str, float]:
    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())

    if device.type != "cuda":
        loss, saved = activation_bytes(forward)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return {"saved_mib": saved / 2**20, "mem_source": "activation_bytes (live storages)"}
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = forward()
    _sync(device)
    saved = torch.cuda.memory_allocated(device) - before
    loss.backward()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    model.zero_grad(set_to_none=True)
    return {"saved_mib": saved / 2**20, "peak_mib": peak / 2**20, "mem_source": "torch.cuda.memory_allocated"}


def _time(model: GPT, inputs, targets, device: torch.device, steps: int) -> float:
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        _step(model, inputs, targets, device)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _model(cfg: GPTConfig, device: torch.device) -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(cfg)


def measure(device: torch.device, smoke: bool, compiled: bool = False) -> dict[str, Any]:
    preset, vocab, batch, seq, steps = ("tiny", 257, 2, 64, 1) if smoke else ("gpt2-124m", None, 8, 1024, 5)
    cfg = GPTConfig.from_name(preset, block_size=seq, **({"vocab_size": vocab} if vocab else {}))
    model = _model(cfg, device)
    x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    inputs, targets = x[:, :-1], x[:, 1:]
    backends = ["flash"] if device.type == "cpu" or compiled else list(BACKENDS)
    rows, errors = [], {}
    for backend in backends:
        for policy in POLICIES:
            if compiled:  # a fresh model and dynamo state: nothing compiled under another policy stays
                from lightning_disttrain.parallel.compile import apply_compile

                torch._dynamo.reset()
                model = _model(cfg, device)
                apply_activation_checkpointing(model.blocks, policy=policy)
                apply_compile(model.blocks, dynamic=False)
            else:
                remove_activation_checkpointing(model.blocks)
                apply_activation_checkpointing(model.blocks, policy=policy)
            try:
                with sdpa_kernel([BACKENDS[backend]]):
                    _step(model, inputs, targets, device)  # warm-up (cuDNN plans, allocator)
                    row = {"backend": backend, "policy": policy, "compiled": compiled}
                    row |= _count_forward_attention(model, inputs, targets, device)
                    row |= _memory(model, inputs, targets, device)
                    row["step_ms"] = 1e3 * _time(model, inputs, targets, device, steps)
            except RuntimeError as e:  # this GPU / build lacks the backend: say so, keep the others
                errors[f"{backend}/{policy}"] = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"#   sac {backend}/{policy}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                break
            rows.append(row)
    remove_activation_checkpointing(model.blocks)
    by = {(r["backend"], r["policy"]): r for r in rows}
    for r in rows:
        none, full = by.get((r["backend"], "none")), by.get((r["backend"], "full"))
        if none:
            r["saved_vs_none"] = r["saved_mib"] / none["saved_mib"]
            r["time_vs_none"] = r["step_ms"] / none["step_ms"]
        if full:
            r["time_vs_full"] = r["step_ms"] / full["step_ms"]
    expected = {"none": 1, "selective": 1, "full": 2}
    key = "kernels_per_block" if device.type == "cuda" else "ops_per_block"
    checks = {f"{r['backend']}/{r['policy']}": r.get(key) == expected[r["policy"]] for r in rows}
    _print(rows, key)
    return {"model": preset, "batch": batch, "seq": seq, "n_layer": cfg.n_layer, "timed_steps": steps, "compiled": compiled,
            "precision": "bf16 autocast" if device.type == "cuda" else "fp32", "rows": rows,
            "attention_forward_per_block_as_expected": checks, "counted_by": key, "backend_errors": errors}


def _print(rows: list[dict[str, Any]], key: str) -> None:
    print(f"# {'backend':<10}{'policy':<11}{key:>18}{'in backward':>12}{'saved MiB':>11}{'vs none':>8}"
          f"{'step ms':>10}{'vs none':>8}")
    for r in rows:
        in_bwd = r.get("kernels_in_backward", r["ops_in_backward"])
        print(f"# {r['backend']:<10}{r['policy']:<11}{r.get(key, float('nan')):>18.2f}{in_bwd:>12}"
              f"{r['saved_mib']:>11.1f}{r.get('saved_vs_none', float('nan')):>8.2f}{r['step_ms']:>10.1f}"
              f"{r.get('time_vs_none', float('nan')):>8.2f}", flush=True)
