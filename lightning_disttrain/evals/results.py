"""Where eval results go besides the loggers: ``evals.json`` in the checkpoint, and one table.

``evals.json`` (written by rank 0 into the checkpoint directory, then listed in its manifest)::

    global_step, epoch       when the evaluated weights were saved
    checkpoint               the checkpoint directory's name
    metrics                  {"eval/<task>/<metric>": value}
    tasks                    {task: {"metrics": {...}, "items": N, "seconds": s}}
    gate                     {"passed", "failed_checkpoint", "violations": [{rule, value, reference, message}]}
    config                   the suite's settings (tasks, limit, ...), so numbers are comparable

A checkpoint that is a single file (Lightning's own strategies) gets ``<file>.evals.json`` beside it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning_disttrain.checkpoint.discovery import EVALS_NAME
from lightning_disttrain.checkpoint.manifest import MANIFEST_NAME, add_to_manifest
from lightning_disttrain.evals.suite import EvalResults


def evals_record(results: EvalResults, *, step: int | None, epoch: int | None, checkpoint: str | None,
                 gate: dict[str, Any] | None, config: dict[str, Any]) -> dict[str, Any]:
    return {"global_step": step, "epoch": epoch, "checkpoint": checkpoint, "metrics": results.flat(),
            "tasks": {t: {"metrics": m, "items": results.items.get(t), "seconds": results.seconds.get(t)}
                      for t, m in results.metrics.items()},
            "seconds_total": results.seconds.get("total"), "gate": gate, "config": config}


def _write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, path)


def checkpoint_complete(ckpt: str | os.PathLike) -> bool:
    """Whether ``ckpt`` can take its ``evals.json`` now: a single file, or a directory with its manifest."""
    path = Path(ckpt)
    return path.is_file() or (path / MANIFEST_NAME).is_file()


def write_evals(ckpt: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Store ``record`` with the checkpoint (rank 0 only). A directory must be complete (manifest
    written: ``checkpoint_complete``); ``evals.json`` joins its manifest."""
    path = Path(ckpt)
    if path.is_file():
        out = path.with_name(path.name + "." + EVALS_NAME)
        _write_json(out, record)
        return out
    real = path.resolve()
    out = real / EVALS_NAME
    _write_json(out, record)
    add_to_manifest(real, [EVALS_NAME])
    return out


def read_evals(ckpt: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(ckpt)
    file = path.with_name(path.name + "." + EVALS_NAME) if path.is_file() else path / EVALS_NAME
    return json.loads(file.read_text()) if file.is_file() else None


def print_results(results: EvalResults, step: int | None, title_extra: str = "") -> None:
    """One table of every task's metrics (call on rank 0). ``step`` None (an exported file, which
    carries no step): the title names no step."""
    from rich.console import Console
    from rich.table import Table

    metric_names = sorted({m for values in results.metrics.values() for m in values})
    table = Table(title=("evals" if step is None else f"evals at step {step}") + title_extra)
    table.add_column("task")
    for m in metric_names:
        table.add_column(m, justify="right")
    table.add_column("items", justify="right")
    table.add_column("s", justify="right")
    for task, values in results.metrics.items():
        table.add_row(task, *[_fmt(values[m]) if m in values else "" for m in metric_names],
                      str(results.items.get(task, "")), f"{results.seconds.get(task, 0.0):.1f}")
    Console().print(table)


def _fmt(value: float) -> str:
    return f"{value:.4f}" if abs(value) < 1000 else f"{value:.4g}"
