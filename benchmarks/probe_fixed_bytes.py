"""What a plain torch training loop holds besides the model state (the `fixed` bytes of bench_plan).

The ``tiny`` GPT (vocab 257, 8 x 256 tokens), AdamW, clipping, no Lightning, no process group, one
process; malloc bytes in use (``memory_meter.ProcessMeter``, memcount preloaded) after each phase of
two steps, and the same minus the model state (weights, gradients and AdamW moments: 16 B/param):

    LD_PRELOAD=$PWD/benchmarks/out/plan/memcount.so MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0 \
        python benchmarks/probe_fixed_bytes.py [--ops]

``--ops`` instead runs, in a fresh process, the tiny model's kinds of op once each (no grad, each
result freed at once) and prints what each one's first call leaves in use.

(memcount.so is built by any memory benchmark, e.g. ``python benchmarks/bench_plan.py``.)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_meter import ProcessMeter  # noqa: E402

from lightning_disttrain.models.gpt import GPT, PRESETS, GPTConfig  # noqa: E402


def first_use(meter: ProcessMeter) -> None:
    """What the first call of each kind of op leaves in use (the tiny model's shapes, no grad)."""
    x, w = torch.randn(8, 256, 128), torch.randn(512, 128)
    meter.mark("inputs")
    with torch.no_grad():
        F.linear(x, w)
        meter.mark("first F.linear 128 -> 512")
        F.linear(torch.randn(8, 256, 512), torch.randn(128, 512))
        meter.mark("F.linear 512 -> 128")
        q = torch.randn(8, 4, 256, 32)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        meter.mark("first causal SDPA")
        F.gelu(F.layer_norm(x, (128,)), approximate="tanh")
        meter.mark("layer_norm + gelu")
    previous = 0
    for name, level in meter.levels.items():
        print(f"{name:28s} {level / 2**20:8.2f} MiB in use (+{(level - previous) / 2**20:.2f})")
        previous = level


def main() -> None:
    torch.set_num_threads(1)
    meter = ProcessMeter()
    meter.start()
    if "--ops" in sys.argv[1:]:
        return first_use(meter)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**PRESETS["tiny"], "vocab_size": 257, "block_size": 256}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = 16 * sum(p.numel() for p in model.parameters())  # fp32: weights 4, gradients 4, moments 8
    meter.mark("built")
    for step in range(2):
        x = torch.randint(0, 257, (8, 257))
        with torch.no_grad():
            model(x[:, :-1])
        meter.mark(f"step{step}: a no-grad forward")
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        del loss
        meter.mark(f"step{step}: forward + backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        meter.mark(f"step{step}: clip + AdamW")
    for name, level in meter.levels.items():
        print(f"{name:34s} {level / 2**20:8.2f} MiB in use, {(level - state) / 2**20:7.2f} MiB besides the state")


if __name__ == "__main__":
    main()
