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

from dataclasses import dataclass, replace

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


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> float:
    """FLOPs of Muon's quintic Newton-Schulz on one whole ``rows x cols`` matrix: per iteration on
    an a x b matrix (a <= b) X X^T (2a^2 b), the Gram polynomial's product (2a^3) and its product
    with X (2a^2 b)."""
    a, b = min(rows, cols), max(rows, cols)
    return float(steps * (4 * a * a * b + 2 * a ** 3))


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
    # The GPTConfig fields the activation terms read (planning/activations.py). The defaults are
    # GPT-2's (``mlp_hidden=0``: 4·n_embd; ``n_kv_head=0``: n_head), so a shape written by hand
    # with the counts above only is a GPT-2-style model.
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention); 0: ``n_head``."""
    mlp: str = "gelu"
    """``gelu``, ``swiglu`` or ``relu2``: how many hidden-width tensors the feed-forward keeps."""
    mlp_hidden: int = 0
    """Hidden width of the dense feed-forward (``GPTConfig.mlp_hidden``, multiple-of rounding
    included); 0: 4·n_embd."""
    norm: str = "layernorm"
    moe_top_k: int = 2
    moe_hidden: int = 0
    """Hidden width of each expert; 0: ``mlp_hidden``."""
    moe_shared_experts: int = 0
    moe_capacity_factor: float | None = None
    moe_layer_ids: tuple[int, ...] | None = None
    """Which blocks are MoE (``GPTConfig.is_moe_layer``); None: the last ``moe_layers``."""
    layer_params: tuple[int, ...] = ()
    """Parameters of each block (experts included), in layer order; (): the blocks' share each."""
    head_params: int = 0
    """What only the last pipeline stage holds: the final norm and an untied head; 0: half of
    ``embedding_params`` (the rest, token and position tables, is the first stage's)."""
    pos_emb: str = "learned"
    """``GPTConfig.pos_emb``: ``rope`` models keep tables the looped pipeline schedules cannot run with yet."""
    layer_matrices: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per block, the (rows, cols) of its 2-D weights: what ``optimizer="muon"`` orthogonalises on
    owner ranks (``optim.build_optimizer``: the blocks' 2-D weights; the routed experts' 3-D stacks
    take ``ExpertMuon``, counted from ``expert_params``; norms and biases take AdamW); (): none counted."""

    def muon_params_of_layer(self, layer: int) -> int:
        """Elements of block ``layer``'s Muon matrices."""
        return sum(r * c for r, c in self.layer_matrices[layer]) if self.layer_matrices else 0

    def newton_schulz_flops_of_layer(self, layer: int, steps: int = 5) -> float:
        """FLOPs of Muon's quintic Newton-Schulz on block ``layer``'s whole matrices, one optimizer
        step (``newton_schulz_flops`` of each)."""
        if not self.layer_matrices:
            return 0.0
        return sum(newton_schulz_flops(r, c, steps) for r, c in self.layer_matrices[layer])

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: n_kv_head · head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def ffn_hidden(self) -> int:
        return self.mlp_hidden or 4 * self.n_embd

    @property
    def expert_hidden(self) -> int:
        return self.moe_hidden or self.ffn_hidden

    @property
    def last_stage_params(self) -> float:
        return self.head_params or self.embedding_params / 2

    @property
    def first_stage_params(self) -> float:
        return self.embedding_params - self.last_stage_params

    def untied(self) -> ModelShape:
        """This shape with its own head (``tie_embeddings=False``), as pipeline stages need it:
        the head's vocab x n_embd weights join the parameters and the last stage."""
        if not self.tied:
            return self
        head = self.vocab * self.n_embd
        last = (self.head_params or 0) + head
        return replace(self, tied=False, params=self.params + head, embedding_params=self.embedding_params + head,
                       active_params=self.active_params + head, head_params=last)

    def is_moe_layer(self, layer: int) -> bool:
        if not self.is_moe:
            return False
        if self.moe_layer_ids is not None:
            return layer in self.moe_layer_ids
        return layer >= self.n_layer - self.moe_layers

    def params_of_layer(self, layer: int) -> float:
        """Parameters of block ``layer`` (experts included)."""
        if self.layer_params:
            return self.layer_params[layer]
        return (self.params - self.embedding_params) / self.n_layer

    def experts_of_layer(self, layer: int) -> float:
        """Routed-expert parameters of block ``layer`` (0 for a dense block)."""
        return self.expert_params / self.moe_layers if self.moe_layers and self.is_moe_layer(layer) else 0.0

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
    head = sum(v for n, v in numel.items() if n.startswith(("ln_f.", "lm_head.")))
    moe_ids = tuple(i for i in range(config.n_layer) if config.is_moe_layer(i))
    matrices = tuple(tuple(tuple(p.shape) for p in b.parameters() if p.dim() == 2) for b in model.blocks)
    return ModelShape(name=name, params=sum(numel.values()), embedding_params=outside,
                      block_params=max(blocks), expert_params=experts,
                      active_params=model.num_params(padding=True, active=True), n_layer=config.n_layer,
                      n_embd=config.n_embd, n_head=config.n_head, vocab=config.padded_vocab_size,
                      tied=config.tie_embeddings, flops_per_token=model.flops_per_token(seq_len), seq_len=seq_len,
                      num_experts=config.moe_num_experts, moe_layers=len(moe_ids),
                      n_kv_head=config.n_kv_head, mlp=config.mlp, mlp_hidden=config.mlp_hidden, norm=config.norm,
                      moe_top_k=config.moe_top_k if config.moe_num_experts else 2,
                      moe_hidden=(config.moe_hidden or config.mlp_hidden) if config.moe_num_experts else 0,
                      moe_shared_experts=config.moe_shared_experts, moe_capacity_factor=config.moe_capacity_factor,
                      moe_layer_ids=moe_ids, layer_params=tuple(blocks), head_params=head, pos_emb=config.pos_emb,
                      layer_matrices=matrices)

