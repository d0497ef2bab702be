"""Context parallel, the step side: each rank of a ``cp`` group trains on its load-balanced shard
of every sequence of the batch (``models.context_parallel``); mixed first into
``NDParallelStrategy`` so that the pipeline and plain steps both receive the shard.

The cp ranks of one data-parallel replica load the same samples (the sampler is over the ``dp``
ranks); here each keeps its chunks of dimension 1 (the sequence) of every tensor of the batch. The
loss a rank computes is the mean over its tokens, and every rank holds the same number of tokens,
so averaging over the data-parallel and cp ranks (FSDP's gradient reduction over ``dp_shard x cp``,
the logged loss over ``dp_cp``) is the mean over the whole batch.

The positions of the shard are recorded on the model's ``ContextParallel`` (``ContextParallel.shard``)
as the batch is sharded: every pipeline stage takes its RoPE / position rows from there, since a
later stage's input is hidden states whose length is not the shard's (1/tp of it under sequence
parallel).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_disttrain.models.context_parallel import ContextParallel, check_length, shard_sequence


class ContextStepMixin:
    """Shards each batch's sequences before the step when cp > 1."""

    @property
    def context_parallel_size(self) -> int:
        dims = getattr(self, "_parallel_dims", None)
        return dims.cp if dims is not None else 1

    def _shard_batch(self, batch: Any) -> Any:
        dims = self.parallel_dims  # type: ignore[attr-defined]
        rank, size = dims.local_rank("cp"), dims.cp
        lengths: set[int] = set()

        def shard(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                lengths.add(value.size(1))
                check_length(value.size(1), size)
                return shard_sequence(value, 1, rank, size)
            if isinstance(value, list):
                return [shard(v) for v in value]
            if isinstance(value, tuple):  # a named tuple is rebuilt from its fields in order
                items = [shard(v) for v in value]
                return tuple(items) if type(value) is tuple else type(value)(*items)
            if isinstance(value, dict):
                return {k: shard(v) for k, v in value.items()}
            return value

        out = shard(batch)
        if len(lengths) == 1:
            seq_len = next(iter(lengths))
            device = next((t.device for t in _tensors(out)), None)
            for cp in self._context_parallels():
                cp.shard(seq_len, device)
        if not lengths:
            raise ValueError(f"cp={size} shards each batch along its sequence dimension (dim 1 of every tensor of at "
                             f"least 2 dimensions), but this batch ({type(batch).__name__}) has none: give the "
                             f"model (batch, sequence, ...) tensors, or use cp=1")
        if len(lengths) > 1:
            raise ValueError(f"cp={size}: the batch's tensors have different sequence lengths {sorted(lengths)} in "
                             f"dimension 1; context parallel shards them all the same way, so they must agree")
        return out

    def _context_parallels(self) -> list[ContextParallel]:
        """The ``ContextParallel`` of the model's modules and of this rank's pipeline stages (one
        per model: every module of it shares the object)."""
        roots = [getattr(self, "lightning_module", None), *getattr(self, "pipeline_stage_modules", ())]
        found: dict[int, ContextParallel] = {}
        for root in roots:
            for m in () if root is None else root.modules():
                cp = getattr(m, "context_parallel", None)
                if isinstance(cp, ContextParallel):
                    found[id(cp)] = cp
        return list(found.values())

    def _sharded(self, args: tuple) -> tuple:
        if self.context_parallel_size == 1 or not args:
            return args
        return (self._shard_batch(args[0]), *args[1:])

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().training_step(*self._sharded(args), **kwargs)  # type: ignore[misc]

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().validation_step(*self._sharded(args), **kwargs)  # type: ignore[misc]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().test_step(*self._sharded(args), **kwargs)  # type: ignore[misc]

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().predict_step(*self._sharded(args), **kwargs)  # type: ignore[misc]


def _tensors(value: Any):
    """The tensors of a (nested) batch, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
