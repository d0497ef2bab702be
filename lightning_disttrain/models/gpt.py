"""GPT in one file: the config, the block, the model. Plain torch, no Lightning, and no import of
the rest of the package above ``models/`` (loading a file is ``checkpoint.gpt_from_exported`` /
``models.hf.gpt_from_hf``).

GPT-2 by default (learned positions, LayerNorm, GELU MLP, tied embedding and head, GPT-2's
initialisation) with the switches modern runs use: RoPE, RMSNorm, SwiGLU or ReLU², QK-norm,
grouped-query attention, an untied head, and a vocabulary padded to a multiple of 64.

The repeated blocks are one ``nn.ModuleDict`` keyed by layer index (``GPT.blocks``): the unit
that FSDP wraps, activation checkpointing recomputes, ``torch.compile`` compiles and the pipeline
splits. Keyed by index rather than listed, a pipeline stage keeps blocks 4..7 under their own names
(``blocks.4``), so checkpoints move between pipeline layouts; the FQNs equal a ``ModuleList``'s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_disttrain.models import param_init
from lightning_disttrain.models.context_parallel import ContextParallel
from lightning_disttrain.models.max_logit import causal_max_logit, ring_max_logit
from lightning_disttrain.models.ring_attention import ring_shift_of
from lightning_disttrain.models.moe import MoE, MoEConfig, active_params, check_gpt_moe_fields, moe_layers

_MLPS = ("gelu", "swiglu", "relu2")
_NORMS = ("layernorm", "rmsnorm")
_POS = ("learned", "rope")


@dataclass
class GPTConfig:
    """Shape and architecture of a GPT. ``GPTConfig.from_name`` gives the named presets.

    Args:
        n_layer: Number of transformer blocks.
        n_head: Attention (query) heads per block; ``n_embd`` must be a multiple of it.
        n_embd: Width of the residual stream.
        block_size: Longest sequence the model accepts (the size of the learned position table).
        vocab_size: Tokens the tokenizer can produce (GPT-2 BPE: 50,257).
        pad_vocab_multiple: Embedding/head rows are padded to a multiple of this for fast matmuls;
            padding rows are never predicted (their logits are cut off). 1 disables padding.
        n_kv_head: Key/value heads for grouped-query attention; None means ``n_head``
            (plain multi-head).
        mlp: Feed-forward: ``gelu`` (GPT-2), ``swiglu`` (LLaMA) or ``relu2`` (ReLU squared).
        mlp_hidden: Hidden width of the feed-forward; None: 4·n_embd, or ~8/3·n_embd rounded to 64 for
            swiglu.
        norm: ``layernorm`` (GPT-2) or ``rmsnorm``.
        norm_eps: Epsilon of every norm.
        pos_emb: ``learned`` absolute positions (GPT-2) or ``rope`` rotary embeddings.
        rope_theta: RoPE base frequency.
        qk_norm: RMS-normalise queries and keys per head before attention (stabilises large learning
            rates).
        tie_embeddings: Share the token embedding with the output head (GPT-2).
        bias: Biases in Linear layers and LayerNorms (GPT-2: True).
        dropout: Dropout on attention probabilities and residual branches (pre-training: 0).
        init_std: Standard deviation of the normal initialisation; residual projections get ``init_std /
            sqrt(2 · n_layer)`` (GPT-2 paper, section 2.3).
        moe_num_experts: Routed experts in each MoE block's feed-forward; 0: every block has a dense
            MLP.
        moe_top_k: Routed experts per token.
        moe_shared_experts: Always-on experts per MoE block, each ``moe_hidden`` wide.
        moe_hidden: Hidden width of each expert; None: ``mlp_hidden``. Experts follow ``mlp``, without
            biases.
        moe_first_dense: Leading blocks that keep a dense MLP.
        moe_every: From block ``moe_first_dense`` on, every ``moe_every``-th block is MoE (1: each one).
        moe_score: Router score: ``softmax``, or ``sigmoid`` renormalised over the chosen experts
            (DeepSeek-V3).
        moe_capacity_factor: None: dropless; else per-expert capacity ``ceil(factor · tokens · top_k /
            experts)``, rest dropped.
        moe_bias_update_speed: Auxiliary-loss-free balancing: bias step per optimizer step (0: off).
        moe_aux_loss_coef: Weight of the sequence-wise balance loss added to the training loss (0: off).
        moe_z_loss_coef: Weight of the router z-loss added to the training loss (0: off).
    """

    # Each field is described once, under Args above (what the API reference and the CLI's --help
    # read); an attribute docstring would say it a second time.
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50257
    pad_vocab_multiple: int = 64
    n_kv_head: int | None = None
    mlp: str = "gelu"
    mlp_hidden: int | None = None
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    pos_emb: str = "learned"
    rope_theta: float = 10000.0
    qk_norm: bool = False
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    init_std: float = 0.02
    # Mixture of experts (models/moe.py; the rest mirror MoEConfig's fields). Off by default.
    moe_num_experts: int = 0
    moe_top_k: int = 2
    moe_shared_experts: int = 0
    moe_hidden: int | None = None
    moe_first_dense: int = 0
    moe_every: int = 1
    moe_score: str = "softmax"
    moe_capacity_factor: float | None = None
    moe_bias_update_speed: float = 1e-3
    moe_aux_loss_coef: float = 0.0
    moe_z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.mlp_hidden is None:
            if self.mlp == "swiglu":
                self.mlp_hidden = 64 * math.ceil(8 * self.n_embd / 3 / 64)
            else:
                self.mlp_hidden = 4 * self.n_embd
        self.validate()

    def validate(self) -> None:
        for name, value, allowed in (("mlp", self.mlp, _MLPS), ("norm", self.norm, _NORMS),
                                     ("pos_emb", self.pos_emb, _POS)):
            if value not in allowed:
                raise ValueError(f"GPTConfig.{name}={value!r} is unknown; use one of {allowed}")
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size",
                     "pad_vocab_multiple", "n_kv_head", "mlp_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}; "
                             f"change one so that n_embd / n_head is a whole head size")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head size; n_embd/n_head = {self.head_dim}")
        check_gpt_moe_fields(self)

    def moe_config(self) -> MoEConfig:
        """The ``MoEConfig`` of this GPT's MoE blocks (``moe_num_experts`` must be >= 1)."""
        return MoEConfig(dim=self.n_embd, hidden=self.moe_hidden or self.mlp_hidden,
                         num_experts=self.moe_num_experts, top_k=self.moe_top_k,
                         shared_experts=self.moe_shared_experts, activation=self.mlp, score=self.moe_score,
                         capacity_factor=self.moe_capacity_factor, bias_update_speed=self.moe_bias_update_speed,
                         aux_loss_coef=self.moe_aux_loss_coef, z_loss_coef=self.moe_z_loss_coef,
                         names="GPTConfig.moe_")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has a mixture of experts instead of a dense MLP."""
        first, every = self.moe_first_dense, self.moe_every
        return self.moe_num_experts > 0 and layer >= first and (layer - first) % every == 0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return m * math.ceil(self.vocab_size / m)

    @classmethod
    def from_name(cls, name: str, **overrides) -> GPTConfig:
        """A named preset, optionally with fields overridden (``from_name("tiny", vocab_size=257)``)."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"GPTConfig has no field(s) {sorted(unknown)}")
        # From the preset's own fields, so derived ones (n_kv_head, mlp_hidden) follow overrides.
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, dict] = {
    # GPT-2's published shapes (Radford et al. 2019, table 2; sizes as counted by HF/nanoGPT).
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-774m": dict(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-1558m": dict(n_layer=48, n_head=25, n_embd=1600),
    # CPU sizes: about 0.8M and 10.6M parameters in the blocks (the embedding adds
    # vocab x n_embd: small with the byte tokenizer, large with GPT-2's 50,257 tokens).
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, block_size=256),
    "small": dict(n_layer=6, n_head=6, n_embd=384, block_size=512),
    # Mixture of experts (counted by GPT.num_params, checked in tests/models/test_moe.py).
    # tiny-moe: "tiny" with 4 experts of half width, top-2, after one dense block: 7,651,840
    # parameters in all, 7,258,624 active per token (with GPT-2's vocabulary).
    # gpt2-moe: GPT-2 124M's width and depth, every MLP 8 experts of half width, top-2, so a token
    # passes through as many expert weights as through GPT-2's MLP: 294,336,768 parameters in
    # all, 124,467,456 active per token (GPT-2 124M: 124,439,808; + the router, - MLP biases).
    "tiny-moe": dict(n_layer=4, n_head=4, n_embd=128, block_size=256, moe_num_experts=4, moe_top_k=2,
                     moe_hidden=256, moe_first_dense=1),
    "gpt2-moe": dict(n_layer=12, n_head=12, n_embd=768, moe_num_experts=8, moe_top_k=2, moe_hidden=1536),
}
"""Preset name -> the GPTConfig fields it sets (the rest keep their defaults)."""


