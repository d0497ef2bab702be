"""ParallelDims: degrees, up-front validation with the fix named, model-shape checks (no processes)."""

import pytest

from lightning_disttrain.models.gpt import GPTConfig
from lightning_disttrain.parallel.mesh import MESH_DIMS, ParallelDims


def test_dp_shard_minus_one_takes_the_rest():
    assert ParallelDims(world_size=8).dp_shard == 8
    dims = ParallelDims(dp_replicate=2, world_size=8)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 4)
    assert (dims.dp_size, dims.fsdp_size) == (8, 4)
    assert dims.hsdp_enabled and dims.fsdp_enabled
    assert ParallelDims(tp=2, pp=2, world_size=8).dp_shard == 2


def test_degrees_are_in_mesh_order():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, world_size=4)
    assert tuple(dims.degrees) == MESH_DIMS == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert list(dims.degrees.values()) == [1, 2, 2, 1, 1]


def test_single_rank_is_not_sharded():
    dims = ParallelDims(world_size=1)
    assert dims.dp_shard == 1 and not dims.fsdp_enabled and not dims.hsdp_enabled


def test_product_must_equal_world_size():
    with pytest.raises(ValueError, match=r"= 2 but world_size=4.*dp_shard=-1"):
        ParallelDims(dp_replicate=2, dp_shard=1, world_size=4)


def test_degree_not_dividing_world_names_the_fix():
    with pytest.raises(ValueError, match=r"tp=3 does not divide world_size=4; choose tp among the divisors of 4"):
        ParallelDims(tp=3, world_size=4)


def test_rest_not_integral():
    # Each degree divides 12, their product 8 does not: dp_shard=-1 cannot take the rest.
    with pytest.raises(ValueError, match=r"= 8 does not divide world_size=12, so dp_shard=-1"):
        ParallelDims(dp_replicate=4, tp=2, world_size=12)


@pytest.mark.parametrize("name", ["dp_replicate", "tp", "pp", "ep", "cp"])
def test_degrees_must_be_positive(name):
    with pytest.raises(ValueError, match=rf"{name}=0 must be an int >= 1"):
        ParallelDims(**{name: 0}, world_size=4)


def test_dp_shard_only_minus_one_or_positive():
    with pytest.raises(ValueError, match=r"dp_shard=-2"):
        ParallelDims(dp_shard=-2, world_size=4)
    with pytest.raises(ValueError, match=r"world_size=0"):
        ParallelDims(world_size=0)


def test_ep_borrows_from_fsdp_dimension():
    assert ParallelDims(ep=2, world_size=4).ep_enabled
    with pytest.raises(ValueError, match=r"ep=3 must divide dp_shard\*cp = 4\*1 = 4"):
        ParallelDims(ep=3, world_size=4)


@pytest.mark.parametrize(("degrees", "config", "message"), [
    ({"tp": 8}, dict(n_head=4, n_embd=128), r"tp=8 does not divide n_head=4; .* divisors of 4"),
    ({"tp": 4}, dict(n_head=8, n_kv_head=2, n_embd=128), r"tp=4 does not divide n_kv_head=2"),
    ({"tp": 2}, dict(n_head=4, n_embd=128, mlp_hidden=99), r"tp=2 does not divide mlp_hidden=99"),
    ({"tp": 2}, dict(n_head=4, n_embd=128, vocab_size=63, pad_vocab_multiple=1),
     r"tp=2 does not divide padded_vocab_size=63"),
    ({"pp": 8}, dict(n_layer=4), r"pp=8 exceeds n_layer=4; .* use pp <= 4"),
    ({"cp": 2}, dict(block_size=6), r"block_size=6 is not a multiple of 2\*cp=4"),
])
def test_validate_for_model(degrees, config, message):
    dims = ParallelDims(**degrees, world_size=8)
    with pytest.raises(ValueError, match=message):
        dims.validate_for_model(GPTConfig.from_name("tiny", **config))


def test_validate_for_model_accepts_fitting_shapes_and_other_configs():
    ParallelDims(tp=4, pp=2, world_size=8).validate_for_model(GPTConfig.from_name("tiny"))

    class Experts:  # any config-like object: missing attributes are skipped
        n_experts = 6

    ParallelDims(ep=2, world_size=2).validate_for_model(Experts())
    with pytest.raises(ValueError, match=r"ep=4 does not divide n_experts=6"):
        ParallelDims(ep=4, world_size=4).validate_for_model(Experts())


def test_meshes_need_build_mesh():
    with pytest.raises(RuntimeError, match=r"build_mesh\(\) has not run"):
        ParallelDims(world_size=2).get_mesh("dp")


# ---- process groups per layout at 1,024 ranks (torch's fake backend: one process) -----------------


