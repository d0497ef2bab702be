"""`plan --optimizer muon` (issue 41): Muon's optimizer state and its step priced from the matrices
the optimizer really takes, and the Newton-Schulz FLOPs from the iteration the package runs."""

from __future__ import annotations

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from lightning_disttrain.cli import main
from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.optim import build_optimizer
from lightning_disttrain.parallel.muon import newton_schulz
from lightning_disttrain.planning import Cluster, Layout, Workload, config_for, memory_per_gpu, shape_of
from lightning_disttrain.planning.memory import STATE_BYTES
from lightning_disttrain.planning.planner import muon_params
from lightning_disttrain.planning.throughput import step_terms

TINY_LLAMA = dict(mlp="swiglu", norm="rmsnorm", pos_emb="rope", bias=False, n_kv_head=2)


def test_the_plan_counts_the_matrices_build_optimizer_gives_muon():
    config = GPTConfig.from_name("tiny", vocab_size=257, **TINY_LLAMA)
    shape = shape_of(config, 64)
    torch.manual_seed(0)
    optimizer = build_optimizer(GPT(config), "muon")
    muon = optimizer.optimizers[0]
    taken = sum(p.numel() for group in muon.param_groups for p in group["params"])
    assert muon_params(shape) == taken > 0
    # q, k and v (2 K/V heads of 32), the output projection, SwiGLU's w1, w2, w3
    assert shape.layer_matrices[0] == ((128, 128), (64, 128), (64, 128), (128, 128), (384, 128), (128, 384),
                                       (384, 128))


def test_with_experts_the_plan_counts_the_stacks_expert_muon_takes():
    config = GPTConfig.from_name("tiny-moe", vocab_size=257)
    shape = shape_of(config, 64)
    torch.manual_seed(0)
    parts = build_optimizer(GPT(config), "muon").optimizers
    taken = sum(p.numel() for part in parts[:-1] for group in part.param_groups for p in group["params"])
    assert muon_params(shape) == taken and shape.expert_params > 0
    cluster = Cluster("H100 SXM", 8, 1)
    layout = Layout(dp_shard=8, ep=2, zero=3)
    adamw = memory_per_gpu(shape, layout, Workload(64, 8, 1, "bf16"), cluster)
    muon = memory_per_gpu(shape, layout, Workload(64, 8, 1, "bf16", optimizer="muon"), cluster)
    half = STATE_BYTES["bf16"].moments / 2
    dense = sum(shape.muon_params_of_layer(i) for i in range(shape.n_layer))
    # dense matrices sharded over 8, each rank's experts (ep=2) over the other 4
    assert adamw.optimizer - muon.optimizer == pytest.approx(dense * half / 8 + shape.expert_params / 2 * half / 4)


def test_the_experts_newton_schulz_is_priced_on_the_experts_a_rank_holds():
    from lightning_disttrain.planning.model_shape import newton_schulz_flops
    from lightning_disttrain.planning.throughput import expert_newton_schulz_flops

    shape = shape_of(GPTConfig.from_name("tiny-moe", vocab_size=257), 64)  # 4 experts in layers 1-3, gelu (2 matrices)
    per_expert = 2 * newton_schulz_flops(shape.moe_hidden, shape.n_embd)
    layers = range(shape.n_layer)
    assert expert_newton_schulz_flops(shape, layers, Layout(dp_shard=1)) == 3 * 4 * per_expert
    assert expert_newton_schulz_flops(shape, layers, Layout(dp_shard=2, ep=2, zero=3)) == 3 * 2 * per_expert
    assert expert_newton_schulz_flops(shape, layers, Layout(dp_shard=8, ep=2, zero=3)) == 3 * 1 * per_expert
    dense = shape_of(GPTConfig.from_name("tiny", vocab_size=257), 64)
    assert expert_newton_schulz_flops(dense, range(dense.n_layer), Layout(dp_shard=2)) == 0


