"""Candidate layouts for a cluster, in order of simplicity, and the recommendation.

The order is the one a practitioner climbs: DDP; FSDP2 (ZeRO-2, then HSDP across nodes, then
ZeRO-3); for a mixture of experts, expert parallel; then activation checkpointing (selective, then
full); then tensor parallel inside a node (2, 4, 8, with sequence parallel); then context parallel
inside a node (2, 4, 8; alone and with the widest tensor parallel beside it), for sequences whose
activations do not fit otherwise; then pipeline parallel across nodes (1F1B, then Interleaved1F1B
with 2 stages per rank). ZeRO-1 is shown for the arithmetic but not recommended: FSDP2 has no
optimizer-only sharding, and ZeRO-2 costs the same communication.

A pipeline layout carries the strategy's schedule arguments: each data-parallel rank's share of the
global batch, ``global_batch / (dp x micro_batch)`` micro-batches, runs as one schedule step
(``pp_microbatches`` = that count, no gradient accumulation: the most micro-batches, the smallest
bubble; 1F1B's memory does not grow with them). Fewer micro-batches than the schedule's stages, or
(interleaved) a count that is not a multiple of pp, leaves the layout out with the reason.

Gradient accumulation under FSDP (``zero >= 2``) is planned in the mode the run will use:
``accumulate_unsharded_grads`` (``plan --accumulate-unsharded-grads``) sets it on every FSDP layout,
whose memory then holds the unsharded gradients between micro-batches and whose communication
reduce-scatters once per step; by default gradients stay sharded, reduce-scattered every
micro-batch. Each candidate's memory is computed with its own accumulation in that mode, so a
layout whose accumulation does not fit is never recommended.

The recommendation is the first layout in that order that divides the batch and fits with
headroom: at least ``PLAN_ERROR`` of the usable memory to spare, the planner's own error as
validated against measured peaks (docs/benchmarks.md, section 12: measured / planned within
0.90-1.10 on CPU). Only when no layout has that much headroom is the first one that merely fits
recommended, and the reason says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from lightning_disttrain.planning.memory import (
    DEFAULT_MARGIN,
    MemoryEstimate,
    memory_per_gpu,
)
from lightning_disttrain.planning.model_shape import ModelShape
from lightning_disttrain.planning.pipeline import check
from lightning_disttrain.planning.spec import GB, Cluster, Layout, Workload

if TYPE_CHECKING:
    from lightning_disttrain.planning.throughput import Throughput

PLAN_ERROR = 0.10
"""Headroom the recommendation wants, as a fraction of usable memory: the planner's validated error."""


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    accumulation: int | None
    """Micro-batches per optimizer step on each data-parallel rank; None when the batch does not divide."""
    note: str = ""
    recommendable: bool = True
    speed: Throughput | None = field(default=None, compare=False)
    """Step time by term (``throughput.step_terms``), set by ``make_plan`` for usable layouts on GPUs."""

    @property
    def usable(self) -> bool:
        return self.recommendable and self.accumulation is not None and self.memory.fits

    def safe(self, error: float = PLAN_ERROR) -> bool:
        """Usable with at least ``error`` of the usable memory to spare."""
        return self.usable and self.memory.headroom >= error * self.memory.usable


def _divisors_in(values, n: int) -> list[int]:
    return [v for v in values if v <= n and n % v == 0]


