"""Muon's optimizer step under FSDP2: collectives, bytes moved, Newton-Schulz FLOPs per rank and time,
measured on gloo ranks; and the same figures computed for large models at 64 and 1,024 ranks.

Measured (under torchrun, N ranks, one thread each; FSDP2 over all of them):

    torchrun --nproc-per-node 2 benchmarks/bench_muon.py --record R.json --plot docs/img [--presets tiny small]
        [--impls sharded torch adamw] [--steps 8]
    torchrun --nproc-per-node 4 benchmarks/bench_muon.py --record R.json --append --plot docs/img

Per preset and variant, one optimizer step (the Muon and AdamW parts; the forward and backward
outside): the collectives ``CommDebugMode`` counts in the last step; the bytes this rank sends in
them (``comm.all_to_all_packed``'s payload to the other ranks; torch's path does not go through
it: not counted); the Newton-Schulz FLOPs this rank runs in the last step (``FlopCounterMode``
around the Muon part: under torch's path it sees DTensor's ops at their global shapes, i.e. every
matrix's whole iteration on every rank), beside the total over all matrices and total / ranks;
the median and minimum step time over steps 3..N. Variants: ``sharded``: ``build_optimizer(model,
"muon")`` (``parallel.muon.ShardedMuon``: each matrix once, on its owner); ``torch``:
``torch.optim.Muon`` on the same DTensor parameters (the path before issue 41); ``adamw``.

Computed (printed alone with ``--computed``, no torchrun; every measured record carries it too): for
gpt2-1558m and llama3-70b at 64 and 1,024 ranks,
FSDP2 alone and FSDP2 x TP8: matrices, collectives per bucket, the owners' plan as ``ShardedMuon``
makes it (``owner_plan``): the busiest rank's Newton-Schulz FLOPs against the mean, the bytes a rank
sends and receives in the exchanges (bf16), and the planner's Muon step term on H100s
(``plan --optimizer muon``) beside the planned step.

The record (``--record``; ``--append`` adds this world size's runs to it) is what
``cpu_figures.py`` draws as ``cpu-muon``. Recorded in docs/benchmarks.md section 24.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import add_record_options, provenance, record_path, wants_record, write_record  # noqa: E402

VOCAB, SEQ, MICRO = 256, 64, 2
COMPUTED_MODELS = ("gpt2-1558m", "llama3-70b")
COMPUTED_RANKS = (64, 1024)


# ---- measured -------------------------------------------------------------------------------------

def measure(preset: str, impl: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_disttrain import comm
    from lightning_disttrain.models.gpt import GPT, GPTConfig
    from lightning_disttrain.optim import build_optimizer
    from lightning_disttrain.planning.model_shape import newton_schulz_flops

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name(preset, vocab_size=VOCAB, block_size=SEQ))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(model, "adamw" if impl == "adamw" else "muon")
    if impl == "torch":
        opt.optimizers[0] = torch.optim.Muon(opt.optimizers[0].param_groups)
    parts = getattr(opt, "optimizers", [opt])  # HybridOptimizer (Muon, AdamW) or one AdamW
    muon = parts[0] if impl != "adamw" else None
    matrices = [tuple(p.shape) for g in muon.param_groups for p in g["params"]] if muon is not None else []
    total = sum(newton_schulz_flops(*m) for m in matrices)

    sent = [0]
    packed = comm.all_to_all_packed

    def counting(sends, recv_numels, group=None):
        me = comm.rank(group)
        sent[0] += sum(t.numel() * t.element_size() for d, t in enumerate(sends) if d != me)
        return packed(sends, recv_numels, group)

    comm.all_to_all_packed = counting
    counts, secs, flops, sent_bytes = [], [], [], []
    try:
        for step in range(steps):
            x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(step * world + rank))
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            dist.barrier()
            sent[0] = 0
            with CommDebugMode() as c:
                t = time.perf_counter()
                if muon is not None:
                    with FlopCounterMode(display=False) as f:
                        muon.step()
                    flops.append(f.get_total_flops())
                for part in parts[1 if muon is not None else 0:]:
                    part.step()
                secs.append(time.perf_counter() - t)
            counts.append(c.get_total_counts())
            sent_bytes.append(sent[0])
            opt.zero_grad()
    finally:
        comm.all_to_all_packed = packed
    timed = secs[2:] or secs
    return {"type": type(parts[0]).__name__, "collectives": counts[-1],
            "sent_bytes": sent_bytes[-1], "ns_flops": flops[-1] if flops else 0, "ns_flops_total": total,
            "ns_flops_mean": total / world, "matrices": len(matrices),
            "median_ms": 1e3 * statistics.median(timed), "min_ms": 1e3 * min(timed)}


def measured_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = []
    for preset in args.presets:
        results = {impl: measure(preset, impl, args.steps) for impl in args.impls}
        gathered = [None] * world
        dist.all_gather_object(gathered, {k: (v["ns_flops"], v["sent_bytes"]) for k, v in results.items()})
        for impl, v in results.items():  # every rank's share, to read the spread
            v["ns_flops_per_rank"] = [g[impl][0] for g in gathered]
            v["sent_bytes_per_rank"] = [g[impl][1] for g in gathered]
        runs.append({"preset": preset, "ranks": world, "results": results})
        if rank == 0:
            print(f"{preset}, {world} ranks:")
            for impl, v in results.items():
                print(f"  {impl:8s} {v['type']:12s} collectives {v['collectives']:4d}  sent/rank "
                      f"{max(v['sent_bytes_per_rank']) / 2**20:7.3f} MiB  NS GFLOP/rank max "
                      f"{max(v['ns_flops_per_rank']) / 1e9:7.3f} (total {v['ns_flops_total'] / 1e9:.3f}, /ranks "
                      f"{v['ns_flops_mean'] / 1e9:.3f})  step ms median {v['median_ms']:8.1f} min {v['min_ms']:8.1f}",
                      flush=True)
    if rank == 0 and wants_record(args):
        write_record(measured_record(runs, args.steps, world), record_path(args, "bench_muon.json"), args.plot,
                     args.format, append="runs" if args.append else None)
    dist.destroy_process_group()
    # Not the interpreter's finalisation: there gloo groups still referenced by the meshes are
    # destroyed with a joinable thread and a rank can abort ("terminate called without an active
    # exception", as tests/dist_utils.exit_without_teardown says), and torchrun then kills rank 0
    # before its record is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def measured_record(runs: list[dict], steps: int, world: int) -> dict:
    """The record ``cpu_figures.py`` draws: the measured runs (per preset and world size) and the
    computed rows; its command is the torchrun line of ``world`` ranks that ran it."""
    head = provenance("bench_muon", "bench_muon.py", "gloo, one thread per rank")
    head["command"] = head["command"].replace("python ", f"torchrun --nproc-per-node {world} ", 1)
    return {**head,
            "setting": f"FSDP2 over gloo ranks (one thread each), vocab {VOCAB}, seq {SEQ}, micro-batch {MICRO}; one "
                       f"optimizer step (the Muon and AdamW parts); collectives, bytes and FLOPs of the last of {steps} "
                       f"steps, times over steps 3..{steps}",
            "variants": {"sharded": "build_optimizer(model, 'muon'): ShardedMuon, each matrix once on its owner",
                         "torch": "torch.optim.Muon on the same DTensor parameters (before issue 41)",
                         "adamw": "AdamW, for scale"},
            "runs": runs, "computed": computed_rows()}


# ---- computed --------------------------------------------------------------------------------------

def computed_rows() -> list[dict]:
    from lightning_disttrain.planning import Cluster, Layout, Workload, config_for, shape_of
    from lightning_disttrain.planning.model_shape import newton_schulz_flops
    from lightning_disttrain.planning.throughput import busiest_muon_owner, step_terms

    rows = []
    for model in COMPUTED_MODELS:
        seq = 8192 if model.startswith("llama") else 1024
        shape = shape_of(config_for(model), seq)
        matrices = [m for layer in shape.layer_matrices for m in layer]
        elements = sum(r * c for r, c in matrices)
        total = sum(newton_schulz_flops(r, c) for r, c in matrices)
        for ranks in COMPUTED_RANKS:
            busiest, owned = busiest_muon_owner(shape, range(shape.n_layer), ranks)  # as ShardedMuon places them
            piece = elements / ranks  # this rank's pieces (1/(n tp) of every matrix)
            crossing = max(piece, owned) * (1 - 1 / ranks)
            for tp in (1, 8):
                n = ranks // tp
                layout = Layout(dp_shard=n, tp=tp, zero=3, ac="full")
                terms = step_terms(shape, layout, Workload(seq, ranks, 1, "bf16", optimizer="muon"),
                                   Cluster("H100 SXM", 8, ranks // 8))
                rows.append({"model": model, "ranks": ranks, "layout": f"FSDP2 x{n}" + (f" x TP{tp}" if tp > 1 else ""),
                             "matrices": len(matrices), "matrix_elements": elements,
                             "collectives_per_bucket": 2 * (1 + (tp > 1)),
                             "ns_flops_total": total, "ns_flops_mean": total / ranks,
                             "ns_flops_busiest": busiest, "ranks_owning": min(len(matrices), ranks),
                             "piece_bytes": 2 * piece, "busiest_owned_bytes": 2 * owned,
                             "bytes_each_way_busiest": 2 * crossing,
                             "planned_muon_s": terms.terms["muon"], "planned_step_s": terms.step_seconds})
    return rows


def computed_main(args: argparse.Namespace) -> None:
    rows = computed_rows()
    print("model        ranks  layout            matrices  coll/bucket  NS GFLOP busiest / mean   ranks owning  "
          "MiB each way (busiest)  planned Muon s / step s (H100, AC full, 1 seq per rank)")
    for r in rows:
        print(f"{r['model']:12s} {r['ranks']:5d}  {r['layout']:17s} {r['matrices']:8d}  {r['collectives_per_bucket']:11d}"
              f"  {r['ns_flops_busiest'] / 1e9:10.1f} / {r['ns_flops_mean'] / 1e9:8.1f}   {r['ranks_owning']:12d}"
              f"  {r['bytes_each_way_busiest'] / 2**20:22.1f}  {r['planned_muon_s']:.3f} / {r['planned_step_s']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_record_options(p, "cpu-muon", append="world size's runs")
    p.add_argument("--computed", action="store_true", help="the computed table (no torchrun)")
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--impls", nargs="+", default=["sharded", "torch", "adamw"], choices=["sharded", "torch", "adamw"])
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    computed_main(args) if args.computed else measured_main(args)


if __name__ == "__main__":
    main()
