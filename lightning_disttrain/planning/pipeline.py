"""What a pipeline-parallel rank holds, from the strategy's own schedule arguments.

The planner does not restate the pipeline: a layout's ``pp_schedule`` / ``pp_microbatches`` /
``pp_stages_per_rank`` become the ``PipelineOptions`` that ``NDParallelStrategy`` builds from the
same arguments, and the stages, their blocks and each rank's stages come from the functions the
strategy splits the model with (``parallel/pipeline.py``: ``split_blocks``, ``stage_ids``). What
is added here is the number of micro-batch forwards whose activations a rank holds at its peak,
read off the order in which torch's schedules (torch 2.13, ``torch.distributed.pipelining``) run
them; ``tests/planning/test_pipeline_terms.py`` checks it against torch's own action lists:

- ``GPipe``: every forward before any backward: all m micro-batches.
- ``1F1B``: rank r runs min(m, p - r) forwards before its first backward, then one backward before
  each further forward: min(m, p - r).
- ``Interleaved1F1B``: ``(v - 1) * mpr + 2 * (p - 1 - r)`` warm-up forwards (mpr = micro-batches
  per round, m // max(1, m // p)), then one more forward before each backward: warm-up + 1, at
  most m * v; each is one micro-batch through one local stage (1/v of the rank's blocks).
- ``LoopedBFS``: every local stage's forwards first: m * v.
- ``InterleavedZeroBubble``, ``ZBVZeroBubble``: p * v (the input-gradient step frees nothing; a
  micro-batch's tensors go with its weight-gradient step). ``DualPipeV``: p * v, one more on the
  last rank.

A held forward costs its stage's blocks' activations for one micro-batch, plus the stage's output
(kept for the send and the backward) on every stage but the last; the last stage also holds the
logits of the micro-batches whose loss awaits its backward: one in every schedule but ``GPipe``
and ``LoopedBFS`` (m).

The bubble (idle fraction of the ideal compute time; Narayanan et al. 2021 for the interleaved
form, Qi et al. 2023 for zero bubble): (p - 1) / m for ``GPipe`` / ``1F1B``, (p - 1) / (v * m)
for the looped schedules, about a third of that for the zero-bubble ones (ZB-H1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lightning_disttrain.parallel.pipeline import (
    SCHEDULES,
    PipelineOptions,
    split_blocks,
    stage_ids,
)

ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
ALL_FORWARDS_FIRST = ("GPipe", "LoopedBFS")


def options_for(schedule: str = "1F1B", microbatches: int | None = None,
                stages_per_rank: int | None = None) -> PipelineOptions:
    """The strategy's ``PipelineOptions`` for these arguments (validated there)."""
    return PipelineOptions(schedule, microbatches, stages_per_rank)


def inflight(options: PipelineOptions, pp: int, rank: int) -> int:
    """Micro-batch forwards (one micro-batch through one local stage) whose activations pipeline
    rank ``rank`` holds at once, at its peak."""
    m, v, s = options.num_microbatches(pp), options.local_stages, options.schedule
    if s == "GPipe":
        return m
    if s == "1F1B":
        return min(m, pp - rank)
    if s == "LoopedBFS":
        return m * v
    if s == "Interleaved1F1B":
        rounds = max(1, m // pp)
        warmup = min((v - 1) * (m // rounds) + 2 * (pp - 1 - rank), m * v)
        return min(warmup + 1, m * v)
    if s in ZERO_BUBBLE:
        return min(pp * v, m * v) + (1 if s == "DualPipeV" and rank == pp - 1 else 0)
    raise ValueError(f"unknown pipeline schedule {s!r}; use one of {SCHEDULES}")


def last_stage_inflight(options: PipelineOptions, pp: int) -> int:
    """Micro-batches whose logits the last stage holds at once."""
    return options.num_microbatches(pp) if options.schedule in ALL_FORWARDS_FIRST else 1


def bubble(options: PipelineOptions, pp: int) -> float:
    """Idle time of a pipeline step as a fraction of its compute time."""
    if pp <= 1:
        return 0.0
    m, v = options.num_microbatches(pp), options.local_stages
    base = (pp - 1) / (v * m)
    return base / 3 if options.schedule in ZERO_BUBBLE else base


@dataclass(frozen=True)
class RankStages:
    """Pipeline rank ``rank``'s part of the model and of the schedule."""

    rank: int
    stages: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]
    """The block indices of each local stage."""
    first: bool
    """Holds stage 0 (the embeddings)."""
    last: bool
    """Holds the last stage (final norm, head, loss)."""
    inflight: int
    last_inflight: int

    @property
    def all_layers(self) -> tuple[int, ...]:
        return tuple(i for stage in self.layers for i in stage)


@lru_cache(maxsize=4096)
def _split(n_layer: int, n_stages: int, split_points: tuple[int, ...] | None, edge_cost: float) -> tuple[range, ...]:
    return tuple(split_blocks(n_layer, n_stages, None if split_points is None else list(split_points), edge_cost))


def check(options: PipelineOptions, pp: int, n_layer: int) -> None:
    """The strategy's checks of the schedule arguments against pp and the model's blocks (a ValueError)."""
    options.validate(pp)
    stages = options.num_stages(pp)
    if stages > n_layer:
        raise ValueError(f"{stages} pipeline stages (pp={pp} x {options.local_stages} per rank) but the model has "
                         f"{n_layer} blocks; every stage needs at least one: lower pp or pp_stages_per_rank")
    _split(n_layer, stages, None if options.split_points is None else tuple(options.split_points), options.edge_cost)


def rank_stages(options: PipelineOptions, pp: int, n_layer: int) -> list[RankStages]:
    """Every pipeline rank's stages, blocks and peak forwards in flight (``pp=1``: one rank, all blocks)."""
    if pp == 1:
        return [RankStages(0, (0,), (tuple(range(n_layer)),), True, True, 1, 1)]
    check(options, pp, n_layer)
    n_stages = options.num_stages(pp)
    ranges = _split(n_layer, n_stages, None if options.split_points is None else tuple(options.split_points),
                    options.edge_cost)
    out = []
    for r in range(pp):
        ids = tuple(stage_ids(r, pp, options))
        out.append(RankStages(r, ids, tuple(tuple(ranges[s]) for s in ids), 0 in ids, n_stages - 1 in ids,
                              inflight(options, pp, r), last_stage_inflight(options, pp)))
    return out
