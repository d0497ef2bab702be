"""A W&B logger that runs offline unless the user has an API key, so configs work anywhere."""

from __future__ import annotations

import netrc
import os

from lightning.pytorch.loggers import WandbLogger


def wandb_key_available() -> bool:
    """True when W&B could authenticate: ``WANDB_API_KEY`` or an ``api.wandb.ai`` netrc entry."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class AutoWandbLogger(WandbLogger):
    """``WandbLogger`` with ``offline`` chosen for you: online with a key, offline (files under
    ``save_dir/wandb``, sync later with ``wandb sync``) without one. ``WANDB_MODE`` still wins."""

    def __init__(self, *args, offline: bool | None = None, **kwargs) -> None:
        if offline is None:
            offline = os.environ.get("WANDB_MODE", "") in ("offline", "disabled") or not wandb_key_available()
        super().__init__(*args, offline=offline, **kwargs)
