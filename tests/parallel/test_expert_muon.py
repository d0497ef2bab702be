"""Muon on the routed experts' stacks (``parallel.expert_muon.ExpertMuon``, issue 41): each expert's
matrix updated exactly as ``torch.optim.Muon`` updates a 2-D parameter of that shape (the same
bits), stacks split along their experts only, and ``build_optimizer``'s parts for a mixture of
experts. Under expert parallel through the Trainer: tests/strategies/test_muon_fsdp2.py."""

from __future__ import annotations

import inspect

import pytest
import torch

from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.optim import build_optimizer
from lightning_disttrain.parallel.expert_muon import DEFAULTS, ExpertMuon, expert_layout_problem
from lightning_disttrain.parallel.muon import ShardedMuon

KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")


def test_the_defaults_are_torchs_muons():
    signature = inspect.signature(torch.optim.Muon.__init__).parameters
    assert {k: signature[k].default for k in DEFAULTS} == DEFAULTS


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(3, 8, 5), (2, 4, 12), (1, 6, 6)])
def test_each_expert_is_updated_as_torchs_muon_updates_its_matrix(shape, nesterov):
    torch.manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(shape))
    matrices = [torch.nn.Parameter(stack.detach()[e].clone()) for e in range(shape[0])]
    ours, torchs = ExpertMuon([stack], nesterov=nesterov, **KW), torch.optim.Muon(matrices, nesterov=nesterov, **KW)
    for step in range(4):
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(step))
        stack.grad = grad.clone()
        for e, m in enumerate(matrices):
            m.grad = grad[e].clone()
        ours.step()
        torchs.step()
        assert torch.equal(stack.detach(), torch.stack([m.detach() for m in matrices]))  # to the bit
    assert torch.equal(ours.state[stack]["momentum_buffer"],
                       torch.stack([torchs.state[m]["momentum_buffer"] for m in matrices]))


def test_stacks_split_inside_a_matrix_are_refused(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    one_rank_mesh = init_device_mesh("cpu", (1,))
    assert expert_layout_problem(torch.zeros(4, 3)) is not None  # not a stack
    along = distribute_tensor(torch.zeros(4, 6, 3), one_rank_mesh, [Shard(0)])
    inside = distribute_tensor(torch.zeros(4, 6, 3), one_rank_mesh, [Shard(1)])
    assert expert_layout_problem(along) is None
    assert "split along their experts only" in expert_layout_problem(inside)
    with pytest.raises(ValueError, match="split along their experts only"):
        ExpertMuon([torch.nn.Parameter(inside)], **KW)


def test_a_mixture_of_experts_trains_its_stacks_with_expert_muon():
    model = GPT(GPTConfig.from_name("tiny-moe", vocab_size=64, n_layer=2))
    optimizer = build_optimizer(model, "muon", **{k: v for k, v in KW.items() if k == "weight_decay"})
    muon, experts, adamw = optimizer.optimizers
    assert (type(muon), type(experts), type(adamw)) == (ShardedMuon, ExpertMuon, torch.optim.AdamW)
    stacks = {n for n, p in model.named_parameters() if p.dim() == 3}
    assert stacks and {id(p) for g in experts.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if n in stacks}
    dense = build_optimizer(GPT(GPTConfig.from_name("tiny", vocab_size=64, n_layer=1)), "muon")
    assert [type(p) for p in dense.optimizers] == [ShardedMuon, torch.optim.AdamW]  # no experts: no part for them


def test_a_hidden_matrices_choice_that_is_not_a_matrix_fails_at_setup():
    model = GPT(GPTConfig.from_name("tiny", vocab_size=64, n_layer=1))
    with pytest.raises(ValueError, match=r"not matrices \(first 'blocks.0.attn_norm.weight' of shape \(128,\)\)"):
        build_optimizer(model, "muon", hidden_matrices=lambda n, p: n.startswith("blocks."))
