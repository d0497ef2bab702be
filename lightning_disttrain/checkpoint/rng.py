"""Per-rank random number generator state: captured at save, restored per rank at resume.

Every rank draws its own dropout masks (and whatever else uses the global generators), so each
rank's state is saved to its own file, ``rng/rank_{r:05d}.json``. JSON rather than a pickle: the
file is loadable without trusting it and readable by eye. Saved are torch's CPU generator, every
CUDA device's generator when CUDA is available, Python's ``random`` and NumPy's legacy global
generator (``np.random``).

Resuming on a different number of ranks (``saved`` ranks, now ``world_size``):

- rank ``r < saved`` restores rank ``r``'s state;
- rank ``r >= saved`` has no saved stream; it is seeded with a seed derived from saved rank
  ``r % saved``'s state and ``r`` (sha256 of both), so the run stays deterministic and ranks get
  distinct streams;
- the streams of saved ranks ``>= world_size`` are dropped.

Streams after a reshard therefore differ from the original run's: batches are split differently
anyway, so bitwise continuation is only promised for the same world size.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

RNG_DIR = "rng"


def rng_file(ckpt_dir: str | os.PathLike, rank: int) -> Path:
    return Path(ckpt_dir) / RNG_DIR / f"rank_{rank:05d}.json"


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states as a JSON-serialisable dict."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": [version, list(mt), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's generators from ``capture_rng_state`` output."""
    torch.set_rng_state(_unb64(state["torch"]))
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        saved = [_unb64(s) for s in state["cuda"]]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
        else:  # a different GPU count per node: derive them like missing ranks (module doc)
            for i in range(torch.cuda.device_count()):
                torch.cuda.default_generators[i].manual_seed(derive_seed(state, i))


def derive_seed(state: dict[str, Any], salt: int) -> int:
    """A 63-bit seed from a saved state and an integer (the new rank): deterministic, distinct."""
    digest = hashlib.sha256(json.dumps(state, sort_keys=True).encode() + b"|" + str(salt).encode())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds every CUDA device
    random.seed(seed)
    np.random.seed(seed % 2**32)


def save_rank_rng(ckpt_dir: str | os.PathLike, rank: int, state: dict[str, Any] | None = None) -> Path:
    from lightning_disttrain.checkpoint import storage

    if storage.is_url(ckpt_dir):
        url = storage.url_join(str(ckpt_dir), RNG_DIR, f"rank_{rank:05d}.json")
        storage.url_write(url, json.dumps(state if state is not None else capture_rng_state()).encode())
        return url
    path = rng_file(ckpt_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state if state is not None else capture_rng_state()))
    return path


def count_saved_ranks(ckpt_dir: str | os.PathLike) -> int:
    from lightning_disttrain.checkpoint import storage

    if storage.is_url(ckpt_dir):
        return sum(1 for rel in storage.url_files(str(ckpt_dir)) if rel.startswith(f"{RNG_DIR}/rank_"))
    folder = Path(ckpt_dir) / RNG_DIR
    return len(list(folder.glob("rank_*.json"))) if folder.is_dir() else 0


def load_rank_rng(ckpt_dir: str | os.PathLike, rank: int, saved_ranks: int) -> tuple[dict[str, Any] | None, int | None]:
    """What rank ``rank`` should restore: ``(state, None)`` for its own saved state,
    ``(None, seed)`` for a rank beyond the saved ones, ``(None, None)`` if nothing was saved."""
    if saved_ranks <= 0:
        return None, None
    from lightning_disttrain.checkpoint import storage

    if storage.is_url(ckpt_dir):
        def read(r: int) -> dict[str, Any]:
            return json.loads(storage.url_read(storage.url_join(str(ckpt_dir), RNG_DIR, f"rank_{r:05d}.json")))

        return (read(rank), None) if rank < saved_ranks else (None, derive_seed(read(rank % saved_ranks), rank))
    if rank < saved_ranks:
        return json.loads(rng_file(ckpt_dir, rank).read_text()), None
    source = json.loads(rng_file(ckpt_dir, rank % saved_ranks).read_text())
    return None, derive_seed(source, rank)


def apply_rank_rng(state: dict[str, Any] | None, seed: int | None) -> None:
    if state is not None:
        restore_rng_state(state)
    elif seed is not None:
        seed_all(seed)
