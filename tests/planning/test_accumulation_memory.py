"""Gradient accumulation under FSDP2, planned against measured: peak memory per rank on 2 CPU ranks,
in both modes of ``NDParallelStrategy(accumulate_unsharded_grads=...)``.

``accumulation_memory_worker.py`` fits ``GPTModule("tiny", vocab_size=257)`` at sequence 64, micro
batch 4 per rank, 4 micro-batches per optimizer step, fp32, and measures the bytes of live tensor
storages over the last step's window (its ``LiveTensorBytes``, explained there): the peak, and what
each rank holds after each micro-batch but the last. ``planning.memory_per_gpu`` plans the same
shape, layout (``Layout(dp_shard=2, zero=3)``), workload and accumulation on a ``cpu`` cluster.

At this size the planner's fixed overheads are nil on a CPU (no CUDA allowance) and the activations
dominate the peak, so the peak comparison alone would hardly see the gradients: the bytes held between
micro-batches (parameters, optimizer state and gradients: ``MemoryEstimate.state``), the part the
mode changes, are compared on their own too, and so is the difference between the two modes.
The runs are in the suite's shared 2-rank launch (tests/conftest.py).
"""

from __future__ import annotations

import pytest

import accumulation_memory_worker as worker
from lightning_disttrain.planning import Cluster, Layout, Workload, config_for, shape_of
from lightning_disttrain.planning.memory import memory_per_gpu

RUNS = list(worker.RUNS)
WORKER, LAUNCH = "accumulation_memory_worker", {2: RUNS}  # launched by conftest.py
TOLERANCE = 0.10


def planned(unsharded: bool, world: int = 2):
    shape = shape_of(config_for("tiny", {"vocab_size": worker.VOCAB, "block_size": worker.SEQ}), worker.SEQ, "tiny")
    workload = Workload(worker.SEQ, worker.MICRO * world * worker.ACCUMULATE, worker.MICRO, "fp32")
    layout = Layout(dp_shard=world, zero=3, accumulate_unsharded_grads=unsharded)
    return memory_per_gpu(shape, layout, workload, Cluster("cpu", world, 1, memory_gb=1), accumulation=worker.ACCUMULATE)


@pytest.mark.slow  # the launch runs 2 processes
def test_the_meter_sees_allocations_frees_and_in_place_resizes(two):
    for r in two["accum_sharded"]:
        assert r["check"] == {"alive": 10**7, "resized": 10**7, "freed": 0}


@pytest.mark.slow  # the launch runs 2 processes
@pytest.mark.parametrize("run", RUNS)
def test_planned_peak_matches_the_measured_peak_with_accumulation(two, run):
    unsharded = worker.RUNS[run]
    plan = planned(unsharded)
    for r in two[run]:
        assert r["accumulate_unsharded_grads"] is unsharded and r["world"] == 2
        assert r["peak"] / plan.total == pytest.approx(1.0, abs=TOLERANCE), (r["peak"], plan.as_gb())
        # what stays between micro-batches: parameter shards, AdamW state and the gradients of the mode
        assert len(r["between"]) == worker.ACCUMULATE - 1
        for held in r["between"]:
            assert held / plan.state == pytest.approx(1.0, abs=TOLERANCE), (held, plan.as_gb())


@pytest.mark.slow  # the launch runs 2 processes
def test_unsharded_accumulation_holds_the_whole_gradient_between_micro_batches(two):
    sharded, unsharded = two["accum_sharded"], two["accum_unsharded"]
    for s, u in zip(sharded, unsharded):
        # sharded: each rank's half of the fp32 gradient; unsharded: all of it (4 B per parameter)
        assert s["between"][0] - 16 * s["local_params"] == pytest.approx(0, abs=0.01 * s["between"][0])
        extra = u["between"][0] - s["between"][0]
        assert extra == pytest.approx(4 * (s["params"] - s["local_params"]), rel=0.02)
        planned_extra = planned(True).grads - planned(False).grads
        assert extra == pytest.approx(planned_extra, rel=TOLERANCE)
        assert u["peak"] - s["peak"] == pytest.approx(planned_extra, rel=TOLERANCE)
