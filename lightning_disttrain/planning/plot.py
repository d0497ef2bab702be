"""``plan --plot FILE``: the per-layout memory breakdown as a chart, what people look at before
renting GPUs.

One horizontal stacked bar per layout of the plan's table (the most loaded rank's bytes, by part:
parameters, gradients, optimizer state, activations, logits, buffers), the usable memory (capacity
less the margin) and the device's capacity as vertical lines, the recommendation marked. matplotlib
is an optional dependency (``pip install 'lightning-disttrain[plot]'``); the file's suffix chooses
the format (``.png``, ``.svg``, ``.pdf``).
"""

from __future__ import annotations

from pathlib import Path

from lightning_disttrain.planning.planner import Plan
from lightning_disttrain.planning.spec import GB

PARTS = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"),
         ("activations", "activations"), ("logits", "logits"), ("buffers", "buffers"))
"""(MemoryEstimate field, legend label), in stacking order: the model state first."""
FORMATS = (".png", ".svg", ".pdf")


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or a ValueError naming the extra to install."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'lightning-disttrain[plot]' (or pip install "
                         "matplotlib)") from None
    matplotlib.use("Agg", force=True)  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    return plt


def check_path(path: str | Path) -> Path:
    """The file ``--plot`` will write, refused before any planning if its format is unknown."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"--plot {str(path)!r}: name a {', '.join(FORMATS)} file (the suffix chooses the format)")
    if not path.parent.exists():
        raise ValueError(f"--plot {str(path)!r}: the directory {str(path.parent)!r} does not exist")
    return path


def plot_memory(plan: Plan, path: str | Path, command: str = "") -> Path:
    """Write the chart of ``plan``'s layouts to ``path``; returns it."""
    path = check_path(path)
    plt = pyplot()
    height = max(2.5, 0.35 * len(plan.candidates) + 1.6)
    with plt.rc_context({"svg.fonttype": "none"}):  # SVG text stays text: searchable, smaller
        fig, ax = plt.subplots(figsize=(10, height))
        try:
            _draw(fig, ax, plan, command)
            # no creation date in an SVG or PDF: the same plan writes the same file
            fig.savefig(path, **({"metadata": {"Date": None}} if path.suffix.lower() in (".svg", ".pdf") else {}))
        finally:
            plt.close(fig)
    return path


def _draw(fig, ax, plan: Plan, command: str) -> None:
    candidates = plan.candidates
    names = [("> " if c is plan.chosen else "") + c.layout.name for c in candidates]
    left = [0.0] * len(candidates)
    for field, label in PARTS:
        values = [getattr(c.memory, field) / GB for c in candidates]
        ax.barh(names, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values)]
    if candidates:
        memory = candidates[0].memory
        ax.axvline(memory.usable / GB, color="black", linestyle="--", linewidth=1,
                   label=f"usable ({1 - memory.margin:.0%} of the device)")
        ax.axvline(memory.capacity / GB, color="black", linewidth=1, label="device memory")
    ax.invert_yaxis()  # the table's order, top to bottom
    ax.set_xlabel("GB per device (the most loaded rank)")
    s, c, w = plan.shape, plan.cluster, plan.workload
    ax.set_title(f"{s.name}: {s.params / 1e9:.3g}B parameters on {c.nodes} x {c.gpus_per_node} {c.gpu}, "
                 f"seq {w.seq_len}, micro batch {w.micro_batch}, {w.precision}", fontsize=10)
    for label in ax.get_yticklabels():  # the recommendation ("> " as in the table), in bold
        if label.get_text().startswith("> "):
            label.set_fontweight("bold")
    ax.legend(loc="lower right", fontsize=8)
    if command:
        fig.text(0.01, 0.01, command, fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03 if command else 0, 1, 1))
