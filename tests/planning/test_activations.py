"""The planner's activation terms: from the GPTConfig fields the model uses, per checkpointing
policy by the package's own names, by hand and against what the model really keeps on CPU."""

import pytest
import torch

from lightning_disttrain.models.gpt import Block, GPTConfig, rope_tables
from lightning_disttrain.parallel.activation import (
    activation_bytes,
    apply_activation_checkpointing,
)
from lightning_disttrain.planning import config_for, shape_of
from lightning_disttrain.planning.activations import (
    backward_peak,
    backward_transient,
    grouped_gemm_saved,
    layer_bytes,
    norm_bytes,
    stage_bytes,
)

LLAMA_LIKE = dict(n_layer=2, n_head=8, n_embd=256, n_kv_head=2, mlp="swiglu", norm="rmsnorm", pos_emb="rope",
                  bias=False, block_size=64)


def _shape(**fields):
    return shape_of(GPTConfig(**fields), 64)


def test_shape_carries_the_config_fields_the_terms_read():
    s = _shape(**LLAMA_LIKE)
    assert s.mlp_hidden == 704 == 64 * 11  # SwiGLU: 8/3 * 256 = 682.7, rounded up to a multiple of 64
    assert (s.kv_dim, s.norm, s.mlp) == (2 * 32, "rmsnorm", "swiglu")
    llama3 = shape_of(config_for("llama3-70b"), 8192)
    assert (llama3.ffn_hidden, llama3.kv_dim, llama3.vocab) == (28672, 8 * 128, 128256)  # no vocabulary padding
    assert shape_of(config_for("gpt2-124m"), 1024).vocab == 50304  # 50257 padded to a multiple of 64
    moe = shape_of(config_for("tiny-moe"), 256)
    assert (moe.moe_top_k, moe.expert_hidden, moe.moe_layer_ids) == (2, 256, (1, 2, 3))


def test_swiglu_gqa_layer_by_hand():
    s = _shape(**LLAMA_LIKE)
    h, f, kv, a = 256, 704, 64, 8
    # bf16 on a GPU: norms keep their input + an fp32 rstd; the gathered norm outputs; q, k, v after
    # RoPE; SDPA's output and fp32 logsumexp; SwiGLU's four hidden-width tensors.
    none = 2 * (2 * h + 4) + 2 * 2 * h + 2 * (h + 2 * kv) + (2 * h + 4 * a) + 2 * 4 * f
    assert none == 9000
    assert layer_bytes(s, 0, e=2) == none
    # torch's CPU RMSNorm is composite: an fp32 copy of its input and the fp32 normalised tensor
    assert norm_bytes(s, 2, cpu=True) == 8 * h + 4
    assert layer_bytes(s, 0, e=2, cpu=True) == none - 2 * (2 * h + 4) + 2 * (8 * h + 4) == 12072
    # selective keeps the block input and the outputs of the matmuls and attention
    selective = 2 * h + 2 * (h + 2 * kv) + (2 * h + 4 * a) + 2 * h + 2 * 2 * f + 2 * h
    assert layer_bytes(s, 0, policy="selective", e=2) == selective == 5664
    assert layer_bytes(s, 0, policy="full", e=2) == 2 * h
    # block: layers 0, 2, ... fully recomputed, the others keep everything
    assert stage_bytes(s, range(2), "block", every_k=2, e=2) == 2 * h + none
    # the backward of a recomputed block: the blocks before it as stored, all it recomputes, and the
    # gradients in flight (the block output's and the 704-wide hidden one)
    transient = 2 * (h + f)
    assert backward_peak(s, range(2), "full", e=2) == 2 * h + none + transient
    assert backward_peak(s, range(2), "selective", e=2) == selective + none + transient
    assert backward_peak(s, range(2), "block", e=2) == none + transient  # layer 0, before anything is stored
    assert backward_peak(s, range(2), "none", e=2) == 0
    # GQA: 2 K/V heads instead of 8 save 2 x 2 x (256 - 64) bytes per token
    mha = _shape(**{**LLAMA_LIKE, "n_kv_head": 8})
    assert layer_bytes(mha, 0, e=2) - layer_bytes(s, 0, e=2) == 2 * 2 * (h - kv)


def test_gelu_layer_is_below_megatrons_34_sbh():
    s = _shape(n_layer=2, n_head=8, n_embd=256, block_size=64)  # GPT-2 style: LayerNorm, GELU 4h, no dropout
    h = 256
    ours = 2 * (2 * h + 8) + 2 * 2 * h + 2 * 3 * h + (2 * h + 4 * 8) + 2 * 2 * 4 * h
    assert layer_bytes(s, 0, e=2) == ours == 8240
    assert ours / (34 * h) == pytest.approx(0.947, abs=1e-3)  # no dropout masks, FlashAttention's logsumexp


