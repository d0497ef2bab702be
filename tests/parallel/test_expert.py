"""Expert parallel pieces in one process: the bad-input errors (before any collective), the
dispatch over a 1-rank ``ep`` mesh against the local one, and what selective activation
checkpointing does with the all-to-alls. The 2- and 4-rank training parity runs are in
tests/strategies/test_moe_fsdp2.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_disttrain.models.gpt import GPTConfig
from lightning_disttrain.models.moe import MoE, MoEConfig
from lightning_disttrain.parallel.activation import ActivationCheckpointConfig, checkpoint_block
from lightning_disttrain.parallel.expert import check_ep, shard_experts
from lightning_disttrain.parallel.mesh import ParallelDims

A2A = torch.ops._c10d_functional.all_to_all_single.default


def _layer(seed=0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(MoEConfig(dim=16, hidden=16, num_experts=4, top_k=2, shared_experts=1))
    layer.init_weights(0.2, 0.2)
    for linear in (layer.router, layer.shared.w1, layer.shared.w2, layer.shared.w3):
        torch.nn.init.normal_(linear.weight, std=0.2)
    return layer


def test_bad_expert_parallel_input_names_the_fix():
    with pytest.raises(ValueError, match=r"ep=3 does not divide num_experts=4"):
        check_ep(3, [_layer()])
    with pytest.raises(ValueError, match=r"ep=2 but the model has no mixture-of-experts layers; set ep=1"):
        check_ep(2, [])
    with pytest.raises(ValueError, match=r"ep=3 does not divide moe_num_experts=4"):
        ParallelDims(ep=3, world_size=3).validate_for_model(GPTConfig(n_layer=2, moe_num_experts=4))
    with pytest.raises(ValueError, match=r"ep=2 but the model has no mixture-of-experts layers \(moe_num_experts=0\)"):
        ParallelDims(ep=2, world_size=2).validate_for_model(GPTConfig(n_layer=2))
    with pytest.raises(ValueError, match=r"top_k=5 must be between 1 and .*num_experts=4"):
        MoEConfig(dim=16, hidden=16, num_experts=4, top_k=5)


@pytest.fixture
def ep_mesh(one_rank_group):
    return init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))


class CountA2A(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is A2A
        return func(*args, **(kwargs or {}))


def _backward_all_to_alls(layer: MoE, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    out = layer(x)
    with CountA2A() as mode:
        out.square().sum().backward()
    return mode.count, out


def test_ep_dispatch_and_what_checkpointing_recomputes(ep_mesh):
    ref = _layer()
    x = torch.randn(2, 6, 16, requires_grad=True)  # as inside a network: both all-to-alls need gradients
    expected = ref(x)
    expected.square().sum().backward()

    counts = {}
    for policy in ("none", "selective", "full"):
        layer = copy.deepcopy(ref)
        layer.zero_grad()
        shard_experts([layer], ep_mesh)
        assert isinstance(layer.experts.w1, DTensor)
        if policy != "none":
            checkpoint_block(layer, ActivationCheckpointConfig(policy=policy))
        counts[policy], out = _backward_all_to_alls(layer, x)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        for name, p in layer.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, dict(ref.named_parameters())[name].grad, rtol=0, atol=1e-5)
    # backward sends the gradients of the dispatch and the combine back: two all-to-alls
    assert counts["none"] == 2
    # selective keeps the forward's all-to-all outputs: the recomputation communicates nothing
    assert counts["selective"] == counts["none"]
    # a full recompute repeats the forward's three (counts, dispatch, combine)
    assert counts["full"] == counts["none"] + 3


def test_expert_parallel_layer_compiles(ep_mesh):
    # Under ep the all-to-all split sizes are host integers: the compiled layer breaks the graph
    # there (one sync per MoE layer, as in eager) and gives the eager results.
    ref = _layer()
    x = torch.randn(2, 6, 16, requires_grad=True)
    expected = ref(x)
    layer = copy.deepcopy(ref)
    shard_experts([layer], ep_mesh)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count >= 1
    torch._dynamo.reset()
    out = torch.compile(layer, backend="aot_eager")(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    out.square().sum().backward()
    assert layer.experts.w1.grad is not None
