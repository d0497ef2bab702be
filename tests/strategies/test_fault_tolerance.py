"""Fault tolerance across replica groups (torchft) inside L.Trainer: NDParallelStrategy(fault_tolerance=...).

The multi-process tests start a torchft lighthouse in this process and each replica group as its
own launch of ``ft_replica.py`` (tests/strategies/ft_launch.py): a group is SIGKILLed mid-run, the
survivor trains on without a restart, the relaunched group heals from it and both continue in
lock step with bitwise-equal weights; with no failure the run equals one HSDP run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RUST_LOG", "warn")  # before torchft loads: its lighthouse logs every quorum at INFO
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "checkpoint" / "scripts")]
pytest.importorskip("torchft")

from ft_launch import WORKER as SCRIPT  # noqa: E402
from ft_launch import ReplicaGroups  # noqa: E402
from harness import MICRO_BATCH, expected_windows, write_indexed_shard  # noqa: E402

from lightning_disttrain.fault_tolerance import FaultTolerance  # noqa: E402

# Ranks per replica group in the kill test: 1 in the suite (about 16 s); LDT_FT_KILL_DEVICES=2 runs it
# with FSDP2 inside each group, so the healed state is DTensor shards (about 55 s on 2 cores).
KILL_TEST_DEVICES = int(os.environ.get("LDT_FT_KILL_DEVICES", "1"))
# Tensor and pipeline parallel inside the groups too (their references in the shared 4-rank launch):
# LDT_FT_EXTENDED=1 (about 1 min more on 2 cores; the suite checks FSDP2 inside the groups).
EXTENDED = os.environ.get("LDT_FT_EXTENDED") == "1"
WORKER, LAUNCH = "ft_replica", {4: ["hsdp"] + (["hsdp_tp", "hsdp_pp", "hsdp_muon"] if EXTENDED else [])}  # by conftest.py
from lightning_disttrain.fault_tolerance.lighthouse import LighthouseUnreachable, check_reachable  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ft_data")
    write_indexed_shard(directory)
    return directory


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


# -- settings and errors (one process) ----------------------------------------------------------


def test_settings_name_what_to_fix(monkeypatch):
    monkeypatch.delenv("LDT_FT_REPLICA_ID", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match=r"replica_id is not set.*LDT_FT_REPLICA_ID"):
        FaultTolerance(num_replica_groups=2, lighthouse="localhost:1")
    with pytest.raises(ValueError, match=r"replica_id=2 is not one of 0 .. 1"):
        FaultTolerance(num_replica_groups=2, replica_id=2, lighthouse="localhost:1")
    with pytest.raises(ValueError, match=r"lighthouse is not set: start one \(lightning-disttrain ft-lighthouse\)"):
        FaultTolerance(num_replica_groups=2, replica_id=0)
    with pytest.raises(ValueError, match=r"min_replicas=3: choose 1 .. 2"):
        FaultTolerance(num_replica_groups=2, replica_id=0, lighthouse="localhost:1", min_replicas=3)
    with pytest.raises(ValueError, match=r"write it as http://host:port"):
        FaultTolerance(num_replica_groups=2, replica_id=0, lighthouse="localhost")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['replicas'\]"):
        FaultTolerance.coerce({"replicas": 2})
    monkeypatch.setenv("LDT_FT_REPLICA_ID", "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "myhost:29510")
    ft = FaultTolerance(num_replica_groups=3)
    assert (ft.replica_id, ft.lighthouse) == (1, "http://myhost:29510")


def test_replicas_are_launches_not_a_mesh_dimension():
    import lightning as L

    from lightning_disttrain.strategies import NDParallelStrategy

    strategy = NDParallelStrategy(dp_replicate=2, fault_tolerance=dict(num_replica_groups=2, replica_id=0,
                                                                       lighthouse="localhost:1"))
    with pytest.raises(ValueError, match=r"set dp_replicate=1 and start fault_tolerance.num_replica_groups=2 groups"):
        L.Trainer(strategy=strategy, devices=2, accelerator="cpu", logger=False)


def test_unreachable_lighthouse_is_one_clear_error():
    port = _closed_port()
    with pytest.raises(LighthouseUnreachable, match=rf"lighthouse at http://127.0.0.1:{port} did not answer within "
                                                    r"0.3 s .*ft-lighthouse --port"):
        check_reachable(f"127.0.0.1:{port}", 0.3)


def test_missing_torchft_says_what_to_install(monkeypatch):
    from lightning_disttrain.fault_tolerance.replicas import require_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r"pip install 'lightning-disttrain\[ft\]'"):
        require_torchft()


@pytest.mark.slow
def test_fit_with_an_unreachable_lighthouse_fails_fast(data, tmp_path):
    port = _closed_port()
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(data), "r", "--replica-id", "0",
                           "--lighthouse", f"http://127.0.0.1:{port}", "--connect-timeout", "0.5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"LighthouseUnreachable: the torchft lighthouse at http://127.0.0.1:{port} did not answer within 0.5 s" \
        in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]


# -- a replica group dies, the other trains on, the relaunched one heals ----------------------------


@pytest.mark.slow
def test_survivor_trains_on_and_relaunched_group_heals_bitwise(data, tmp_path):
    steps, kill_after = 24, 5
    devices = KILL_TEST_DEVICES
    groups = ReplicaGroups(tmp_path, data, "kill", devices=devices, steps=steps, sleep=0.05, gated=True,
                           extra=["--save-every", "4"])
    try:
        groups.start_and_kill(1, kill_after)
        killed_at = len(groups.records(0))
        groups.wait_until(lambda: sum(r["ft"]["ft/live_replicas"] == 1 and r["ft"]["ft/committed"] == 1
                                      for r in groups.records(0)[killed_at:]) >= 3, 60, "group 0 training alone")
        groups.hold(True)  # group 0 waits after its current step until the relaunched group has started
        groups.wait_until(lambda: groups.records(0, event="held"), 60, "group 0 held")
        groups.launch(1)
        groups.wait_until(lambda: len(groups.records(1, event="start")) == 2, 120, "group 1 relaunched")
        groups.hold(False)
        codes = groups.wait_all(180)
    finally:
        groups.close()
    assert codes == {0: 0, 1: 0}, groups.logs()
    survivor = groups.records(0)
    every = groups.records(1, event=None)
    second_start = [i for i, r in enumerate(every) if r["event"] == "start"][1]
    first, relaunched = [r for r in every[:second_start] if r["event"] == "step"], \
        [r for r in every[second_start:] if r["event"] == "step"]

    # The survivor never stopped: every step once, in order, up to the end; no job-wide exit.
    assert [r["step"] for r in survivor] == list(range(1, steps + 1))
    live = [r["ft"]["ft/live_replicas"] for r in survivor]
    assert live[:kill_after] == [2] * kill_after and 1 in live and live[-1] == 2, live
    uncommitted = [r["step"] for r in survivor if not r["ft"]["ft/committed"]]
    assert len(uncommitted) <= 1, uncommitted  # a kill inside the step's all-reduce fails that one step
    # Before the kill both groups averaged into the same weights at every step.
    by_step = {r["step"]: r for r in survivor}
    assert all(by_step[r["step"]]["weights"] == r["weights"] for r in first)
    # The relaunched group healed in its first step, at the survivor's position, and from then on
    # both hold bitwise-equal weights, the same data position and step, to the end.
    heal = relaunched[0]
    assert heal["ft"]["ft/heals"] == 1 and heal["step"] > kill_after + 3, heal
    assert [r["step"] for r in relaunched] == list(range(heal["step"], steps + 1))
    for r in relaunched:
        peer = by_step[r["step"]]
        assert (r["weights"], r["consumed"]) == (peer["weights"], peer["consumed"]), r["step"]
        # The healing group's gradient does not count in its heal step; from the next one it does.
        assert peer["ft"]["ft/live_replicas"] == r["ft"]["ft/live_replicas"] == (1 if r is heal else 2)
    # Data: after its heal step the relaunched group's rank 0 reads its own slice (data-parallel
    # rank `devices` of 2 * devices) of the global batch at the shared position; the survivor's, rank 0's.
    G = 2 * devices * MICRO_BATCH
    for r in relaunched[1:]:
        assert r["samples"] == expected_windows(r["consumed"] - G + devices * MICRO_BATCH, MICRO_BATCH), r["step"]
    for r in survivor:
        assert r["samples"] == expected_windows(r["consumed"] - G, MICRO_BATCH), r["step"]
    # The missing group's share was skipped and counted, identically in both groups' counters.
    end, peer_end = relaunched[-1]["ft"], survivor[-1]["ft"]
    assert end["ft/samples_skipped"] == peer_end["ft/samples_skipped"] > 0
    assert end["ft/samples_trained"] + end["ft/samples_skipped"] == steps * G
    # Checkpoints: each save was written by exactly one group, and is complete.
    saves = {}
    for g in (0, 1):
        for r in groups.records(g, event="save"):
            saves.setdefault(r["step"], []).append(r["writer"])
    assert saves and all(sorted(w) in ([False, True], [True]) for w in saves.values()), saves
    for step in saves:
        assert (tmp_path / "kill.ckpt" / f"step={step:03d}.ckpt" / "manifest.json").exists(), step


# -- no failure: the same run as one HSDP job ------------------------------------------------------


# tp, pp and Muon (over fsdp) inside the groups: an extended run (LDT_FT_EXTENDED=1, about 30 s each), not collected
# otherwise (the suite's time budget), rather than collected and skipped
_LAYOUTS = ["fsdp", *(["tp", "pp", "muon"] if EXTENDED else [])]


@pytest.mark.slow
@pytest.mark.own_processes  # its 4 fault-tolerant processes run after the shared launches, not beside them
@pytest.mark.parametrize("layout", _LAYOUTS)
def test_no_failure_equals_hsdp(data, tmp_path, four, layout):
    """2 groups of 2 ranks (dp_shard=2, tp=2 or pp=2 inside) against one job of 2 replicas of the same."""
    from ft_replica import HSDP_STEPS

    steps, hsdp = HSDP_STEPS, four[{"fsdp": "hsdp", "tp": "hsdp_tp", "pp": "hsdp_pp", "muon": "hsdp_muon"}[layout]]
    groups = ReplicaGroups(tmp_path, data, "ft", devices=2, steps=steps, lighthouse_min_replicas=2,
                           extra=["--final-state", "--layout", layout])
    codes = groups.run_all(300)
    assert codes == {0: 0, 1: 0}, groups.logs()
    for g in (0, 1):
        for rank in (0, 1):
            # The reference's rank holding group g's rank: pp is outermost in the mesh, so its
            # replicas interleave; dp_shard and tp are inside dp_replicate.
            ref_rank = 2 * rank + g if layout == "pp" else 2 * g + rank
            ft, ref = groups.records(g, rank), hsdp[ref_rank]["records"]
            assert [r["ft"]["ft/live_replicas"] for r in ft] == [2] * steps
            # averaged over the groups inside the backward, unit by unit (FSDP's all-reduce hook):
            # under fsdp: the tiny preset's 4 blocks and the root's own parameters
            if layout in ("fsdp", "muon"):
                assert [r["ft"]["ft/units_averaged_in_backward"] for r in ft] == [5] * steps
            # The same samples per global data-parallel rank, losses within 1e-6 at every step.
            assert [r["samples"] for r in ft] == [r["samples"] for r in ref]
            losses = torch.tensor([float.fromhex(r["loss"]) for r in ft])
            ref_losses = torch.tensor([float.fromhex(r["loss"]) for r in ref])
            torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-6, equal_nan=True)
            # And the weights after the last step: the same shard of the same parameters.
            mine = torch.load(tmp_path / f"ft.g{g}.rank{rank}.pt")
            theirs = torch.load(hsdp[ref_rank]["state"])
            assert mine.keys() == theirs.keys()
            for name in mine:
                torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=1e-6)


# -- fewer live groups than min_replicas: save and stop --------------------------------------------


@pytest.mark.slow
def test_below_min_replicas_the_survivor_saves_and_stops(data, tmp_path):
    groups = ReplicaGroups(tmp_path, data, "min", steps=40, sleep=0.05, min_replicas=2, gated=True,
                           extra=["--save-every", "100"])
    try:
        groups.start_and_kill(1, 3)
        code = groups.procs[0][-1].wait(timeout=120)
    finally:
        groups.close()
    assert code == 0, groups.logs()
    records = groups.records(0)
    last = records[-1]
    # The step with one live group was not applied (its weights are the step before's) and was the last.
    assert (last["ft"]["ft/live_replicas"], last["ft"]["ft/committed"]) == (1, 0), last
    assert last["weights"] == records[-2]["weights"] and last["step"] < 40
    assert all(r["ft"]["ft/committed"] for r in records[:-1])
    stop = tmp_path / "min.ckpt" / f"ft-stopped-step={last['step']}.ckpt"
    assert (stop / "manifest.json").exists(), sorted(p.name for p in (tmp_path / "min.ckpt").iterdir())
    assert "fewer than min_replicas=2: the step was not applied; saving a checkpoint and stopping" in groups.logs()


# -- the start: groups launched apart wait for min_replicas; different initial weights are refused --


@pytest.mark.slow
def test_groups_launched_apart_wait_for_min_replicas_then_start_together(data, tmp_path):
    groups = ReplicaGroups(tmp_path, data, "apart", steps=4, min_replicas=2)
    try:
        groups.launch(0)
        groups.wait_until(lambda: groups.records(0, event="start"), 120, "group 0 started")
        # Group 0 forms quorums alone meanwhile (join timeout 1 s), and while group 1 imports.
        __import__("time").sleep(1)
        groups.launch(1)
        codes = groups.wait_all(200)
    finally:
        groups.close()
    assert codes == {0: 0, 1: 0}, groups.logs()
    assert "fault tolerance: waiting for 2 replica groups (min_replicas); 1 in the quorum" in groups.logs()
    for g in (0, 1):  # no step ran ahead: both trained every step together, from the first
        assert [(r["step"], r["ft"]["ft/live_replicas"], r["ft"]["ft/committed"]) for r in groups.records(g)] == \
            [(step, 2, 1) for step in range(1, 5)]
    assert groups.records(0)[-1]["weights"] == groups.records(1)[-1]["weights"]


@pytest.mark.slow
def test_groups_with_different_initial_weights_are_refused(data, tmp_path):
    groups = ReplicaGroups(tmp_path, data, "seeds", steps=3, lighthouse_min_replicas=2)
    groups.extra_for = {1: ["--seed", "99"]}
    codes = groups.run_all(200)
    assert codes[0] != 0 and codes[1] != 0
    assert groups.logs().count("the replica groups start from different weights") >= 2, groups.logs()


# -- the shipped config through ft-local ---------------------------------------------------------------


_FT_LOCAL_ARGS = {
    # the shipped config's run, with trainer options after ft-local's own (two words each)
    "shipped": ["--trainer.max_steps", "4", "--trainer.log_every_n_steps", "2", "--trainer.val_check_interval", "4",
                "--data.init_args.val_batches", "1"],
    # --demo-failure 2: group 1 SIGKILLed at step 2 and relaunched (options as --key=value)
    "relaunch": ["--demo-failure", "2", "--trainer.max_steps=4", "--trainer.log_every_n_steps=2",
                 "--trainer.val_check_interval=4", "--data.init_args.val_batches=1"],
}


def _ft_local_runs(tmp_path_factory) -> dict:
    """The two real ft-local runs of the shipped config (min_replicas 2, so that the groups start
    together whatever the order they reach the lighthouse in: with 1, a group launched a moment
    earlier may finish 4 tiny steps alone before the other arrives, seen once in the suite), in a
    background thread beside the other slow tests (tests/conftest.py): {name: (directory, rc, out)}."""
    import yaml

    from dist_utils import _env

    runs = {}
    for name, args in _FT_LOCAL_ARGS.items():
        root = tmp_path_factory.mktemp(f"ft_local_{name}")
        config = yaml.safe_load((HERE.parents[1] / "configs" / "fault-tolerant.yaml").read_text())
        config["trainer"]["strategy"]["init_args"]["fault_tolerance"]["min_replicas"] = 2
        (root / "fault-tolerant.yaml").write_text(yaml.safe_dump(config))
        env = _env()
        env.pop("RUST_LOG", None)  # as a user runs it: torchft's lighthouse logs every quorum at INFO
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_disttrain.cli", "ft-local", "--config", str(root / "fault-tolerant.yaml"),
             "--groups", "2", "--log-dir", "runs/ftl", *args],
            cwd=root, capture_output=True, text=True, timeout=300, env=env, check=False)
        runs[name] = (root, proc.returncode, proc.stdout, proc.stderr)
    return runs


BACKGROUND = {"ft_local": _ft_local_runs}


@pytest.fixture(scope="module")
def ft_local(background):
    return background(__name__, "ft_local")


@pytest.mark.slow
def test_ft_local_runs_the_shipped_config_and_shows_progress_not_torchft_chatter(ft_local):
    """ft-local with trainer options after its own (--trainer.max_steps 4, as two words): each group
    trains with the fault-tolerance metrics in its own CSV version directory; the terminal shows a
    line per group every log_every_n_steps and the fault-tolerance events, while torchft's
    per-quorum log lines go to <log-dir>/lighthouse.log."""
    import csv

    tmp_path, returncode, stdout, stderr = ft_local["shipped"]
    out = stdout + stderr
    logs = tmp_path / "runs" / "ftl"
    assert returncode == 0, out + "".join(p.read_text()[-3000:] for p in sorted(logs.glob("group*.log")))
    for g in (0, 1):
        assert f"group {g} | step 2/4" in out and f"group {g} | step 4/4" in out, out
        assert f"group {g}: exit code 0" in out, out
        # each group's own CSV version directory, with the fault-tolerance metrics at the logging steps
        rows = [r for r in csv.DictReader(open(tmp_path / "runs" / "fault-tolerant" / "logs" / f"replica_{g}" /
                                               "metrics.csv")) if r.get("ft/live_replicas")]
        assert [(r["step"], float(r["ft/live_replicas"]), float(r["ft/committed"])) for r in rows] == \
            [(str(step), 2.0, 1.0) for step in (1, 3)], rows
    assert "in the quorum at step 0" in out, out  # the fault-tolerance events
    assert "Quorum" not in out and "[INFO]" not in out, out
    assert len(out.splitlines()) <= 20, out
    assert "Quorum status" in (logs / "lighthouse.log").read_text()


def test_ft_local_builds_each_groups_fit_command(monkeypatch, tmp_path):
    """ft-local's own options are its own (no prefix of them is taken), every other argument goes to
    each group's fit after the config, a relaunch logs beside its first launch (Lightning's CSV logger
    deletes the metrics of a version directory it opens again), and each group on CPU gets its share
    of the cores."""
    import argparse

    from lightning_disttrain.fault_tolerance import command

    config = HERE.parents[1] / "configs" / "fault-tolerant.yaml"
    fit_args = ["--trainer.max_steps", "20", "--model.init_args.lr", "-1e-3"]
    first, again = (command.group_command(config, 1, launch, fit_args) for launch in (0, 1))
    assert first[first.index("fit"):][:3] == ["fit", "--config", str(config)] and first[-4:] == fit_args, first
    assert first[first.index("--trainer.logger.init_args.version") + 1] == "replica_1"
    assert again[again.index("--trainer.logger.init_args.version") + 1] == "replica_1-relaunch1"
    assert "--trainer.callbacks+=lightning_disttrain.fault_tolerance.command.GroupProgress" in first
    seen = {}

    def parse_known_args(self, args=None, namespace=None):  # ft-local's parse, then stop before it starts anything
        seen["result"] = original(self, args, namespace)
        raise SystemExit(0)

    original = argparse.ArgumentParser.parse_known_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    with pytest.raises(SystemExit):
        command.local_main(["--config", str(config), "--demo", "5", *fit_args])
    args, rest = seen["result"]
    assert args.demo_failure is None and rest == ["--demo", "5", *fit_args]  # --demo is not --demo-failure
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert command._threads_per_group(2, config, []) == 1
    assert command._threads_per_group(1, config, []) == 2
    assert command._threads_per_group(2, config, ["--trainer.devices", "2"]) == 1  # 4 processes on 2 cores
    assert command._threads_per_group(2, config, ["--trainer.accelerator=gpu"]) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own setting wins
    assert command._threads_per_group(2, config, []) is None


@pytest.mark.slow
def test_ft_local_relaunch_keeps_the_first_launchs_logs(ft_local):
    """--demo-failure: the SIGKILL and the relaunch are on the terminal, the group's output log holds
    both launches, and the relaunch's CSV metrics go beside the first launch's (Lightning's CSV
    logger deletes the metrics.csv of a version directory it opens again)."""
    tmp_path, returncode, stdout, stderr = ft_local["relaunch"]
    logs = tmp_path / "runs" / "ftl"
    assert returncode == 0, stdout + stderr + "".join(p.read_text()[-3000:] for p in logs.glob("group*.log"))
    assert "SIGKILLed group 1" in stdout and "group 1: relaunched" in stdout, stdout
    text = (logs / "group1.log").read_text()
    assert "--- launch 0:" in text and "--- launch 1:" in text, text[-3000:]
    versions = tmp_path / "runs" / "fault-tolerant" / "logs"
    assert (versions / "replica_1-relaunch1" / "metrics.csv").is_file(), sorted(versions.rglob("*"))
    assert (versions / "replica_0" / "metrics.csv").is_file()
