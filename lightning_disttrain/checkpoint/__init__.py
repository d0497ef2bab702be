"""Checkpoints: sharded DCP directories with a sha256 manifest, resume discovery, retention, export.

The strategy side (Lightning's save/load hooks) is ``lightning_disttrain.strategies.checkpointing.
DCPCheckpointMixin``; everything here is usable without Lightning. The ``export`` command is
``checkpoint.command`` (not re-exported here: it imports the Hugging Face writer,
``checkpoint.hf_export``, which sits above this package in the layers of ``docs/architecture.md``).
"""

from lightning_disttrain.checkpoint.consolidate import (
    EXPORT_FORMAT,
    EXPORT_FORMAT_VERSION,
    Exported,
    export_consolidated,
    gpt_from_exported,
    load_consolidated,
    load_consolidated_into,
    read_exported,
)
from lightning_disttrain.checkpoint.dcp_io import META_NAME, CheckpointWriter, load_sharded, remove_checkpoint_path
from lightning_disttrain.checkpoint.discovery import (
    describe_checkpoint,
    find_latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
)
from lightning_disttrain.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointVerificationError,
    IncompleteCheckpointError,
    Manifest,
    read_manifest,
    verify_checkpoint,
)

__all__ = [
    "EXPORT_FORMAT",
    "EXPORT_FORMAT_VERSION",
    "MANIFEST_NAME",
    "META_NAME",
    "CheckpointVerificationError",
    "CheckpointWriter",
    "Exported",
    "IncompleteCheckpointError",
    "Manifest",
    "describe_checkpoint",
    "export_consolidated",
    "find_latest_checkpoint",
    "gpt_from_exported",
    "list_checkpoints",
    "load_consolidated",
    "load_consolidated_into",
    "load_sharded",
    "prune_checkpoints",
    "read_exported",
    "read_manifest",
    "remove_checkpoint_path",
    "verify_checkpoint",
]
