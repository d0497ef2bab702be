"""The fixed order in which model transforms run (DESIGN.md) and the registry callbacks use.

A strategy owns one ``TransformRegistry``. Callbacks that change the model (float8, activation
checkpointing) register a function at their stage instead of wrapping modules themselves; the
strategy runs every stage in ``STAGES`` order once the model is built, so each transform sees the
model in the state its stage expects (float8 sees plain ``nn.Linear``, FSDP wraps last, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

STAGES: tuple[str, ...] = (
    "dtype",                     # 1. e.g. float8 Linear swap: must see plain nn.Linear
    "tensor_parallel",           # 2. TP / SP / loss parallel: shards weights before FSDP does (2-D)
    "expert_parallel",           # 3. experts leave the dense FSDP group
    "pipeline",                  # 4. each rank keeps only its blocks
    "activation_checkpointing",  # 5. wraps whole blocks, after TP so plans see real names
    "compile",                   # 6. per-block torch.compile, after AC so the policy is traced
    "fsdp",                      # 7. fully_shard per block then the root: outermost
)


@dataclass
class TransformContext:
    """What a transform may read about the parallel layout it runs under."""

    device: torch.device
    mesh: Any = None
    """The strategy's ``DeviceMesh`` (None on a single device)."""
    dims: Any = None
    """The strategy's ``ParallelDims`` (None on a single device)."""
    precision: str | None = None
    """The Trainer's precision string, e.g. ``"bf16-mixed"``."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Facts one transform leaves for a later one (e.g. float8 tells FSDP to all-gather in fp8)."""


Transform = Callable[[nn.Module, TransformContext], None]
"""Changes the LightningModule (or model) in place at its stage."""


@dataclass
class _Entry:
    stage: str
    name: str
    fn: Transform


class TransformRegistry:
    """Transforms by stage; within one stage they run in registration order."""

    def __init__(self) -> None:
        self._entries: list[_Entry] = []

    def register(self, stage: str, fn: Transform, name: str | None = None) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown transform stage {stage!r}; use one of {STAGES}")
        name = name or getattr(fn, "__qualname__", repr(fn))
        if any(e.name == name and e.stage == stage for e in self._entries):
            return  # registering twice (e.g. setup called again) must not apply twice
        self._entries.append(_Entry(stage, name, fn))

    def has(self, stage: str) -> bool:
        return any(e.stage == stage for e in self._entries)

    def names(self) -> list[tuple[str, str]]:
        """(stage, name) in the order they will run."""
        return [(e.stage, e.name) for e in self._ordered()]

    def apply_stage(self, stage: str, module: nn.Module, ctx: TransformContext) -> None:
        for e in self._entries:
            if e.stage == stage:
                e.fn(module, ctx)

    def apply_all(self, module: nn.Module, ctx: TransformContext) -> None:
        for stage in STAGES:
            self.apply_stage(stage, module, ctx)

    def _ordered(self) -> list[_Entry]:
        return sorted(self._entries, key=lambda e: STAGES.index(e.stage))


def compile_transform(options: dict[str, Any] | None = None) -> Transform:
    """The ``compile`` stage as a transform: ``apply_compile`` on the module's plan blocks."""
    options = dict(options or {})

    def compile_blocks(module: nn.Module, ctx: TransformContext) -> None:
        # Imported when run: compile.py pulls in torch._dynamo, which most runs never need.
        from lightning_disttrain.parallel.compile import apply_compile
        from lightning_disttrain.parallel.plan import find_parallel_plan

        apply_compile(find_parallel_plan(module).blocks, **options)

    return compile_blocks
