"""Random streams under a layout: one seed the ranks agree on, and, for a module that declares it,
a training stream per rank that is independent where ranks see different activations and equal
where they hold copies.

Whose policy (issue 40): a module that declares nothing keeps the global generators exactly as
Lightning's strategies leave them (``seed_everything``'s seed, restored by ``reset_seed`` at
setup, then whatever its own hooks draw): a project moved over from Lightning draws the same numbers
at every hook (``strategies/migration.py`` says where a meta-device build is the exception), and
its replicas initialise alike however late. The per-rank streams
below are this package's policy, for the modules that ask for it (``GPTModule``):
``independent_training_streams = True`` on the class (``declares_training_streams``). The
strategies (``NDParallelStrategy.setup``) call ``seed_training_streams`` for those and
``agree_on_streams`` for every other module.

- ``agreed_seed``: rank 0's seed, on every rank (one broadcast through ``comm``, staged on the
  group's device). Initialisation (``models.param_init``) derives every weight from it, so ranks
  that were not seeded alike still build one model.
- ``seed_training_streams``: for a module that declares it, each rank's global generators (CPU
  and accelerator) restart at setup from a seed of ``(agreed seed, data-parallel rank, pipeline
  rank)``. Data-parallel ranks (their own samples) and pipeline stages (their own blocks) draw
  independent dropout masks; the ranks of a tensor-parallel group share the key, so dropout on
  activations they hold replicated (the residual stream without sequence parallel, the embedding
  output) draws the same mask on each copy, as it must.

  Known difference from one process (docs/guides/existing-project.md): with sequence parallel, the TP
  ranks of a group draw *the same* mask for their *different* sequence shards, and attention
  dropout draws the same mask for the different heads each TP rank holds. The masks are
  correlated across those shards, not wrong in distribution; one process would draw one mask over
  the whole sequence and all heads. A module that declares these streams initialises nothing
  replicated from the global generator after setup (its data-parallel replicas draw different
  numbers there): ``GPTModule`` initialises by parameter name (``models.param_init``).

- ``agree_on_streams``: for a module that does not declare them, the ranks' global generators made
  equal (rank 0's) where they are not: ranks that were not seeded alike (no ``seed_everything``)
  would otherwise initialise their copies of a replicated parameter differently in a late
  ``init_weights()``, and train apart without noticing. Ranks seeded alike keep their streams
  untouched, so a seeded run is Lightning's, draw for draw.

Every rank calls ``agreed_seed`` and ``agree_on_streams`` (collectives over the world). Plain
torch, no Lightning.
"""

from __future__ import annotations

import hashlib
import warnings

import torch

from lightning_disttrain import comm
from lightning_disttrain.models.param_init import base_seed, derived_seed

STREAMS_ATTRIBUTE = "independent_training_streams"


def declares_training_streams(module: object) -> bool:
    """Whether ``module`` asks for ``seed_training_streams`` (the class attribute
    ``independent_training_streams = True``). Anything but a bool is refused: a string such as
    ``"no"`` would otherwise read as a yes."""
    value = getattr(module, STREAMS_ATTRIBUTE, False)
    if not isinstance(value, bool):
        raise ValueError(f"{type(module).__name__}.{STREAMS_ATTRIBUTE}={value!r}: set it to True (this package's "
                         f"per-rank training streams) or False (the global streams as Lightning's strategies "
                         f"leave them)")
    return value


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


def _states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def agree_on_streams(device: torch.device) -> bool:
    """If the ranks' global generators (CPU, and ``device``'s when it is a CUDA device) differ,
    give every rank global rank 0's states (with a warning on rank 0); returns whether they
    differed. Equal states are left alone: one exchange of a digest per rank."""
    states = _states(torch.device(device))
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in states)).hexdigest()
    if len(set(comm.all_gather_object(digest))) <= 1:
        return False
    for t in states:
        comm.broadcast(t, group_src=0)
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1], torch.device(device))
    if comm.rank() == 0:
        warnings.warn("the ranks' global random generators differed at setup (not seeded alike: seed_everything(N) "
                      "seeds them alike); every rank continues rank 0's, so that replicas a hook initialises "
                      "later agree", stacklevel=2)
    return True