def test_tensor_parallel_divides_all_but_the_gathered_inputs():
    s = _shape(**LLAMA_LIKE)
    h, f, kv, a, t = 256, 704, 64, 8, 4
    none = 2 * (2 * h + 4) / t + 2 * 2 * h + 2 * (h + 2 * kv) / t + (2 * h + 4 * a) / t + 2 * 4 * f / t
    assert layer_bytes(s, 0, e=2, t=t) == pytest.approx(none)
    # selective under TP also keeps the row-parallel projections' full-length partial sums and the
    # collectives' outputs (all-gathered inputs, reduce-scattered outputs)
    selective = (2 * h / t + 2 * (h + 2 * kv) / t + (2 * h + 4 * a) / t + 2 * h + 2 * 2 * f / t + 2 * h
                 + 2 * 2 * h + 2 * 2 * h / t)
    assert layer_bytes(s, 0, policy="selective", e=2, t=t) == pytest.approx(selective)
    assert layer_bytes(s, 0, policy="full", e=2, t=t) == 2 * h / t


def test_moe_layer_by_hand():
    base = dict(n_layer=2, n_head=8, n_embd=256, block_size=64, moe_num_experts=8, moe_top_k=2, moe_hidden=512)
    s = _shape(**base)
    h = 256
    attn = (2 * h + 8) + 2 * h + 2 * 3 * h + (2 * h + 4 * 8)
    # router probabilities (fp32), the router's fp32 copy of its bf16 input, and per routed
    # assignment: the gathered token, the expert output and its weighted copy, GELU's two
    # hidden tensors, three int64 indices and the fp32 weight
    per_assignment = 3 * 2 * h + 2 * 2 * 512 + 28
    ffn = (2 * h + 8) + 2 * h + 4 * 8 + 4 * h + 2 * per_assignment
    assert layer_bytes(s, 0, e=2) == attn + ffn == 12424
    dropping = _shape(**base, moe_capacity_factor=0.5)  # at most half the assignments reach an expert
    assert layer_bytes(dropping, 0, e=2) == attn + ffn - per_assignment
    shared = _shape(**base, moe_shared_experts=1)
    assert layer_bytes(shared, 0, e=2) - layer_bytes(s, 0, e=2) == 2 * 2 * 512
    # selective: the package's save list has no grouped GEMM, so the routed experts are recomputed;
    # the router's fp32 logits are a matmul output and stay; expert parallel's all-to-all outputs too
    assert not grouped_gemm_saved()
    sel = 2 * h + 2 * 3 * h + (2 * h + 4 * 8) + 2 * h + 4 * 8
    assert layer_bytes(s, 0, policy="selective", e=2) == sel == 3136
    assert layer_bytes(s, 0, policy="selective", e=2, ep=2) == sel + 2 * 2 * 2 * h
    # a recomputed MoE block's backward: the gradients in flight (h, and 2 x 512 hidden for the routed
    # experts), and under expert parallel the dispatch's send and receive copies
    assert backward_transient(s, e=2) == 2 * (h + 2 * 512)
    assert backward_transient(s, e=2, ep=2) == 2 * (h + 2 * 512) + 2 * 2 * 2 * h


def test_unknown_policy_names_the_package_policies():
    s = _shape(**LLAMA_LIKE)
    with pytest.raises(ValueError, match="'none', 'selective', 'block', 'full'"):
        stage_bytes(s, range(2), "megatron")


# ---- against the model: what a forward really leaves alive for backward (CPU) -------------------

def _measured(dtype, policy, fields, s=64, b=2):
    torch.manual_seed(0)
    c = GPTConfig(**{"n_layer": 3, "n_head": 4, "n_embd": 64, "block_size": 128, **fields})
    blocks = torch.nn.ModuleDict({str(i): Block(c, i) for i in range(c.n_layer)}).to(dtype)
    apply_activation_checkpointing(blocks, policy, every_k=2)
    rope = rope_tables(c) if c.pos_emb == "rope" else None
    x = torch.randn(b, s, c.n_embd, dtype=dtype, requires_grad=True) * 1.0

    def forward():
        y = x * 1.0  # the first block's input, allocated inside the measured region as in a model
        for block in blocks.values():
            y = block(y, rope)
        return y

    out, alive = activation_bytes(forward)
    e = torch.finfo(dtype).bits // 8
    planned = stage_bytes(shape_of(c, s), range(c.n_layer), policy, 2, e=e, cpu=True) * s * b
    return alive - out.numel() * e, planned


@pytest.mark.parametrize("policy", ["none", "selective", "full", "block"])
@pytest.mark.parametrize(("dtype", "fields"), [
    (torch.float32, {}),
    (torch.float32, dict(mlp="relu2")),
    (torch.float32, {**LLAMA_LIKE, "n_layer": 3, "n_head": 4, "n_embd": 64, "n_kv_head": 1, "block_size": 128}),
    (torch.bfloat16, {**LLAMA_LIKE, "n_layer": 3, "n_head": 4, "n_embd": 64, "n_kv_head": 2, "block_size": 128}),
], ids=["gpt2-fp32", "relu2-fp32", "swiglu-gqa-fp32", "swiglu-gqa-bf16"])
def test_dense_terms_equal_what_the_model_keeps(dtype, fields, policy):
    measured, planned = _measured(dtype, policy, fields)
    assert measured == planned


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_moe_terms_equal_what_the_model_keeps_but_its_load_counts(policy):
    fields = dict(moe_num_experts=4, moe_top_k=2, moe_hidden=128, moe_first_dense=1, moe_shared_experts=1)
    measured, planned = _measured(torch.float32, policy, fields)
    # + each MoE layer's per-expert counts (a few int64 x 4-expert tensors: up to 128 bytes per layer,
    # not per token, so not planned)
    assert 0 <= measured - planned <= 2 * 128
