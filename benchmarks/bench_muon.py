"""Collectives and wall time of one optimizer step (Muon + AdamW parts) under FSDP2, tiny preset, gloo.

    torchrun --nproc-per-node 2 benchmarks/bench_muon.py OUT.json sharded,torch,adamw

``sharded``: ``build_optimizer(model, "muon")`` (``parallel.muon.ShardedMuon`` on the FSDP2 shards:
each matrix orthogonalised once, on its owner rank); ``torch``: ``torch.optim.Muon`` on the same
DTensor parameters (the path before issue 41); ``adamw``: the AdamW step for scale. Per variant:
the collectives ``CommDebugMode`` counts in the last step, the median and minimum step time over
steps 3-8 (one thread per rank). Recorded in docs/benchmarks.md section 24.
"""
import json, statistics, sys, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.optim import build_optimizer

dist.init_process_group("gloo"); rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
mesh = init_device_mesh("cpu", (world,))
out = {}
for impl in sys.argv[2].split(","):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=256, block_size=64))
    for b in model.blocks.values() if hasattr(model.blocks, "values") else model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(model, "adamw" if impl == "adamw" else "muon")
    if impl == "torch":
        opt.optimizers[0] = torch.optim.Muon(opt.optimizers[0].param_groups)
    counts, secs = [], []
    for step in range(8):
        x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(step * world + rank))
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        dist.barrier()
        with CommDebugMode() as c:
            t = time.perf_counter(); opt.step(); secs.append(time.perf_counter() - t)
        counts.append(c.get_total_counts()); opt.zero_grad()
    n = sum(1 for g in opt.param_groups for p in g["params"] if p.dim() == 2 and impl != "adamw") 
    out[impl] = dict(type=type(opt.optimizers[0] if hasattr(opt, "optimizers") else opt).__name__, collectives=counts[-1],
                     median_ms=1e3 * statistics.median(secs[2:]), min_ms=1e3 * min(secs[2:]))
if rank == 0:
    print(json.dumps(out, indent=1))
    open(sys.argv[1], "w").write(json.dumps(out, indent=1))
dist.destroy_process_group()
