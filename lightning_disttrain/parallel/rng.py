"""Random streams under a layout: one seed the ranks agree on, and a training stream per rank
that is independent where ranks see different activations and equal where they hold copies.

- ``agreed_seed``: rank 0's seed, on every rank (one broadcast through ``comm``, staged on the
  group's device). Initialisation (``models.param_init``) derives every weight from it, so ranks
  that were not seeded alike still build one model.
- ``seed_training_streams``: each rank's global generators (CPU and accelerator) restart from a
  seed of ``(agreed seed, data-parallel rank, pipeline rank)``. Data-parallel ranks (their own
  samples) and pipeline stages (their own blocks) draw independent dropout masks; the ranks of a
  tensor-parallel group share the key, so dropout on activations they hold replicated (the
  residual stream without sequence parallel, the embedding output) draws the same mask on each
  copy, as it must.

  Known difference from one process (documented in the README): with sequence parallel, the TP
  ranks of a group draw *the same* mask for their *different* sequence shards, and attention
  dropout draws the same mask for the different heads each TP rank holds. The masks are
  correlated across those shards, not wrong in distribution; one process would draw one mask over
  the whole sequence and all heads.

Every rank calls both (collective over the world). Plain torch, no Lightning.
"""

from __future__ import annotations

import torch

from lightning_disttrain import comm
from lightning_disttrain.models.param_init import base_seed, derived_seed

def agreed_seed() -> int:
    """``models.param_init.base_seed()`` of global rank 0, on every rank."""
    seed = torch.tensor([base_seed()], dtype=torch.int64)
    return int(comm.broadcast(seed, group_src=0).item())


def stream_seed(seed: int, dp_rank: int, pp_rank: int) -> int:
    """The training stream's seed of the ranks at data-parallel rank ``dp_rank`` and pipeline rank
    ``pp_rank`` (stable across processes and Python versions). The first data-parallel rank of
    the first stage keeps ``seed`` itself, as a one-process run does."""
    if dp_rank == 0 and pp_rank == 0:
        return seed
    return derived_seed(seed, f"train/dp{dp_rank}/pp{pp_rank}")


def seed_training_streams(seed: int, dp_rank: int, pp_rank: int) -> int:
    """Restart this rank's global generators (``torch.manual_seed``: CPU and every accelerator
    device) from ``stream_seed``; returns that seed."""
    s = stream_seed(seed, dp_rank, pp_rank)
    torch.manual_seed(s)
    return s