def _norm(config: GPTConfig, dim: int | None = None) -> nn.Module:
    dim = dim or config.n_embd
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


def rope_tables(config: GPTConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (block_size, head_dim/2), computed in fp32."""
    half = config.head_dim // 2
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(config.block_size, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, H, D) by position; pairs are the two halves of D (GPT-NeoX layout)."""
    T = x.size(1)
    cos, sin = cos[:T, None, :], sin[:T, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.layer = layer
        kv_dim = config.n_kv_head * config.head_dim
        # Separate q/k/v projections (not one fused c_attn) so that column-wise tensor parallel
        # shards whole heads of each.
        self.wq = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.wk = nn.Linear(config.n_embd, kv_dim, bias=config.bias)
        self.wv = nn.Linear(config.n_embd, kv_dim, bias=config.bias)
        self.wo = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(config.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.dropout = config.dropout
        self.context_parallel: ContextParallel | None = None
        """Set by the strategy under cp > 1: the sequence is sharded, attention runs the ring."""
        self.track_max_logit = False
        """Set by ``callbacks.QKClip``: training forwards record each head's largest logit."""
        self.max_logit: torch.Tensor | None = None
        """With ``track_max_logit``: the largest pre-softmax logit of each of this rank's query heads
        over the training forwards since the last reset (float32, ``(local heads,)``); None before one."""

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 rather than n_head: under tensor parallel each rank holds a slice of the heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D) for SDPA
        dropout_p = self.dropout if self.training else 0.0
        cp = self.context_parallel
        if self.track_max_logit and self.training:
            self._record_max_logit(q, k)
        if cp is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                               enable_gqa=self.n_kv_head != self.n_head)
        else:  # this rank's queries against the whole sequence's keys (models/context_parallel.py)
            y = cp.attention(q, k, v, dropout_p=dropout_p, enable_gqa=self.n_kv_head != self.n_head)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    @torch.compiler.disable  # a side effect on the module, outside any compiled graph (QK-clip only)
    def _record_max_logit(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Fold this forward's per-head largest logit into ``max_logit`` (models/max_logit.py); a
        recomputed forward (activation checkpointing) records the same values again."""
        cp = self.context_parallel
        if cp is None:
            current = causal_max_logit(q, k)
        else:
            current = ring_max_logit(q, k, cp.rank, cp.size, ring_shift_of(cp.group_name))
        self.max_logit = current if self.max_logit is None else torch.maximum(self.max_logit, current)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.kind = config.mlp
        self.w1 = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.w2 = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.w3 = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias) if self.kind == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        if self.kind == "gelu":
            h = F.gelu(h, approximate="tanh")  # GPT-2's tanh approximation
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = F.silu(h) * self.w3(x)
        return self.w2(h)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)). ``mlp`` is a
    mixture of experts (``moe.MoE``) in the blocks ``config.is_moe_layer(layer)`` names."""

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = _norm(config)
        self.attn = CausalSelfAttention(config, layer)
        self.mlp_norm = _norm(config)
        self.mlp = MoE(config.moe_config()) if config.is_moe_layer(layer) else MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), rope))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class Layers(nn.ModuleDict):
    """The blocks, keyed by layer index (``"0"``, ``"1"``, ...), used like an ``nn.ModuleList``:
    iterating yields the blocks in order and ``layers[i]`` is layer ``i``. A pipeline stage deletes
    the layers it does not hold and the others keep their index, hence their names."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, key: int | str) -> nn.Module:
        return super().__getitem__(str(key) if isinstance(key, int) else key)


class GPT(nn.Module):
    """A decoder-only transformer (GPT-2 / Llama family), built from a ``GPTConfig``.

    Args:
        config: the architecture: layers, heads, widths, vocabulary, norm, positions, MoE.
    """

    layout_independent_init = True
    """``init_weights`` draws each weight from a generator of its own (``param_init``): see there."""
    trim_logits: bool = False
    """Whether ``forward`` returns logits over ``config.vocab_size`` only, without the vocabulary
    padding. Off for training: the loss cuts the padding itself, and the untrimmed output is the
    fresh tensor FSDP2's backward hooks need (a tensor-parallel head will mask padded columns of
    vocabulary-sharded logits instead of slicing them). On for inference: the loaders
    (``checkpoint.gpt_from_exported``, ``models.hf.gpt_from_hf``) set it, so that a softmax or argmax over the logits can never pick a padding id."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        with param_init.no_global_draws():  # construction leaves the global RNG as it was: see there
            self._build(config)
        self.init_weights()

    def _build(self, config: GPTConfig) -> None:
        V = config.padded_vocab_size
        self.wte = nn.Embedding(V, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == "learned" else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = Layers({str(i): Block(config, i) for i in range(config.n_layer)})
        self.moe_aux_loss: torch.Tensor | None = None  # set by forward: see there
        self.context_parallel: ContextParallel | None = None  # cp > 1: positions of the shard (forward)
        self.ln_f = _norm(config)
        self.lm_head = nn.Linear(config.n_embd, V, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        if config.pos_emb == "rope":
            # Not persistent: derived from the config, recomputed by init_weights after a meta build.
            cos, sin = rope_tables(config)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer in place.

        Called at construction and again by strategies after a model built on the meta device has
        been materialised with ``to_empty``. GPT-2 init: N(0, 0.02) for weights and embeddings,
        zero biases, unit norms; the projections that write into the residual stream (attention
        ``wo``, MLP ``w2``) get std / sqrt(2·n_layer) so the residual's variance stays O(1) with depth.
        Each parameter is drawn from a generator of its own, seeded by the run's seed and the
        parameter's name (``models.param_init``): the result does not depend on the global RNG
        state, on the device type aside, or on the layout (meta build + FSDP / TP / PP / EP
        materialisation gives, gathered, exactly the weights of an eager one-process build).
        """
        c = self.config
        if c.tie_embeddings and self.lm_head is not None and self.wte is not None \
                and self.lm_head.weight is not self.wte.weight:
            # to_empty() on a meta-built model gives each module its own new tensor: tie again.
            self.lm_head.weight = self.wte.weight
        resid_std = c.init_std / math.sqrt(2 * c.n_layer)
        for name, module in self.named_modules():
            if module is self.lm_head and c.tie_embeddings:
                continue  # the tied head is the embedding, initialised once as an Embedding
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith(("attn.wo", "mlp.w2", "mlp.shared.w2")) else c.init_std
                param_init.normal_(module.weight, f"{name}.weight", std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, MoE):  # the stacked expert weights and the balancing bias
                module.init_weights(c.init_std, resid_std, prefix=name)
            elif isinstance(module, nn.Embedding):
                param_init.normal_(module.weight, f"{name}.weight", std=c.init_std)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        if c.pos_emb == "rope":
            cos, sin = rope_tables(c, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) → logits (B, T, padded_vocab_size), or (B, T, vocab_size) when
        ``trim_logits`` is set.

        Columns from ``vocab_size`` on are padding: ``trim_padding`` cuts them off, and
        ``GPTModule``'s loss and ``generate`` do, so they are never predicted. Returning the padded
        tensor (not a slice) keeps the output a fresh tensor, which FSDP's backward hooks need,
        and the cut costs nothing extra because the loss copies the logits to fp32 anyway.

        A pipeline stage is this model with parts removed (``parallel.pipeline``): without the
        token embedding its input is the previous stage's hidden states (B, T, n_embd); without
        the head it returns its hidden states.

        With mixture-of-experts blocks, ``self.moe_aux_loss`` is afterwards the sum of their
        enabled auxiliary losses (balance, z-loss; already weighted), or None when none is on:
        the trainer adds it to the loss.
        """
        cp = self.context_parallel
        # Under context parallel, the global positions of this rank's shard: recorded by the strategy
        # when it sharded the batch, for every stage (a later stage's input is hidden states, whose
        # length under sequence parallel is 1/tp of the shard); without it, from the token ids.
        tokens = idx.size(1) if self.wte is not None else None
        positions = None if cp is None else cp.shard_positions(idx.device, tokens)
        if self.wte is not None:
            T = idx.size(1)  # this rank's tokens (under context parallel, a shard of the sequence)
            full = T if cp is None else cp.full_length(positions.numel())
            if full > self.config.block_size:
                raise ValueError(f"sequence length {full} exceeds block_size={self.config.block_size}; "
                                 f"use shorter sequences or a config with a larger block_size")
            x = self.wte(idx)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(T, device=idx.device) if positions is None else positions)
            x = self.drop(x)
        else:
            x = idx  # a later pipeline stage: the hidden states of the one before
        rope = None
        if self.config.pos_emb == "rope":
            rope = (self.rope_cos, self.rope_sin) if positions is None else (
                self.rope_cos[positions], self.rope_sin[positions])
        for block in self.blocks:
            x = block(x, rope)
        if self.config.moe_num_experts:
            losses = [m.aux_loss for m in moe_layers(self).values() if m.aux_loss is not None]
            self.moe_aux_loss = sum(losses) if losses else None
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.ln_f(x))
        if self.trim_logits:
            # contiguous: callers reshape logits with .view (nanoGPT-style losses do).
            return self.trim_padding(logits).contiguous()
        return logits

    def trim_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary only (a view when there is padding)."""
        V = self.config.vocab_size
        return logits if logits.size(-1) == V else logits[..., :V]

    def num_params(self, embeddings: bool = True, padding: bool = False, active: bool = False) -> int:
        """Parameters counted once (tied weights once).

        ``active=True`` counts, in mixture-of-experts blocks, only what one token passes through:
        the router, ``moe_top_k`` routed experts and the shared experts (``moe.active_params``);
        ``active=False`` counts every expert (what is allocated). The same for dense models.
        ``embeddings=False`` leaves out the token and position tables (the head stays, when untied).
        ``padding=False`` leaves out the vocabulary padding rows, so GPT-2 124M counts 124,439,808
        as published; ``padding=True`` is what is allocated.
        """
        c = self.config
        total = sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once
        pad_rows = c.padded_vocab_size - c.vocab_size
        if not padding:
            total -= pad_rows * c.n_embd * (1 if c.tie_embeddings else 2)
        if active:
            total -= sum(sum(p.numel() for p in m.parameters()) - active_params(m) for m in moe_layers(self).values())
        if not embeddings:
            total -= self.wte.weight.numel() - (0 if padding else pad_rows * c.n_embd)
            if self.wpe is not None:
                total -= self.wpe.weight.numel()
            if c.tie_embeddings:  # the tied head is a matmul, not a lookup: it counts
                total += c.vocab_size * c.n_embd + (pad_rows * c.n_embd if padding else 0)
        return total

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6·N + 12·L·H·Dh·T (PaLM appendix B, causal mask not credited).

        N counts the matmul weights a token passes through: every non-embedding parameter plus the
        head at its padded size (the head matmul runs over the padded rows). In mixture-of-experts
        blocks only the parameters a token is routed through count (``num_params(active=True)``:
        router, top-k routed and shared experts); the dispatch (sort, gather, scatter) is not counted.
        """
        c = self.config
        T = seq_len or c.block_size
        whole = self
        if self.wte is None or self.lm_head is None or len(self.blocks) != c.n_layer:
            with torch.device("meta"):  # a pipeline stage: count the whole model, built without memory
                whole = GPT(c)
        n = whole.num_params(embeddings=False, padding=True, active=True)
        return 6 * n + 12 * c.n_layer * c.n_head * c.head_dim * T
