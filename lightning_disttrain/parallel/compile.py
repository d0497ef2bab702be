"""Per-block ``torch.compile`` and a watcher that turns silent recompilations into warnings.

Why per block, not the whole model: the blocks are identical, so dynamo compiles one graph and
every block reuses it (nn.Module parameters are graph inputs, ``inline_inbuilt_nn_modules``), a
12-block model compiles about as fast as one block; graph breaks outside the blocks (data-
dependent code in the head, the loss) do not split the hot path; and FSDP2's per-block hooks,
applied after this, stay outside compiled code (DESIGN.md, stage 6 before stage 7).

Why ``block.compile()`` rather than ``blocks[i] = torch.compile(block)``: ``Module.compile``
compiles the block's ``__call__`` in place, so the module tree and every parameter name stay as
they were (``torch.compile(block)`` returns an ``OptimizedModule`` that adds ``_orig_mod.`` to
every FQN, which breaks checkpoints and TP plans). Activation checkpointing applied before this
(stage 5) is traced into the graph, its SAC policy included.

Recompilations: a shape change between steps (the last, shorter batch; variable sequence length)
makes dynamo recompile the blocks, which is slow and, past ``torch.compiler.config.recompile_limit``
(8), falls back to eager for good, silently apart from one log line. ``RecompileWatcher.check`` is
called by the strategy once per training step and warns with dynamo's own reason.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from lightning_disttrain import _torch_compat as torch_compat


def apply_compile(
    blocks: nn.ModuleList | nn.ModuleDict,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    backend: str = "inductor",
    mode: str | None = None,
) -> None:
    """``torch.compile`` each block in place (FQNs unchanged). Compilation itself is lazy: it
    happens on the first forward.

    Args:
        fullgraph: fail on a graph break inside a block instead of splitting the graph.
        dynamic: ``None`` (dynamo's default: static first, then dynamic for the dims that
            changed), ``True`` (dynamic from the start, no recompile per sequence length) or
            ``False`` (one graph per shape).
        backend: ``"inductor"`` (fused kernels), or ``"aot_eager"`` / ``"eager"`` to debug.
        mode: inductor's mode, e.g. ``"max-autotune"``; only with ``backend="inductor"``.
    """
    if mode is not None and backend != "inductor":
        raise ValueError(f"compile mode={mode!r} is an inductor option but backend={backend!r}; "
                         f"use backend='inductor' or leave mode=None")
    from lightning_disttrain.parallel.plan import as_block_list

    blocks = as_block_list(blocks)
    if not blocks:
        raise ValueError("apply_compile got no blocks; pass the model's nn.ModuleList / nn.ModuleDict of blocks")
    options: dict[str, Any] = dict(fullgraph=fullgraph, dynamic=dynamic, backend=backend)
    if mode is not None:
        options["mode"] = mode
    for block in blocks:
        block.compile(**options)


class RecompileWarning(UserWarning):
    """torch.compile recompiled (or gave up compiling) a function after the first compile."""


@dataclass(frozen=True)
class Recompile:
    """One recompilation dynamo recorded."""

    function: str
    """The recompiled function, ``name (file:line)``."""
    reason: str
    """Dynamo's guard failure, e.g. ``tensor 'x' size mismatch at index 1. expected 512,
    actual 384``."""
    compile_id: str
    """Dynamo's id, ``frame/attempt`` (``0/1``: frame 0's second compile)."""
    limit_hit: bool = False
    """True when this recompile exceeded ``recompile_limit``: the function now runs eagerly."""


def _compilation_metrics() -> list:
    # Private but stable since 2.2: one CompilationMetrics per dynamo frame compile, with the
    # guard failure that caused it (``recompile_reason``) whether or not recompile logging is on.
    return torch_compat.compilation_metrics()


class RecompileWatcher:
    """Reports dynamo recompilations since the previous ``poll``/``check``.

    Create it once (after ``apply_compile``) and call ``check(step)`` once per training step, e.g.
    from the strategy's ``on_train_batch_start``: it warns (``RecompileWarning``) for each
    recompilation that happened in between. It sees every ``torch.compile`` in the process,
    not only the blocks'. Dynamo keeps its last 64 records; polled every step, none are missed.
    """

    def __init__(self) -> None:
        metrics = _compilation_metrics()
        self._last = metrics[-1] if metrics else None
        self.recompiles: list[Recompile] = []
        """Every recompilation seen so far."""

    def poll(self) -> list[Recompile]:
        """Recompilations since the last call (or construction), oldest first."""
        metrics = _compilation_metrics()
        start = 0
        for i in range(len(metrics) - 1, -1, -1):
            if metrics[i] is self._last:
                start = i + 1
                break
        new = metrics[start:]  # our marker gone (reset, or >64 compiles since): all are new
        if metrics:
            self._last = metrics[-1]
        found = []
        for m in new:
            if m.recompile_reason is None:
                continue  # a first compile (or the backward graph of one) is expected
            limit_hit = "recompile limit" in (m.fail_reason or "")
            where = (f"{m.co_name} ({m.co_filename}:{m.co_firstlineno})" if m.co_name
                     else "a function")
            found.append(Recompile(function=where, reason=m.recompile_reason,
                                   compile_id=str(m.compile_id), limit_hit=limit_hit))
        self.recompiles.extend(found)
        return found

    def check(self, step: int | None = None) -> list[Recompile]:
        """``poll``, and ``warnings.warn`` a ``RecompileWarning`` for each recompilation found."""
        found = self.poll()
        at = f" before step {step}" if step is not None else ""
        for r in found:
            if r.limit_hit:
                consequence = (f"this exceeded torch.compiler.config.recompile_limit="
                               f"{torch.compiler.config.recompile_limit}: it now runs eagerly")
            else:
                consequence = "recompiling costs time on every new shape"
            warnings.warn(
                f"torch.compile recompiled {r.function}{at} [{r.compile_id}] because {r.reason}; "
                f"{consequence}. Shapes that change between steps (sequence length, a short last "
                f"batch) recompile: keep them fixed (pad, drop_last=True) or compile with "
                f"dynamic=True.", RecompileWarning, stacklevel=2)
        return found
