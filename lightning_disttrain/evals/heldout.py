"""Held-out loss and perplexity on a fixed corpus: the ``heldout`` task.

The corpus is a fixed set of token windows (``seq_len + 1`` tokens each: inputs and their
next-token targets), the same at every checkpoint so that the numbers compare:

- ``"val"``: the data module's validation set: ``TokenDataModule``'s validation windows, or the
  (x, y) batches of any data module's ``val_dataloader()``, in order;
- a ``.txt`` file, tokenized with the run's tokenizer and cut into consecutive windows;
- a ``.bin`` token shard (llm.c format, as ``prepare`` writes);
- a ``.pt`` file holding the windows themselves, an int64 tensor (N, seq_len + 1) (how
  ``CheckpointEval(mode="subprocess")`` hands the validation windows to the eval command).

``loss`` is the mean next-token cross-entropy over every token of every window (fp32, padding
columns of the vocabulary cut); ``ppl`` = exp(loss). Windows are split across data-parallel ranks
like the requests (``parallel_scoring``), token sums gathered.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_disttrain.evals.parallel_scoring import DataParallel, Forward, filler, forwards_per_rank, shard


def windows_from_tokens(tokens: list[int] | torch.Tensor, seq_len: int, limit: int | None) -> torch.Tensor:
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n = max(len(tokens) - 1, 0) // seq_len
    if limit is not None:
        n = min(n, limit)
    if n == 0:
        raise ValueError(f"the held-out corpus has {len(tokens)} tokens, fewer than one window of seq_len {seq_len} + 1; "
                         f"give a longer corpus or a smaller heldout_seq_len")
    return torch.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


def _from_datamodule(datamodule: Any, limit: int | None) -> torch.Tensor:
    windows = getattr(datamodule, "val_windows", None)
    if windows is not None:  # TokenDataModule: the validation windows themselves, not its per-rank loader
        n = len(windows) if limit is None else min(limit, len(windows))
        return torch.stack([torch.cat([windows[i][0], windows[i][1][-1:]]) for i in range(n)])
    loader = datamodule.val_dataloader() if callable(getattr(datamodule, "val_dataloader", None)) else None
    rows: list[torch.Tensor] = []
    for batch in loader or []:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(f"heldout='val' needs val_dataloader() batches of (inputs, targets) token ids; "
                             f"{type(datamodule).__name__} gives {type(batch).__name__}: pass heldout= a .txt or .bin file")
        x, y = batch
        rows.extend(torch.cat([x, y[:, -1:]], dim=1).long())
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise ValueError(f"heldout='val': {type(datamodule).__name__} has no validation data; pass heldout= a .txt "
                         f"or .bin file, or set up validation data")
    return torch.stack(rows[:limit])


def load_windows(source: str, *, tokenizer=None, seq_len: int = 256, limit: int | None = None,
                 datamodule: Any = None) -> torch.Tensor:
    """The held-out windows (N, seq_len + 1) of ``source`` (see the module docstring)."""
    if source == "val":
        if datamodule is None:
            raise ValueError("heldout='val' uses the data module's validation set, and there is none here "
                             "(the eval command has no data module); pass heldout= a .txt or .bin file")
        return _from_datamodule(datamodule, limit)
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"heldout={source!r} does not exist; give 'val' (the data module's validation set), "
                         f"a .txt file or a .bin token shard")
    if path.suffix == ".pt":
        windows = torch.load(path, weights_only=True)
        if not (isinstance(windows, torch.Tensor) and windows.dim() == 2 and windows.size(1) > 1):
            raise ValueError(f"heldout={source!r} must hold an int64 tensor of windows (N, seq_len + 1)")
        return windows.long()[:limit]
    if path.suffix == ".bin":
        from lightning_disttrain.data.shards import read_shard

        return windows_from_tokens(torch.from_numpy(read_shard(path).astype("int64")), seq_len, limit)
    if tokenizer is None:
        raise ValueError(f"heldout={source!r} is text: a tokenizer is needed to read it")
    return windows_from_tokens(tokenizer.encode(path.read_text(encoding="utf-8")), seq_len, limit)


def heldout_metrics(forward: Forward, windows: torch.Tensor, dp: DataParallel, *, vocab: int, batch_size: int,
                    device: torch.device, multiple: int = 1) -> dict[str, float]:
    """``{"loss", "ppl"}`` over all windows (every rank gets the same numbers)."""
    mine = shard(len(windows), dp)
    nll, count = 0.0, 0
    for start in range(0, len(mine), batch_size):
        batch = windows[mine[start:start + batch_size]].to(device)
        logits = forward(batch[:, :-1])[..., :vocab].float()
        nll += float(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").double())
        count += batch[:, 1:].numel()
    for _ in range(forwards_per_rank(len(windows), dp, batch_size) - math.ceil(len(mine) / batch_size)):
        filler(forward, device, multiple)
    parts = dp.all_gather((nll, count))
    loss = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0))}
