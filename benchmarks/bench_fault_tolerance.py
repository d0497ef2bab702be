"""Fault tolerance across replica groups (issue 27): what the quorum costs per step, how long the
survivors wait after a group dies, what a heal costs by model size, and the work a failure loses
compared with checkpoint/restart.

Every run is ``tests/strategies/ft_replica.py`` (the tiny GPT unless said, TokenDataModule over the
indexed test shard, micro-batch 2 x 32 tokens per rank) started as the tests start it
(``tests/strategies/ft_launch.py``: a torchft lighthouse in this process, each group its own
launch); times come from the per-step records (``time.time()`` at each step's end, rank 0).

- overhead, in rounds (each variant once per round, ``--steps`` steps each; the median step of
  steps 5..end): one process without fault tolerance vs one fault-tolerant group alone (what the
  quorum, the commit and the state capture cost when there is nobody to reduce with), and HSDP over
  2 processes (dp_replicate=2: FSDP2 replicating over 2 ranks) vs 2 fault-tolerant groups of 1
  process (one flat all-reduce per step through torchft instead of FSDP2's). Also the median
  ``ft/quorum_wait_ms`` (the quorum not ready when the gradients are) and ``ft/allreduce_ms`` (with
  the wait for the other group).
- failure: group 1 is SIGKILLed at an arbitrary moment (about its step 10); the time from the kill
  to the end of the survivor's first committed step without it (live replicas 1), per lighthouse
  heartbeat timeout, and how many survivor steps ending after the kill were not committed.
- heal: group 0 trains alone, group 1 is launched and heals from it; by model: the survivor's heal
  step minus its median step (serving the state), the joiner's ``load_state_dict`` time, and the
  joiner's process start to its first (heal) step.
- restart: one process of the same job saving a DCP checkpoint every 5 steps: the save's cost C
  (the save step's extra time) and process start to the first step R.
- lost work per failure (computed from the above, group-seconds, 2 groups): checkpoint/restart
  stops every group for half a Young/Daly checkpoint interval sqrt(2 C M) plus R; fault tolerance
  loses the survivor's wait (kill -> first step alone, less a step) plus the dead group's relaunch
  (launch -> heal step).

    python benchmarks/bench_fault_tolerance.py --repeats 3

Results: printed; JSON under benchmarks/out/fault_tolerance.json. With every part, ``--record FILE``
writes them as ``cpu_figures.py`` reads them (``record``); ``--plot DIR`` draws ``cpu-fault-tolerance``
from that record.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import REPO, header, parser, part, report, spread, table
from record import add_record_options, provenance, record_path, wants_record, write_record

sys.path[:0] = [str(REPO / "tests" / "strategies"), str(REPO / "tests"), str(REPO / "tests" / "checkpoint" / "scripts")]
from ft_launch import WORKER, ReplicaGroups  # noqa: E402


PARTS = ("overhead", "failure", "heal", "restart")
"""The parts, in order (``--parts``)."""


def step_times(records: list[dict], first: int = 5) -> list[float]:
    t = [r["t"] for r in records]
    return [b - a for a, b in zip(t[first - 1:], t[first:])]


def reference_run(work: Path, data: Path, steps: int, tag: str, devices: int) -> list[dict]:
    """Without fault tolerance: HSDP over 2 processes, or one process."""
    from dist_utils import _env

    mode = ["--hsdp", "--devices", "2"] if devices == 2 else ["--plain"]
    subprocess.run([sys.executable, str(WORKER), str(work), str(data), tag, *mode, "--steps", str(steps)], check=True,
                   env=_env(), capture_output=True, timeout=600)
    import json

    return [json.loads(line) for line in (work / f"{tag}.g0.rank0.jsonl").read_text().splitlines()
            if '"event": "step"' in line]


def ft_run(work: Path, data: Path, steps: int, tag: str, groups_n: int) -> list[dict]:
    groups = ReplicaGroups(work, data, tag, groups=groups_n, steps=steps, lighthouse_min_replicas=groups_n)
    codes = groups.run_all(600)
    assert set(codes.values()) == {0}, groups.logs()
    return groups.records(0)


OVERHEAD_VARIANTS = {  # name -> (fault-tolerant groups or None, processes)
    "1 process": (None, 1), "1 fault-tolerant group (quorum of 1)": (1, 1),
    "HSDP, 2 processes (dp_replicate=2)": (None, 2), "2 fault-tolerant groups x 1 process": (2, 2),
}


def overhead(work: Path, data: Path, steps: int, repeats: int) -> dict:
    out: dict = {name: {"step_s": [], "quorum_wait_ms": [], "allreduce_ms": []} for name in OVERHEAD_VARIANTS}
    for i in range(repeats):  # rounds: every variant once per round, in turn
        for j, (name, (groups_n, procs)) in enumerate(OVERHEAD_VARIANTS.items()):
            tag = f"o{i}_{j}"
            records = reference_run(work, data, steps, tag, procs) if groups_n is None \
                else ft_run(work, data, steps, tag, groups_n)
            out[name]["step_s"].append(statistics.median(step_times(records)))
            if groups_n is not None:
                out[name]["quorum_wait_ms"].append(statistics.median(r["ft"]["ft/quorum_wait_ms"] for r in records[4:]))
                out[name]["allreduce_ms"].append(statistics.median(r["ft"]["ft/allreduce_ms"] for r in records[4:]))
    names = list(OVERHEAD_VARIANTS)
    out["ratio_1"] = [f / p for f, p in zip(out[names[1]]["step_s"], out[names[0]]["step_s"])]
    out["ratio_2"] = [f / h for f, h in zip(out[names[3]]["step_s"], out[names[2]]["step_s"])]
    return out


def failure(work: Path, data: Path, heartbeat_ms: int, tag: str) -> dict:
    groups = ReplicaGroups(work, data, tag, steps=400, sleep=0.02, heartbeat_timeout_ms=heartbeat_ms, gated=True)
    try:
        killed = groups.start_and_kill(1, 10, delay=0.037)  # the delay: not aligned with a step boundary

        def alone(r: dict) -> bool:
            return r["t"] > killed and r["ft"]["ft/committed"] and r["ft"]["ft/live_replicas"] == 1

        groups.wait_until(lambda: any(alone(r) for r in groups.records(0)), 120, "the survivor's first step alone")
        after = [r for r in groups.records(0) if r["t"] > killed]
        before = step_times([r for r in groups.records(0) if r["t"] <= killed])
        commit = next(r for r in after if alone(r))
        return {"kill_to_commit_s": commit["t"] - killed, "median_step_s": statistics.median(before),
                "uncommitted": sum(1 for r in after[:after.index(commit)] if not r["ft"]["ft/committed"])}
    finally:
        groups.close()


def heal(work: Path, data: Path, model: str, tag: str) -> dict:
    groups = ReplicaGroups(work, data, tag, steps=12, gated=True, extra=["--model", model])
    try:
        groups.go()
        groups.launch(0)
        groups.wait_until(lambda: len(groups.records(0)) >= 4, 600, "group 0's step 4")
        groups.hold(True)
        groups.wait_until(lambda: groups.records(0, event="held"), 600, "group 0 held")
        launched = time.time()
        groups.launch(1)
        groups.wait_until(lambda: groups.records(1, event="start"), 600, "group 1 started")
        groups.hold(False)
        codes = groups.wait_all(900)
        assert codes == {0: 0, 1: 0}, groups.logs()
        survivor, joiner = groups.records(0), groups.records(1)
        first = joiner[0]
        assert first["ft"]["ft/heals"] == 1
        by_step = {r["step"]: r for r in survivor}
        released = groups.records(0, event="released")[0]["t"]  # the step before waited (held) until then
        heal_step = by_step[first["step"]]["t"] - released
        normal = statistics.median(step_times(survivor, first=2)[:2] + step_times(survivor)[-3:])
        import torch

        from lightning_disttrain.models.gpt import GPT, GPTConfig

        with torch.device("meta"):
            params = sum(p.numel() for p in GPT(GPTConfig.from_name(model, vocab_size=257)).parameters())
        return {"survivor_heal_step_s": heal_step, "survivor_median_step_s": normal,
                "apply_s": first["ft"]["ft/last_heal_ms"] / 1e3, "launch_to_heal_step_s": first["t"] - launched,
                "params": params, "weights_equal": first["weights"] == by_step[first["step"]]["weights"]}
    finally:
        groups.close()


def checkpoint_cost(work: Path, data: Path, tag: str) -> dict:
    """One process of the same job saving a DCP checkpoint every 5 steps: the save steps' extra time
    over the median step (C), and process start to the first step (R, a restart's floor)."""
    from dist_utils import _env

    started = time.time()
    subprocess.run([sys.executable, str(WORKER), str(work), str(data), tag, "--plain", "--steps", "21",
                    "--save-every", "5"], check=True, env=_env(), capture_output=True, timeout=600)
    import json

    lines = [json.loads(line) for line in (work / f"{tag}.g0.rank0.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["event"] == "step"]
    saved = {r["step"] for r in lines if r["event"] == "save"}
    durations = {b["step"]: b["t"] - a["t"] for a, b in zip(steps, steps[1:])}
    # A save at the end of step s delays the record of step s + 1.
    save_steps = [durations[s + 1] for s in saved if s + 1 in durations]
    normal = statistics.median(d for s, d in durations.items() if s - 1 not in saved)
    return {"save_s": statistics.median(save_steps) - normal, "step_s": normal, "start_to_first_step_s":
            steps[0]["t"] - started}


def lost_work(heal: dict, failure: dict, cost: dict, groups: int = 2) -> list[tuple]:
    """Group-seconds of training lost per failure (computed): checkpoint/restart stops every group for
    half a checkpoint interval (Young/Daly: sqrt(2 C M) for a job MTBF M) plus a restart; fault
    tolerance loses the survivors' wait and the dead group's relaunch."""
    import math

    rows = []
    wait = statistics.median(r["kill_to_commit_s"] for r in failure[1000]) - cost["step_s"]
    relaunch = heal["launch_to_heal_step_s"]
    for mtbf_h in (1, 24):
        interval = math.sqrt(2 * cost["save_s"] * mtbf_h * 3600)
        restart = groups * (interval / 2 + cost["start_to_first_step_s"])
        ft = (groups - 1) * wait + relaunch
        rows.append((mtbf_h, interval, restart, ft, restart / ft))
    return rows


def record(result: dict, setting: str) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-fault-tolerance`` from: ``result`` as ``main`` builds it
    with every part (``overhead``, ``failure``, ``heal``, ``checkpoint``, ``lost_work``) in the
    section's units, each number to the precision ``main`` prints it: the median step per round of
    each overhead run (ms) with the quorum wait and all-reduce (min, median, max of the rounds'
    medians) and the two ratios; kill to the survivor's first step alone per heartbeat timeout; the
    heal by model; and the work lost per failure (``lost_work``'s, from the unrounded figures) with
    the inputs it was computed from (the survivor's step it subtracts: the checkpoint run's step)."""
    o, cost, tiny = result["overhead"], result["checkpoint"], result["heal"]["tiny"]

    def three(xs: list[float]) -> list[float]:
        return [round(x, 3) for x in (min(xs), statistics.median(xs), max(xs))]

    overhead = []
    for name in OVERHEAD_VARIANTS:
        row = {"run": name, "step_ms_rounds": [round(1e3 * x, 1) for x in o[name]["step_s"]]}
        if o[name]["quorum_wait_ms"]:
            row |= {"quorum_wait_ms": three(o[name]["quorum_wait_ms"]), "allreduce_ms": three(o[name]["allreduce_ms"])}
        overhead.append(row)
    return provenance("bench_fault_tolerance", "bench_fault_tolerance.py",
                      "2 replica groups x 1 CPU process (gloo), torchft lighthouse in this process") | {
        "setting": setting, "overhead": overhead,
        "overhead_ratios": {name: dict(zip(("min", "median", "max"), three(o[key])))
                            for name, key in (("one group alone / one process", "ratio_1"),
                                              ("two groups / HSDP", "ratio_2"))},
        "failure": [{"heartbeat_timeout_ms": int(hb), "command": 1,
                     "kill_to_step_alone_s": [round(r["kill_to_commit_s"], 3) for r in runs],
                     "not_committed": [r["uncommitted"] for r in runs],
                     "step_before_ms": round(1e3 * statistics.median(r["median_step_s"] for r in runs), 1)}
                    for hb, runs in result["failure"].items()],
        "heal": [{"model": model, "params_m": round(h["params"] / 1e6, 2),
                  "survivor_step_ms": round(1e3 * h["survivor_median_step_s"]),
                  "survivor_heal_step_ms": round(1e3 * h["survivor_heal_step_s"]),
                  "joiner_load_state_dict_ms": round(1e3 * h["apply_s"]),
                  "joiner_launch_to_heal_s": round(h["launch_to_heal_step_s"], 1),
                  "weights": "bitwise the survivor's" if h["weights_equal"] else "NOT the survivor's"}
                 for model, h in result["heal"].items()],
        "work_lost_inputs": {"checkpoint_save_s": round(cost["save_s"], 3), "step_ms": round(1e3 * cost["step_s"]),
                             "restart_to_first_step_s": round(cost["start_to_first_step_s"], 1),
                             "survivor_wait_s": round(statistics.median(r["kill_to_commit_s"]
                                                                        for r in result["failure"][1000]), 3),
                             "survivor_step_s": round(cost["step_s"], 3),
                             "relaunch_to_heal_s": round(tiny["launch_to_heal_step_s"], 1)},
        "work_lost": [{"mtbf_h": mtbf, "interval_s": round(interval), "restart_s": round(restart, 1),
                       "fault_tolerant_s": round(ft, 1), "ratio": round(ratio, 1)}
                      for mtbf, interval, restart, ft, ratio in result["lost_work"]]}


def main() -> None:
    p = parser(__doc__, steps=(40, "steps per overhead run"), repeats=(3, "rounds"))
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--models", default="tiny,small,gpt2-124m")
    add_record_options(p, "cpu-fault-tolerance (every part, the tiny model among --models)")
    args = p.parse_args()
    if wants_record(args) and (set(args.parts.split(",")) != set(PARTS) or "tiny" not in args.models.split(",")):
        p.error("--record and --plot need every part (--parts " + ",".join(PARTS) + ") and tiny in --models")
    header("bench_fault_tolerance", "2 replica groups x 1 CPU process (gloo), torchft lighthouse in this process")
    from harness import write_indexed_shard

    work = Path(tempfile.mkdtemp(prefix="ldt_ft_bench_"))
    data = work / "data"
    write_indexed_shard(data)
    parts = args.parts.split(",")
    result: dict = {"args": vars(args)}
    try:
        if "overhead" in parts:
            with part("overhead"):
                o = result["overhead"] = overhead(work, data, args.steps, args.repeats)
                rows = [(name, " ".join(f"{1e3 * x:.1f}" for x in o[name]["step_s"]),
                         spread(o[name]["quorum_wait_ms"]) if o[name]["quorum_wait_ms"] else None,
                         spread(o[name]["allreduce_ms"]) if o[name]["allreduce_ms"] else None)
                        for name in OVERHEAD_VARIANTS]
                print(table(["run", "median step ms, per round", "quorum wait ms", "allreduce ms"], rows))
                print(f"1 group / 1 process, round by round (min median max): {spread(o['ratio_1'])}; "
                      f"2 groups / HSDP: {spread(o['ratio_2'])}\n")
        if "failure" in parts:
            with part("failure"):
                rows, result["failure"] = [], {}
                for hb in (1000, 5000):
                    runs = [failure(work, data, hb, f"fail{hb}_{i}") for i in range(args.repeats if hb == 1000 else 1)]
                    result["failure"][hb] = runs
                    rows.append((hb, spread([r["kill_to_commit_s"] for r in runs]),
                                 " ".join(str(r["uncommitted"]) for r in runs),
                                 statistics.median(r["median_step_s"] for r in runs) * 1e3))
                print(table([("heartbeat timeout ms", ""), "kill -> next commit s (min median max)",
                             "uncommitted steps", ("median step ms", ".1f")], rows) + "\n")
        if "heal" in parts:
            with part("heal"):
                rows, result["heal"] = [], {}
                for model in args.models.split(","):
                    h = result["heal"][model] = heal(work, data, model, f"heal_{model}")
                    rows.append((model, h["params"] / 1e6, h["survivor_median_step_s"] * 1e3, h["survivor_heal_step_s"] * 1e3,
                                 h["apply_s"] * 1e3, h["launch_to_heal_step_s"], h["weights_equal"]))
                print(table(["model", ("params M", ".2f"), ("survivor step ms", ".0f"), ("its heal step ms", ".0f"),
                             ("joiner apply ms", ".0f"), ("joiner launch -> heal step s", ".1f"), "bitwise"], rows))
        if "restart" in parts:
            with part("restart"):
                cost = result["checkpoint"] = checkpoint_cost(work, data, "ckpt")
                print(f"tiny, 1 process: DCP save {1e3 * cost['save_s']:.0f} ms over a {1e3 * cost['step_s']:.0f} ms step; "
                      f"process start -> first step {cost['start_to_first_step_s']:.1f} s")
                if "heal" in result and "failure" in result:
                    rows = lost_work(result["heal"]["tiny"], result["failure"], cost)
                    result["lost_work"] = rows
                    print("lost group-seconds per failure, 2 groups of the tiny model (computed from the figures above):")
                    print(table([("job MTBF h", ""), ("checkpoint interval s", ".0f"), ("restart: 2 x (interval/2 + R)", ".1f"),
                                 ("fault tolerant: wait + relaunch", ".1f"), ("ratio", ".1f")], rows))
    finally:
        report("fault_tolerance", result)
        shutil.rmtree(work, ignore_errors=True)
    if wants_record(args):
        setting = (f"tests/strategies/ft_replica.py: GPTModule tiny unless said, micro-batch 2 x 32 tokens per rank; a "
                   f"torchft lighthouse, each replica group its own launch of one CPU process (gloo); step times: the "
                   f"median difference of consecutive step-end timestamps, steps 5 to {args.steps}, rank 0")
        write_record(record(result, setting), record_path(args, "bench_fault_tolerance.json"), args.plot, args.format)


if __name__ == "__main__":
    main()
