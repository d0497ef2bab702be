"""ProfilerCallback: the step breakdown's arithmetic on hand-made events (one process), and real
2-rank fsdp2 runs on gloo (the suite's shared 2-rank launch): all-gathers and reduce-scatters in
the trace, the parts adding up to the wall-clock step, a slow loader diagnosed as such, and
configs/profile.yaml through the CLI."""


import pytest

from lightning_disttrain.callbacks import ProfilerCallback
from lightning_disttrain.callbacks.step_breakdown import (
    BOUNDARY,
    DATA_WAIT,
    OPTIMIZER,
    PARTS,
    Event,
    breakdown,
    collective_kind,
    diagnose,
)

WORKER, LAUNCH = "profiler_worker", {2: ["fsdp2", "slow_data", "config"]}  # the suite's shared 2-rank launch
MS = 1_000_000  # ns


def _ev(name, start_ms, end_ms, thread=1, **kw):
    return Event(name, int(start_ms * MS), int(end_ms * MS), thread, **kw)


def test_breakdown_labels_each_instant_once():
    # One 100 ms step on the training thread (1); gloo runs on thread 7.
    events = [
        _ev(BOUNDARY, 0, 0, user_annotation=True), _ev(BOUNDARY, 100, 100, user_annotation=True),
        _ev(DATA_WAIT, 0, 10, user_annotation=True),                      # 10 data wait
        _ev("aten::mm", 10, 40), _ev("aten::addmm", 20, 30),              # 30 compute (nested op once)
        _ev("c10d::_allgather_base_", 40, 41, shapes=((8, 4), (4, 4)), dtypes=("float", "float")),  # 1 exposed
        _ev("gloo:all_gather", 40.5, 55, thread=7, user_annotation=True),  # 5 under compute, 9 more exposed
        _ev("aten::copy_", 45, 50),                                       # 5 compute
        _ev("aten::mm", 55, 70),                                          # 15 compute
        _ev("c10d::_reduce_scatter_base_", 70, 71, shapes=((4, 4), (8, 4)), dtypes=("c10::BFloat16",) * 2),
        _ev("gloo:all_reduce", 71, 80, thread=7, user_annotation=True),   # 10 exposed (with the issue op)
        _ev(OPTIMIZER, 85, 98, user_annotation=True), _ev("aten::add_", 86, 90),  # 13 optimizer, 2 + 5 idle
    ]
    b = breakdown(events, measured=[0.1])
    step = b.steps[0]
    assert step.total == pytest.approx(0.1)
    assert step.parts == pytest.approx({"data_wait": 0.010, "compute": 0.050, "comm_exposed": 0.020,
                                        "optimizer": 0.013, "idle": 0.007})
    assert sum(step.parts.values()) == pytest.approx(step.total)
    assert step.comm_overlapped == pytest.approx(0.005)
    assert b.collectives["all_gather"].count == 1 and b.collectives["all_gather"].bytes == 8 * 4 * 4
    assert b.collectives["all_gather"].seconds == pytest.approx(0.0145)
    # gloo reduce-scatters as an all-reduce; paired in order, it is timed under the kind that was issued
    assert b.collectives["reduce_scatter"].bytes == 8 * 4 * 2
    assert b.collectives["reduce_scatter"].seconds == pytest.approx(0.009)
    assert "all_reduce" not in b.collectives
    assert diagnose(b).startswith("compute-bound: compute 50%, comm exposed 20%, data wait 10%, optimizer 13%")


@pytest.mark.parametrize(("name", "kind"), [
    ("c10d::_allgather_base_", "all_gather"), ("c10d::allgather_into_tensor_coalesced_", "all_gather"),
    ("c10d::_reduce_scatter_base_", "reduce_scatter"), ("c10d::allreduce_", "all_reduce"),
    ("gloo:all_gather", "all_gather"), ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce_scatter"),
    ("ncclDevKernel_AllGather_RING_LL", "all_gather"), ("c10d::alltoall_base_", "all_to_all"),
    ("c10d::broadcast_", "broadcast"),
])
def test_collective_kinds(name, kind):
    assert collective_kind(name) == kind


def test_diagnosis_follows_the_largest_share():
    step = [_ev(BOUNDARY, 0, 0), _ev(BOUNDARY, 100, 100)]
    data = breakdown(step + [_ev(DATA_WAIT, 0, 60), _ev("aten::mm", 60, 90)])
    comm = breakdown(step + [_ev("aten::mm", 0, 30), _ev("gloo:all_gather", 30, 90, thread=7)])
    assert diagnose(data).startswith("dataloader-bound: compute 30%, comm exposed 0%, data wait 60%")
    assert diagnose(comm).startswith("communication-bound: compute 30%, comm exposed 60%")


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="start_step >= 0 and num_steps >= 1"):
        ProfilerCallback(start_step=-1)
    with pytest.raises(ValueError, match="two step boundaries"):
        breakdown([_ev(BOUNDARY, 0, 0), _ev("aten::mm", 0, 1)])


# ---- 2 ranks, fsdp2 on gloo -------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(launched):
    return launched(WORKER, 2)  # its files live in the launch's pytest directory


@pytest.mark.slow
def test_fsdp2_trace_has_all_gathers_and_reduce_scatters(runs):
    for r, rank in enumerate(runs["fsdp2"]):
        names = rank["trace"]["names"]
        assert names.get("gloo:all_gather", 0) > 0 and names.get("c10d::_allgather_base_", 0) > 0
        assert names.get("c10d::_reduce_scatter_base_", 0) > 0
        assert {f"trace_rank{r}.json", f"breakdown_rank{r}.json"} <= set(rank["files"])  # one of each per rank
        table = rank["breakdown"]["collectives"]
        # one reduce-scatter per FSDP unit (2 blocks + the root) per profiled step
        assert table["reduce_scatter"]["count"] == 3 * 2
        assert table["all_gather"]["count"] >= table["reduce_scatter"]["count"]
        for kind in ("all_gather", "reduce_scatter"):
            assert table[kind]["bytes"] > 0 and table[kind]["seconds"] > 0
        assert rank["state"] is True


@pytest.mark.slow
@pytest.mark.parametrize("run", ["fsdp2", "slow_data", "config"])
def test_breakdown_parts_sum_to_the_measured_step(runs, run):
    for rank in runs[run]:
        steps = rank["breakdown"]["steps"]
        assert len(steps) == 2
        for s in steps:
            assert sum(s[p] for p in PARTS) == pytest.approx(s["measured"], rel=0.10)
            assert s["comm_overlapped"] <= s["compute"] + 1e-9


@pytest.mark.slow
def test_slow_loader_is_diagnosed_dataloader_bound(runs):
    for rank in runs["slow_data"]:
        b = rank["breakdown"]
        assert b["diagnosis"].startswith("dataloader-bound"), b["diagnosis"]
        assert b["mean"]["data_wait"] >= 0.15  # 4 samples x 50 ms per step, at least
    for rank in runs["fsdp2"]:  # the same run with a fast loader is not
        assert not rank["breakdown"]["diagnosis"].startswith("dataloader-bound"), rank["breakdown"]["diagnosis"]


@pytest.mark.slow
def test_profile_config_runs_through_the_cli(runs):
    ranks = runs["config"]
    assert all(r["steps"] == 4 for r in ranks)
    assert {"profiler/compute_s", "profiler/comm_exposed_s", "profiler/data_wait_frac", "profiler/step_s"} <= set(
        ranks[0]["logged"])
