"""Candidate layouts for a cluster, in order of simplicity, and the recommendation.

The order is the one a practitioner climbs: DDP; FSDP2 (ZeRO-2, then HSDP across nodes, then
ZeRO-3); for a mixture of experts, expert parallel; then activation checkpointing (selective, then
full); then tensor parallel inside a node (2, 4, 8, with sequence parallel); then pipeline parallel
across nodes. The recommendation is the first layout in that order that fits in memory and whose
degrees divide the batch. ZeRO-1 is shown for the arithmetic but not recommended: FSDP2 has no
optimizer-only sharding, and ZeRO-2 costs the same communication.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_disttrain.planning.memory import DEFAULT_MARGIN, MemoryEstimate, memory_per_gpu
from lightning_disttrain.planning.model_shape import ModelShape
from lightning_disttrain.planning.spec import GB, Cluster, Layout, Workload


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    accumulation: int | None
    """Micro-batches per optimizer step on each data-parallel rank; None when the batch does not divide."""
    note: str = ""
    recommendable: bool = True

    @property
    def usable(self) -> bool:
        return self.recommendable and self.accumulation is not None and self.memory.fits


def _divisors_in(values, n: int) -> list[int]:
    return [v for v in values if v <= n and n % v == 0]


def candidate_layouts(shape: ModelShape, cluster: Cluster) -> list[tuple[Layout, str, bool]]:
    """(layout, note, recommendable) in the planner's order of simplicity."""
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
        out += [(Layout(dp_shard=N, zero=3, ep=e, ac=ac), "", True) for e in eps]
    if shape.is_moe:
        return out  # tensor / pipeline parallel of MoE blocks: not modelled (the strategy refuses TP of MoE)
    tps = [t for t in _divisors_in((2, 4, 8, 16), G) if shape.n_head % t == 0]
    for t in tps:
        for ac in ("none", "selective", "full"):
            out.append((Layout(dp_shard=N // t, tp=t, zero=3, ac=ac), "", True))
    pps = [p for p in _divisors_in((2, 4, 8, 16, 32, 64), M) if shape.n_layer % p == 0]
    tp_max = tps[-1] if tps else 1
    for p in pps:
        for ac in ("none", "selective", "full"):
            note = "pipeline stages need an untied head (tie_embeddings=False)" if shape.tied else ""
            out.append((Layout(dp_shard=N // (p * tp_max), tp=tp_max, pp=p, zero=3, ac=ac), note, True))
    return out


def evaluate(shape: ModelShape, workload: Workload, cluster: Cluster,
             margin: float = DEFAULT_MARGIN) -> list[Candidate]:
    """Every candidate layout with its memory estimate and gradient accumulation."""
    out = []
    for layout, note, ok in candidate_layouts(shape, cluster):
        per_step = workload.micro_batch * layout.dp
        accumulation = workload.global_batch // per_step if workload.global_batch % per_step == 0 else None
        if accumulation is None:
            note = (note + "; " if note else "") + (f"global batch {workload.global_batch} is not a multiple of "
                                                    f"micro batch x data-parallel ranks = {per_step}")
        out.append(Candidate(layout, memory_per_gpu(shape, layout, workload, cluster, margin), accumulation, note, ok))
    return out


def recommend(candidates: list[Candidate]) -> tuple[Candidate | None, str]:
    """The simplest candidate that fits, and the reason in one line."""
    chosen = next((c for c in candidates if c.usable), None)
    usable_gb = candidates[0].memory.usable / GB
    if chosen is None:
        best = min(candidates, key=lambda c: c.memory.total)
        return None, (f"nothing fits: the smallest need is {best.memory.total / GB:.1f} GB per GPU "
                      f"({best.layout.name}) against {usable_gb:.1f} GB usable; add GPUs, or shorten the micro "
                      f"batch or the sequence")
    before = [c for c in candidates[:candidates.index(chosen)] if c.recommendable]
    need = f"needs {chosen.memory.total / GB:.1f} of {usable_gb:.1f} GB usable per GPU"
    if not before:
        return chosen, f"{chosen.layout.name} is the simplest layout and fits: {need}"
    last = before[-1]
    why = "does not divide the batch" if last.memory.fits else f"needs {last.memory.total / GB:.1f} GB"
    return chosen, f"{chosen.layout.name} is the simplest layout that fits: {need} ({last.layout.name} {why})"
