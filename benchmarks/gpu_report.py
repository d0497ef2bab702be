"""What the one-GPU scripts (``gpu_sac.py``, ``gpu_paths.py``) share: a JSON report rewritten after
every section, sections isolated from each other, and a time budget; the merged report of a run,
and its figures.

The budget: ``gpu.sh`` exports ``LDT_GPU_DEADLINE`` (Unix time by which everything must be done).
A section whose estimate does not fit in the time left is skipped and says so in the report,
instead of being killed half-way by the hard ``timeout`` (which would lose its figures).

Command line (at least one of ``--merge`` and ``--plot``)::

    python benchmarks/gpu_report.py --merge $OUT                  # $OUT/gpu_report.json
    python benchmarks/gpu_report.py --plot docs/img benchmarks/results/h200-2026-12-04
    python benchmarks/gpu_report.py --plot docs/img run1_gpu_bench.json run1_gpu_paths.json ...
    python benchmarks/gpu_report.py --merge $OUT --plot $OUT/img  # merge, then plot $OUT's JSONs

``--plot DIR`` (needs matplotlib: ``pip install 'lightning-disttrain[plot]'``) draws the figures of
the given JSONs into ``DIR``. Each input is a JSON file or a directory; a directory gives its
``*gpu_bench.json``, ``*gpu_paths.json`` and ``*gpu_versions.json`` (sorted by name), or, if it has
none, its merged ``gpu_report.json``. A file is read by what it holds: ``results`` (gpu_bench.py),
``sections`` (gpu_paths.py), ``installed`` (gpu_versions.py: CUDA and NCCL for the footnotes),
``parts`` (a merged gpu_report.json). Without inputs, ``--plot`` reads the ``--merge`` directory.
Each run is labelled by its file name less ``gpu_bench.json`` / ``gpu_paths.json`` (``run1_``) or,
for plain names, by its directory; nothing is deduplicated. The figures (``--format svg``, the
default, or ``png``), each with the device, torch version and date of its data and the command that
rendered it in a footnote:

- ``gpu-throughput``: tokens/s and MFU of every row of every gpu_bench JSON;
- ``gpu-fp8-speedup``: float8 tokens/s over bf16 per recipe, per section (model width) and run,
  from the rows of one section of one JSON; lines at 1.0 and at the issue's goal 1.25;
- ``gpu-sac``: memory kept for backward against step time, per SDPA backend, eager or compiled
  (gpu_paths ``sac`` / ``sac_compiled``), a marker per policy;
- ``gpu-async-save``: blocking time per save, sync against async, from the ``async_save``
  sections that record ``previous_write_wait_s`` (the benchmark that waits for the previous write
  untimed; earlier runs' async figures include that wait).

A figure without data in the inputs is not written, and said so. SVGs carry no date and fixed
element ids: the same inputs and command render the same bytes.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

try:  # as a script (benchmarks/ on the path) or as benchmarks.gpu_report from the repository root
    from figure_output import PLOT_FORMATS, check_format, json_inputs, render_command, run_plot, save_with_footnote
except ImportError:
    from benchmarks.figure_output import (PLOT_FORMATS, check_format, json_inputs, render_command, run_plot,
                                          save_with_footnote)


def deadline_from_env() -> float | None:
    value = os.environ.get("LDT_GPU_DEADLINE")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"LDT_GPU_DEADLINE={value!r} must be a Unix time in seconds (gpu.sh sets it)") from None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class SectionReport:
    """``report.run(name, estimate_s, fn, **kwargs)``: time ``fn``, keep its dict (or its error) under
    ``sections[name]`` and rewrite ``<out>/<filename>`` at once."""

    def __init__(self, filename: str, out: str | None, device: torch.device, smoke: bool,
                 deadline: float | None = None) -> None:
        self.path = os.path.join(out, filename) if out else None
        self.deadline = deadline
        self.data: dict[str, Any] = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device_name(device),
            "torch": torch.__version__, "smoke": smoke, "sections": {}, "errors": {}, "skipped": {}}

    def run(self, name: str, estimate_s: float, fn: Callable[..., dict[str, Any]], **kwargs) -> dict[str, Any] | None:
        left = None if self.deadline is None else self.deadline - time.time()
        if left is not None and left < estimate_s:
            self.data["skipped"][name] = f"time budget: {left:.0f} s left, section estimated at {estimate_s:.0f} s"
            print(f"# {name}: SKIPPED ({self.data['skipped'][name]})", flush=True)
            self.write()
            return None
        print(f"# {name}: running (estimate {estimate_s:.0f} s on one H200)", flush=True)
        t0 = time.perf_counter()
        try:
            result = fn(**kwargs)
        except Exception as e:  # noqa: BLE001  (report and go on: one broken section must not hide the others)
            self.data["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(f"# {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            result = None
        else:
            result["wall_s"] = time.perf_counter() - t0
            self.data["sections"][name] = result
            print(f"# {name}: done in {result['wall_s']:.1f} s", flush=True)
        self.write()
        return result

    def write(self) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)  # a hard stop mid-write leaves the previous complete file


PARTS = ("gpu_versions.json", "gpu_layouts.json", "gpu_bench.json", "gpu_paths.json")
"""The files the scripts of gpu.sh write, in the order gpu.sh runs them."""


def merge_reports(out: str) -> dict[str, Any]:
    """Every figure of one ``gpu.sh`` run in one file, ``<out>/gpu_report.json``: each script's JSON
    under its name, plus which ones are missing (not run, or killed before writing) and, per
    script, what errored, was skipped or failed a check."""
    merged: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "parts": {},
                              "missing": [], "summary": {}}
    for name in PARTS:
        path = os.path.join(out, name)
        if not os.path.exists(path):
            merged["missing"].append(name)
            continue
        with open(path) as f:
            data = json.load(f)
        key = name.removesuffix(".json")
        merged["parts"][key] = data
        merged["summary"][key] = {k: sorted(data[k]) for k in ("errors", "skipped") if data.get(k)} | (
            {"failed_checks": data["failed"]} if data.get("failed") else {}) | (
            {"differences": data["differences"]} if data.get("differences") else {})
    tmp = os.path.join(out, "gpu_report.json.tmp")
    with open(tmp, "w") as f:
        json.dump(merged, f, indent=1, default=str)
    os.replace(tmp, os.path.join(out, "gpu_report.json"))
    return merged


# ---- figures (--plot): the recorded JSONs of gpu_bench.py / gpu_paths.py as charts

FIGURES = ("gpu-throughput", "gpu-fp8-speedup", "gpu-sac", "gpu-async-save")
POLICY_MARKERS = {"none": "o", "selective": "s", "full": "^"}
RECIPE_ORDER = ("tensorwise", "rowwise")


def _kind(data: dict[str, Any]) -> str | None:
    if "parts" in data:
        return "report"
    if isinstance(data.get("results"), list):
        return "bench"
    if "installed" in data:
        return "versions"
    if isinstance(data.get("sections"), dict) and "gpus" not in data:  # gpu_layouts.json records "gpus"
        return "paths"
    return None


def _label(path: str) -> str:
    """``run1`` for ``.../run1_gpu_bench.json``; the directory's name for a plain ``gpu_bench.json``."""
    stem = os.path.basename(path).removesuffix(".json")
    for suffix in ("gpu_bench", "gpu_paths", "gpu_versions", "gpu_report"):
        if stem.endswith(suffix):
            stem = stem.removesuffix(suffix).rstrip("_-.")
            break
    return stem or os.path.basename(os.path.dirname(os.path.abspath(path))) or "run"