@pytest.fixture
def fake_world():
    """A default process group of ``world_size`` fake ranks in this process; this rank is the last."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world_size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=world_size - 1, world_size=world_size)

    assert not dist.is_initialized(), "an earlier test left a process group initialised in this process"
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _joined(dims: ParallelDims) -> list[tuple[int, ...]]:
    import torch.distributed as dist

    return sorted(tuple(dist.get_process_group_ranks(g)) for g in dims.process_groups())


# Layout -> (the meshes the strategy's code asks for, the sizes of the groups this rank then joins).
# One group per distinct rank set, none of size 1; before (every dimension, size 1 included, and
# seven flattened ones) the same layouts joined 5, 10, 11 and 12 groups (1, 3, 5, 5 distinct sets).
_LAYOUTS = {
    "fsdp1024": (dict(), [], ("fsdp", "dp")),
    "fsdp128_tp8": (dict(tp=8), [8, 128], ("fsdp", "tp", "dp", "stage")),
    "pp4_fsdp32_tp8": (dict(pp=4, tp=8), [4, 8, 32, 256], ("fsdp", "tp", "pp", "dp", "stage")),
    "hsdp8x16_tp8": (dict(dp_replicate=8, tp=8), [8, 8, 16, 128], ("fsdp", "tp", "dp", "dp_cp", "stage")),
    "hsdp8x16_cp2_tp4": (dict(dp_replicate=8, cp=2, tp=4), [2, 4, 8, 16, 32, 256],
                         ("fsdp", "tp", "cp", "dp_cp", "stage")),  # stage: the world (default group)
    "ep8_fsdp1024": (dict(ep=8), [8, 128], ("fsdp", "dp", "ep", "efsdp")),
}


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_each_layout_joins_one_group_per_distinct_rank_set(fake_world, layout):
    degrees, sizes, used = _LAYOUTS[layout]
    fake_world(1024)
    dims = ParallelDims(**degrees, world_size=1024)
    world = dims.build_mesh("cpu")
    assert world.mesh_dim_names == dims.mesh_dims() == tuple(
        d for d in MESH_DIMS if getattr(dims, d) > 1 or d == "dp_shard")
    for name in used:
        dims.get_mesh(name)
    joined = _joined(dims)
    assert sorted(len(r) for r in joined) == sizes
    assert len(set(joined)) == len(joined)  # no two groups over the same ranks
    for name in used:  # the same mesh object each time: nothing made twice
        assert dims.get_mesh(name) is dims.get_mesh(name)
    dims.release()
    assert dims.process_groups() == []


def test_names_over_the_same_ranks_share_a_mesh_and_size_one_names_have_none(fake_world):
    fake_world(8)
    dims = ParallelDims(tp=2, world_size=8)  # dp_shard=4
    dims.build_mesh("cpu")
    assert dims.get_mesh("dp") is dims.get_mesh("dp_shard") is dims.get_mesh("dp_cp") is dims.get_mesh("fsdp")
    assert dims.get_mesh("tensor_parallel") is dims.get_mesh("tp")
    with pytest.raises(ValueError, match=r"cp has size 1 in this layout .* no process group.*local_rank\('cp'\)"):
        dims.get_mesh("cp")
    # Rank 7 of (dp_shard=4, tp=2): dp_shard coordinate 3, tp coordinate 1.
    assert (dims.local_rank("dp"), dims.local_rank("tp"), dims.local_rank("cp"), dims.dp_rank) == (3, 1, 0, 3)
    assert dims.local_rank("dp") == dims.get_mesh("dp").get_local_rank()
    assert dims.local_rank("tp") == dims.get_mesh("tp").get_local_rank()
    with pytest.raises(RuntimeError, match=r"ran already"):
        dims.build_mesh("cpu")


def test_lightning_names_are_views_of_existing_groups(fake_world):
    fake_world(4)
    dims = ParallelDims(dp_shard=4, world_size=4)  # tp=1 kept at size 1, as Lightning's mesh has it
    world = dims.build_mesh("cpu", keep=("dp_shard", "tp"), aliases=("data_parallel", "tensor_parallel"))
    assert world.mesh_dim_names == ("dp_shard", "tp")
    groups = dims.process_groups()
    assert [len(__import__("torch.distributed", fromlist=["x"]).get_process_group_ranks(g)) for g in groups] == [1]
    assert world["data_parallel"].get_group() is world["dp_shard"].get_group()
    assert world["tensor_parallel"].get_group() is world["tp"].get_group()
    assert world["data_parallel"].size() == 4 and world["tensor_parallel"].size() == 1
    assert dims.process_groups() == groups  # the names made no group


def test_keep_names_only_mesh_dimensions():
    with pytest.raises(ValueError, match=r"keep=\['fsdp'\]: only mesh dimensions"):
        ParallelDims(world_size=2).mesh_dims(keep=("fsdp",))
    assert ParallelDims(pp=2, world_size=2).mesh_dims(keep=()) == ("pp",)
    assert ParallelDims(world_size=1).mesh_dims(keep=()) == ("dp_shard",)


def test_a_layout_built_again_reuses_its_meshes_and_release_destroys_them(fake_world):
    import torch.distributed as dist
    from lightning_disttrain.parallel.mesh import release_all_meshes

    fake_world(16)
    first = ParallelDims(tp=2, pp=2, world_size=16)
    world = first.build_mesh("cpu")
    first.get_mesh("stage")
    groups = first.process_groups()
    again = ParallelDims(tp=2, pp=2, world_size=16)  # the next fit of the same layout
    assert again.build_mesh("cpu") is world and again.get_mesh("stage") is first.get_mesh("stage")
    assert again.process_groups() == groups  # nothing new
    other = ParallelDims(tp=4, world_size=16)
    other.build_mesh("cpu")
    assert all(g is not h for g in other.process_groups() for h in groups)
    first.release()  # this layout's groups, for every ParallelDims of it
    assert first.process_groups() == [] and again.process_groups() == []
    for group in groups:
        with pytest.raises(Exception):
            dist.get_process_group_ranks(group)
    others = len(other.process_groups())
    assert release_all_meshes() == others == 2 and other.process_groups() == []
    rebuilt = ParallelDims(tp=2, pp=2, world_size=16)  # a fresh mesh, fresh groups
    assert rebuilt.build_mesh("cpu") is not world and len(rebuilt.process_groups()) == 3
    release_all_meshes()
