"""What the benchmarks' figure writers (``gpu_report.py --plot``, ``cpu_figures.py``) share: the
formats, saving a figure with its grey footnote (an SVG without a creation date, so the same inputs
write the same bytes), and the command line's report of what was drawn. No torch import."""

from __future__ import annotations

import glob
import os
import shlex
import sys
import textwrap
from collections.abc import Callable
from typing import Any

PLOT_FORMATS = ("svg", "png")


def json_inputs(inputs: list[str], patterns: tuple[str, ...] = ("*.json",), fallback: str | None = None,
                what: str = "JSON file") -> list[str]:
    """The files behind ``inputs``: a file as it is; a directory's files matching ``patterns``
    (sorted per pattern, in pattern order), or its ``fallback`` file when none match. A directory
    with neither, or a path that does not exist, is refused naming it."""
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(f for pattern in patterns for f in glob.glob(os.path.join(item, pattern)))
            if not found and fallback is not None and os.path.exists(os.path.join(item, fallback)):
                found = [os.path.join(item, fallback)]
            if not found:
                raise ValueError(f"{item}: no {what} in it")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise ValueError(f"{item}: no such file or directory")
    return files


def check_format(fmt: str) -> None:
    if fmt not in PLOT_FORMATS:
        raise ValueError(f"--format {fmt!r}: one of {', '.join(PLOT_FORMATS)}")


def save_with_footnote(plt, fig, path: str, footnote: str, right: float = 1.0) -> None:
    lines = textwrap.wrap(footnote, int(fig.get_figwidth() * 19))  # ~19 characters of 6.5 pt per inch
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=6.5, color="gray", va="bottom")
    fig.tight_layout(rect=(0, 0.012 + 0.022 * len(lines) * 6.0 / fig.get_figheight(), right, 1))
    # no creation date in an SVG: the same inputs write the same file (element ids: svg.hashsalt)
    fig.savefig(path, **({"metadata": {"Date": None}} if path.endswith(".svg") else {}))
    plt.close(fig)


def render_command(script: str, argv: list[str] | None) -> str:
    """The command line that rendered the figures, for their footnotes."""
    argv = sys.argv[1:] if argv is None else argv
    return f"python benchmarks/{script} " + " ".join(shlex.quote(a) for a in argv)


def run_plot(plot: Callable[..., dict[str, Any]], inputs: list[str], out_dir: str, command: str, fmt: str) -> int:
    """``plot(inputs, out_dir, command, fmt)``, then one line per figure written or not: the exit code."""
    try:
        result = plot(inputs, out_dir, command, fmt)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, path in result["files"].items():
        print(f"# {name}: {path} ({os.path.getsize(path):,} bytes)")
    for name, why in result["skipped"].items():
        print(f"# {name}: not drawn ({why})")
    return 0