def _pipeline_layout(shape: ModelShape, workload: Workload, p: int, tp: int, dp_shard: int, ac: str,
                     schedule: str) -> tuple[Layout, str]:
    """A pipeline layout whose micro-batches are a data-parallel rank's share of the batch, or the
    strategy's default count with the reason it cannot run (note)."""
    stages_per_rank = None if schedule == "1F1B" else 2
    base = Layout(dp_shard=dp_shard, tp=tp, pp=p, zero=3, ac=ac, pp_schedule=schedule,
                  pp_stages_per_rank=stages_per_rank)
    options = base.pipeline
    per_rank = workload.micro_batch * dp_shard
    n = workload.global_batch // per_rank if workload.global_batch % per_rank == 0 else 0
    note = "pipeline stages need an untied head (tie_embeddings=False): planned untied" if shape.tied else ""
    try:
        if not n:
            raise ValueError(f"global batch {workload.global_batch} is not a multiple of micro batch x "
                             f"data-parallel ranks = {per_rank}")
        if stages_per_rank and shape.pos_emb == "rope":  # parallel/recipe.py refuses it (issue 43)
            raise ValueError(f"{schedule} with RoPE on a meta-device build (the default) is not supported yet: "
                             f"its stage views keep the meta RoPE tables")
        check(options.__class__(schedule, n, stages_per_rank), p, shape.n_layer)
    except ValueError as err:
        m = options.num_microbatches(p)
        return Layout(**{**base.__dict__, "pp_microbatches": m}), (note + "; " if note else "") + f"cannot run: {err}"
    return Layout(**{**base.__dict__, "pp_microbatches": n}), note


def candidate_layouts(shape: ModelShape, cluster: Cluster, workload: Workload | None = None,
                      accumulate_unsharded_grads: bool = False) -> list[tuple[Layout, str, bool]]:
    """(layout, note, recommendable) in the planner's order of simplicity; the FSDP layouts (zero >= 2)
    carry ``accumulate_unsharded_grads``."""
    out = _candidates(shape, cluster, workload)
    if not accumulate_unsharded_grads:
        return out
    return [(replace(layout, accumulate_unsharded_grads=True) if layout.zero >= 2 else layout, note, ok)
            for layout, note, ok in out]


