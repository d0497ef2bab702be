"""Initial weights: meta materialisation with the uninitialised-tensor check, ties, device placement
under CPU offload, and the device the initial broadcast uses. One process, no process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_disttrain.parallel.fsdp import offload_safe_to_device
from lightning_disttrain.parallel.materialize import (
    init_weights,
    materialize_,
    retie_parameters,
    tied_parameters,
)

CUDA = torch.device("cuda", 0)  # never touched when the code is right: this machine has no GPU


class WithBareParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.empty(8))  # nobody initialises this after to_empty
        self.register_buffer("table", torch.empty(4))


class WithAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2)  # initialised by its private _reset_parameters
        self.norm = nn.LayerNorm(16)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight


def _meta(cls):
    with torch.device("meta"):
        return cls()


def test_uninitialised_parameters_and_buffers_are_named():
    module = _meta(WithBareParameter)
    with pytest.raises(ValueError, match=r"nothing initialised scale, table after materialisation.*Define init_weights"):
        materialize_(module, device="cpu")


def test_an_init_weights_that_misses_a_tensor_is_caught_too():
    class Partial(WithBareParameter):
        def init_weights(self):
            self.proj.reset_parameters()
            self.scale.fill_(1.0)

    with pytest.raises(ValueError, match=r"nothing initialised table after"):
        materialize_(_meta(Partial), device="cpu")


def test_torch_modules_with_private_reset_are_initialised():
    module = _meta(WithAttention)
    materialize_(module, device="cpu")
    w = module.attn.in_proj_weight
    assert torch.isfinite(w).all() and 0.05 < w.std() < 0.5  # xavier_uniform over (48, 16)
    assert torch.equal(module.attn.in_proj_bias, torch.zeros(48))
    assert torch.equal(module.norm.weight, torch.ones(16))


def test_replacing_a_parameter_counts_as_initialising_it():
    class Replaces(WithBareParameter):
        def init_weights(self):
            self.proj.reset_parameters()
            self.scale = nn.Parameter(torch.ones(8))
            self.table = torch.zeros(4)

    module = _meta(Replaces)
    materialize_(module, device="cpu")
    assert torch.equal(module.scale, torch.ones(8))


def test_a_hugging_face_model_inside_a_module_is_initialised_by_its_own_init_weights():
    transformers = pytest.importorskip("transformers")

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
            self.model = transformers.GPT2LMHeadModel(config)

    module = _meta(Wrapper)
    materialize_(module, device="cpu")
    model = module.model
    assert model.lm_head.weight is model.transformer.wte.weight  # to_empty split it; re-tied
    assert torch.isfinite(model.transformer.wte.weight).all() and model.transformer.wte.weight.std() < 0.05


def test_ties_survive_materialisation():
    module = _meta(Tied)
    assert tied_parameters(module) == [["emb.weight", "head.weight"]]
    materialize_(module, device="cpu")
    assert module.head.weight is module.emb.weight


def test_retie_restores_a_split_tie():
    module = Tied()
    groups = tied_parameters(module)
    module.head.weight = nn.Parameter(module.emb.weight.detach().clone())
    retie_parameters(module, groups)
    assert module.head.weight is module.emb.weight


def test_with_cpu_offload_parameters_are_materialised_on_the_host():
    # Sharded parameters of FSDP2 with CPUOffloadPolicy must live on the host; materialising
    # them on the GPU (as before) fails at the first forward. No buffers here: buffers go to
    # the GPU, which this machine does not have.
    module = _meta(Tied)
    materialize_(module, device="cpu", buffer_device=CUDA)
    assert all(p.device.type == "cpu" for p in module.parameters())


def test_with_cpu_offload_only_buffers_move_to_the_device():
    module = Tied()
    offload_safe_to_device(module, CUDA, cpu_offload=True)  # would raise if it moved any parameter
    assert all(p.device.type == "cpu" for p in module.parameters())
    with pytest.raises((RuntimeError, AssertionError)):  # without offload the whole module moves
        offload_safe_to_device(module, CUDA, cpu_offload=False)


def test_the_strategy_does_not_move_offloaded_parameters_to_the_gpu():
    from lightning_disttrain.strategies import NDParallelStrategy

    strategy = NDParallelStrategy(cpu_offload=True, parallel_devices=[CUDA])
    strategy.model = Tied()
    strategy.model_to_device()  # before the fix: module.to(cuda:0) -> "Torch not compiled with CUDA"
    assert all(p.device.type == "cpu" for p in strategy.model.parameters())


def test_generic_modules_are_initialised_by_name_not_by_draw_order():
    # A pipeline stage that keeps only block "b" must give it the values the whole model gives it
    # (one global stream gave it the values of block "a": the first draws of the stream).
    torch.manual_seed(0)
    with torch.device("meta"):
        whole = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
        part = nn.ModuleDict({"b": nn.Linear(4, 4)})
    materialize_(whole, "cpu")
    materialize_(part, "cpu")
    assert torch.equal(part["b"].weight, whole["b"].weight) and torch.equal(part["b"].bias, whole["b"].bias)
    assert not torch.equal(whole["a"].weight, whole["b"].weight)


def test_init_weights_without_meta_is_a_plain_reinitialisation():
    module = Tied()
    before = module.emb.weight.detach().clone()
    init_weights(module)
    assert not torch.equal(before, module.emb.weight) and module.head.weight is module.emb.weight


def test_materialising_leaves_torchmetrics_states_alone():
    # to_empty on the whole LightningModule reached its torchmetrics Metrics, whose _apply replaced
    # their states and the defaults reset() restores with torch.empty memory: validation losses
    # were garbage (differently on every run) once the meta device became the default (issue 38).
    from torchmetrics import MeanMetric

    class WithMetric(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.metric = MeanMetric()

    with torch.device("meta"):
        module = WithMetric()
    module.metric = MeanMetric()  # built outside the meta build, as a LightningModule's __init__ does
    state = module.metric.mean_value
    materialize_(module, device="cpu")
    assert module.metric.mean_value is state and torch.equal(state, torch.tensor(0.0))
    module.metric.update(torch.tensor(2.0))
    module.metric.reset()
    module.metric.update(torch.tensor(3.0))
    assert module.metric.compute() == 3.0
