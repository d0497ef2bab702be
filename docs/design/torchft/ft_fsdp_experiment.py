#!/usr/bin/env python
"""torchft 0.2.0 + FSDP2 (HSDP-style: FT replicate dim x FSDP shard dim), CPU/gloo.

Each replica group = one torchrun with 2 ranks; inside it FSDP2 shards over a
1-D "dp_shard" DeviceMesh (gloo). Cross-replica gradient averaging goes through
torchft: a ManagedProcessGroup registered as a c10d backend and called from
FSDPModule.set_all_reduce_hook (what torchtitan's experiments/torchft does).

Run (orchestrator):  python /tmp/ft_fsdp_experiment.py
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

HERE = os.path.abspath(__file__)


def worker(args: argparse.Namespace) -> None:
    import logging

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    import torchft
    from torchft.process_group import ManagedProcessGroup

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    rank = int(os.environ["RANK"])
    ws = int(os.environ["WORLD_SIZE"])
    print("EV " + json.dumps({"ev": "pid", "rank": rank, "pid": os.getpid()}), flush=True)
    dist.init_process_group("gloo")  # intra-replica default PG (torchrun store)
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("dp_shard",))

    torch.manual_seed(1000 + args.replica_id)  # different init per replica on purpose
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = {"pos": 0}

    cache: dict = {}

    def fresh_sd():
        return {"model": model.state_dict(), "optim": opt.state_dict(), "data": dict(data)}

    def state_dict():
        # Called from torchft's quorum thread (async quorum) while the main thread
        # may be inside forward/backward. FSDP2's state_dict pre-hook reshards the
        # module (frees unsharded storage) -> never call model.state_dict() there.
        # --cache-sd: return a dict built on the main thread between steps (its
        # tensors alias the live sharded params / optimizer states).
        return cache["sd"] if args.cache_sd else fresh_sd()

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        data.update(sd["data"])
        print(f"EV {json.dumps({'ev': 'healed', 'replica': args.replica_id, 'rank': rank, 'pos': data['pos']})}", flush=True)

    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=not args.sync_quorum,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
        replica_id=f"replica_{args.replica_id}",
        # rank/world_size/store from torchrun env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        lighthouse_addr=args.lighthouse,
    )
    if args.cache_sd:
        cache["sd"] = fresh_sd()
    replicate_pg = ManagedProcessGroup(manager)
    replicate_pg.register("dp_replicate")

    def all_reduce_hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, group=replicate_pg, op=dist.ReduceOp.AVG)

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)

    while manager.current_step() < args.steps:
        t0 = time.perf_counter()
        manager.start_quorum()
        g = torch.Generator().manual_seed(data["pos"] * 100 + args.replica_id * 10 + rank)
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()  # FSDP reduce-scatter + FT all-reduce hook
        committed = manager.should_commit()
        if committed:
            opt.step()
            data["pos"] += 1
        if args.cache_sd:
            cache["sd"] = fresh_sd()  # main thread, between steps (also after a heal)
        full = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
        if rank == 0:
            print("EV " + json.dumps({
                "ev": "step", "replica": args.replica_id, "step": manager.current_step(),
                "committed": committed, "participants": manager.num_participants(),
                "is_dtensor": isinstance(next(model.parameters()), DTensor),
                "w": [round(v, 7) for v in full.tolist()],
                "step_ms": (time.perf_counter() - t0) * 1e3,
            }), flush=True)
        time.sleep(args.sleep_s)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def orchestrate(args: argparse.Namespace) -> None:
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                          heartbeat_timeout_ms=1000)

    def launch(rid: int, tag: str):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(29600 + 10 * rid + (5 if tag.endswith("b") else 0)),
               HERE, "worker", "--replica-id", str(rid), "--lighthouse", lh.address(),
               "--steps", str(args.steps), "--sleep-s", str(args.sleep_s)]
        cmd += ["--sync-quorum"] if args.sync_quorum else []
        cmd += ["--cache-sd"] if args.cache_sd else []
        out = open(f"/tmp/ft_fsdp_{tag}.out", "w")
        err = open(f"/tmp/ft_fsdp_{tag}.err", "w")
        # own session so the whole torchrun tree can be SIGKILLed together
        return subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)

    def events(tag):
        evs = []
        for line in open(f"/tmp/ft_fsdp_{tag}.out"):
            if line.startswith("EV "):
                evs.append(json.loads(line[3:]))
        return evs

    def last_step(tag):
        s = [e["step"] for e in events(tag) if e["ev"] == "step" and e["committed"]]
        return max(s) if s else 0

    p0 = launch(0, "r0")
    p1 = launch(1, "r1a")
    t0 = time.time()
    while last_step("r1a") < 6:
        assert time.time() - t0 < 120 and p1.poll() is None, "r1a did not reach step 6"
        time.sleep(0.05)
    # NOTE: torchrun starts its workers in their own sessions, so killpg(torchrun)
    # does NOT kill the ranks. Kill every rank and the agent explicitly.
    for e in events("r1a"):
        if e["ev"] == "pid":
            os.kill(e["pid"], signal.SIGKILL)
    os.kill(p1.pid, signal.SIGKILL)
    kill_t = time.time()
    p1.wait()
    assert p0.poll() is None, "replica group 0 died"
    print("killed replica group 1 at step", last_step("r1a"), "r0 at", last_step("r0"))
    while last_step("r0") < last_step("r1a") + 4:
        assert time.time() - kill_t < 60, "r0 stuck after kill"
        time.sleep(0.05)
    solo = [e for e in events("r0") if e["ev"] == "step" and e["committed"] and e["participants"] == 1]
    print("r0 kept committing; solo steps so far:", [e["step"] for e in solo])
    p1 = launch(1, "r1b")
    rc1 = p1.wait(timeout=180)
    rc0 = p0.wait(timeout=180)
    print("return codes", rc0, rc1)
    e0 = {e["step"]: e for e in events("r0") if e["ev"] == "step" and e["committed"]}
    e1 = {e["step"]: e for e in events("r1b") if e["ev"] == "step" and e["committed"]}
    healed = [e for e in events("r1b") if e["ev"] == "healed"]
    common = sorted(set(e0) & set(e1))
    mism = [s for s in common if e0[s]["w"] != e1[s]["w"]]
    med = lambda xs: sorted(xs)[len(xs) // 2]
    print(json.dumps({
        "healed_events": healed,
        "common_steps": common,
        "weight_mismatch_steps": mism,
        "params_are_dtensor": next(iter(e0.values()))["is_dtensor"],
        "median_step_ms_2p": med([e["step_ms"] for e in e0.values() if e["participants"] == 2]),
        "median_step_ms_1p": med([e["step_ms"] for e in e0.values() if e["participants"] == 1]),
    }, indent=1))
    lh.shutdown()
    assert healed and common and not mism
    print("OK: FSDP2-in-replica + torchft replicate dim: kill/rejoin/heal with identical weights")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="orchestrate")
    ap.add_argument("--replica-id", type=int, default=0)
    ap.add_argument("--lighthouse", default="")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sleep-s", type=float, default=0.2)
    ap.add_argument("--sync-quorum", action="store_true")
    ap.add_argument("--cache-sd", action="store_true")
    a = ap.parse_args()
    worker(a) if a.mode == "worker" else orchestrate(a)
