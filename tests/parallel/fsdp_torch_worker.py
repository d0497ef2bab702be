"""Plain-torch checks of ``parallel.mesh`` and ``parallel.fsdp`` on 2 gloo ranks (no Lightning).

    (RANK/WORLD_SIZE/MASTER_* set by tests/dist_utils.run_torch_script) python fsdp_torch_worker.py OUT_DIR

Every rank compares the sharded model against an unsharded copy it builds itself from the same
seed, over the GLOBAL batch, and writes its measurements to ``OUT_DIR/torch.rankR.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import exit_without_teardown, write_rank_json  # noqa: E402
from lightning_disttrain.models.gpt import GPT, GPTConfig  # noqa: E402
from lightning_disttrain.parallel.fsdp import (  # noqa: E402
    apply_fsdp,
    clip_grad_norm_,
    mp_policy_for_precision,
    set_gradient_sync,
)
from lightning_disttrain.parallel.mesh import MESH_DIMS, ParallelDims  # noqa: E402
from lightning_disttrain.parallel.plan import ParallelPlan, find_parallel_plan  # noqa: E402

CFG = dict(n_layer=3, n_embd=32, n_head=2, n_kv_head=2, mlp_hidden=64, block_size=8)
_RS = [0]
_orig_rs = dist.reduce_scatter_single


def _counting_rs(*args, **kwargs):  # counts FSDP's gradient reduce-scatters, then does them
    _RS[0] += 1
    return _orig_rs(*args, **kwargs)


dist.reduce_scatter_single = _counting_rs


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def build(tied: bool = True) -> tuple[GPT, GPT]:
    cfg = GPTConfig.from_name("tiny", vocab_size=64, tie_embeddings=tied, **CFG)
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    return GPT(cfg), ref


def batches(n: int, bs: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (bs, 9), generator=g) for _ in range(n)]


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def max_grad_diff(model, ref) -> float:
    return max(float((full(p.grad) - q.grad).abs().max())
               for p, q in zip(model.parameters(), ref.parameters()))


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict = {}

    # -- meshes -----------------------------------------------------------------------------
    dims = ParallelDims(world_size=world)
    world_mesh = dims.build_mesh("cpu")
    res["mesh_dims"] = list(world_mesh.mesh_dim_names)
    def size(name):
        try:
            return dims.get_mesh(name).size()
        except ValueError as e:
            assert "has size 1 in this layout" in str(e) and "no process group" in str(e), e
            return "no group"

    res["mesh_sizes"] = {n: size(n) for n in (*MESH_DIMS, "dp", "dp_shard_cp", "dp_cp", "fsdp")}
    res["same_mesh"] = {n: dims.get_mesh(n) is dims.get_mesh("dp_shard") for n in ("dp", "dp_shard_cp", "dp_cp", "fsdp")}
    res["dp_rank"] = dims.dp_rank
    res["local_ranks"] = {n: dims.local_rank(n) for n in ("dp", "tp", "pp")}
    hsdp = ParallelDims(dp_replicate=world, world_size=world)  # 2 replicas of 1 shard: DDP-like HSDP
    hsdp.build_mesh("cpu")
    res["hsdp_fsdp_mesh"] = [list(hsdp.get_mesh("fsdp").mesh_dim_names), list(hsdp.get_mesh("fsdp").shape)]

    # -- ZeRO-3 on the tied GPT, gradient accumulation without sync --------------------------
    model, ref = build(tied=True)
    plan = find_parallel_plan(model)  # no parallel_plan(): the largest ModuleList (blocks)
    apply_fsdp(model, plan, dims.get_mesh("fsdp"), reshard_after_forward=True)
    res["units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
    w = model.blocks[0].attn.wq.weight
    res["placements"] = [str(p) for p in w.placements]
    res["local_rows"] = w.to_local().shape[0]

    micro = batches(4, 2 * world)  # 4 micro-batches of the GLOBAL batch; each rank takes its rows
    for tokens in micro:
        (loss_of(ref, tokens) / len(micro)).backward()
    counts = []
    for i, tokens in enumerate(micro):
        last = i == len(micro) - 1
        set_gradient_sync(model, last)
        before = _RS[0]
        local = tokens.chunk(world)[rank]
        out = loss_of(model, local) / len(micro)
        if i == 0:
            # After forward, a resharded unit holds DTensors again; an unresharded one (the last
            # block, the root) still holds the gathered plain tensors until its backward.
            res["after_forward_sharded"] = [isinstance(b.attn.wq.weight, DTensor) for b in model.blocks]
        out.backward()
        counts.append(_RS[0] - before)
    res["reduce_scatters_per_micro_batch"] = counts
    res["accum_grad_diff"] = max_grad_diff(model, ref)

    # -- clipping: the total norm over shards equals the single-process norm ------------------
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    norm = clip_grad_norm_(model.parameters(), 0.05)
    res["clip_norm"] = [float(norm), float(ref_norm)]
    res["clip_norm_is_plain_tensor"] = not isinstance(norm, DTensor)
    res["clipped_grad_diff"] = max_grad_diff(model, ref)

    # -- clipping over gradients on different meshes ------------------------------------------
    torch.manual_seed(1)
    fulls = [torch.randn(4, 3), torch.randn(6), torch.randn(5)]
    params = [
        torch.nn.Parameter(distribute_tensor(fulls[0].clone(), dims.get_mesh("dp_shard_cp"), [Shard(0)])),
        torch.nn.Parameter(distribute_tensor(fulls[1].clone(), hsdp.get_mesh("fsdp"),  # 2-D: (2, 1)
                                             [Replicate(), Shard(0)])),
        torch.nn.Parameter(fulls[2].clone()),  # a plain, replicated tensor (e.g. an ignored param)
    ]
    for p, f in zip(params, fulls):
        p.grad = distribute_tensor(f.clone(), p.device_mesh, p.placements) if isinstance(p, DTensor) else f.clone()
    expected = torch.cat([f.flatten() for f in fulls]).norm()
    norm = clip_grad_norm_(params, 1.0)
    res["mixed_mesh_norm"] = [float(norm), float(expected)]
    res["mixed_mesh_clipped"] = max(float((full(p.grad) - f * (1.0 / (expected + 1e-6))).abs().max())
                                    for p, f in zip(params, fulls))
    try:
        torch.nn.utils.get_total_norm([p.grad for p in params[:2]])
        res["torch_mixed_mesh"] = "ok"
    except Exception as e:  # torch's behaviour that grad_norm works around (asserted in the test)
        res["torch_mixed_mesh"] = type(e).__name__

    # -- untied GPT: plan groups as their own units, ZeRO-2 ------------------------------------
    model, ref = build(tied=False)
    plan = ParallelPlan(blocks=model.blocks, fsdp_groups=[[model.wte], [model.ln_f, model.lm_head]])
    apply_fsdp(model, plan, dims.get_mesh("fsdp"), reshard_after_forward=False)
    res["untied_units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
    tokens = batches(1, 2 * world)[0]
    loss_of(ref, tokens).backward()
    before = _RS[0]
    loss_of(model, tokens.chunk(world)[rank]).backward()
    res["untied_reduce_scatters"] = _RS[0] - before
    res["untied_grad_diff"] = max_grad_diff(model, ref)

    # -- bf16 mixed precision: bf16 compute, fp32 sharded params and gradients ----------------
    model, _ = build(tied=True)
    apply_fsdp(model, find_parallel_plan(model), dims.get_mesh("fsdp"), mp_policy=mp_policy_for_precision("bf16-mixed"))
    seen = []
    model.blocks[0].mlp.w1.register_forward_hook(lambda m, i, o: seen.append(str(m.weight.dtype)))
    loss_of(model, tokens.chunk(world)[rank]).backward()
    res["bf16_compute_dtype"] = seen[0]
    res["bf16_grad_dtype"] = str(model.blocks[0].mlp.w1.weight.grad.dtype)

    # -- CPU offload: a full step runs with everything in host memory -------------------------
    model, _ = build(tied=True)
    apply_fsdp(model, find_parallel_plan(model), dims.get_mesh("fsdp"), cpu_offload=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_of(model, tokens.chunk(world)[rank]).backward()
    opt.step()
    res["offload_devices"] = sorted({str(p.device) for p in model.parameters()})

    write_rank_json(out_dir, "torch", rank, res)
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