def load_runs(inputs: list[str]) -> list[dict[str, Any]]:
    """The JSONs behind ``inputs`` (files or directories, see the module's docstring), in order:
    ``{"kind": "bench" | "paths" | "versions", "label", "path", "data"}`` each."""
    files = json_inputs(inputs, ("*gpu_bench.json", "*gpu_paths.json", "*gpu_versions.json"), fallback="gpu_report.json",
                        what="gpu_bench.json, gpu_paths.json or gpu_report.json")
    runs: list[dict[str, Any]] = []
    for path in files:
        with open(path) as f:
            data = json.load(f)
        kind = _kind(data)
        if kind == "report":  # a merged report: its parts, labelled by its directory
            for part in ("gpu_bench", "gpu_paths", "gpu_versions"):
                if part in data["parts"]:
                    runs.append({"kind": part.removeprefix("gpu_"), "label": _label(path),
                                 "path": path, "data": data["parts"][part]})
        elif kind is None:
            raise ValueError(f"{path}: not a JSON of gpu_bench.py, gpu_paths.py, gpu_versions.py or gpu_report.py")
        else:
            runs.append({"kind": kind, "label": _label(path), "path": path, "data": data})
    return runs


def throughput_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every result row of every gpu_bench JSON, labelled by its run."""
    return [{"run": r["label"], "section": row["section"], "model": row["model"], "precision": row["precision"],
             "tokens_per_s": row["tokens_per_s"], "mfu": row.get("mfu_bf16_peak"), "step_ms": row.get("step_ms")}
            for r in runs if r["kind"] == "bench" for row in r["data"]["results"]]


def fp8_speedups(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """float8 over bf16 (tokens/s ratio) per recipe, from the rows of one section of one JSON."""
    out = []
    for r in runs:
        if r["kind"] != "bench":
            continue
        by_section: dict[str, list[dict[str, Any]]] = {}
        for row in r["data"]["results"]:
            by_section.setdefault(row["section"], []).append(row)
        for section, rows in by_section.items():
            base = next((row for row in rows if row["precision"] == "bf16"), None)
            if base is None:
                continue
            for row in rows:
                if row["precision"].startswith("fp8 "):
                    out.append({"run": r["label"], "section": section, "model": row["model"],
                                "recipe": row["precision"].removeprefix("fp8 "),
                                "speedup": row["tokens_per_s"] / base["tokens_per_s"]})
    return out


def sac_series(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One series per run, section (eager ``sac`` / ``sac_compiled``) and SDPA backend: its policies'
    memory kept for backward and step time."""
    out = []
    for r in runs:
        if r["kind"] != "paths":
            continue
        for section in ("sac", "sac_compiled"):
            s = r["data"]["sections"].get(section)
            if not s:
                continue
            compiled = bool(s.get("compiled", section == "sac_compiled"))
            backends: dict[str, list[dict[str, Any]]] = {}
            for row in s["rows"]:
                if row.get("saved_mib") is not None and row.get("step_ms") is not None:
                    backends.setdefault(row["backend"], []).append(row)
            for backend, rows in backends.items():
                out.append({"run": r["label"], "mode": "compiled" if compiled else "eager", "backend": backend,
                            "model": f"{s.get('model')}, batch {s.get('batch')} x {s.get('seq')}, "
                                     f"{s.get('precision')}, median of {s.get('timed_steps')} steps",
                            "points": [{"policy": row["policy"], "saved_mib": row["saved_mib"],
                                        "step_ms": row["step_ms"]} for row in rows]})
    return out


