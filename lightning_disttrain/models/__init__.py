"""Plain-torch models: no Lightning imports here."""

from lightning_disttrain.models.gpt import GPT, PRESETS, Block, GPTConfig
from lightning_disttrain.models.moe import MoE, MoEConfig, moe_layers

__all__ = ["GPT", "GPTConfig", "Block", "PRESETS", "MoE", "MoEConfig", "moe_layers"]
