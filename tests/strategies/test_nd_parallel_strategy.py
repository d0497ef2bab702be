"""NDParallelStrategy / FSDP2Strategy without launching processes: construction errors, the
registered names, degree resolution at Trainer construction, LightningCLI YAML resolution."""

import lightning as L
import pytest

import lightning_disttrain.strategies  # noqa: F401  (registers the names)
from lightning_disttrain.strategies import FSDP2Strategy, NDParallelStrategy


def trainer(strategy, devices=2, num_nodes=1):
    return L.Trainer(strategy=strategy, devices=devices, num_nodes=num_nodes, accelerator="cpu",
                     logger=False, enable_progress_bar=False, enable_checkpointing=False)


def test_a_degree_that_is_not_a_positive_int_fails_at_construction():
    with pytest.raises(ValueError, match=r"NDParallelStrategy\(cp=0\): a parallel degree is an int >= 1; set cp=1"):
        NDParallelStrategy(cp=0)
    with pytest.raises(ValueError, match=r"dp_shard=-2.*or -1"):
        NDParallelStrategy(dp_shard=-2)
    NDParallelStrategy(cp=2, tp=2, dp_shard=-1)  # every degree is implemented


@pytest.mark.parametrize("other, devices", [({"tp": 2}, 4), ({"pp": 2}, 4), ({"dp_replicate": 2}, 4)])
def test_expert_parallel_with_tp_pp_or_replicas_is_refused_at_trainer_construction(other, devices):
    (name, value), = other.items()
    with pytest.raises(ValueError, match=rf"ep=2 with {name}={value} is not supported yet.*set {name}=1"):
        trainer(NDParallelStrategy(ep=2, **other), devices=devices)


def test_expert_parallel_degree_must_divide_the_fsdp_ranks():
    with pytest.raises(ValueError, match=r"ep=4 must divide dp_shard\*cp = 2\*1 = 2"):
        trainer(NDParallelStrategy(ep=4), devices=2)
    s = trainer("fsdp2_ep", devices=4).strategy
    assert s.parallel_dims.ep == 2 and s.parallel_dims.dp_shard == 4


@pytest.mark.parametrize("value", [0, 1, -1, "yes"])
def test_reshard_after_forward_values(value):
    with pytest.raises(ValueError, match=r"reshard_after_forward=.*use True \(ZeRO-3\), False"):
        NDParallelStrategy(reshard_after_forward=value)


@pytest.mark.parametrize("hsdp", [(0, 2), (2,), (-1, -1), "yes"])
def test_hsdp_argument(hsdp):
    with pytest.raises(ValueError, match=r"hsdp=.*use None, 'auto' or \(replicate, shard\)"):
        FSDP2Strategy(hsdp=hsdp)


def test_registered_names():
    s = trainer("fsdp2").strategy
    assert type(s) is FSDP2Strategy and s.reshard_after_forward is True and s.hsdp is None
    assert s.parallel_dims.degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}
    s = trainer("fsdp2_zero2").strategy
    assert type(s) is FSDP2Strategy and s.reshard_after_forward is False
    assert s.is_distributed  # Lightning then syncs self.log(sync_dist=True)
    s = trainer("fsdp2_tp", devices=4).strategy
    assert type(s) is NDParallelStrategy and (s.parallel_dims.dp_shard, s.parallel_dims.tp) == (2, 2)
    assert s.tp_options.sequence_parallel and s.tp_options.loss_parallel


@pytest.mark.parametrize(("devices", "num_nodes", "split"), [
    (4, 1, (1, 4)),  # one node: shard over every rank (replicating inside a node only costs memory)
    (8, 1, (1, 8)),
    (2, 1, (1, 2)),
    (2, 2, (2, 2)),  # several nodes: replicate across nodes, shard within one
    (4, 2, (2, 4)),
])
def test_hsdp_auto_split(devices, num_nodes, split):
    dims = trainer("hsdp", devices=devices, num_nodes=num_nodes).strategy.parallel_dims
    assert (dims.dp_replicate, dims.dp_shard) == split


@pytest.mark.parametrize("value", [3, 4, 8])
def test_reshard_group_must_divide_the_shard_ranks(value):
    # 4 ranks: groups of 2 are fine; 3 does not divide 4, and a group of 4 (or more) is no group.
    assert trainer(FSDP2Strategy(reshard_after_forward=2), devices=4).strategy.reshard_after_forward == 2
    with pytest.raises(ValueError, match=rf"reshard_after_forward={value} must divide the 4 ranks.*proper divisor"):
        trainer(FSDP2Strategy(reshard_after_forward=value), devices=4)


