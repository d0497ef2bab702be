"""What a benchmark writes when it records its own result for ``cpu_figures.py`` (issue 39): the
five fields every recorded JSON starts with (``benchmark``, ``date`` in UTC, ``machine`` with the
CPU count and torch's version, ``command``, ``source``), the ``--record FILE`` / ``--plot DIR`` /
``--format`` options, and writing the record and drawing its figure. Each benchmark fills the rest
of its record, in the schema its figure reads, from what it measured.
"""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench_common import OUT_ROOT
from figure_output import PLOT_FORMATS, render_command


def provenance(benchmark: str, script: str, machine: str = "", *, when: datetime | None = None,
               argv: list[str] | None = None, source: str | None = None) -> dict[str, str]:
    """The fields every recorded JSON carries: ``benchmark``; ``date`` (``when``, by default now, in
    UTC to the minute); ``machine`` (architecture, CPU count, torch's version, then ``machine``);
    ``command`` (``python benchmarks/<script>`` and ``argv``, by default this process's arguments);
    ``source`` (by default ``<script>'s own output (this file)``)."""
    import torch

    when = datetime.now(timezone.utc) if when is None else when.astimezone(timezone.utc)
    return {"benchmark": benchmark, "date": f"{when:%Y-%m-%d %H:%M} UTC",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
                       + (f", {machine}" if machine else ""),
            "command": render_command(script, argv), "source": source or f"{script}'s own output (this file)"}


def add_record_options(p, figure: str, record_flag: str = "--record", append: str | None = None) -> None:
    """``record_flag`` FILE (the record), ``--plot DIR`` and ``--format`` on the parser ``p``; with
    ``append`` (what a run adds, for its help), ``--append``: add this run to the record in FILE."""
    if record_flag:
        p.add_argument(record_flag, dest="record", type=Path, default=None, metavar="FILE",
                       help="write this run's record (the JSON benchmarks/cpu_figures.py draws) here")
    if append:
        p.add_argument("--append", action="store_true",
                       help=f"add this run's {append} to the record already in FILE (its figure shows them side by side)")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help=f"also draw {figure} (benchmarks/cpu_figures.py) into DIR from the record; needs matplotlib")
    p.add_argument("--format", default="svg", choices=PLOT_FORMATS, help="the figure's format (default svg)")


def write_record(data: dict[str, Any], path: str | Path, plot: str | None = None, fmt: str = "svg",
                 append: str | None = None) -> Path:
    """Write ``data`` (a record: ``provenance`` and the figure's fields) as JSON at ``path``; with
    ``plot``, draw its figure there (``plot_record``). With ``append`` (a key of ``data`` holding a
    list), the record already at ``path`` (the same benchmark) keeps its fields and gets ``data``'s
    items of that list after its own, and this run's date and command after its own. Prints what it
    wrote."""
    path, command = Path(path), data["command"]  # this run's: the figure's "rendered by"
    if append:
        before = json.loads(path.read_text())
        if before.get("benchmark") != data["benchmark"]:
            raise ValueError(f"{path}: not a {data['benchmark']} record, nothing to append to")
        data = before | {append: before[append] + data[append],
                         **{k: f"{before[k]}; {data[k]}" for k in ("date", "command") if data[k] != before[k]}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"# record: {path}", flush=True)
    if plot:
        plot_record(path, command, plot, fmt)
    return path


def plot_record(path: str | Path, command: str, plot: str, fmt: str = "svg") -> dict[str, str]:
    """Draw the figure of the record at ``path`` into ``plot`` through ``cpu_figures.plot_results``
    (``command``: the footnote's 'rendered by'); prints and returns the files written."""
    from cpu_figures import plot_results

    done = plot_results([str(path)], plot, command=command, fmt=fmt)
    for name, written in done["files"].items():
        print(f"# figure {name}: {written}", flush=True)
    return done["files"]


def wants_record(args) -> bool:
    """Whether ``args`` asks for a record (``--record``) or a figure (``--plot``, which needs one)."""
    return bool(getattr(args, "record", None) or getattr(args, "plot", None))


def record_path(args, default: str | Path) -> Path:
    """``--record``, or ``default`` when only ``--plot`` was given (a bare file name: under
    ``benchmarks/out/``)."""
    if getattr(args, "record", None):
        return Path(args.record)
    return Path(default) if Path(default).parent != Path(".") else OUT_ROOT / default

