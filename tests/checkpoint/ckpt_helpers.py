"""Helpers for the single-process checkpoint tests: real DCP checkpoints of a tiny GPT."""

from __future__ import annotations

import torch
from torch import nn

from lightning_disttrain.checkpoint import CheckpointWriter
from lightning_disttrain.models.gpt import GPT, GPTConfig

VOCAB = 257


class Wrapper(nn.Module):
    """Stands in for a LightningModule: the GPT lives under ``.model`` (keys ``model.*``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = GPT(GPTConfig.from_name("tiny", vocab_size=VOCAB, n_layer=2))


def train_a_bit(module: nn.Module, steps: int = 2, seed: int = 0) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (2, 16), generator=g)
        module.model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def dcp_state(module: nn.Module, opt: torch.optim.Optimizer, nested: bool = False) -> dict:
    """What the strategies save: the optimizer state flattened (``nested``: the form checkpoints
    had before pipeline parallel, which must still load)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from lightning_disttrain.checkpoint.dcp_io import optimizer_state_options

    return {"state_dict": get_model_state_dict(module),
            "optimizer_0": get_optimizer_state_dict(module, opt, options=optimizer_state_options(not nested))}


def save(path, module, opt, step: int = 0, writer: CheckpointWriter | None = None, meta: dict | None = None):
    writer = writer or CheckpointWriter()
    writer.save(path, dcp_state(module, opt), meta if meta is not None else {"global_step": step, "epoch": 0},
                global_step=step, epoch=0)
    return path
