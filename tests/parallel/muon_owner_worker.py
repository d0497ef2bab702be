"""Plain-torch checks of ``parallel.muon.ShardedMuon`` on gloo ranks (no Lightning).

    (RANK/WORLD_SIZE/MASTER_* set by tests/dist_utils.run_torch_script) python muon_owner_worker.py OUT_DIR

Every rank builds the same full matrices and gradients from a seed, steps ``torch.optim.Muon`` on
the full matrices (the one-process reference) and ``ShardedMuon`` on their DTensors, laid out as
FSDP2 gives them (``Shard(0)``; HSDP's ``(Replicate, Shard(0))`` on 4 ranks), as tensor parallel
does (column-parallel ``Shard(0)`` and row-parallel ``Shard(1)``, alternating), as FSDP2 over TP
does on a (dp_shard=2, tp=2) mesh (``(_StridedShard(0, sf=2), Shard(0))`` and ``(Shard(0),
Shard(1))``), and HSDP over TP (``(Replicate, Shard(0 or 1))``); and on 4 ranks the same through
``parallelize_module`` + ``fully_shard`` themselves (the shards torch's FSDP2 holds). It writes per
layout and step: the largest difference of the gathered weights from the reference, the
collectives the step issued (CommDebugMode; and those of the construction: none), the
Newton-Schulz work this rank did (min(m, n)^2 max(m, n) per matrix), the error a ``Partial``
layout gets from ``ShardedMuon`` and what ``build_optimizer`` does with it.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import exit_without_teardown, write_rank_json  # noqa: E402
from lightning_disttrain import _torch_compat as torch_compat  # noqa: E402
from lightning_disttrain.optim import build_optimizer  # noqa: E402
from lightning_disttrain.parallel import muon as muon_mod  # noqa: E402

# uneven row splits on 2 and 4 ranks; (3, 7) leaves rank 3 of 4 empty, (1, 5) all but rank 0
SHAPES = [(8, 4), (5, 6), (3, 7), (1, 5), (4, 12), (12, 4), (6, 6), (6, 6), (16, 8)]
STEPS = 4
KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")

_NS_WORK = [0]
_newton_schulz = muon_mod.newton_schulz


def _counted_newton_schulz(update, *args, **kwargs):  # this rank's iterations' cost, then runs them
    _NS_WORK[0] += min(update.shape) ** 2 * max(update.shape)
    return _newton_schulz(update, *args, **kwargs)


def compare(mesh, layouts, bucket_numel, params=None) -> dict:
    """``layouts``: the placements of the matrices in turn; ``params``: DTensors made elsewhere
    (FSDP2's), holding the same initial weights."""
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES]
    ref_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    ref = torch.optim.Muon(ref_params, **KW)
    if params is None:
        params = [torch.nn.Parameter(distribute_tensor(f.clone(), mesh, layouts[i % len(layouts)], src_data_rank=None))
                  for i, f in enumerate(fulls)]
    assert all(torch.equal(p.full_tensor(), f) for p, f in zip(params, fulls))
    with CommDebugMode() as counter:
        opt = muon_mod.ShardedMuon(params, bucket_numel=bucket_numel, **KW)
    out = {"diffs": [], "collectives": [], "ns_work": [], "construction_collectives": counter.get_total_counts(),
           "placements": sorted({str(tuple(p.placements)) for p in params})}
    for _ in range(STEPS):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        ref.step()
        for p, g in zip(params, grads):
            p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements, src_data_rank=None)
        _NS_WORK[0] = 0
        with CommDebugMode() as counter:
            opt.step()
        out["collectives"].append(counter.get_total_counts())
        out["ns_work"].append(_NS_WORK[0])
        out["diffs"].append(max((p.full_tensor() - r).abs().max().item() for p, r in zip(params, ref_params)))
    out["buckets"] = len(opt._buckets([(p, None) for p in params]))
    return out


def fsdp_over_tp_params(mesh) -> list:
    """The matrices as ``parallelize_module`` (column-parallel, then row-parallel, in turn) and
    ``fully_shard`` over (dp_shard, tp) lay them out, with the reference's initial weights."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential()  # fully_shard wants a module with a forward
    for rows, cols in SHAPES:
        model.append(torch.nn.Linear(cols, rows, bias=False))
        with torch.no_grad():
            model[-1].weight.copy_(torch.randn(rows, cols, generator=gen))
    parallelize_module(model, mesh["tp"], {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                                           for i in range(len(SHAPES))})
    fully_shard(model, mesh=mesh["dp_shard"])
    return [m.weight for m in model]


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    muon_mod.newton_schulz = _counted_newton_schulz
    result = {}
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    result["fsdp"] = compare(flat, [[Shard(0)]], None)
    result["fsdp_buckets"] = compare(flat, [[Shard(0)]], 100)  # several buckets of about 100 elements
    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    result["tp"] = compare(tp, [[Shard(0)], [Shard(1)]], None)  # column- and row-parallel matrices
    if world == 4:
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        result["hsdp"] = compare(hsdp, [[Replicate(), Shard(0)]], None)
        strided = torch_compat.strided_shard_type()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        fsdp_tp = [[strided(0, split_factor=2), Shard(0)], [Shard(0), Shard(1)]]  # FSDP2 over column- / row-parallel
        result["fsdp_tp"] = compare(mesh, fsdp_tp, None)
        result["fsdp_tp_buckets"] = compare(mesh, fsdp_tp, 100)
        result["fsdp_tp_modules"] = compare(mesh, None, None, fsdp_over_tp_params(mesh))
        hsdp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
        result["hsdp_tp"] = compare(hsdp_tp, [[Replicate(), Shard(0)], [Replicate(), Shard(1)]], None)
    try:  # a pending reduction: refused at construction
        muon_mod.ShardedMuon([torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), flat, [Partial()]))], **KW)
        result["partial_error"] = None
    except ValueError as e:
        result["partial_error"] = str(e)
    # build_optimizer keeps torch's Muon (DTensor math on the whole matrix) for such a layout, and says so
    model = torch.nn.Module()
    model.blocks = torch.nn.Module()
    model.blocks.weight = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), flat, [Partial()]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        muon = build_optimizer(model, "muon").optimizers[0]
    result["partial_fallback"] = [type(muon).__name__, [str(w.message) for w in caught]]
    # build_optimizer takes tensor-parallel matrices to ShardedMuon now
    model.blocks.weight = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), tp, [Shard(1)]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        muon = build_optimizer(model, "muon").optimizers[0]
    result["tp_built"] = [type(muon).__name__, [str(w.message) for w in caught]]
    write_rank_json(out_dir, "muon_owner", rank, result)
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
