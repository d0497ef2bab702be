"""Model transforms that callbacks contribute, and the stages of the recipe they run at.

A strategy owns one ``TransformRegistry``. Callbacks that change the model (float8, activation
checkpointing) register a function at their stage instead of wrapping modules themselves;
``recipe.parallelize`` runs each stage's transforms at that stage's place in the fixed order
(DESIGN.md), so each sees the model in the state it expects (float8 sees plain ``nn.Linear``,
activation checkpointing sees tensor-parallel blocks, FSDP wraps last).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

STAGES: tuple[str, ...] = (
    "dtype",                     # 1. e.g. float8 Linear swap: must see plain nn.Linear
    "pipeline",                  # 2. each rank keeps only its blocks
    "tensor_parallel",           # 3. TP / SP / loss parallel: shards weights before FSDP does (2-D)
    "expert_parallel",           # 4. experts leave the dense FSDP group
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
    owner: Any


class TransformRegistry:
    """Transforms by stage; within one stage they run in registration order."""

    def __init__(self) -> None:
        self._entries: list[_Entry] = []

    def register(self, stage: str, fn: Transform, name: str | None = None, owner: Any = None) -> None:
        """Add ``fn`` at ``stage`` under ``name`` (default: its qualified name).

        ``owner`` (default: the object a bound method belongs to) makes re-registration
        idempotent: a callback's ``setup`` runs again for every ``fit``/``validate``, and its
        transform must still run once. The same name from a different owner is an error, not a
        silent drop of one of the two.
        """
        if stage not in STAGES:
            raise ValueError(f"unknown transform stage {stage!r}; use one of {STAGES}")
        name = name or getattr(fn, "__qualname__", repr(fn))
        owner = owner if owner is not None else getattr(fn, "__self__", fn)
        for e in self._entries:
            if e.name == name and e.stage == stage:
                if e.owner is owner:
                    return
                raise ValueError(f"a transform named {name!r} is already registered at stage {stage!r} by "
                                 f"{_describe(e.owner)}; register this one ({_describe(owner)}) under another "
                                 f"name, or use one instance of it")
        self._entries.append(_Entry(stage, name, fn, owner))

    def has(self, stage: str) -> bool:
        return any(e.stage == stage for e in self._entries)

    def names(self) -> list[tuple[str, str]]:
        """(stage, name) in the order they will run."""
        return [(e.stage, e.name) for e in sorted(self._entries, key=lambda e: STAGES.index(e.stage))]

    def apply_stage(self, stage: str, module: nn.Module, ctx: TransformContext) -> list[str]:
        """Run the transforms registered at ``stage``; return their names."""
        if stage not in STAGES:
            raise ValueError(f"unknown transform stage {stage!r}; use one of {STAGES}")
        ran = []
        for e in self._entries:
            if e.stage == stage:
                e.fn(module, ctx)
                ran.append(e.name)
        return ran


def _describe(owner: Any) -> str:
    return f"{type(owner).__name__} at 0x{id(owner):x}"
