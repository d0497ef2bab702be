"""lightning-disttrain: large-model parallelism as a plug-in for PyTorch Lightning.

Public API: ``GPTConfig``, ``GPT``, ``GPTModule``, ``TokenDataModule``, the strategies
(``lightning_disttrain.strategies``) and callbacks (``lightning_disttrain.callbacks``).
"""

from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.module import GPTModule

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "GPTModule", "TokenDataModule", "__version__"]


def __getattr__(name: str):
    if name == "TokenDataModule":
        from lightning_disttrain.data import TokenDataModule

        return TokenDataModule
    raise AttributeError(f"module 'lightning_disttrain' has no attribute {name!r}")
