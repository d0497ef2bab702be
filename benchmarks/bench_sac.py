"""Activation checkpointing policies side by side: memory kept for backward, FLOPs recomputed, time.

For each model shape and policy, one training step (forward, cross-entropy, backward) of a GPT:

- ``saved MiB``: bytes of the tensors the forward allocated that are still alive when it returns
  (``activation_bytes``: live storages, deduplicated; this includes SAC's cache of op outputs
  and checkpointed blocks' inputs, which a ``saved_tensors_hooks`` sum cannot see), including
  the logits and the loss's own saved tensors, which no policy changes.
- ``recomputed GFLOP``: ``FlopCounterMode`` over backward minus the same for ``none``: the
  forward FLOPs run again. Attention is counted as a full (not causal) T x T product.
- ``step CPU s``: forward+backward CPU time of this process (one intra-op thread by default),
  the best of ``--steps`` rounds that visit every policy in turn (after a warm-up round), and its
  ratio to ``none``. CPU time, because on a machine shared with other jobs wall time (also
  printed) mostly measures the scheduler's share.

    python benchmarks/bench_sac.py                       # small and gpt2-124m, batch 1, seq 512
    python benchmarks/bench_sac.py --shapes tiny --seq-len 128 --steps 2

``--record FILE`` writes the table as ``cpu_figures.py`` reads it (``record``); ``--plot DIR`` draws
``cpu-sac`` from that record.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from bench_common import header, parser, report, table, timed_rounds
from record import add_record_options, provenance, record_path, wants_record, write_record
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.parallel.activation import (
    activation_bytes,
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)

POLICIES = {
    "none": dict(policy="none"),
    "selective": dict(policy="selective"),
    "selective every_other": dict(policy="selective", recompute_matmuls="every_other"),
    "block k=2": dict(policy="block", every_k=2),
    "full": dict(policy="full"),
}
VOCAB = {"tiny": 257, "small": 257, "gpt2-124m": 50257}  # byte tokenizer on the CPU sizes

aten = torch.ops.aten


def _sdpa_cpu(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _sdpa_cpu_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


# torch's FlopCounterMode has formulas for the CUDA SDPA kernels but not the CPU flash kernel;
# without these, recomputed attention (full / block) would count as free.
CPU_SDPA_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


def _loss(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())


def _use(model: GPT, policy: str) -> None:
    remove_activation_checkpointing(model.blocks)
    apply_activation_checkpointing(model.blocks, **POLICIES[policy])


def measure(shape: str, batch: int, seq_len: int, steps: int) -> list[dict]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name(shape, vocab_size=VOCAB.get(shape, 50257)))
    idx = torch.randint(0, model.config.vocab_size, (batch, seq_len))
    rows = {}
    for name in POLICIES:
        _use(model, name)
        model.zero_grad(set_to_none=True)
        loss, saved = activation_bytes(lambda: _loss(model, idx))
        with FlopCounterMode(display=False, custom_mapping=CPU_SDPA_FLOPS) as counter:
            loss.backward()
        rows[name] = dict(shape=shape, policy=name, saved=saved,
                          backward_flops=counter.get_total_flops(), cpu=[], wall=[])
        del loss

    def step(name: str):
        _use(model, name)
        model.zero_grad(set_to_none=True)
        c0, w0 = time.process_time(), time.perf_counter()
        _loss(model, idx).backward()
        return time.process_time() - c0, time.perf_counter() - w0

    # Timing rounds visit every policy in turn, so load from other processes on a shared machine
    # spreads over all policies instead of landing on one; the first round is a warm-up.
    times, _ = timed_rounds({name: lambda name=name: step(name) for name in POLICIES}, steps, warmup=1, rotate=False)
    for name, ts in times.items():
        rows[name]["cpu"], rows[name]["wall"] = [c for c, _ in ts], [w for _, w in ts]
    base = rows["none"]
    for r in rows.values():
        # The least-disturbed run (noise only ever adds time), in CPU seconds of this process:
        # on a machine shared with other jobs wall time mostly measures the scheduler's share.
        r["step"], r["step_wall"] = min(r["cpu"]), min(r["wall"])
        r["recomputed"] = r["backward_flops"] - base["backward_flops"]
        r["saved_ratio"] = r["saved"] / base["saved"]
    for r in rows.values():
        r["time_ratio"] = r["step"] / base["step"]
    return list(rows.values())


def main() -> None:
    p = parser(__doc__, steps=(3, "timed steps per policy (after a warm-up)"))
    p.add_argument("--shapes", nargs="+", default=["small", "gpt2-124m"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads; 1 keeps timings stable on a machine shared with others")
    add_record_options(p, "cpu-sac")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    header("bench_sac", f"{torch.get_num_threads()} torch threads", f"batch {args.batch}, seq {args.seq_len}, fp32",
           f"best of {args.steps} interleaved steps")
    rows = [r for shape in args.shapes for r in measure(shape, args.batch, args.seq_len, args.steps)]
    report("sac", {"args": vars(args), "rows": rows},
           table(["shape", "policy", ("saved MiB", ".1f"), ("vs none", ".2f"), ("recomputed GFLOP", ".2f"),
                  ("step CPU s", ".3f"), ("vs none", ".2f"), ("step wall s", ".3f")],
                 [(r["shape"], r["policy"], r["saved"] / 2**20, r["saved_ratio"], r["recomputed"] / 1e9, r["step"],
                   r["time_ratio"], r["step_wall"]) for r in rows], markdown=True))
    if wants_record(args):
        write_record(record(rows, args.batch, args.seq_len, args.steps, torch.get_num_threads()),
                     record_path(args, "bench_sac.json"), args.plot, args.format)


def record(rows: list[dict], batch: int, seq_len: int, steps: int, threads: int) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-sac`` from: ``measure``'s rows in the table's units
    (MiB, GFLOP, the best step's CPU and wall seconds, each ratio to the shape's ``none``)."""
    return provenance("bench_sac", "bench_sac.py", f"{threads} torch thread{'s' if threads > 1 else ''}") | {
        "setting": f"batch {batch}, seq {seq_len}, fp32, best of {steps} interleaved steps",
        "rows": [{"shape": r["shape"], "policy": r["policy"], "saved_mib": r["saved"] / 2**20,
                  "saved_vs_none": r["saved_ratio"], "recomputed_gflop": r["recomputed"] / 1e9,
                  "step_cpu_s": r["step"], "step_vs_none": r["time_ratio"], "step_wall_s": r["step_wall"]}
                 for r in rows]}


if __name__ == "__main__":
    main()
