"""Process groups per rank by layout at 1,024 ranks, counted with torch's fake backend (one process).

    python benchmarks/bench_process_groups.py [--world 1024] [--rank -1]

For each layout, ``ParallelDims.build_mesh`` runs as the strategy runs it on rank ``--rank`` (the
last by default) of a fake default group of ``--world`` ranks, and the meshes the strategy's code
asks for are requested (``fsdp``, ``tp``, ``pp``, the loss group, the stage group). Printed: how
many process groups this rank joins, over how many distinct rank sets, their sizes, and how many
``new_group`` calls every rank made to build them (torch makes one call per subgroup of a mesh
dimension, on every rank, so a size-1 dimension costs ``world`` calls). No communication happens:
the fake backend creates groups without communicators; on GPUs each joined group is an NCCL
communicator with its own buffers.
"""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_disttrain.parallel.mesh import ParallelDims, release_all_meshes

LAYOUTS = {
    "FSDP 1024": (dict(), ("fsdp", "dp")),
    "FSDP 128 x TP 8": (dict(tp=8), ("fsdp", "tp", "dp", "stage")),
    "PP 4 x FSDP 32 x TP 8": (dict(pp=4, tp=8), ("fsdp", "tp", "pp", "dp", "stage")),
    "HSDP 8x16 x TP 8": (dict(dp_replicate=8, tp=8), ("fsdp", "tp", "dp", "stage")),
    "HSDP 8x16 x CP 2 x TP 4": (dict(dp_replicate=8, cp=2, tp=4), ("fsdp", "tp", "cp", "dp_cp", "stage")),
    "FSDP 1024, EP 8": (dict(ep=8), ("fsdp", "dp", "ep", "efsdp")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=-1, help="this process's rank (-1: the last)")
    args = parser.parse_args()
    rank = args.rank % args.world
    calls = [0]
    real_new_group = dist.new_group

    def counting_new_group(*a, **k):
        calls[0] += 1
        return real_new_group(*a, **k)

    dist.new_group = counting_new_group
    import torch.distributed.device_mesh as device_mesh
    device_mesh.new_group = counting_new_group
    print(f"world {args.world}, rank {rank}")
    print(f"{'layout':28} {'groups':>6} {'rank sets':>9} {'new_group calls':>15} {'build s':>8}  sizes")
    for name, (degrees, used) in LAYOUTS.items():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=args.world)
        calls[0] = 0
        start = time.perf_counter()
        dims = ParallelDims(**degrees, world_size=args.world)
        dims.build_mesh("cpu")
        for mesh in used:
            dims.get_mesh(mesh)
        seconds = time.perf_counter() - start
        groups = dims.process_groups()
        sets = sorted({tuple(dist.get_process_group_ranks(g)) for g in groups}, key=len)
        print(f"{name:28} {len(groups):>6} {len(sets):>9} {calls[0]:>15} {seconds:>8.3f}  "
              f"{[len(s) for s in sets]}")
        release_all_meshes()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
