"""What an AdamW step costs on the host when the parameters are DTensors: foreach against fused.

    python benchmarks/bench_adamw_dtensor.py [--preset tiny] [--steps 6] [--repeats 3]

The tiny GPT (68 parameters) under FSDP2 over 2 gloo ranks and under HSDP 2x2 over 4, spawned here;
``torch.optim.AdamW`` with a schedule that changes the LR every step (as training's does), built
with ``foreach=True`` (what ``optim.build_adamw`` chose on CPU until 2026-12-04) and with
``fused=True`` (what it chooses on CUDA, and now on CPU). For each, every rank times the CPU of each
``optimizer.step()`` (``time.process_time``): the first step, where DTensor plans the sharding of
each op it has not seen (for a foreach op: over every parameter in the list), and the median of the
later ones, where its cache answers. Each repeat is a fresh set of processes (nothing cached); the
two implementations alternate. Also the loss after the last step: the two agree to fp32 rounding.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, preset: str, impl: str, steps: int, out: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_disttrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name(preset))
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if world == 4
            else init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if impl == "fused" else {"foreach": True}))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    tokens = torch.randint(0, model.config.vocab_size, (2, 65), generator=torch.Generator().manual_seed(rank % 2))
    cpu, loss = [], None
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        start = time.process_time()
        optimizer.step()
        cpu.append(time.process_time() - start)
        optimizer.zero_grad()
        schedule.step()
    out[rank] = (cpu, loss.item(), len(list(model.parameters())))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, preset: str, impl: str, steps: int) -> dict:
    out = mp.Manager().dict()
    mp.start_processes(_rank, args=(world, _port(), preset, impl, steps, out), nprocs=world, start_method="spawn")
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for world, layout in ((2, "FSDP2 x2"), (4, "HSDP 2x2")):
        rows = {"foreach": [], "fused": []}
        for _ in range(args.repeats):
            for impl in rows:
                rows[impl].append(_run(world, args.preset, impl, args.steps))
        params = next(iter(rows["fused"][0].values()))[2]
        print(f"{layout}, {args.preset} ({params} parameters), {args.repeats} repeats x {world} ranks, "
              f"{args.steps} steps each: CPU per optimizer.step(), ms")
        for impl, runs in rows.items():
            first = [r[0][0] * 1e3 for run in runs for r in run.values()]
            later = [statistics.median(r[0][1:]) * 1e3 for run in runs for r in run.values()]
            losses = sorted({round(r[1], 6) for run in runs for r in run.values()})
            print(f"  {impl:8s} first step median {statistics.median(first):7.1f} [{min(first):.1f}-{max(first):.1f}]"
                  f"   later steps median {statistics.median(later):5.1f} [{min(later):.1f}-{max(later):.1f}]"
                  f"   last losses {losses}")


if __name__ == "__main__":
    main()
