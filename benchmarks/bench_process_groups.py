"""Process groups per rank by layout at 1,024 ranks, counted with torch's fake backend (one process).

    python benchmarks/bench_process_groups.py [--world 1024] [--rank -1] [--record FILE] [--plot DIR]

For each layout, ``ParallelDims.build_mesh`` runs as the strategy runs it on rank ``--rank`` (the
last by default) of a fake default group of ``--world`` ranks, and the meshes the strategy's code
asks for are requested (``fsdp``, ``tp``, ``pp``, the loss group, the stage group). Printed: how
many process groups this rank joins, over how many distinct rank sets, their sizes, and how many
``new_group`` calls every rank made to build them (torch makes one call per subgroup of a mesh
dimension, on every rank, so a size-1 dimension costs ``world`` calls). No communication happens:
the fake backend creates groups without communicators; on GPUs each joined group is an NCCL
communicator with its own buffers. ``--record FILE`` writes the counts as ``cpu_figures.py`` reads them
(``record``); ``--plot DIR`` draws ``cpu-process-groups`` from that record.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_disttrain.parallel.mesh import ParallelDims, release_all_meshes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import add_record_options, provenance, record_path, wants_record, write_record  # noqa: E402

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
    add_record_options(parser, "cpu-process-groups")
    args = parser.parse_args()
    rank = args.rank % args.world
    rows = []
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
        rows.append({"layout": name, "groups_joined": len(groups), "distinct_rank_sets": len(sets),
                     "sizes": [len(s) for s in sets], "new_group_calls": calls[0], "build_s": seconds})
        release_all_meshes()
        dist.destroy_process_group()
    if wants_record(args):
        write_record(record(args.world, rank, rows), record_path(args, "bench_process_groups.json"), args.plot,
                     args.format)


def record(world: int, rank: int, rows: list[dict]) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-process-groups`` from: ``rows`` as ``main`` measures them
    (per layout: groups joined, distinct rank sets, their sizes, ``new_group`` calls, build seconds),
    a layout that joins no group noted as using the default group."""
    return provenance("bench_process_groups", "bench_process_groups.py",
                      f"torch's fake backend in one process, rank {rank} of {world:,} (counts, not times)") | {
        "world": world, "rank": rank,
        "rows": [r | ({"sizes_note": "the default group"} if not r["sizes"] else {}) for r in rows]}


if __name__ == "__main__":
    main()
