"""Plain-torch models: no Lightning imports here."""

from lightning_disttrain.models.gpt import GPT, PRESETS, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "PRESETS"]
