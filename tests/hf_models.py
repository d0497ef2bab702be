"""Third-party model code for the callback tests: Hugging Face models built from tiny configs with
random weights (nothing downloaded), and the LightningModule a user would write around one.

The module knows nothing about lightning-disttrain: no ``flops_per_token``, no ``parallel_plan``;
its blocks are found as the largest ``nn.ModuleList`` of identical layers. It does not pass
``use_cache``, so the models run with their configs' default (``use_cache=True``), as a user's
code would.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

VOCAB = 128
SEQ = 32


def gpt2(n_layer: int = 2, dropout: float = 0.0) -> nn.Module:
    """GPT-2 (``Conv1D`` projections, learned positions, head tied to the token embedding)."""
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def llama(n_layer: int = 2, tied: bool = False) -> nn.Module:
    """LLaMA (``nn.Linear`` projections, RoPE, RMSNorm, SwiGLU, grouped-query attention)."""
    config = transformers.LlamaConfig(num_hidden_layers=n_layer, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, tie_word_embeddings=tied,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def bert(n_layer: int = 2) -> nn.Module:
    """BERT encoder: its FFN output projections are ``encoder.layer.N.output.dense``."""
    config = transformers.BertConfig(num_hidden_layers=n_layer, hidden_size=64, intermediate_size=128,
                                     num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64)
    return transformers.BertModel(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama}


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a model built here."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def kv_cache(output):
    """The KV cache a model returned (``cache`` in transformers 5, ``past_key_values`` in 4)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def causal_lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


class HFCausalLM(pl.LightningModule):
    """A Hugging Face causal LM trained on ``(x, y)`` next-token batches, built in ``__init__``."""

    def __init__(self, name: str = "llama", lr: float = 1e-3, seed: int = 0, **model_kwargs) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = MODELS[name](**model_kwargs)
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = causal_lm_loss(self.model, *batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def token_batches(n: int, batch_size: int, seq: int = SEQ, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, VOCAB, (batch_size, seq + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out
