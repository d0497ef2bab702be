"""A healing replica group's received state, rebuilt on the receiving rank's tensors
(``fault_tolerance/state.py``): its own mesh objects and devices, the moments on the parameters,
Adam's step left to the optimizer; a shard of another layout refused. One process, a 1-rank mesh."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_disttrain.fault_tolerance.state import like, model_state_here, optimizer_state_here


@pytest.fixture
def mesh(one_rank_group):
    return init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))


def test_received_dtensors_land_on_this_ranks_mesh(mesh):
    module = torch.nn.Linear(4, 3, bias=False)
    module.weight = torch.nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))
    sent = {k: v.detach().clone() for k, v in module.state_dict().items()}
    sent["weight"] = pickle.loads(pickle.dumps(sent["weight"]))  # as it arrives: unpickled, a copy of the mesh
    sent["weight"].to_local().add_(1.0)
    here = model_state_here(sent, module)
    assert isinstance(here["weight"], DTensor) and here["weight"].device_mesh is module.weight.device_mesh
    assert here["weight"].placements == module.weight.placements
    assert torch.equal(here["weight"].to_local(), sent["weight"].to_local())
    module.load_state_dict(here)
    assert torch.equal(module.weight.to_local(), sent["weight"].to_local())

    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module.weight.grad = distribute_tensor(torch.ones(3, 4), mesh, [Shard(0)])
    optimizer.step()
    received = pickle.loads(pickle.dumps(optimizer.state_dict()))
    fresh = torch.optim.AdamW(module.parameters(), lr=0.1)  # a joiner: no state yet
    moved = optimizer_state_here(received, fresh)
    weight_index = [id(p) for p in module.parameters()].index(id(module.weight))
    moment = moved["state"][weight_index]["exp_avg"]
    assert isinstance(moment, DTensor) and moment.device_mesh is module.weight.device_mesh
    assert moved["state"][weight_index]["step"] is received["state"][weight_index]["step"]
    fresh.load_state_dict(moved)
    fresh.step()  # the moments and the parameters meet in one foreach kernel


def test_a_shard_of_another_layout_is_refused(mesh):
    mine = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"received a shard of shape \(3, 2\) where this rank holds \(4, 2\): every "
                                         r"replica group must use the same layout"):
        like(torch.zeros(3, 2), mine)
    plain = like(torch.ones(2), torch.zeros(2))
    assert plain.device == torch.device("cpu") and torch.equal(plain, torch.ones(2))


def test_the_parts_of_a_hybrid_optimizer_land_on_this_ranks_mesh(mesh):
    from lightning_disttrain.optim import HybridOptimizer

    a, b = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2, bias=False)
    for m in (a, b):
        m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0)]))
        m.weight.grad = distribute_tensor(torch.ones_like(m.weight.full_tensor()), mesh, [Shard(0)])
    hybrid = HybridOptimizer([torch.optim.AdamW([a.weight], lr=0.1), torch.optim.SGD([b.weight], lr=0.1, momentum=0.9)])
    hybrid.step()
    received = pickle.loads(pickle.dumps(hybrid.state_dict()))
    moved = optimizer_state_here(received, hybrid)
    assert moved["optimizers"][0]["state"][0]["exp_avg"].device_mesh is a.weight.device_mesh
    assert moved["optimizers"][1]["state"][0]["momentum_buffer"].device_mesh is b.weight.device_mesh
    hybrid.load_state_dict(moved)
    hybrid.step()


def test_a_healed_group_gets_muons_state_and_steps_as_the_group_it_came_from(mesh):
    # Muon's parts (the matrices' ShardedMuon, a mixture of experts' ExpertMuon) and AdamW, their
    # state sent as a heal sends it (pickled) to a joiner with fresh optimizers: the next step of the
    # joiner equals the sender's to the bit
    from torch.distributed.fsdp import fully_shard

    from lightning_disttrain.models.gpt import GPT, GPTConfig
    from lightning_disttrain.optim import build_optimizer

    def build():
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_name("tiny-moe", vocab_size=64, n_layer=2, n_embd=32, n_head=2, moe_hidden=16))
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, build_optimizer(model, "muon")

    def train_step(model, optimizer, seed):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    sender, sender_opt = build()
    for seed in range(2):
        train_step(sender, sender_opt, seed)
    assert [type(p).__name__ for p in sender_opt.optimizers] == ["ShardedMuon", "ExpertMuon", "AdamW"]
    joiner, joiner_opt = build()
    joiner.load_state_dict(model_state_here(pickle.loads(pickle.dumps(sender.state_dict())), joiner))
    received = pickle.loads(pickle.dumps(sender_opt.state_dict()))
    joiner_opt.load_state_dict(optimizer_state_here(received, joiner_opt))
    for part in joiner_opt.optimizers[:2]:
        assert all(isinstance(s["momentum_buffer"], DTensor) and s["momentum_buffer"].device_mesh is mesh
                   for s in part.state.values())
    train_step(sender, sender_opt, 2)
    train_step(joiner, joiner_opt, 2)
    for (name, a), b in zip(sender.state_dict().items(), joiner.state_dict().values()):
        full = [t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b)]
        assert torch.equal(*full), name


def test_a_heal_waits_for_the_captured_steps_device_work_before_serving_it():
    # torchft copies the captured tensors on a stream of its own: on a GPU the last optimizer
    # step's kernels may still be queued at capture, so _ft_state waits for the event recorded
    # there. On the host the work is done when it returns: no marker.
    from lightning_disttrain.strategies.fault_tolerant_steps import FaultTolerantStepMixin, work_done_marker

    assert work_done_marker(torch.device("cpu")) is None

    class Event:  # stands in for the CUDA event (no GPU here): records whether it was waited on
        waited = False

        def synchronize(self):
            self.waited = True

    strategy = FaultTolerantStepMixin()
    strategy._ft_capture, strategy._ft_capture_ready = {"model": {}}, Event()
    assert strategy._ft_state() == {"model": {}} and strategy._ft_capture_ready.waited
