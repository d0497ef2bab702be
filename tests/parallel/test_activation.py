"""Activation checkpointing mechanics: exact gradients, memory ordering, what gets recomputed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.parallel.activation import (
    activation_bytes,
    apply_activation_checkpointing,
    checkpoint_config_of,
    remove_activation_checkpointing,
)

import hf_models  # tests/ is on sys.path (conftest.py)

CONFIGS = {
    "none": dict(policy="none"),
    "selective": dict(policy="selective"),
    "selective_every_other": dict(policy="selective", recompute_matmuls="every_other"),
    "block_k2": dict(policy="block", every_k=2),
    "full": dict(policy="full"),
}


def _gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_name("tiny", vocab_size=101, **overrides))


def _batch() -> torch.Tensor:
    return torch.randint(0, 101, (2, 32), generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def _grads(model: nn.Module, idx: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = _loss(model, idx)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


class _OpLog(TorchDispatchMode):
    """Every aten op run, tagged with the phase ("forward" / "backward") it ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.ops: list[tuple[str, object, torch.Size | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shape = out.shape if isinstance(out, torch.Tensor) else None
        self.ops.append((self.phase, func, shape))
        return out

    def count(self, phase: str | None, pred) -> int:
        return sum(1 for ph, f, _ in self.ops if (phase is None or ph == phase) and pred(f))


def _is_attention_forward(func) -> bool:
    # Judged by name, independently of the op set the policy uses: every fused SDPA forward.
    name = str(func)
    return name.startswith("aten._scaled_dot_product") and "backward" not in name


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_equal_the_unchecked_run_exactly(name):
    idx = _batch()
    ref_loss, ref = _grads(_gpt(), idx)
    model = _gpt()
    chosen = apply_activation_checkpointing(model.blocks, **CONFIGS[name])
    assert chosen == {"none": [], "block_k2": [0, 2]}.get(name, [0, 1, 2, 3])
    loss, grads = _grads(model, idx)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref.keys()
    for n in ref:
        assert torch.equal(grads[n], ref[n]), n


def test_dropout_masks_replay_in_recomputation():
    # preserve_rng_state=True: the recomputed forward draws the same dropout masks.
    idx = _batch()
    ref_loss, ref = _grads(_gpt(dropout=0.2), idx, seed=3)
    for cfg in (CONFIGS["selective"], CONFIGS["full"]):
        model = _gpt(dropout=0.2)
        apply_activation_checkpointing(model.blocks, **cfg)
        loss, grads = _grads(model, idx, seed=3)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[n], ref[n]) for n in ref), cfg


def test_saved_activation_bytes_are_ordered():
    idx = _batch()
    saved = {}
    for name, cfg in CONFIGS.items():
        model = _gpt()
        apply_activation_checkpointing(model.blocks, **cfg)
        loss, saved[name] = activation_bytes(lambda: _loss(model, idx))
        loss.backward()  # the measured graph is a real one
    assert saved["none"] > saved["selective"] > saved["selective_every_other"] > saved["full"]
    assert saved["none"] > saved["block_k2"] > saved["full"]
    # Full AC keeps about one block input per block: 4 x (2 x 32 x 128 fp32) plus embedding/head.
    block_input = 2 * 32 * 128 * 4
    assert saved["full"] < saved["none"] / 4
    assert saved["full"] >= 4 * block_input


@pytest.mark.parametrize("name,per_block", [
    ("none", 1), ("selective", 1), ("selective_every_other", 1), ("full", 2)])
def test_attention_forward_runs_once_per_block_under_selective(name, per_block):
    model = _gpt()
    n_layer = len(model.blocks)
    apply_activation_checkpointing(model.blocks, **CONFIGS[name])
    log = _OpLog()
    with log:
        loss = _loss(model, _batch())
        log.phase = "backward"
        loss.backward()
    assert log.count("forward", _is_attention_forward) == n_layer
    assert log.count(None, _is_attention_forward) == per_block * n_layer
    if name.startswith("selective"):
        assert log.count("backward", _is_attention_forward) == 0


def test_block_policy_recomputes_attention_of_the_chosen_blocks_only():
    model = _gpt()
    apply_activation_checkpointing(model.blocks, policy="block", every_k=2)
    log = _OpLog()
    with log:
        loss = _loss(model, _batch())
        log.phase = "backward"
        loss.backward()
    assert log.count("backward", _is_attention_forward) == 2  # blocks 0 and 2 of 4


