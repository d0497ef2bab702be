"""Owner-based Muon (``parallel.muon.ShardedMuon``, issue 41) against ``torch.optim.Muon`` on the
full matrices: the same weights after each step (the same Newton-Schulz on the same whole matrix,
so equal to the bit), at most 2 collectives per bucket, each matrix orthogonalised on one rank of
its shard group with the work spread; on 2 and 4 gloo ranks (``muon_owner_worker.py``), uneven
and empty shards included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_utils import read_ranks, run_torch_script
from lightning_disttrain.optim import build_optimizer
from lightning_disttrain.parallel.muon import ShardedMuon, shard_rows

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


@pytest.mark.slow
def test_sharded_muon_equals_torch_muon_on_the_full_matrices(ranks):
    world, results = ranks
    for rank in results:
        for layout in ("fsdp", "fsdp_buckets") + (("hsdp",) if world == 4 else ()):
            diffs = rank[layout]["diffs"]
            assert len(diffs) == 4 and max(diffs) <= 1e-5, (world, layout, diffs)


@pytest.mark.slow
def test_two_collectives_per_bucket_and_the_work_split_once(ranks):
    # FSDP2: two all-to-alls per bucket over the shard group. HSDP (2 replicas x 2 shards): the
    # owners span all 4 ranks, so every matrix is orthogonalised once in the whole data-parallel
    # group, not once per replica, for one more collective per bucket (the replica group's exchange).
    world, results = ranks
    total, largest = sum(map(_work, SHAPES)), max(map(_work, SHAPES))
    for layout, group, per_bucket in (("fsdp", list(range(world)), 2), ("fsdp_buckets", list(range(world)), 2),
                                      *((("hsdp", [0, 1, 2, 3], 3),) if world == 4 else ())):
        buckets = results[group[0]][layout]["buckets"]
        assert buckets == (1 if layout != "fsdp_buckets" else 4)
        for step in range(4):
            assert all(results[r][layout]["collectives"][step] <= per_bucket * buckets for r in group), layout
            work = [results[r][layout]["ns_work"][step] for r in group]
            assert sum(work) == total, (layout, work)  # every matrix once in the group
            assert max(work) <= total / len(group) + largest, (layout, work)  # spread by size


@pytest.mark.slow
def test_a_tensor_parallel_layout_is_refused_by_name_and_keeps_torchs_muon(ranks):
    for rank in ranks[1]:
        assert "Shard(dim=1)" in rank["tp_error"] and "tensor parallel" in rank["tp_error"]
        kind, warned = rank["tp_fallback"]  # build_optimizer: torch's Muon on the DTensors, with a warning
        assert kind == "Muon" and any("'blocks.weight'" in w and "tensor parallel" in w for w in warned), warned


def test_shard_rows_are_torch_chunks_with_empty_ranks():
    assert shard_rows(5, 2) == [3, 2]
    assert shard_rows(3, 4) == [1, 1, 1, 0]
    assert shard_rows(1, 4) == [1, 0, 0, 0]
    assert shard_rows(5, 4) == [2, 2, 1, 0]
    for rows in range(9):
        assert shard_rows(rows, 3) == [len(c) for c in torch.arange(rows).chunk(3)] + [0] * (
            3 - len(torch.arange(rows).chunk(3)))


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
