"""Deterministic windows over token shards, addressed by a global sample index.

The whole resume story rests on one definition: the g-th global sample (g = 0, 1, 2, ...) is a
pure function of (seed, g) for a given corpus and `seq_len`:

    n_windows = sum over shards of (shard_tokens - 1) // seq_len
    epoch     = g // n_windows
    window    = permutation(seed, epoch)[g % n_windows]
    sample    = tokens[start(window) : start(window) + seq_len + 1]   (never crossing a shard)

Windows start every `seq_len` tokens, so within one epoch every token is a target exactly once
(the extra token of a window is the next window's first input). Global batch k is the samples
[k * G, (k + 1) * G) with G = micro_batch * dp_size, and data-parallel rank r reads the slice
[r * B, (r + 1) * B) of it. Nothing here depends on the number of ranks, which is why a run can
resume on a different data-parallel size and continue the very same sequence of samples.
"""

from __future__ import annotations

import collections
import functools
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from .shards import read_header, read_shard


class TokenWindows(Dataset):
    """Window `w` of a list of shards as `(x, y)` int64 tensors of `seq_len` tokens, y = x shifted by one.

    Shards are opened as memory maps lazily in each process, and not pickled: DataLoader workers
    started with "spawn" would otherwise receive a full in-memory copy of every shard.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
        self.paths = [Path(p) for p in paths]
        self.seq_len = seq_len
        self.shard_tokens = np.array([read_header(p) for p in self.paths], dtype=np.int64)
        per_shard = np.maximum(self.shard_tokens - 1, 0) // seq_len
        # window_offsets[i] = index of shard i's first window; searchsorted maps a window to its shard.
        self.window_offsets = np.concatenate([[0], np.cumsum(per_shard)])
        self._maps: list[np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.shard_tokens.sum())

    def __len__(self) -> int:
        return int(self.window_offsets[-1])

    def locate(self, window: int) -> tuple[int, int]:
        """(shard index, first token) of `window`."""
        if not 0 <= window < len(self):
            raise IndexError(f"window {window} out of range for {len(self)} windows")
        shard = int(np.searchsorted(self.window_offsets, window, side="right")) - 1
        return shard, int(window - self.window_offsets[shard]) * self.seq_len

    def __getitem__(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard, start = self.locate(int(window))
        if self._maps is None:
            self._maps = [read_shard(p, mmap=True) for p in self.paths]
        chunk = torch.from_numpy(self._maps[shard][start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = None
        return state


@functools.lru_cache(maxsize=2)
def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The order of the `n` windows in `epoch`: a pure function of (seed, epoch, n).

    Cached because consecutive batches nearly always fall in the same epoch; `n` = 10M windows
    (FineWeb-10B at seq_len 1024) costs ~80 MB and a fraction of a second, once per epoch.
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(n)


def global_windows(seed: int, start: int, count: int, n_windows: int, shuffle: bool = True) -> np.ndarray:
    """The window index of each global sample in [start, start + count)."""
    g = np.arange(start, start + count, dtype=np.int64)
    if not shuffle:
        return g % n_windows
    out = np.empty(count, dtype=np.int64)
    epochs = g // n_windows
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = epoch_permutation(seed, int(epoch), n_windows)[g[sel] % n_windows]
    return out


class GlobalSampleSampler(DistributedSampler):
    """Yields this data-parallel rank's window indices, global batch after global batch.

    Iteration starts at global sample `start()` (read at `iter()` time, so the datamodule can
    move it on resume) and yields `num_batches` micro-batches of `batch_size`: for global batch k,
    the windows of samples start + k*G + r*B ... start + k*G + (r+1)*B - 1.

    It subclasses `DistributedSampler` only so that Lightning recognises it as already
    distributed and does not replace it with its own (see `_requires_distributed_sampler` in
    lightning/pytorch/trainer/connectors/data_connector.py); none of the parent's index logic is
    used.
    """

    def __init__(
        self,
        dataset: TokenWindows,
        *,
        batch_size: int,
        dp_size: int,
        dp_rank: int,
        seed: int,
        start,
        num_batches: int,
        shuffle: bool = True,
        shift=None,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} is not in 0..{dp_size - 1}; check the strategy.")
        super().__init__(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False, drop_last=True)
        self.batch_size = batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.start = start if callable(start) else (lambda: start)
        self.shift = shift if shift is not None else (lambda: 0)
        self.num_batches = num_batches
        self.produced: collections.deque[int] = collections.deque(maxlen=4096)
        """The first global sample of each batch this iterator has produced and training has not
        consumed yet (the datamodule pops them): batches a loader prefetched before a ``seek``."""
        self.shuffle_windows = shuffle
        self.n_windows = len(dataset)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    def __len__(self) -> int:
        return self.num_batches * self.batch_size

    def __iter__(self) -> Iterator[int]:
        # Read the start now, not lazily in a generator: the first batch must begin exactly where
        # the datamodule says at the time the loader's iterator is created.
        return self._indices(int(self.start()), int(self.shift()))

    def _indices(self, start: int, shift0: int = 0) -> Iterator[int]:
        # Batch k starts at global sample start + k*G + (shift() - shift0): shift() is read as each batch is
        # produced, so a seek of the datamodule (a healed replica group jumping to its peers' data
        # position) moves every batch produced after it.
        G, B = self.global_batch_size, self.batch_size
        span = max(1, 4096 // G) * G  # samples resolved per numpy call: amortise, stay lazy
        self.produced.clear()
        base, windows = None, None
        for k in range(self.num_batches):
            position = start + k * G + int(self.shift()) - shift0
            if base is None or not base <= position <= base + len(windows) - G:
                base, windows = position, global_windows(self.seed, position, span, self.n_windows,
                                                         self.shuffle_windows)
            self.produced.append(position)
            offset = position - base + self.dp_rank * B
            yield from windows[offset : offset + B].tolist()

    def batch_windows(self, position: int) -> np.ndarray:
        """This rank's windows of the global batch that starts at global sample ``position``."""
        return global_windows(self.seed, position + self.dp_rank * self.batch_size, self.batch_size,
                              self.n_windows, self.shuffle_windows)

    def set_epoch(self, epoch: int) -> None:
        # Lightning calls this each epoch for DistributedSamplers; our epochs come from the global
        # sample index instead, so there is nothing to do.
        pass
