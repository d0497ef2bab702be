import math

import pytest
import torch
import torch.nn.functional as F

from lightning_disttrain.models import GPT, GPTConfig

# Published parameter counts of GPT-2 (HF transformers / nanoGPT, 50,257-token vocab, tied head).
GPT2_COUNTS = {"gpt2-124m": 124_439_808, "gpt2-350m": 354_823_168,
               "gpt2-774m": 774_030_080, "gpt2-1558m": 1_557_611_200}


@pytest.mark.parametrize("name,count", sorted(GPT2_COUNTS.items()))
def test_gpt2_parameter_counts(name, count):
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name(name))
    assert model.num_params() == count
    c = model.config
    assert c.padded_vocab_size == 50304
    # What is allocated: the 47 padding rows of the tied table on top.
    assert model.num_params(padding=True) == count + (50304 - 50257) * c.n_embd
    assert sum(p.numel() for p in model.parameters()) == model.num_params(padding=True)


def test_unpadded_vocab_is_exact_gpt2():
    with torch.device("meta"):
        model = GPT(GPTConfig.from_name("gpt2-124m", pad_vocab_multiple=1))
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_cpu_preset_sizes():
    tiny = GPT(GPTConfig.from_name("tiny", vocab_size=257))
    small = GPT(GPTConfig.from_name("small", vocab_size=257))
    assert 0.7e6 < tiny.num_params() < 1.2e6
    assert 9e6 < small.num_params() < 12e6


def test_preset_overrides_rederive_dependent_fields():
    c = GPTConfig.from_name("tiny", n_head=2, n_embd=64)
    assert c.n_kv_head == 2 and c.mlp_hidden == 256
    assert GPTConfig.from_name("tiny", mlp="swiglu").mlp_hidden == 384  # 8/3 * 128 rounded to 64


def test_unknown_preset_and_bad_shapes():
    with pytest.raises(ValueError, match="unknown GPT preset 'gpt5'.*choose one of"):
        GPTConfig.from_name("gpt5")
    with pytest.raises(ValueError, match="n_embd=100 is not a multiple of n_head=12"):
        GPTConfig(n_embd=100, n_head=12)
    with pytest.raises(ValueError, match="mlp='tanh' is unknown"):
        GPTConfig(mlp="tanh")
    with pytest.raises(ValueError, match="no field"):
        GPTConfig.from_name("tiny", n_layers=3)


def test_forward_shapes_and_padding_never_predicted():
    config = GPTConfig.from_name("tiny", vocab_size=300)  # padded to 320
    model = GPT(config)
    assert model.wte.weight.shape[0] == 320
    x = torch.randint(0, 300, (2, 17))
    logits = model(x)
    assert logits.shape == (2, 17, 320)
    assert model.trim_padding(logits).shape == (2, 17, 300)
    with pytest.raises(ValueError, match="exceeds block_size=256"):
        model(torch.zeros(1, 257, dtype=torch.long))


@pytest.mark.parametrize("overrides", [
    {},
    {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True, "tie_embeddings": False},
    {"mlp": "relu2", "n_kv_head": 2, "bias": False, "pos_emb": "rope"},
])
def test_variants_run_and_backprop(overrides):
    model = GPT(GPTConfig.from_name("tiny", vocab_size=257, **overrides))
    x = torch.randint(0, 257, (2, 16))
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert (model.lm_head.weight is model.wte.weight) == model.config.tie_embeddings


def test_causality():
    model = GPT(GPTConfig.from_name("tiny", vocab_size=257, pos_emb="rope")).eval()
    x = torch.randint(0, 257, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 257
    torch.testing.assert_close(model(x)[0, :8], model(y)[0, :8])
    assert not torch.allclose(model(x)[0, 8:], model(y)[0, 8:])


def test_gpt2_initialisation_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("small", vocab_size=257))
    std = model.config.init_std
    resid = std / math.sqrt(2 * model.config.n_layer)
    assert abs(model.blocks[0].attn.wq.weight.std().item() - std) < 0.002
    assert abs(model.blocks[0].attn.wo.weight.std().item() - resid) < 0.001
    assert abs(model.blocks[0].mlp.w2.weight.std().item() - resid) < 0.001
    assert torch.count_nonzero(model.blocks[0].attn.wq.bias) == 0
    assert torch.equal(model.ln_f.weight, torch.ones_like(model.ln_f.weight))


def test_meta_build_then_materialise_matches_eager_build():
    config = GPTConfig.from_name("tiny", vocab_size=257, pos_emb="rope")
    eager = GPT(config)
    torch.manual_seed(3)
    eager.init_weights()
    # init_weights must cover every parameter and buffer: whatever to_empty left is overwritten.
    with torch.device("meta"):
        meta = GPT(config)
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    for (n, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), n
    torch.testing.assert_close(eager.rope_cos, meta.rope_cos)


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", vocab_size=257))
    x = torch.randint(0, 257, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(60):
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, loss.item()


def test_flops_per_token_formula():
    model = GPT(GPTConfig.from_name("gpt2-124m"))
    c = model.config
    n = 85_054_464 + 50304 * 768 + 2 * 768  # blocks + padded head + final norm
    assert model.flops_per_token(1024) == 6 * n + 12 * c.n_layer * c.n_head * c.head_dim * 1024


def test_trim_logits_switch_drops_padding_columns():
    model = GPT(GPTConfig.from_name("tiny", vocab_size=300)).eval()  # padded to 320
    x = torch.randint(0, 300, (2, 9))
    padded = model(x)
    assert padded.shape == (2, 9, 320)  # the training default is unchanged
    model.trim_logits = True
    trimmed = model(x)
    assert trimmed.shape == (2, 9, 300) and trimmed.is_contiguous()
    assert torch.equal(trimmed, padded[..., :300])
    assert trimmed.view(-1, 300).shape == (18, 300)  # nanoGPT-style reshapes work on it