class _Chain(nn.Module):
    """Three Linears (an odd count) of distinct widths, so a recomputed matmul tells which it was."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 9), nn.Linear(9, 10), nn.Linear(10, 8)

    def forward(self, x):
        return x + self.l3(F.gelu(self.l2(F.gelu(self.l1(x)))))


def test_every_other_recomputes_the_same_matmuls_in_every_block_and_step():
    # "Every other" must count per block and per forward. With 3 matmuls a block, a counter that
    # ran on across blocks (or steps) would recompute l1 in the second block, not l2.
    torch.manual_seed(0)
    ref_blocks = nn.ModuleList(_Chain() for _ in range(3))
    blocks = copy.deepcopy(ref_blocks)
    apply_activation_checkpointing(blocks, policy="selective", recompute_matmuls="every_other")
    x = torch.randn(5, 8)

    def run(mods, log=None):
        h = x
        for m in mods:
            h = m(h)
        if log is not None:
            log.phase = "backward"
        h.square().sum().backward()

    for step in range(2):
        for m in (ref_blocks, blocks):
            m.zero_grad(set_to_none=True)
        run(ref_blocks)
        log = _OpLog()
        with log:
            run(blocks, log)
        # An addmm in backward is a recomputed Linear forward (gradients use mm). The 2nd matmul,
        # l2 (width 10), is recomputed in every block; l1 and l3 are kept (l3's output is not
        # needed by backward at all, so it would not be recomputed even if dropped).
        recomputed = [shape[-1] for ph, f, shape in log.ops
                      if ph == "backward" and f is torch.ops.aten.addmm.default]
        assert recomputed == [10, 10, 10], (step, recomputed)
        for a, b in zip(ref_blocks.parameters(), blocks.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)


def test_fqns_state_dict_and_parameters_unchanged():
    ref = _gpt()
    model = _gpt()
    params_before = list(model.named_parameters())
    apply_activation_checkpointing(model.blocks, policy="selective")
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in params_before]
    assert [n for n, _ in model.named_modules()] == [n for n, _ in ref.named_modules()]
    model.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(model.state_dict(), strict=True)


def test_deepcopy_checkpoints_the_copy_with_its_own_weights():
    model = _gpt()
    apply_activation_checkpointing(model.blocks, policy="full")
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.blocks.parameters():
            p.mul_(0.5)
    _loss(clone, _batch()).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in clone.blocks.parameters())
    assert checkpoint_config_of(clone.blocks[0]).policy == "full"


def test_no_grad_forward_is_unchanged():
    ref, model = _gpt(), _gpt()
    apply_activation_checkpointing(model.blocks, policy="selective")
    with torch.no_grad():
        assert torch.equal(model(_batch()), ref(_batch()))


def test_remove_and_reapply():
    model = _gpt()
    apply_activation_checkpointing(model.blocks, policy="full")
    with pytest.raises(ValueError, match="remove_activation_checkpointing"):
        apply_activation_checkpointing(model.blocks, policy="selective")
    remove_activation_checkpointing(model.blocks)
    assert all(checkpoint_config_of(b) is None and "forward" not in vars(b) for b in model.blocks)
    apply_activation_checkpointing(model.blocks, policy="selective")
    assert checkpoint_config_of(model.blocks[1]).policy == "selective"


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy="op"), "policy='op' is unknown"),
    (dict(policy="block", every_k=0), "every_k=0"),
    (dict(policy="selective", recompute_matmuls="half"), "recompute_matmuls='half' is unknown"),
    (dict(policy="full", recompute_matmuls="every_other"), "only applies to policy='selective'"),
])
def test_invalid_options_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_activation_checkpointing(_gpt().blocks, **kwargs)


# ---- third-party model code: Hugging Face decoder layers -------------------------------------


def _hf_grads(model: nn.Module, x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, dict, object]:
    # Called as a user's module calls it: no use_cache argument, so the config's use_cache=True
    # holds and the model hands every layer a KV cache to write.
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=x)
    loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("name", ["selective", "selective_every_other", "full"])
def test_hugging_face_layers_get_the_unchecked_gradients(arch, name):
    # Selective used to fail in backward on GPT-2 ("aten.slice.Tensor encountered during
    # backward but not found in storage"): the recomputation wrote the KV cache a second time.
    build = {"gpt2": lambda: hf_models.gpt2(dropout=0.1), "llama": hf_models.llama}[arch]
    x = torch.randint(0, hf_models.VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = build()
    model = copy.deepcopy(ref)
    ref_loss, ref_grads, _ = _hf_grads(ref, x)
    blocks = hf_models.blocks_of(model)
    assert apply_activation_checkpointing(blocks, **CONFIGS[name]) == list(range(len(blocks)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads, out = _hf_grads(model, x)
    assert torch.equal(loss, ref_loss)
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n
    # Checkpointed layers ran without the cache, and said so.
    assert hf_models.kv_cache(out).get_seq_length() == 0
    assert any("KV cache" in str(w.message) for w in caught)


def test_hugging_face_layers_keep_the_cache_without_gradients():
    # Generation (no_grad) is not checkpointed: the cache fills as in the unchecked model.
    model = hf_models.gpt2()
    apply_activation_checkpointing(hf_models.blocks_of(model), policy="selective")
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 5, dtype=torch.long))
    assert hf_models.kv_cache(out).get_seq_length() == 5


def test_attention_is_not_recomputed_in_hugging_face_layers():
    model = hf_models.llama()
    apply_activation_checkpointing(hf_models.blocks_of(model), policy="selective")
    log = _OpLog()
    x = torch.randint(0, hf_models.VOCAB, (2, 32))
    with log:
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), x.flatten())
        log.phase = "backward"
        loss.backward()
    assert log.count("forward", _is_attention_forward) == 2
    assert log.count("backward", _is_attention_forward) == 0
    assert log.count("backward", lambda f: f is torch.ops.aten.mm.default) > 0  # backward ran