def async_saves(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``async_save`` sections that record ``previous_write_wait_s`` (timed without that wait)."""
    out = []
    for r in runs:
        s = r["data"].get("sections", {}).get("async_save") if r["kind"] == "paths" else None
        if s and "previous_write_wait_s" in s.get("async", {}):
            out.append({"run": r["label"], "model": s.get("model"), "save_at_steps": s.get("save_at_steps"),
                        "checkpoint_gb": s["async"].get("checkpoint_gb"), "sync": s["sync"]["block_s"],
                        "async": s["async"]["block_s"], "async_previous_write_wait_s": s["async"]["previous_write_wait_s"],
                        "device": r["data"].get("device"), "torch": r["data"].get("torch")})
    return out


def _machine(runs: list[dict[str, Any]], used: list[str], kind: str) -> str:
    """'NVIDIA H200, torch 2.11.0+cu130, CUDA 13.0; data: run1 2026-12-04T12:20:54, ...'."""
    docs = [r for r in runs if r["kind"] == kind and r["label"] in used]
    versions = [r["data"]["installed"] for r in runs if r["kind"] == "versions"]
    machines: list[str] = []
    for r in docs:
        d = r["data"]
        m = f"{d.get('device', '?')}, torch {d.get('torch', '?')}"
        v = next((v for v in versions if v.get("torch") == d.get("torch")), None)
        if v:
            m += f", CUDA {v.get('cuda_runtime')}, NCCL {v.get('nccl')}"
        if m not in machines:
            machines.append(m)
    dates = ", ".join(f"{r['label']} {r['data'].get('date', '?')}" for r in docs)
    return f"{'; '.join(machines)}; data ({kind}): {dates}"


def _draw_throughput(plt, rows, note: str, path: str) -> None:
    labels = [f"{r['run']} {r['section']}: {r['model']}, {r['precision']}" for r in rows]
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    colors = [f"C{precisions.index(r['precision']) % 10}" for r in rows]
    fig, (ax, ax_mfu) = plt.subplots(1, 2, figsize=(12, 0.42 * len(rows) + 2.2), sharey=True,
                                     gridspec_kw={"width_ratios": [3, 2]})
    y = range(len(rows))
    tokens = [r["tokens_per_s"] for r in rows]
    ax.barh(y, tokens, color=colors)
    for i, t in enumerate(tokens):
        ax.text(t, i, f" {t:,.0f}", va="center", fontsize=7)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(tokens) * 1.2)
    ax.set_xlabel("tokens/s")
    ax.xaxis.set_major_formatter(lambda v, _: f"{v:,.0f}")
    mfu = [100 * (r["mfu"] or 0) for r in rows]
    ax_mfu.barh(y, mfu, color=colors)
    for i, m in enumerate(mfu):
        ax_mfu.text(m, i, f" {m:.1f}%", va="center", fontsize=7)
    ax_mfu.axvline(50, color="black", linestyle="--", linewidth=1, label="issue's MFU goal (50%)")
    ax_mfu.set_xlim(0, max(max(mfu), 50) * 1.2)
    ax_mfu.set_xlabel("MFU, % of the dense bf16 peak")
    ax_mfu.legend(loc="upper right", fontsize=7)
    fig.suptitle("Throughput per run and row (gpu_bench.py): tokens/s and MFU", fontsize=10)
    save_with_footnote(plt, fig, path, "MFU of the fp8 rows against the bf16 peak too, so that rows compare. " + note)


def _draw_fp8(plt, speedups, note: str, path: str) -> None:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    sections = list(dict.fromkeys(s["section"] for s in speedups))
    recipes = sorted({s["recipe"] for s in speedups},
                     key=lambda r: (RECIPE_ORDER.index(r) if r in RECIPE_ORDER else len(RECIPE_ORDER), r))
    for section in sections:
        for recipe in recipes:
            found = [s for s in speedups if s["section"] == section and s["recipe"] == recipe]
            if found:
                groups[(section, recipe)] = found
    run_names = list(dict.fromkeys(s["run"] for s in speedups))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) + 2), 4.8))
    width = 0.8 / max(len(g) for g in groups.values())
    for x, ((section, recipe), found) in enumerate(groups.items()):
        for j, s in enumerate(found):
            pos = x + (j - (len(found) - 1) / 2) * width
            c = f"C{run_names.index(s['run']) % 10}"
            ax.bar(pos, s["speedup"], width * 0.9, color=c)
            ax.text(pos, s["speedup"], f"{s['speedup']:.3f}x", ha="center", va="bottom", fontsize=7.5)
    for name in run_names:  # one legend entry per run
        ax.bar([0], [0], 0, color=f"C{run_names.index(name) % 10}", label=name)
    ax.axhline(1.0, color="black", linewidth=1, label="bf16 (1.0)")
    ax.axhline(1.25, color="black", linestyle="--", linewidth=1, label="issue's goal (1.25x)")
    ax.set_xticks(range(len(groups)),
                  [f"{found[0]['model']}\n({section})\n{recipe}" for (section, recipe), found in groups.items()],
                  fontsize=8)
    ax.set_ylim(0, max(1.35, max(s["speedup"] for s in speedups) * 1.12))
    ax.set_ylabel("tokens/s of float8 / tokens/s of bf16")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    ax.set_title("float8 (torchao) speedup over bf16 per recipe and model width (gpu_bench.py)", fontsize=10)
    save_with_footnote(plt, fig, path, note)


def _draw_sac(plt, series, note: str, path: str) -> None:
    keys = list(dict.fromkeys((s["mode"], s["backend"]) for s in series))
    runs = list(dict.fromkeys(s["run"] for s in series))
    styles = ("-", "--", ":", "-.")
    fig, ax = plt.subplots(figsize=(10, 5.4))
    for s in series:
        color = f"C{keys.index((s['mode'], s['backend'])) % 10}"
        style = styles[runs.index(s["run"]) % len(styles)]
        xs = [p["step_ms"] for p in s["points"]]
        ys = [p["saved_mib"] for p in s["points"]]
        ax.plot(xs, ys, color=color, linestyle=style, linewidth=0.8, alpha=0.7,
                label=f"{s['run']}, {s['mode']}, {s['backend']}")
        for p in s["points"]:
            ax.plot(p["step_ms"], p["saved_mib"], marker=POLICY_MARKERS.get(p["policy"], "x"), color=color,
                    markersize=7, linestyle="none")
    first = ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, title="run, mode, SDPA backend",
                      title_fontsize=7)
    ax.add_artist(first)
    handles = [ax.plot([], [], marker=m, color="gray", linestyle="none")[0] for m in POLICY_MARKERS.values()]
    ax.legend(handles, list(POLICY_MARKERS), loc="lower left", bbox_to_anchor=(1.01, 0), fontsize=7,
              title="policy", title_fontsize=7)
    ax.set_xlabel("step time, ms (forward + backward)")
    ax.set_ylabel("memory kept for backward, MiB")
    ax.set_xlim(0, None)
    ax.set_ylim(0, None)
    models = "; ".join(dict.fromkeys(s["model"] for s in series))
    ax.set_title(f"Activation checkpointing (gpu_sac.py): memory kept against step time\n{models}", fontsize=10)
    save_with_footnote(plt, fig, path, note, right=0.8)  # the legends right of the axes


def _draw_async(plt, saves, note: str, path: str) -> None:
    labels, sync, asyn = [], [], []
    for s in saves:
        steps = s["save_at_steps"] or list(range(1, len(s["sync"]) + 1))
        for i, (a, b) in enumerate(zip(s["sync"], s["async"])):
            labels.append(f"{s['run'] + ' ' if len(saves) > 1 else ''}save {i + 1}\n(after step {steps[i]})")
            sync.append(a)
            asyn.append(b)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(labels) + 2), 4.6))
    x = range(len(labels))
    for offset, values, name, c in ((-0.2, sync, "sync", "C3"), (0.2, asyn, "async", "C0")):
        ax.bar([i + offset for i in x], values, 0.38, color=c, label=name)
        for i, v in enumerate(values):
            ax.text(i + offset, v, f"{v:.2f} s", ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("training blocked by the save, s")
    ax.legend(fontsize=8)
    where = "; ".join(dict.fromkeys(f"{s['device']}, torch {s['torch']}" for s in saves))
    gb = "; ".join(dict.fromkeys(f"{s['model']}, {s['checkpoint_gb']:.2f} GB" for s in saves))
    ax.set_title(f"Checkpoint save, blocking time per save, sync vs async ({gb})\n{where}", fontsize=10)
    waits = "; ".join(f"{s['run']}: " + " / ".join(f"{w:.2f}" for w in s["async_previous_write_wait_s"])
                      for s in saves)
    save_with_footnote(plt, fig, path, f"async: wait for the previous write before each save, untimed, s: {waits}. {note}")


def plot_reports(inputs: list[str], out_dir: str, command: str = "", fmt: str = "svg") -> dict[str, Any]:
    """Write the figures of ``inputs`` (see the module's docstring) into ``out_dir``. Returns the
    files written (``files``: figure name -> path), the figures not written and why (``skipped``),
    and each figure's data (``throughput``, ``fp8_speedup``, ``sac``, ``async_save``)."""
    check_format(fmt)
    runs = load_runs(inputs)
    data = {"throughput": throughput_rows(runs), "fp8_speedup": fp8_speedups(runs), "sac": sac_series(runs),
            "async_save": async_saves(runs)}
    from lightning_disttrain.planning.plot import pyplot  # matplotlib on Agg, or what to install

    plt = pyplot()
    os.makedirs(out_dir, exist_ok=True)
    rendered = f" Rendered by: {command}" if command else ""
    jobs = {"gpu-throughput": (_draw_throughput, data["throughput"], "bench", "no gpu_bench results"),
            "gpu-fp8-speedup": (_draw_fp8, data["fp8_speedup"], "bench",
                                "no gpu_bench section with a bf16 row and fp8 rows"),
            "gpu-sac": (_draw_sac, data["sac"], "paths", "no gpu_paths sac / sac_compiled section"),
            "gpu-async-save": (_draw_async, data["async_save"], "paths",
                               "no gpu_paths async_save section with previous_write_wait_s (the fixed benchmark)")}
    files, skipped = {}, {}
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "lightning-disttrain gpu_report"}):
        for name, (draw, items, kind, why) in jobs.items():
            if not items:
                skipped[name] = why
                continue
            used = list(dict.fromkeys(i["run"] for i in items))
            path = os.path.join(out_dir, f"{name}.{fmt}")
            draw(plt, items, _machine(runs, used, kind) + "." + rendered, path)
            files[name] = path
    return {"files": files, "skipped": skipped, **data}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="merge the gpu*.json of one gpu.sh run into gpu_report.json, "
                                            "and/or draw the figures of recorded gpu_bench / gpu_paths JSONs")
    p.add_argument("--merge", metavar="DIR", help="the directory the scripts wrote to ($OUT)")
    p.add_argument("--plot", metavar="DIR", help="write the figures (gpu-*.svg) into DIR (needs matplotlib)")
    p.add_argument("--format", default="svg", choices=PLOT_FORMATS, help="the figures' format (default svg)")
    p.add_argument("inputs", nargs="*", metavar="JSON_OR_DIR",
                   help="for --plot: gpu_bench / gpu_paths / gpu_versions / gpu_report JSONs, or directories "
                        "holding them (default: the --merge directory)")
    args = p.parse_args(argv)
    if not args.merge and not args.plot:
        p.error("give --merge DIR, --plot DIR, or both")
    if args.inputs and not args.plot:
        p.error("JSON files or directories are read by --plot only")
    if args.merge:
        merged = merge_reports(args.merge)
        print(f"# gpu_report.json: {', '.join(merged['parts']) or 'nothing'}"
              f"{'; missing ' + ', '.join(merged['missing']) if merged['missing'] else ''}")
        for part, s in merged["summary"].items():
            if s:
                print(f"#   {part}: {json.dumps(s)[:400]}")
    if args.plot:
        return run_plot(plot_reports, args.inputs or [args.merge], args.plot,
                        render_command("gpu_report.py", argv), args.format)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
