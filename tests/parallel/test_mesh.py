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