def _candidates(shape: ModelShape, cluster: Cluster, workload: Workload | None) -> list[tuple[Layout, str, bool]]:
    N, G, M = cluster.world, cluster.gpus_per_node, cluster.nodes
    out: list[tuple[Layout, str, bool]] = [
        (Layout(dp_replicate=N, dp_shard=1, zero=0), "", True),
        (Layout(dp_shard=N, zero=1), "reference only: FSDP2 has no optimizer-only sharding", False),
        (Layout(dp_shard=N, zero=2), "", True),
    ]
    if M > 1:
        out.append((Layout(dp_replicate=M, dp_shard=G, zero=3), "shard within a node, replicate across", True))
    out.append((Layout(dp_shard=N, zero=3), "", True))
    eps = [1]
    if shape.is_moe:
        eps = [e for e in _divisors_in((1, 2, 4, 8, 16, 32, 64), N) if shape.num_experts % e == 0]
        out += [(Layout(dp_shard=N, zero=3, ep=e), "", True) for e in eps[1:]]
    for ac in ("selective", "full"):
        for e in eps:
            out.append((Layout(dp_shard=N, zero=3, ep=e, ac=ac), "", True))
    if shape.is_moe:
        return out  # tensor / pipeline parallel of MoE blocks: not modelled (the strategy refuses TP of MoE)
    tps = [t for t in _divisors_in((2, 4, 8, 16), G) if shape.n_head % t == 0]
    for t in tps:
        for ac in ("none", "selective", "full"):
            out.append((Layout(dp_shard=N // t, tp=t, zero=3, ac=ac), "", True))
    # context parallel inside a node (its ring passes K/V every block), alone and beside the widest
    # tensor parallel that still fits the node: it divides every sequence-length term by cp
    for c in _divisors_in((2, 4, 8), G):
        if shape.seq_len % (2 * c):
            continue  # the strategy splits each sequence into 2 x cp load-balanced chunks
        with_tp = [t for t in tps if c * t <= G]
        for t in [1] + with_tp[-1:]:
            for ac in ("none", "selective", "full"):
                out.append((Layout(dp_shard=N // (c * t), tp=t, cp=c, zero=3, ac=ac), "", True))
    pps = [p for p in _divisors_in((2, 4, 8, 16, 32, 64), M) if p <= shape.n_layer]
    tp_max = tps[-1] if tps else 1
    workload = workload or Workload(shape.seq_len, N, 1)
    for p in pps:
        for schedule in ("1F1B", "Interleaved1F1B"):
            if schedule != "1F1B" and 2 * p > shape.n_layer:
                continue
            for ac in ("none", "selective", "full"):
                layout, note = _pipeline_layout(shape, workload, p, tp_max, N // (p * tp_max), ac, schedule)
                out.append((layout, note, not note.startswith("cannot run") and "; cannot run" not in note))
    return out


def evaluate(shape: ModelShape, workload: Workload, cluster: Cluster, margin: float = DEFAULT_MARGIN,
             accumulate_unsharded_grads: bool = False) -> list[Candidate]:
    """Every candidate layout with its memory estimate and gradient accumulation (the memory of that
    accumulation in the chosen mode: see the module doc)."""
    out = []
    for layout, note, ok in candidate_layouts(shape, cluster, workload, accumulate_unsharded_grads):
        per_step = workload.micro_batch * layout.dp * layout.microbatches
        accumulation = workload.global_batch // per_step if workload.global_batch % per_step == 0 else None
        if accumulation is None and ok:
            note = (note + "; " if note else "") + (f"global batch {workload.global_batch} is not a multiple of "
                                                    f"micro batch x data-parallel ranks"
                                                    + (" x micro-batches" if layout.pp > 1 else "")
                                                    + f" = {per_step}")
        memory = memory_per_gpu(shape, layout, workload, cluster, margin, accumulation or 1)
        out.append(Candidate(layout, memory, accumulation, note, ok))
    return out


def recommend(candidates: list[Candidate], error: float = PLAN_ERROR) -> tuple[Candidate | None, str]:
    """The simplest candidate that fits with ``error`` headroom (else the simplest that fits), and
    the reason in one line."""
    fitting = [c for c in candidates if c.usable]
    usable_gb = candidates[0].memory.usable / GB
    if not fitting:
        best = min(candidates, key=lambda c: c.memory.total)
        return None, (f"nothing fits: the smallest need is {best.memory.total / GB:.1f} GB per GPU "
                      f"({best.layout.name}) against {usable_gb:.1f} GB usable; add GPUs, or shorten the micro "
                      f"batch or the sequence")
    allowance = f"{error:.0%} of usable = {error * usable_gb:.1f} GB, the planner's validated error"
    safe = next((c for c in fitting if c.safe(error)), None)
    chosen = safe or fitting[0]
    need = (f"needs {chosen.memory.total / GB:.1f} of {usable_gb:.1f} GB usable per GPU, "
            f"{chosen.memory.headroom / GB:.1f} GB to spare")
    if safe is None:
        return chosen, (f"{chosen.layout.name} is the simplest layout that fits, but with little headroom: {need}, "
                        f"less than {allowance}; no layout has more: measure the first steps' peak before a long run")
    before = [c for c in candidates[:candidates.index(chosen)] if c.recommendable]
    thin = [c for c in before if c.usable]
    if thin:
        listed = ", ".join(f"{c.layout.name} ({c.memory.headroom / GB:.1f} GB)" for c in thin[:2])
        return chosen, (f"{chosen.layout.name} is the simplest layout that fits with headroom: {need}, at least "
                        f"{allowance}; simpler layouts fit with less to spare: {listed}")
    why = ""
    if before:
        last = before[-1]
        why = " (" + last.layout.name + (" does not divide the batch" if last.memory.fits
                                         else f" needs {last.memory.total / GB:.1f} GB") + ")"
    if not before:
        return chosen, f"{chosen.layout.name} is the simplest layout and fits: {need}"
    return chosen, f"{chosen.layout.name} is the simplest layout that fits: {need}{why}"
