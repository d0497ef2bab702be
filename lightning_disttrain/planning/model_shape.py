"""What the planner needs to know about a model: its parameter counts by kind and its shape.

Counted exactly, not estimated: the GPT is built on the meta device (no memory, no
initialisation cost; a 70B shape builds in well under a second) and its parameters are summed
by where they live, so the counts follow every ``GPTConfig`` switch (SwiGLU, GQA, untied head,
mixture of experts, vocabulary padding).

Besides the ``GPTConfig`` presets (``tiny``, ``gpt2-124m``, ``gpt2-moe``, ...), a few public shapes
the planner is often asked about, as ``GPTConfig`` fields: ``llama2-7b``, ``llama2-13b``,
``llama3-8b``, ``llama3-70b`` (the published configs' widths, depths, heads and vocabularies).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_disttrain.models.gpt import GPT, PRESETS, GPTConfig

_LLAMA = dict(mlp="swiglu", norm="rmsnorm", pos_emb="rope", bias=False, tie_embeddings=False, pad_vocab_multiple=1)
SHAPES: dict[str, dict] = {
    "llama2-7b": dict(_LLAMA, n_layer=32, n_head=32, n_embd=4096, mlp_hidden=11008, vocab_size=32000, block_size=4096),
    "llama2-13b": dict(_LLAMA, n_layer=40, n_head=40, n_embd=5120, mlp_hidden=13824, vocab_size=32000, block_size=4096),
    "llama3-8b": dict(_LLAMA, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, mlp_hidden=14336, vocab_size=128256,
                      block_size=8192, rope_theta=500000.0),
    "llama3-70b": dict(_LLAMA, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, mlp_hidden=28672, vocab_size=128256,
                       block_size=8192, rope_theta=500000.0),
}
"""Planner-only shape names -> GPTConfig fields (trainable too: ``GPTModule(model_overrides=...)``)."""


def model_names() -> list[str]:
    return sorted(PRESETS) + sorted(SHAPES)


def config_for(name: str, overrides: dict | None = None) -> GPTConfig:
    """The ``GPTConfig`` of a preset or planner shape name, with ``overrides`` applied."""
    overrides = dict(overrides or {})
    if name in SHAPES:
        return GPTConfig(**{**SHAPES[name], **overrides})
    if name in PRESETS:
        return GPTConfig.from_name(name, **overrides)
    raise ValueError(f"unknown model {name!r}; use one of {model_names()} (plus --override field=value)")


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts (allocated, vocabulary padding included) and the shape of one GPT."""

    name: str
    params: int
    """Every parameter, tied weights once, every expert."""
    embedding_params: int
    """Outside the repeated blocks: token (and position) tables, the head when untied, the final norm."""
    block_params: int
    """Parameters of the largest block."""
    expert_params: int
    """Routed-expert weights of all MoE blocks (sharded by expert parallel); 0 for a dense model."""
    active_params: int
    """What one token passes through (MoE: router, top-k routed and the shared experts)."""
    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    """Padded vocabulary: the logits' width."""
    tied: bool
    flops_per_token: int
    """Training FLOPs per token at ``seq_len`` (``GPT.flops_per_token``: 6·N + 12·L·H·Dh·T)."""
    seq_len: int
    num_experts: int = 0
    moe_layers: int = 0
    """Blocks whose feed-forward is a mixture of experts."""

    @property
    def dense_params(self) -> int:
        """Everything but the routed experts."""
        return self.params - self.expert_params

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def shape_of(config: GPTConfig, seq_len: int, name: str = "custom") -> ModelShape:
    """Count ``config``'s parameters on a meta-device build; ``seq_len`` is the training length."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    if seq_len > config.block_size:
        config = GPTConfig(**{**config.to_dict(), "block_size": seq_len})  # learned positions grow with it
    with torch.device("meta"):
        model = GPT(config)
    numel = {n: p.numel() for n, p in model.named_parameters()}  # a tied weight once, under its first name
    outside = sum(v for n, v in numel.items() if not n.startswith("blocks."))
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    experts = sum(v for n, v in numel.items() if ".mlp.experts." in n)
    return ModelShape(name=name, params=sum(numel.values()), embedding_params=outside,
                      block_params=max(blocks), expert_params=experts,
                      active_params=model.num_params(padding=True, active=True), n_layer=config.n_layer,
                      n_embd=config.n_embd, n_head=config.n_head, vocab=config.padded_vocab_size,
                      tied=config.tie_embeddings, flops_per_token=model.flops_per_token(seq_len), seq_len=seq_len,
                      num_experts=config.moe_num_experts,
                      moe_layers=sum(config.is_moe_layer(i) for i in range(config.n_layer)))

