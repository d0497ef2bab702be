"""What idle gloo process groups cost: threads and CPU per rank while every rank sleeps.

    python benchmarks/bench_idle_groups.py [--groups 1 25 100] [--idle-s 5]

For each count, two gloo ranks (spawned here, on this machine) create that many 2-rank groups,
use each once (an all-reduce), then sleep ``--idle-s`` seconds; each rank reports its thread count
and the CPU time its process used while asleep, as a fraction of one core. Why it matters: the test
suite's shared launches run many Trainer runs in one set of processes, and torch's DeviceMesh
makes a process group per mesh dimension, none destroyed between runs (tests/conftest.py
``_RUNS_PER_PROCESS``).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, groups: int, idle_s: float, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    made = [dist.new_group([0, 1]) for _ in range(groups)]
    for group in made:
        dist.all_reduce(torch.ones(1), group=group)
    dist.barrier()
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    time.sleep(idle_s)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    out[rank] = (len(os.listdir("/proc/self/task")), cpu / wall)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, nargs="+", default=[1, 25, 100])
    p.add_argument("--idle-s", type=float, default=5.0)
    args = p.parse_args()
    print(f"{'groups':>7} {'rank':>5} {'threads':>8} {'idle CPU (cores)':>17}")
    for n in args.groups:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_rank, args=(_free_port(), n, args.idle_s, out), nprocs=2, join=True)
            for rank in sorted(out):
                threads, cores = out[rank]
                print(f"{n:>7} {rank:>5} {threads:>8} {cores:>17.3f}")


if __name__ == "__main__":
    main()
