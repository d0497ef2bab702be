#!/usr/bin/env python
"""Minimal torchft 0.2.0 kill/heal experiment (CPU, gloo, localhost).

Orchestrator (default mode):
    python /tmp/ft_experiment.py [--heartbeat-timeout-ms 5000] [--sync-quorum]
  - starts a torchft LighthouseServer in-process (min_replicas=1)
  - launches 2 replica groups (1 process each) as subprocesses
  - SIGKILLs replica 1 mid-run, watches replica 0 keep committing,
    relaunches replica 1 and checks it heals (weights identical to replica 0).

Worker mode (spawned by the orchestrator):
    python /tmp/ft_experiment.py worker --replica-id N --lighthouse ADDR ...
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import logging

    import torch
    import torch.distributed as dist
    from torch import nn

    from torchft import Manager, ProcessGroupGloo

    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )

    def emit(**kw: object) -> None:
        kw["t"] = time.time()
        kw["replica"] = args.replica_id
        print("EV " + json.dumps(kw), flush=True)

    t_start = time.time()
    # Each replica group owns a TCPStore master; the Manager connects to it as a
    # client (Manager.__init__ creates TCPStore(is_master=False)).
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)

    # Different init per replica on purpose: init_sync=True must overwrite it.
    torch.manual_seed(1000 + args.replica_id)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data_pos = {"pos": 0}  # stands in for a dataloader position

    # ---- baseline: step time without any torchft (same model/optimizer copy)
    base_model = nn.Linear(4, 2)
    base_opt = torch.optim.SGD(base_model.parameters(), lr=0.1)
    t0 = time.perf_counter()
    for i in range(200):
        base_opt.zero_grad()
        base_model(torch.randn(8, 4)).pow(2).mean().backward()
        base_opt.step()
    base_step_ms = (time.perf_counter() - t0) / 200 * 1e3

    heal_events: list = []

    def state_dict() -> dict:
        return {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "data": dict(data_pos),
        }

    def load_state_dict(sd: dict) -> None:
        heal_events.append(time.time())
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        data_pos.update(sd["data"])
        emit(ev="load_state_dict", data_pos=data_pos["pos"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s))
    t_mgr = time.time()
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=not args.sync_quorum,
        timeout=timedelta(seconds=args.timeout_s),
        quorum_timeout=timedelta(seconds=args.quorum_timeout_s),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"replica_{args.replica_id}",
    )
    emit(
        ev="started",
        base_step_ms=base_step_ms,
        manager_init_s=time.time() - t_mgr,
        startup_s=time.time() - t_start,
        pid=os.getpid(),
    )

    while manager.current_step() < args.steps:
        ts = time.perf_counter()
        manager.start_quorum()
        tq = time.perf_counter()
        # batch depends on data position so healed position matters
        g = torch.Generator().manual_seed(data_pos["pos"] * 10 + args.replica_id)
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        tf = time.perf_counter()
        if args.self_kill_at_step >= 0 and manager.current_step() == args.self_kill_at_step:
            # crash mid-step: after joining the quorum, before the allreduce
            emit(ev="dying", step=manager.current_step())
            os.kill(os.getpid(), signal.SIGKILL)
        # fault tolerant gradient averaging across live replicas
        works = [manager.allreduce(p.grad) for p in model.parameters()]
        for w in works:
            w.wait()
        ta = time.perf_counter()
        participants = manager.num_participants()
        participating = manager.is_participating()
        committed = manager.should_commit()
        tc = time.perf_counter()
        if committed:
            opt.step()
            data_pos["pos"] += 1
        emit(
            ev="step",
            step=manager.current_step(),
            committed=committed,
            participants=participants,
            participating=participating,
            quorum_id=manager._quorum_id,
            errored=str(manager.errored()) if manager.errored() else None,
            data_pos=data_pos["pos"],
            w=[round(v, 8) for v in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()],
            step_ms=(tc - ts) * 1e3,
            start_quorum_ms=(tq - ts) * 1e3,
            allreduce_ms=(ta - tf) * 1e3,
            should_commit_ms=(tc - ta) * 1e3,
        )
        time.sleep(args.sleep_s)

    emit(ev="done", step=manager.current_step())
    manager.shutdown(wait=False)


# --------------------------------------------------------------------------
# orchestrator
# --------------------------------------------------------------------------
class Proc:
    def __init__(self, rid: int, lh: str, args: argparse.Namespace, tag: str) -> None:
        self.rid = rid
        self.events: list = []
        self.lock = threading.Lock()
        cmd = [
            sys.executable, HERE, "worker",
            "--replica-id", str(rid), "--lighthouse", lh,
            "--steps", str(args.steps), "--sleep-s", str(args.sleep_s),
            "--pg-timeout-s", str(args.pg_timeout_s),
            "--timeout-s", str(args.timeout_s),
            "--quorum-timeout-s", str(args.quorum_timeout_s),
        ]
        if args.sync_quorum:
            cmd.append("--sync-quorum")
        if tag == "r1a" and args.crash_mid_step:
            cmd += ["--self-kill-at-step", str(args.kill_at)]
        self.errf = open(f"{args.logdir}/{tag}.stderr", "w")
        self.launched = time.time()
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.errf, text=True)
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith("EV "):
                ev = json.loads(line[3:])
                with self.lock:
                    self.events.append(ev)

    def snapshot(self) -> list:
        with self.lock:
            return list(self.events)

    def last_step(self) -> int:
        steps = [e["step"] for e in self.snapshot() if e["ev"] == "step" and e["committed"]]
        return max(steps) if steps else 0


def wait_for(pred, timeout: float, what: str) -> None:
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise TimeoutError(what)
        time.sleep(0.02)


def orchestrate(args: argparse.Namespace) -> None:
    from torchft.coordination import LighthouseServer

    os.makedirs(args.logdir, exist_ok=True)
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    lh = lighthouse.address()
    print(f"lighthouse at {lh}", flush=True)

    r0 = Proc(0, lh, args, "r0")
    r1 = Proc(1, lh, args, "r1a")

    # both replicas in the quorum and committing
    if args.crash_mid_step:
        r1.p.wait(timeout=120)
        kill_t = [e for e in r1.snapshot() if e["ev"] == "dying"][0]["t"]
        r0_step_at_kill = r0.last_step()
        print(f"replica 1 SIGKILLed itself mid-step {args.kill_at} (before allreduce)", flush=True)
    else:
        wait_for(lambda: r1.last_step() >= args.kill_at, 120, "r1 reaching kill step")
        kill_t = time.time()
        r0_step_at_kill = r0.last_step()
        os.kill(r1.p.pid, signal.SIGKILL)
        r1.p.wait()
        print(f"SIGKILLed replica 1 at its step {args.kill_at}; r0 step {r0_step_at_kill}", flush=True)

    def r0_committed_after_kill() -> list:
        return [
            e for e in r0.snapshot()
            if e["ev"] == "step" and e["committed"] and e["t"] > kill_t and e["participants"] == 1
        ]

    wait_for(lambda: len(r0_committed_after_kill()) >= 3, 120, "r0 committing alone")
    survivor = r0_committed_after_kill()
    first_alone = survivor[0]
    print(
        f"survivor: first committed step with 1 participant = {first_alone['step']} "
        f"{first_alone['t'] - kill_t:.2f}s after kill",
        flush=True,
    )
    r0_failed = [e for e in r0.snapshot() if e["ev"] == "step" and not e["committed"]]

    # relaunch replica 1
    relaunch_t = time.time()
    r1b = Proc(1, lh, args, "r1b")

    wait_for(lambda: any(e["ev"] == "load_state_dict" for e in r1b.snapshot()), 120, "r1b heal")
    wait_for(lambda: r1b.p.poll() is not None and r0.p.poll() is not None, 180, "both done")

    ev0 = r0.snapshot()
    ev1 = r1b.snapshot()
    started = [e for e in ev1 if e["ev"] == "started"][0]
    heal = [e for e in ev1 if e["ev"] == "load_state_dict"][0]
    s0 = {e["step"]: e for e in ev0 if e["ev"] == "step" and e["committed"]}
    s1 = {e["step"]: e for e in ev1 if e["ev"] == "step" and e["committed"]}
    common = sorted(set(s0) & set(s1))
    mismatches = [s for s in common if s0[s]["w"] != s1[s]["w"]]
    first_joint = common[0] if common else None

    def med(xs: list) -> float:
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else float("nan")

    two = [e for e in ev0 if e["ev"] == "step" and e["committed"] and e["participants"] == 2]
    one = [e for e in ev0 if e["ev"] == "step" and e["committed"] and e["participants"] == 1]
    r0_started = [e for e in ev0 if e["ev"] == "started"][0]
    summary = {
        "baseline_step_ms_no_ft": r0_started["base_step_ms"],
        "manager_init_s": r0_started["manager_init_s"],
        "median_step_ms_2_participants": med([e["step_ms"] for e in two]),
        "median_start_quorum_ms_2p": med([e["start_quorum_ms"] for e in two]),
        "median_allreduce_ms_2p": med([e["allreduce_ms"] for e in two]),
        "median_should_commit_ms_2p": med([e["should_commit_ms"] for e in two]),
        "median_step_ms_1_participant": med([e["step_ms"] for e in one]),
        "kill_to_survivor_first_solo_commit_s": first_alone["t"] - kill_t,
        "survivor_uncommitted_steps_after_kill": [
            {k: e[k] for k in ("step", "errored", "participants", "step_ms")} for e in r0_failed
        ],
        "relaunch_to_started_s": started["t"] - relaunch_t,
        "relaunch_to_load_state_dict_s": heal["t"] - relaunch_t,
        "healed_data_pos": heal["data_pos"],
        "first_common_committed_step": first_joint,
        "common_steps": len(common),
        "weight_mismatch_steps": mismatches,
        "final_step_r0": max(s0),
        "final_step_r1": max(s1),
        "r1_first_events": [
            {k: e.get(k) for k in ("ev", "step", "committed", "participants", "participating", "data_pos")}
            for e in ev1[:5]
        ],
        "r0_quorum_ids": sorted({e["quorum_id"] for e in ev0 if e["ev"] == "step"}),
    }
    print(json.dumps(summary, indent=1), flush=True)
    lighthouse.shutdown()
    assert not mismatches, "weights diverged after heal"
    print("OK: survivor kept committing, relaunched replica healed with identical weights")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="orchestrate")
    ap.add_argument("--replica-id", type=int, default=0)
    ap.add_argument("--lighthouse", default="")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sleep-s", type=float, default=0.2)
    ap.add_argument("--kill-at", type=int, default=8)
    ap.add_argument("--pg-timeout-s", type=float, default=5)
    ap.add_argument("--timeout-s", type=float, default=10)
    ap.add_argument("--quorum-timeout-s", type=float, default=30)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    ap.add_argument("--join-timeout-ms", type=int, default=1000)
    ap.add_argument("--sync-quorum", action="store_true")
    ap.add_argument("--crash-mid-step", action="store_true")
    ap.add_argument("--self-kill-at-step", type=int, default=-1)
    ap.add_argument("--logdir", default="/tmp/ft_exp_logs")
    args = ap.parse_args()
    if args.mode == "worker":
        worker(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
