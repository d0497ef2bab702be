"""Small Hugging Face models with random weights, saved locally (nothing is downloaded), and the
matching GPT configs, for the interop tests. Also imported by the 2-rank script, outside pytest."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule

from lightning_disttrain.models.gpt import GPT, GPTConfig

VOCAB = 100  # not a multiple of 64: our embedding and head carry padding rows
SEQ = 16


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """Noise on every parameter: freshly initialised norms (ones) and biases (zeros) would hide a
    norm or bias that lands in the wrong place."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def hf_gpt2(tied: bool = True, dropout: float = 0.1):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                                     tie_word_embeddings=tied, resid_pdrop=dropout, embd_pdrop=dropout,
                                     attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return perturb_(transformers.GPT2LMHeadModel(config)).eval()


def hf_llama(tied: bool = False, bias: bool = False, kv_heads: int = 2):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                                      num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=VOCAB,
                                      max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=5000.0,
                                      tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias,
                                      bos_token_id=0, eos_token_id=0)
    return perturb_(transformers.LlamaForCausalLM(config)).eval()


def save(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(model, idx: torch.Tensor) -> torch.Tensor:
    return model(input_ids=idx).logits


@torch.no_grad()
def our_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model.trim_padding(model(idx))


GPT2_LIKE = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=VOCAB)
LLAMA_LIKE = dict(GPT2_LIKE, n_kv_head=2, mlp="swiglu", mlp_hidden=96, norm="rmsnorm", norm_eps=1e-6,
                  pos_emb="rope", rope_theta=5000.0, tie_embeddings=False, bias=False)


class NoData(LightningDataModule):
    """A data module for a LightningCLI YAML that is only instantiated (``run=False``)."""


def our_gpt(**fields) -> GPT:
    torch.manual_seed(0)
    return perturb_(GPT(GPTConfig(**fields))).eval()
