"""``lightning-disttrain export CKPT OUT --format hf``: a GPTModule checkpoint directory, or a file
written by ``export``, as a Hugging Face model directory that ``transformers`` loads
(``AutoModelForCausalLM.from_pretrained(OUT)``). The conversion itself is ``models/hf.py``; this
reads the model and its config from either source, in one process.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lightning_disttrain.checkpoint.consolidate import (
    DEFAULT_PREFIX,
    HPARAMS_KEY,
    _manifest_or_none,
    _meta_for_model_export,
    _model_config,
    _read_dcp,
    read_exported,
    strip_prefix,
)
from lightning_disttrain.checkpoint.dcp_io import MODEL_KEY
from lightning_disttrain.checkpoint.manifest import verify_checkpoint
from lightning_disttrain.models.gpt import GPTConfig
from lightning_disttrain.models.hf import save_hf


def read_model(source: str | os.PathLike, *, verify: bool = True,
               trust_checkpoint: bool = False) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The GPT config and state dict (GPT names) of a checkpoint directory or an exported file
    (DCP's ``.metadata`` unpickled with restrictions unless ``trust_checkpoint``)."""
    path = Path(source)
    if path.is_dir():
        if verify:
            verify_checkpoint(path)
        else:
            _manifest_or_none(path)
        state = _read_dcp(path, {MODEL_KEY}, trust_checkpoint).get(MODEL_KEY)
        if state is None:
            raise ValueError(f"{str(path)!r} holds no model state under {MODEL_KEY!r}; pass a checkpoint directory "
                             f"written by a lightning-disttrain strategy, or a file written by `export`")
        state = strip_prefix(state, DEFAULT_PREFIX)
        config = _model_config(_meta_for_model_export(path).get(HPARAMS_KEY))
    elif path.is_file():
        exported = read_exported(path, prefix=DEFAULT_PREFIX)
        state, config = exported.state_dict, exported.model_config
    else:
        raise ValueError(f"{str(path)!r} does not exist; pass a checkpoint directory or a file written by `export`")
    if config is None:
        raise ValueError(f"{str(path)!r} carries no GPTModule config (no hyper-parameter `config`), so its "
                         f"architecture is unknown; export a checkpoint of a GPTModule run")
    try:
        return GPTConfig(**config), state
    except TypeError as err:
        raise ValueError(f"the model config stored in {str(path)!r} is not a GPTConfig ({err})") from err


def export_hf(source: str | os.PathLike, out_dir: str | os.PathLike, *, verify: bool = True,
              dtype: torch.dtype | None = None, tokenizer: bool | None = None,
              trust_checkpoint: bool = False) -> Path:
    """Write ``out_dir`` (config.json, model.safetensors, and GPT-2's tokenizer files when the
    vocabulary is GPT-2's) from a checkpoint directory or an exported file; returns ``out_dir``.
    ``ValueError`` when the model has no ``transformers`` equivalent (see ``models.hf.hf_architecture``)."""
    config, state = read_model(source, verify=verify, trust_checkpoint=trust_checkpoint)
    return save_hf(config, state, out_dir, dtype=dtype, tokenizer=tokenizer)
