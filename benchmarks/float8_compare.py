"""Float8 vs a high-precision baseline: train the same model twice on the same batches and compare
the losses (used by ``bench_float8.py`` and by the float8 tests).

Plain torch + torchao; the float8 run uses the package's own swap (``convert_to_float8``) with
Float8Training's default filter, so what is measured is what the callback does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_disttrain.parallel.float8 import Float8Options, convert_to_float8


@dataclass
class Float8Comparison:
    """Two runs from the same initial weights over the same batches: float8 vs a baseline."""

    recipe: str
    baseline: str
    """``"bf16-autocast"`` or ``"fp32"``: what the baseline (and the float8 run's other ops) ran in."""
    baseline_losses: list[float]
    float8_losses: list[float]
    converted: list[str]
    tail: int
    """Steps at the end over which the losses are averaged for ``gap_pct``."""
    baseline_s_per_step: float = 0.0
    float8_s_per_step: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def gap_pct(self) -> float:
        """(mean float8 loss - mean baseline loss) / mean baseline loss x 100 over the last ``tail``
        steps: positive when float8 trains worse."""
        b = sum(self.baseline_losses[-self.tail:]) / self.tail
        f = sum(self.float8_losses[-self.tail:]) / self.tail
        return 100.0 * (f - b) / b

    @property
    def max_step_gap_pct(self) -> float:
        """The largest relative gap at any single step, in percent."""
        return max(100.0 * abs(f - b) / b for b, f in zip(self.baseline_losses, self.float8_losses))


_SHORT_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _train(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], steps: int, lr: float,
           warmup_steps: int, clip: float | None, device: torch.device, autocast_dtype: torch.dtype | None,
           loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[list[float], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = (t.to(device) for t in batches[step % len(batches)])
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = loss_fn(model(x), y)
        loss.backward()
        # Warm-up and clipping as in pre-training: without them early loss spikes, which land on
        # different steps in the two runs, dominate the gap instead of float8's rounding.
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(warmup_steps, 1))
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss became {losses[-1]} at step {step}")
    return losses, (time.perf_counter() - t0) / steps


def compare_float8_to_baseline(
    model_factory: Callable[[], nn.Module],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    steps: int = 20,
    recipe: str = "tensorwise",
    lr: float = 1e-3,
    warmup_steps: int = 0,
    clip_grad_norm: float | None = 1.0,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None | str = "auto",
    options: Float8Options | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    seed: int = 0,
    tail: int = 5,
) -> Float8Comparison:
    """Train ``model_factory()`` twice for ``steps`` AdamW steps, cycling through ``batches``
    ``(x, y)``: once as built (the baseline), once with its Linears in float8; same seed, same
    initial weights, same data, linear warm-up over ``warmup_steps`` then constant ``lr``,
    gradients clipped to ``clip_grad_norm`` (None: off). Returns both loss curves and ``gap_pct``.

    ``autocast_dtype="auto"``: bf16 autocast on CUDA (what float8 replaces in practice); on CPU no
    autocast, i.e. an fp32 baseline (CPU bf16 matmuls are slower than fp32 ones, and fp32 is the
    stricter reference: the gap is then float8's alone, not float8's plus bf16's).
    """
    device = torch.device(device)
    if autocast_dtype == "auto":
        autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    options = options or Float8Options(recipe=recipe)
    loss_fn = loss_fn or _cross_entropy
    if steps < 1 or not batches:
        raise ValueError("compare_float8_to_baseline needs steps >= 1 and at least one batch")
    tail = max(1, min(tail, steps))

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return model_factory().to(device)

    train = dict(steps=steps, lr=lr, warmup_steps=warmup_steps, clip=clip_grad_norm, device=device,
                 autocast_dtype=autocast_dtype, loss_fn=loss_fn)
    base_losses, base_s = _train(build(), batches, **train)
    model = build()
    converted = convert_to_float8(model, options, device=device)
    if not converted:
        raise ValueError("no Linear of the model qualifies for float8 (dimensions divisible by 16, not a "
                         "head/router); nothing to compare")
    fp8_losses, fp8_s = _train(model, batches, **train)
    return Float8Comparison(
        recipe=options.recipe,
        baseline="fp32" if autocast_dtype is None else f"{_SHORT_DTYPE.get(autocast_dtype, autocast_dtype)}-autocast",
        baseline_losses=base_losses, float8_losses=fp8_losses, converted=converted, tail=tail,
        baseline_s_per_step=base_s, float8_s_per_step=fp8_s,
        notes={"device": str(device), "emulated": options.emulate if options.emulate is not None
               else device.type == "cpu", "steps": steps, "lr": lr, "warmup_steps": warmup_steps,
               "clip_grad_norm": clip_grad_norm, "seed": seed})