@pytest.mark.parametrize("rows, cols", [(64, 96), (96, 64), (48, 48)])
def test_newton_schulz_flops_are_what_the_iteration_runs(rows, cols):
    shape = shape_of(GPTConfig.from_name("tiny", vocab_size=257), 64)
    one = type(shape)(**{**shape.__dict__, "layer_matrices": (((rows, cols),),)})
    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.randn(rows, cols), (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
    assert counter.get_total_flops() == one.newton_schulz_flops_of_layer(0)


def test_muon_state_is_one_momentum_per_matrix_element_sharded_as_adamws():
    shape = shape_of(config_for("llama3-8b"), 8192)
    cluster = Cluster("H100 SXM", 8, 1)
    layout = Layout(dp_shard=8, zero=3, ac="selective")
    adamw = memory_per_gpu(shape, layout, Workload(8192, 64, 1, "bf16"), cluster)
    muon = memory_per_gpu(shape, layout, Workload(8192, 64, 1, "bf16", optimizer="muon"), cluster)
    saved = muon_params(shape) * STATE_BYTES["bf16"].moments / 2 / 8  # 4 B of the 8, over 8 ranks
    assert adamw.optimizer - muon.optimizer == pytest.approx(saved)
    assert (adamw.params, adamw.grads, adamw.activations) == (muon.params, muon.grads, muon.activations)
    assert 0.8 < muon_params(shape) / shape.params < 0.95  # the blocks' matrices: most of an 8B model


def test_the_muon_step_is_split_over_the_shards_and_the_tensor_parallel_ranks():
    shape = shape_of(config_for("llama3-8b"), 8192)
    cluster = Cluster("H100 SXM", 8, 1)
    workload = Workload(8192, 64, 1, "bf16", optimizer="muon")
    fsdp = step_terms(shape, Layout(dp_shard=8, zero=3), workload, cluster).terms["muon"]
    fsdp4 = step_terms(shape, Layout(dp_shard=4, zero=3), workload, cluster).terms["muon"]
    tp = step_terms(shape, Layout(dp_shard=4, tp=2, zero=3), workload, cluster).terms["muon"]
    adamw = step_terms(shape, Layout(dp_shard=8, zero=3), Workload(8192, 64, 1, "bf16"), cluster).terms
    assert adamw["muon"] == 0.0
    ns = sum(shape.newton_schulz_flops_of_layer(i) for i in range(shape.n_layer))
    assert fsdp == pytest.approx(ns / 8 / (989e12 * 0.4), rel=0.1)  # Newton-Schulz dominates; the all-to-alls are small
    assert fsdp4 == pytest.approx(2 * fsdp, rel=0.1)
    # ShardedMuon under TP: the 8 ranks of dp_shard=4 x tp=2 split the work as dp_shard=8's do (plus a tp exchange)
    assert tp == pytest.approx(fsdp, rel=0.1) and tp < 0.7 * fsdp4
    hsdp = step_terms(shape, Layout(dp_replicate=2, dp_shard=4, zero=3), workload, Cluster("H100 SXM", 4, 2)).terms
    assert hsdp["muon"] == pytest.approx(fsdp, rel=0.3)  # the work split over both replicas too, not repeated
    assert hsdp["muon"] < 0.7 * fsdp4


@pytest.mark.parametrize("ranks", [1, 3, 8, 64, 1024])
def test_the_owner_plan_spreads_the_work_within_the_largest_matrix(ranks):
    from lightning_disttrain.parallel.muon import newton_schulz_cost, owner_plan

    shapes = [m for layer in shape_of(config_for("llama3-8b"), 8192).layer_matrices for m in layer]
    owners = owner_plan(shapes, ranks)
    load = [0] * ranks
    for s, o in zip(shapes, owners):
        load[o] += newton_schulz_cost(s)
    largest, total = max(map(newton_schulz_cost, shapes)), sum(map(newton_schulz_cost, shapes))
    assert sum(load) == total and max(load) <= total / ranks + largest
    if ranks >= len(shapes):  # 224 matrices: each on a rank of its own, the busiest one holds the largest
        assert len(set(owners)) == len(shapes) and max(load) == largest


def test_at_1024_ranks_the_muon_step_is_priced_on_the_busiest_owner_not_the_mean():
    # llama3-70b: 560 matrices over 1,024 ranks: the busiest rank orthogonalises a whole MLP matrix
    # (8192 x 28672), far above the mean (total / 1,024), and receives and sends that whole matrix
    from lightning_disttrain.planning.model_shape import newton_schulz_flops
    from lightning_disttrain.planning.throughput import busiest_muon_owner

    shape = shape_of(config_for("llama3-70b"), 8192)
    layers = range(shape.n_layer)
    total = sum(shape.newton_schulz_flops_of_layer(i) for i in layers)
    flops, elements = busiest_muon_owner(shape, layers, 1024)
    assert (flops, elements) == (newton_schulz_flops(8192, 28672), 8192 * 28672)
    assert flops > 3 * total / 1024
    flops64, _ = busiest_muon_owner(shape, layers, 64)
    assert total / 64 <= flops64 <= total / 64 + newton_schulz_flops(8192, 28672)
    cluster, workload = Cluster("H100 SXM", 8, 128), Workload(8192, 1024, 1, "bf16", optimizer="muon")
    muon = step_terms(shape, Layout(dp_shard=128, tp=8, zero=3), workload, cluster).terms["muon"]
    assert muon > flops / (989e12 * 0.4)  # the busiest owner's iteration, then its exchanges


def test_plan_with_muon_prints_and_writes_it(tmp_path, capsys):
    path = tmp_path / "muon.yaml"
    args = ["plan", "--model", "tiny", "--override", "vocab_size=257", "--gpu", "cpu", "--gpu-memory", "1",
            "--seq-len", "64", "--global-batch", "8", "--micro-batch", "2", "--precision", "fp32",
            "--gpus-per-node", "2", "--optimizer", "muon", "--write-config", str(path)]
    main(args)
    out = capsys.readouterr().out
    assert "fp32, optimizer muon" in out
    assert yaml.safe_load(path.read_text())["model"]["init_args"]["optimizer"] == "muon"
    with pytest.raises(SystemExit):
        main([*args[:-2], "--optimizer", "lion"])
    assert "invalid choice: 'lion'" in capsys.readouterr().err


def test_an_unknown_optimizer_in_a_workload_is_refused():
    with pytest.raises(ValueError, match="optimizer='sgd' is unknown; use one of"):
        Workload(64, 8, optimizer="sgd")
