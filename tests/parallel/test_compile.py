"""Per-block torch.compile: same numbers as eager, stable FQNs, recompilations reported."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from lightning_disttrain.models.gpt import GPT, Block, GPTConfig
from lightning_disttrain.parallel.activation import apply_activation_checkpointing
from lightning_disttrain.parallel.compile import RecompileWarning, RecompileWatcher, apply_compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _blocks(n: int = 2) -> nn.ModuleList:
    torch.manual_seed(0)
    cfg = GPTConfig.from_name("tiny", vocab_size=101, n_embd=64)
    return nn.ModuleList(Block(cfg) for _ in range(n))


def _step(blocks: nn.ModuleList, seq_len: int = 16) -> torch.Tensor:
    x = torch.randn(2, seq_len, blocks[0].attn.wq.in_features, generator=torch.Generator().manual_seed(seq_len))
    h = x.requires_grad_()
    for b in blocks:
        h = b(h)
    h.square().mean().backward()
    return h.detach()


def test_inductor_blocks_match_eager():
    ref = _blocks()
    blocks = copy.deepcopy(ref)
    apply_compile(blocks)  # inductor, the default
    out, ref_out = _step(blocks), _step(ref)
    assert all(b._compiled_call_impl is not None for b in blocks)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    for (n, p), (_, q) in zip(blocks.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=n)


def test_fqns_and_state_dict_unchanged_by_compile():
    torch.manual_seed(0)
    ref = GPT(GPTConfig.from_name("tiny", vocab_size=101))
    model = copy.deepcopy(ref)
    apply_compile(model.blocks, backend="eager")
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    model(torch.randint(0, 101, (1, 8)))  # compiled now; names still the same
    assert list(model.state_dict()) == list(ref.state_dict())
    model.load_state_dict(ref.state_dict(), strict=True)


def test_compile_after_selective_checkpointing_keeps_gradients():
    # The strategy's order: AC (stage 5), then compile (stage 6) traces the SAC policy.
    ref = _blocks()
    blocks = copy.deepcopy(ref)
    apply_activation_checkpointing(blocks, policy="selective", recompute_matmuls="every_other")
    apply_compile(blocks, backend="aot_eager")
    torch.testing.assert_close(_step(blocks), _step(ref), rtol=0, atol=0)
    for p, q in zip(blocks.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_no_recompile_warning_for_fixed_shapes():
    blocks = _blocks()
    apply_compile(blocks, backend="eager")
    watcher = RecompileWatcher()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            _step(blocks, seq_len=16)
            assert watcher.check(step) == []
    assert not [w for w in caught if issubclass(w.category, RecompileWarning)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_checkpointed_blocks_compile_once(policy):
    # Checkpointing reads each block class's forward signature (the KV-cache arguments it drops):
    # filled in a module-level cache inside the compiled region, dynamo guarded on the cache and
    # recompiled the second block at step 0, which RecompileWatcher reported to users.
    blocks = _blocks()
    apply_activation_checkpointing(blocks, policy=policy)
    apply_compile(blocks, backend="eager")
    watcher = RecompileWatcher()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            _step(blocks, seq_len=16)
            assert watcher.check(step) == []
    assert not [w for w in caught if issubclass(w.category, RecompileWarning)]


def test_recompile_warning_when_sequence_length_changes():
    blocks = _blocks()
    apply_compile(blocks, backend="eager")
    watcher = RecompileWatcher()
    _step(blocks, seq_len=16)
    assert watcher.check(0) == []
    _step(blocks, seq_len=24)
    with pytest.warns(RecompileWarning, match=r"before step 1 .*size mismatch.*expected 16, actual 24"):
        [r] = watcher.check(1)
    assert not r.limit_hit and "forward" in r.function
    # dynamic=None: after one change the dim is dynamic, so a third length does not recompile.
    _step(blocks, seq_len=32)
    assert watcher.check(2) == []
    assert len(watcher.recompiles) == 1


def test_recompile_limit_is_reported_as_falling_back_to_eager():
    blocks = _blocks(1)
    apply_compile(blocks, backend="eager", dynamic=False)
    watcher = RecompileWatcher()
    with torch._dynamo.config.patch(recompile_limit=1):
        _step(blocks, seq_len=16)
        _step(blocks, seq_len=24)
    with pytest.warns(RecompileWarning, match="runs eagerly"):
        found = watcher.check()
    assert [r.limit_hit for r in found] == [True]


def test_mode_needs_inductor():
    with pytest.raises(ValueError, match="backend='inductor'"):
        apply_compile(_blocks(), backend="eager", mode="max-autotune")
