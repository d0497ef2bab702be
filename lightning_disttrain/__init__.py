"""lightning-disttrain: large-model parallelism as a plug-in for PyTorch Lightning.

Public API: ``GPTConfig``, ``GPT``, ``GPTModule``, ``TokenDataModule``, the loaders
``gpt_from_exported`` (a file written by ``export``) and ``gpt_from_hf`` (a Hugging Face
directory), the strategies (``lightning_disttrain.strategies``: importing the package registers ``fsdp2``, ``fsdp2_zero2``
and ``hsdp`` with Lightning) and the callbacks (``lightning_disttrain.callbacks``).
"""

import warnings

# torch 2.13 deprecates constructing `LeafSpec` (FutureWarning: "`isinstance(treespec, LeafSpec)` is
# deprecated"), and Lightning 2.6's own pytree copy (lightning/pytorch/utilities/_pytree.py) still
# calls `LeafSpec()` whenever it flattens logged values: the warning names no user code and no user
# can act on it. Only that message from that module is ignored; remove this once Lightning builds
# leaves with `torch.utils._pytree.treespec_leaf()`.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
                        module=r"lightning\.pytorch\.utilities\._pytree$")

from lightning_disttrain import callbacks, strategies  # noqa: F401  (strategies: registers names)
from lightning_disttrain.checkpoint.consolidate import gpt_from_exported
from lightning_disttrain.data import TokenDataModule, get_tokenizer
from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.models.hf import gpt_from_hf
from lightning_disttrain.module import GPTModule

__version__ = "0.1.0"

__all__ = ["GPT", "GPTConfig", "GPTModule", "TokenDataModule", "get_tokenizer", "gpt_from_exported", "gpt_from_hf", "callbacks", "strategies",
           "__version__"]