def test_hsdp_explicit_split_with_rest():
    dims = trainer(FSDP2Strategy(hsdp=(-1, 2)), devices=4).strategy.parallel_dims
    assert (dims.dp_replicate, dims.dp_shard) == (2, 2)


def test_bad_layout_fails_at_trainer_construction():
    # Before any process is launched or any process group exists.
    with pytest.raises(ValueError, match=r"dp_replicate=3 does not divide world_size=4"):
        trainer(FSDP2Strategy(hsdp=(3, -1)), devices=4)
    with pytest.raises(ValueError, match=r"pp\*dp_replicate\*dp_shard\*cp\*tp = 1\*2\*1\*1\*1 = 2 but world_size=4"):
        trainer(NDParallelStrategy(dp_replicate=2, dp_shard=1), devices=4)
    with pytest.raises(ValueError, match=r"hsdp=\(-1, 3\): shard=3 does not divide world_size=4"):
        trainer(FSDP2Strategy(hsdp=(-1, 3)), devices=4)


def test_fp16_loss_scaling_is_refused_at_trainer_construction():
    from lightning.pytorch.plugins.precision import MixedPrecision

    with pytest.raises(ValueError, match="does not support precision='16-mixed'.*use precision='bf16-mixed'"):
        L.Trainer(strategy=FSDP2Strategy(), devices=2, accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu")])
    assert trainer(FSDP2Strategy()).strategy.world_size == 2  # other precisions construct


def test_mesh_before_setup_is_an_error():
    s = trainer("fsdp2").strategy
    with pytest.raises(RuntimeError, match="setup_environment"):
        _ = s.device_mesh


def test_transform_registry_orders_stages_and_refuses_a_second_owner_of_a_name():
    s = FSDP2Strategy(compile={"backend": "eager"})
    assert s.compile_options == {"backend": "eager"} and s.transforms.names() == []

    class Owner:
        def transform(self, module, ctx):
            pass

    a, b = Owner(), Owner()
    s.transforms.register("activation_checkpointing", a.transform, name="ac")
    s.transforms.register("dtype", lambda m, ctx: None, name="float8", owner=a)
    assert s.transforms.names() == [("dtype", "float8"), ("activation_checkpointing", "ac")]
    s.transforms.register("activation_checkpointing", a.transform, name="ac")  # setup again: idempotent
    s.transforms.register("dtype", lambda m, ctx: None, name="float8", owner=a)  # a new closure, same owner
    assert len(s.transforms.names()) == 2
    with pytest.raises(ValueError, match="named 'ac' is already registered at stage 'activation_checkpointing'"):
        s.transforms.register("activation_checkpointing", b.transform, name="ac")
    with pytest.raises(ValueError, match="unknown transform stage 'sharding'"):
        s.transforms.register("sharding", b.transform)


@pytest.mark.parametrize(("strategy_yaml", "expected"), [
    ("  strategy: fsdp2\n", (True, None, (1, 4))),
    ("  strategy: hsdp\n", (True, "auto", (1, 4))),  # one node: "auto" shards only
    ("  strategy:\n    class_path: lightning_disttrain.strategies.FSDP2Strategy\n"
     "    init_args:\n      reshard_after_forward: false\n      hsdp: [2, 2]\n", (False, (2, 2), (2, 2))),
])
def test_lightning_cli_yaml(tmp_path, strategy_yaml, expected):
    from lightning_disttrain.cli import DistTrainCLI

    config = tmp_path / "run.yaml"
    config.write_text(
        "trainer:\n" + strategy_yaml + "  devices: 4\n  accelerator: cpu\n  logger: false\n"
        "model:\n  class_path: lightning_disttrain.GPTModule\n  init_args:\n    config: tiny\n"
        "data:\n  class_path: cli_worker.RandomTokenData\n")
    cli = DistTrainCLI(args=["--config", str(config)], run=False)
    s = cli.trainer.strategy
    dims = s.parallel_dims
    assert type(s) is FSDP2Strategy
    assert (s.reshard_after_forward, s.hsdp, (dims.dp_replicate, dims.dp_shard)) == expected
