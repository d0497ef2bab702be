"""Collectives per training step by layout (issue 38): no collective over the whole world in a
step other than what the layout needs for gradients. Counted at torch.distributed's call (with each
group's ranks) and as dispatched ops, in 4-rank fits of GPTModule under the package's
defaults (tests/strategies/collectives_worker.py, the suite's shared 4-rank launch).

What may span all 4 ranks: FSDP2's all-gathers and reduce-scatters when the layout shards over all
of them (fsdp4); the stop agreement of the default PreemptionCheckpoint, on its own cadence (a
gloo all-reduce of a 3-number host tensor); the loss's mean over the data-parallel ranks at the
steps the loggers read (one 4-byte all-reduce; the world unless TP shares the ranks). Before this
issue the loss was averaged at every step, and Lightning's training loop broadcast its SIGTERM
flag over the world at every step (with a host read of it): both are asserted gone here.
"""

from __future__ import annotations

import pytest

WORKER = "collectives_worker"
LAYOUTS = ["fsdp4", "hsdp2x2", "fsdp2_tp2"]
LAUNCH = {4: LAYOUTS}  # launched by conftest.py
LOGGING_WINDOWS = {2, 5}  # batches 2 and 5: steps 3 and 6 (log_every_n_steps=3)
FSDP_OPS = {"all_gather_single", "reduce_scatter_single"}


def _world(calls: list, world: int) -> list[str]:
    return [op for op, ranks in calls if len(ranks) == world]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_world_wide_collective_in_a_step_beyond_the_gradients(four, layout):
    for rank in four[layout]:
        world, steps = rank["world"], rank["steps"]
        assert len(steps) == 6
        agreements = [s - 1 for s in rank["agreement_steps"]]  # step s ends in window s - 1
        for i, step in enumerate(steps):
            world_ops = _world(step["calls"], world)
            if layout == "fsdp4":  # the gradients' reduce-scatter (and the all-gathers) span the world
                assert FSDP_OPS <= set(world_ops), (i, world_ops)
            others = [op for op in world_ops if not (layout == "fsdp4" and op in FSDP_OPS)]
            # the loss's mean is over the data-parallel ranks: the world unless TP shares them
            expected = agreements.count(i) + (i in LOGGING_WINDOWS and layout != "fsdp2_tp2")
            assert others == ["all_reduce"] * expected, (layout, i, others, agreements)
        # a step that neither logs nor agrees has no world-wide collective but the gradients'
        quiet = [i for i in range(6) if i not in LOGGING_WINDOWS and i not in agreements]
        assert quiet, agreements
        for i in quiet:
            assert set(_world(steps[i]["calls"], world)) <= (FSDP_OPS if layout == "fsdp4" else set())
            # and no host read of a tensor (Lightning's per-step SIGTERM broadcast read its flag)
            assert steps[i]["host_reads"] == 0, (layout, i, steps[i]["host_reads"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layouts_collectives_run_on_its_groups_and_every_dispatched_one_is_counted(four, layout):
    for rank in four[layout]:
        steps = rank["steps"]
        for i, step in enumerate(steps):
            # every c10d collective dispatched was a torch.distributed call recorded with its group
            assert step["dispatched"] == sum(not op.startswith("funcol.") for op, _ in step["calls"]), (i, step)
        sizes = {len(ranks) for s in steps for op, ranks in s["calls"] if op in FSDP_OPS}
        groups = {op: {len(r) for s in steps for o, r in s["calls"] if o == op} for op in ("all_reduce",)}
        if layout == "hsdp2x2":  # shard within pairs, all-reduce the gradients across the 2 replicas
            assert sizes == {2} and 2 in groups["all_reduce"]
        elif layout == "fsdp2_tp2":  # FSDP over the 2 data ranks; TP's collectives within its pairs
            assert sizes == {2}
            assert any(op.startswith("funcol.") and len(r) == 2 for s in steps for op, r in s["calls"])
            # the loss's mean over the 2 data-parallel ranks, at the logging steps only
            loss_means = [sum(op == "all_reduce" and len(r) == 2 for op, r in s["calls"]) for s in steps]
            assert loss_means == [int(i in LOGGING_WINDOWS) for i in range(6)], loss_means
        else:
            assert sizes == {4}
