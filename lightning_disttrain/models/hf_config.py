"""Configs for Hugging Face interop (``models/hf.py``): a ``transformers`` ``config.json`` (GPT-2 or
Llama) as our ``GPTConfig`` and back, and which of our configs ``transformers`` can express.

Only what changes the computation is compared or refused: a ``ValueError`` names the field and
the fix. Plain data, no ``transformers`` import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_disttrain.models.gpt import GPTConfig

SAFETENSORS, BIN = "model.safetensors", "pytorch_model.bin"
OVERRIDABLE = ("dropout", "pad_vocab_multiple", "block_size", "init_std")
"""GPTConfig fields that may differ from the checkpoint's: they change no weight (a shorter
``block_size`` with learned positions keeps the first rows of the position table)."""

# transformers' config defaults: config.json leaves out values equal to them.
_DEFAULTS = {
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                 layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True),
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                  max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, rope_theta=10000.0, attention_bias=False, mlp_bias=False,
                  attention_dropout=0.0),
}
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # all tanh approximations, as ours


def read_hf_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` of a Hugging Face model directory."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face model directory (no config.json); pass one "
                         f"written by save_pretrained: config.json + {SAFETENSORS} or {BIN}")
    return json.loads((path / "config.json").read_text())


def config_from_hf(hf: Mapping) -> GPTConfig:
    """Our config for a ``transformers`` config dict (``gpt2`` or ``llama``)."""
    kind = hf.get("model_type")
    if kind not in _DEFAULTS:
        raise ValueError(f"model_type={kind!r} cannot be imported; lightning-disttrain reads 'gpt2' (GPT-2 family) "
                         f"and 'llama' checkpoints")
    hf = {**_DEFAULTS[kind], **{k: v for k, v in hf.items() if v is not None or k not in _DEFAULTS[kind]}}

    def refuse(key: str, why: str) -> None:
        raise ValueError(f"config.json has {key}={hf.get(key)!r}: {why}; our GPT cannot express it, so this "
                         f"checkpoint cannot be imported")

    if kind == "gpt2":
        if hf["activation_function"] not in _TANH_GELUS:
            refuse("activation_function", f"our GELU is the tanh approximation ({', '.join(_TANH_GELUS)})")
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
            if hf[key] != want:
                refuse(key, f"only {want} is supported")
        drops = {hf["resid_pdrop"], hf["embd_pdrop"], hf["attn_pdrop"]}
        return GPTConfig(n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
                         block_size=hf["n_positions"], vocab_size=hf["vocab_size"], mlp="gelu",
                         mlp_hidden=hf["n_inner"] or 4 * hf["n_embd"], norm="layernorm",
                         norm_eps=hf["layer_norm_epsilon"], pos_emb="learned",
                         tie_embeddings=hf["tie_word_embeddings"], bias=True,
                         dropout=hf["resid_pdrop"] if len(drops) == 1 else max(drops),
                         init_std=hf["initializer_range"])
    if hf["hidden_act"] != "silu":
        refuse("hidden_act", "our SwiGLU gates with SiLU")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        refuse("rope_parameters" if "rope_parameters" in hf else "rope_scaling", "only unscaled RoPE is supported")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse("partial_rotary_factor", "our RoPE rotates the whole head")
    heads = hf["num_attention_heads"]
    if hf["head_dim"] not in (None, hf["hidden_size"] // heads):
        refuse("head_dim", f"our head size is hidden_size / num_attention_heads = {hf['hidden_size'] // heads}")
    if hf["attention_bias"] != hf["mlp_bias"]:
        refuse("attention_bias", f"with mlp_bias={hf['mlp_bias']!r}: our `bias` switches both together")
    return GPTConfig(n_layer=hf["num_hidden_layers"], n_head=heads, n_embd=hf["hidden_size"],
                     block_size=hf["max_position_embeddings"], vocab_size=hf["vocab_size"],
                     n_kv_head=hf["num_key_value_heads"] or heads, mlp="swiglu", mlp_hidden=hf["intermediate_size"],
                     norm="rmsnorm", norm_eps=hf["rms_norm_eps"], pos_emb="rope",
                     rope_theta=float(rope.get("rope_theta", hf["rope_theta"])),
                     tie_embeddings=hf["tie_word_embeddings"], bias=hf["attention_bias"],
                     dropout=hf["attention_dropout"], init_std=hf["initializer_range"])


def config_from_hf_dir(path: str | os.PathLike) -> GPTConfig:
    return config_from_hf(read_hf_config(path))


def hf_architecture(config: GPTConfig) -> str:
    """``"gpt2"`` or ``"llama"``: the ``transformers`` architecture that computes what ``config``
    does; ``ValueError`` naming every field in the way when neither does."""
    c = config
    if c.pos_emb == "learned":
        kind, fix = "gpt2", "GPT-2 (learned positions)"
        wrong = [(f, v, want) for f, v, want in (("norm", c.norm, "layernorm"), ("mlp", c.mlp, "gelu"),
                                                 ("bias", c.bias, True), ("n_kv_head", c.n_kv_head, c.n_head))
                 if v != want]
    else:
        kind, fix = "llama", "Llama (RoPE)"
        wrong = [(f, v, want) for f, v, want in (("norm", c.norm, "rmsnorm"), ("mlp", c.mlp, "swiglu")) if v != want]
    if c.qk_norm:
        wrong.append(("qk_norm", True, False))
    if getattr(c, "moe_num_experts", 0):  # neither has experts (transformers' Mixtral / DeepSeek layouts differ)
        wrong.append(("moe_num_experts", c.moe_num_experts, 0))
    if wrong:
        got = ", ".join(f"{f}={v!r} (needs {want!r})" for f, v, want in wrong)
        raise ValueError(
            f"this GPTConfig has no Hugging Face equivalent: it would export as {fix}, but {got}. transformers' "
            f"GPT-2 has learned positions, LayerNorm, GELU, biases and no grouped-query attention; its Llama has "
            f"RoPE, RMSNorm and SwiGLU. Export with the default format (checkpoint.gpt_from_exported loads it) instead")
    return kind


def config_to_hf(config: GPTConfig, dtype: torch.dtype = torch.float32) -> dict:
    """``config.json`` for ``transformers`` (``ValueError`` when no architecture fits, see ``hf_architecture``)."""
    c, kind = config, hf_architecture(config)
    eot = {50257: 50256, 257: 256}.get(c.vocab_size)  # GPT-2 BPE / the byte tokenizer's end-of-text
    common = dict(vocab_size=c.vocab_size, tie_word_embeddings=c.tie_embeddings, initializer_range=c.init_std,
                  bos_token_id=eot, eos_token_id=eot, dtype=str(dtype).removeprefix("torch."),
                  torch_dtype=str(dtype).removeprefix("torch."), use_cache=True)
    if kind == "gpt2":
        return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_layer=c.n_layer, n_head=c.n_head,
                    n_embd=c.n_embd, n_positions=c.block_size, n_inner=c.mlp_hidden, activation_function="gelu_new",
                    layer_norm_epsilon=c.norm_eps, resid_pdrop=c.dropout, embd_pdrop=c.dropout,
                    attn_pdrop=c.dropout, **common)
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=c.n_layer,
                num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, hidden_size=c.n_embd,
                head_dim=c.head_dim, intermediate_size=c.mlp_hidden, hidden_act="silu",
                max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
                rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                attention_bias=c.bias, mlp_bias=c.bias, attention_dropout=c.dropout, **common)


def check_compatible(config: GPTConfig, source: GPTConfig, where: str = "the checkpoint") -> None:
    """Raise unless ``config`` has ``source``'s architecture (only ``OVERRIDABLE`` fields may differ,
    and with learned positions ``block_size`` may only shrink)."""
    ours, theirs = asdict(config), asdict(source)
    diff = [f"{k}={ours[k]!r} (it has {theirs[k]!r})" for k in ours if k not in OVERRIDABLE and ours[k] != theirs[k]]
    if config.pos_emb == "learned" and config.block_size > source.block_size:
        diff.append(f"block_size={config.block_size} (its position table has {source.block_size} rows)")
    if diff:
        raise ValueError(f"the GPTConfig does not match {where}: {', '.join(diff)}. The architecture comes from the "
                         f"checkpoint's config.json; only {', '.join(OVERRIDABLE)} may be overridden")
