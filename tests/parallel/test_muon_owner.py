"""Owner-based Muon (``parallel.muon.ShardedMuon``, issue 41) against ``torch.optim.Muon`` on the
full matrices: the same weights after each step (the same Newton-Schulz on the same whole matrix,
so equal to the bit), at most 2 collectives per bucket and splitting mesh dimension (one more
over a replica group), each matrix orthogonalised on one of the ranks holding its pieces with the
work spread; under FSDP2, HSDP, tensor parallel, FSDP2 x TP and HSDP x TP, on 2 and 4 gloo ranks
(``muon_owner_worker.py``), uneven and empty shards included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from dist_utils import read_ranks, run_torch_script
from lightning_disttrain.optim import build_optimizer
from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain.parallel.muon import ShardedMuon, piece_indices, sharded_layout_problem

WORKER = Path(__file__).with_name("muon_owner_worker.py")
SHAPES = [(8, 4), (5, 6), (3, 7), (1, 5), (4, 12), (12, 4), (6, 6), (6, 6), (16, 8)]  # the worker's
KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"muon{request.param}")
    run_torch_script(WORKER, request.param, out, timeout=240)
    return request.param, read_ranks(out, "muon_owner", request.param)


def _work(shape) -> int:
    return min(shape) ** 2 * max(shape)


# layout -> collectives per bucket: 2 per mesh dimension that splits the matrices (an all-to-all
# each way), 1 more over a replica group (HSDP: this rank's piece of the other replicas' results)
PER_BUCKET = {"fsdp": 2, "fsdp_buckets": 2, "tp": 2, "hsdp": 3, "fsdp_tp": 4, "fsdp_tp_buckets": 4,
              "fsdp_tp_modules": 4, "hsdp_tp": 3}
FOUR_RANKS = ("hsdp", "fsdp_tp", "fsdp_tp_buckets", "fsdp_tp_modules", "hsdp_tp")


def _layouts(world: int) -> list[str]:
    return [k for k in PER_BUCKET if world == 4 or k not in FOUR_RANKS]


@pytest.mark.slow
def test_sharded_muon_equals_torch_muon_on_the_full_matrices(ranks):
    world, results = ranks
    for rank in results:
        for layout in _layouts(world):
            diffs = rank[layout]["diffs"]
            assert len(diffs) == 4 and max(diffs) <= 1e-5, (world, layout, diffs)
            assert rank[layout]["construction_collectives"] == 0, layout  # the plan is computed, not exchanged


@pytest.mark.slow
def test_the_layouts_are_fsdp2_and_tensor_parallels(ranks):
    world, results = ranks
    if world == 4:  # parallelize_module + fully_shard give what the synthetic FSDP2 x TP layout assumes
        modules, synthetic = results[0]["fsdp_tp_modules"]["placements"], results[0]["fsdp_tp"]["placements"]
        assert modules == synthetic == ["(Shard(dim=0), Shard(dim=1))", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"]


@pytest.mark.slow
def test_collectives_per_bucket_and_the_work_split_once(ranks):
    # FSDP2 / TP: two all-to-alls per bucket over the group. HSDP (2 replicas x 2 shards): the owners
    # span all 4 ranks, so every matrix is orthogonalised once in the whole data-parallel group, not
    # once per replica, for one more collective per bucket (the replica group's exchange). FSDP2 x TP:
    # two all-to-alls over tp and two over dp_shard; owners over all 4 ranks.
    world, results = ranks
    total, largest = sum(map(_work, SHAPES)), max(map(_work, SHAPES))
    for layout in _layouts(world):
        buckets = results[0][layout]["buckets"]
        assert buckets == (4 if layout.endswith("_buckets") else 1), layout
        for step in range(4):
            counts = [results[r][layout]["collectives"][step] for r in range(world)]
            assert all(c <= PER_BUCKET[layout] * buckets for c in counts), (layout, counts)
            work = [results[r][layout]["ns_work"][step] for r in range(world)]
            assert sum(work) == total, (layout, work)  # every matrix once among all the ranks
            assert max(work) <= total / world + largest, (layout, work)  # spread by size


@pytest.mark.slow
def test_a_partial_layout_is_refused_by_name_and_keeps_torchs_muon(ranks):
    for rank in ranks[1]:
        assert "Partial" in rank["partial_error"] and "pending reduction" in rank["partial_error"]
        kind, warned = rank["partial_fallback"]  # build_optimizer: torch's Muon on the DTensors, with a warning
        assert kind == "Muon" and any("'blocks.weight'" in w and "Partial" in w for w in warned), warned
        assert rank["tp_built"] == ["ShardedMuon", []]  # a tensor-parallel matrix: the owner path, no warning


def test_pieces_are_torchs_chunks_with_empty_ranks():
    rows = [r for r, _ in piece_indices((5, 3), (4,), [Shard(0)])]
    assert rows == [[0, 1], [2, 3], [4], []]  # torch.chunk's split: ceil-sized, the last ones short or empty
    assert [c for _, c in piece_indices((3, 5), (4,), [Shard(1)])] == [[0, 1], [2, 3], [4], []]
    assert all(r == [0, 1, 2] for r, _ in piece_indices((3, 5), (4,), [Shard(1)]))
    for n in range(9):
        assert [len(r) for r, _ in piece_indices((n, 2), (3,), [Shard(0)])] == [
            len(c) for c in torch.arange(n).chunk(3)] + [0] * (3 - len(torch.arange(n).chunk(3)))
    # FSDP2 over TP on (dp_shard=2, tp=2), flat coordinates (dp, tp) = 00, 01, 10, 11: rows split over tp
    # first, then over dp_shard within each tp piece; row-parallel: dp_shard splits rows, tp columns
    strided = torch_compat.strided_shard_type()
    assert [r for r, _ in piece_indices((10, 6), (2, 2), [strided(0, split_factor=2), Shard(0)])] == [
        [0, 1, 2], [5, 6, 7], [3, 4], [8, 9]]
    assert piece_indices((3, 5), (2, 2), [Shard(0), Shard(1)]) == [
        ([0, 1], [0, 1, 2]), ([0, 1], [3, 4]), ([2], [0, 1, 2]), ([2], [3, 4])]
    # a replicated or 1-rank dimension splits nothing
    assert piece_indices((3, 5), (2, 1), [Replicate(), Shard(0)]) == [([0, 1, 2], [0, 1, 2, 3, 4])]


def test_layouts_the_owner_path_takes_and_refuses(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    strided = torch_compat.strided_shard_type()
    for placements in ([strided(0, split_factor=1), Shard(0)], [Shard(0), Shard(1)], [Replicate(), Shard(1)]):
        assert sharded_layout_problem(distribute_tensor(torch.ones(4, 4), mesh, placements)) is None
    problem = sharded_layout_problem(distribute_tensor(torch.ones(4, 4), mesh, [Partial(), Shard(0)]))
    assert "Partial" in problem and "pending reduction" in problem


def test_one_process_equals_torch_muon_and_build_optimizer_picks_it():
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES]
    ref_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    ref, opt = torch.optim.Muon(ref_params, **KW), ShardedMuon(params, **KW)
    for _ in range(3):
        for p, r in zip(params, ref_params):
            r.grad = torch.randn(p.shape, generator=gen)
            p.grad = r.grad.clone()
        ref.step()
        opt.step()
        assert all(torch.equal(p, r) for p, r in zip(params, ref_params))
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False)])
    model.head = torch.nn.Linear(4, 2)
    muon, _adamw = build_optimizer(model, "muon").optimizers
    assert isinstance(muon, ShardedMuon) and isinstance(muon, torch.optim.Muon)


def test_a_vector_is_refused_at_construction():
    with pytest.raises(ValueError, match="2D"):
        ShardedMuon([torch.nn.Parameter(torch.ones(3))], **KW)


def test_the_iteration_leaves_the_momentum_alone_without_nesterov():
    # without Nesterov the update is the momentum buffer itself; an fp32 iteration must not divide it in place
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES[:3]]
    ref_params = [torch.nn.Parameter(f.clone()) for f in fulls]
    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    kw = {**KW, "nesterov": False}
    ref, opt = torch.optim.Muon(ref_params, **kw), ShardedMuon(params, ns_dtype=torch.float32, **kw)
    for _ in range(2):
        for p, r in zip(params, ref_params):
            r.grad = torch.randn(p.shape, generator=gen)
            p.grad = r.grad.clone()
        ref.step()
        opt.step()
        assert all(torch.equal(opt.state[p]["momentum_buffer"], ref.state[r]["momentum_buffer"])
                   for p, r in zip(params, ref_params))
