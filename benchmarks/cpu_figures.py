"""Figures of the CPU benchmarks, drawn from their recorded results (issue 39): what
``gpu_report.py --plot`` does for the GPU runs.

    python benchmarks/cpu_figures.py --plot docs/img benchmarks/results/cpu-2026-12-04

Needs matplotlib (``pip install 'lightning-disttrain[plot]'``). Each input is a JSON file or a
directory, which gives its ``*.json`` (sorted by name). Every JSON holds one benchmark's numbers
and says where they come from: ``benchmark`` (which one, below), ``date``, ``machine`` and
``command`` (the run that produced them), ``source`` (the benchmark's own output file, or the
section of docs/benchmarks.md they were transcribed from). The figures (``--format svg``, the
default, or ``png``), each with the machine, date and command of its data and the command that
rendered it in a footnote:

- ``cpu-plan-vs-measured`` (``bench_plan``: ``bench_plan.py``'s ``report.json`` under
  ``records``): measured peak memory against ``plan``'s, per case and rank, raw and without the
  fixed bytes (``measured peak - fixed``, bench_plan's ``w/o fixed``), a y = x line and a +-10%
  band, a marker per layout;
- ``cpu-fsdp-memory`` (``bench_fsdp_memory``: section 4): memory per rank against the number of
  ranks, ZeRO-3 and ZeRO-2, at rest and at the step's peak, with the computed sharded state;
- ``cpu-cp-memory`` (``bench_cp``: ``bench_cp.py``'s own JSON, section 17): per GPT preset, the
  peak memory of a step per rank against sequence length for cp = 1, 2, 4 (ring attention), the
  budget and the longest sequence within it (linear between the points and beyond the last, as
  ``bench_cp.py`` computes it);
- ``cpu-process-groups`` (``bench_process_groups``: section 21): process groups each rank joins
  and ``new_group`` calls per rank, by layout, at 1,024 ranks;
- ``cpu-tp-memory`` (``bench_tp_memory``: section 10): memory per rank against tp = 1, 2, 4 (with
  and without sequence parallel), at rest and at the step's peak, with the computed state; and the
  activations per layer, measured (malloc, what autograd saved) against Megatron's formula and the
  formula adapted to this model (and, with sequence parallel, the adapted one kept sharded);
- ``cpu-pp-bubble-memory`` (``bench_pp_bubble_memory``: section 11): the bubble per schedule against
  the number of micro-batches at p = 2 and p = 4, measured (mean and min-max over ranks) and the
  schedule's theory; and the activation memory per stage, GPipe against 1F1B (p = 2, m = 8), with
  the ratio expected (m / (p - stage)).
- ``cpu-sac`` (``bench_sac``: section 7): per model shape, the activation memory kept for backward
  against the step's CPU time for each activation checkpointing policy, both against ``none``,
  with the GFLOP each recomputes;
- ``cpu-moe`` (``bench_moe_quality``: section 14): MoE (with and without the balancing bias) against
  the dense model of equal active parameters, held-out loss and tokens/s (median, p10-p90); and the
  max/mean expert load per block along training, with and without the bias.

A figure whose benchmark is not among the inputs is not written, and said so. As in gpu_report.py
(both save through ``figure_output.py``): SVG text stays text, no creation date, fixed element ids,
so the same inputs and command render the same bytes.
"""

from __future__ import annotations

import glob
import json
import os
import textwrap
from typing import Any

from figure_output import PLOT_FORMATS, check_format, render_command, run_plot, save_with_footnote

REQUIRED = ("benchmark", "date", "machine", "command", "source")
"""The fields every recorded JSON carries."""
FIGURES = {"cpu-plan-vs-measured": "bench_plan", "cpu-fsdp-memory": "bench_fsdp_memory",
           "cpu-cp-memory": "bench_cp", "cpu-process-groups": "bench_process_groups",
           "cpu-tp-memory": "bench_tp_memory", "cpu-pp-bubble-memory": "bench_pp_bubble_memory",
           "cpu-sac": "bench_sac", "cpu-moe": "bench_moe_quality"}
"""Figure name -> the benchmark whose JSON it is drawn from."""
LAYOUT_MARKERS = {"fsdp2": "o", "tp": "s", "pp-1f1b": "^", "pp-interleaved": "v", "pp-gpipe": "D", "ep": "P",
                  "cp": "X"}
"""bench_plan's layouts -> marker (another layout: x)."""
BAND = 0.10
"""The plan-vs-measured figure's band around y = x: +-10%."""


def load_results(inputs: list[str]) -> dict[str, dict[str, Any]]:
    """benchmark -> its recorded JSON (plus ``path``), from files and directories, in order."""
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(glob.glob(os.path.join(item, "*.json")))
            if not found:
                raise ValueError(f"{item}: no JSON file in it")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise ValueError(f"{item}: no such file or directory")
    results: dict[str, dict[str, Any]] = {}
    for path in files:
        with open(path) as f:
            data = json.load(f)
        missing = [k for k in REQUIRED if not isinstance(data, dict) or k not in data]
        if missing:
            raise ValueError(f"{path}: not a recorded CPU benchmark result (no {', '.join(missing)})")
        if data["benchmark"] not in FIGURES.values():
            raise ValueError(f"{path}: no figure draws benchmark {data['benchmark']!r} "
                             f"(known: {', '.join(FIGURES.values())})")
        if data["benchmark"] in results:
            raise ValueError(f"{path}: a second {data['benchmark']} result (the first: "
                             f"{results[data['benchmark']]['path']})")
        results[data["benchmark"]] = data | {"path": path}
    return results


def footnote(data: dict[str, Any], render_command: str) -> str:
    """The machine, date and command of the data, its source, and the command that drew it."""
    text = f"Data: {data['command']} on {data['date']}; {data['machine']}. Source: {data['source']}."
    return text + (f" Rendered by: {render_command}" if render_command else "")


# ---- each figure's numbers, from its JSON

def plan_points(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One point per case and rank: planned and measured peak (MiB), and the measured peak less
    that rank's fixed bytes (bench_plan's per-rank 'w/o fixed' numerator)."""
    return [{"layout": r["layout"], "preset": r["preset"], "ac": r["ac"], "rank": rank,
             "planned_mib": p["planned_mib"], "measured_mib": p["measured_mib"],
             "without_fixed_mib": p["measured_mib"] - fixed}
            for r in data["records"] for rank, (p, fixed) in enumerate(zip(r["per_rank"], r["fixed_mib"]))]


def plan_case_ratios(record: dict[str, Any]) -> tuple[float, float]:
    """(raw, without fixed) ratio of one case as bench_plan's table computes them: the larger rank's
    measured peak (less that rank's fixed bytes) over the larger rank's planned peak."""
    ranks = record["per_rank"]
    top_planned = max(range(len(ranks)), key=lambda r: ranks[r]["planned_mib"])
    top_measured = max(range(len(ranks)), key=lambda r: ranks[r]["measured_mib"])
    planned, peak = ranks[top_planned]["planned_mib"], ranks[top_measured]["measured_mib"]
    return peak / planned, (peak - record["fixed_mib"][top_measured]) / planned


def fsdp_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per N and stage: rest, peak and the peak's part above rest, and the computed state."""
    return [{"n": r["n"], "stage": r["stage"], "rest": r["rest"], "peak": r["peak"],
             "above_rest": r["peak"] - r["rest"], "computed_state": r["computed_state"]} for r in data["rows"]]


def longest_within(points: list[tuple[float, float]], budget: float) -> float:
    """The longest sequence whose memory stays within ``budget``: linear between the (seq, MiB)
    points, and beyond the last along the last two (``bench_cp.py``'s rule)."""
    points = sorted(points)
    for (a, ma), (b, mb) in zip(points, points[1:]):
        if ma <= budget <= mb:
            return a + (budget - ma) * (b - a) / (mb - ma)
    (s0, m0), (s1, m1) = points[-2], points[-1]
    if m1 < budget:
        return s1 + (budget - m1) * (s1 - s0) / (m1 - m0)
    return points[0][0] * budget / points[0][1]


def cp_series(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per preset, one series per cp degree: its (seq, peak MiB per rank) points and the longest
    sequence within the budget: as recorded (``bench_cp.py``'s: drawn) and as computed here from
    the recorded points (the same rule: equal)."""
    out = {}
    for preset, m in data["memory"].items():
        out[preset] = [{"cp": int(cp), "points": [(row["seq"], row["peak_mib"][cp]) for row in m["rows"]],
                        "longest_within_budget": m["longest"][cp],
                        "longest_from_points": longest_within([(row["seq"], row["peak_mib"][cp]) for row in m["rows"]],
                                                              m["budget_mib"]),
                        "over_cp1": m["longest_over_cp1"][cp], "extrapolated": m["extrapolated"][cp]}
                       for cp in m["rows"][0]["peak_mib"]]
    return out


def group_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per layout: the groups this rank joins (one per distinct rank set) and the ``new_group``
    calls every rank makes."""
    return [{"layout": r["layout"], "groups": len(r["sizes"]), "sizes": r["sizes"],
             "note": r.get("sizes_note", ""), "new_group_calls": r["new_group_calls"]} for r in data["rows"]]


def tp_memory_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per tp degree and sequence-parallel setting: rest, peak and the peak's part above rest, the
    computed state and rest / computed state."""
    return [{"t": r["t"], "sp": r["sp"], "rest": r["rest"], "peak": r["peak"], "above_rest": r["peak"] - r["rest"],
             "computed_state": r["computed_state"], "rest_over_computed": r["rest"] / r["computed_state"]}
            for r in data["memory_rows"]]


def megatron_layer_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool) -> float:
    """Korthikanti et al. 2022's activation bytes per transformer layer (16-bit, dropout masks, a
    stored softmax): s*b*h*(34 + 5as/h); under TP 10 + 24/t + 5as/(ht); with sequence parallel all
    of it / t (bench_tp.py's 'megatron formula' column)."""
    if t == 1 or sp:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def tp_activation_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case: the measured activations per layer (malloc, saved), the recorded formulas, and
    Megatron's formula computed here from s, b, h, a (MiB)."""
    return [{"t": r["t"], "sp": r["sp"], "malloc": r["malloc"], "saved": r["saved"], "megatron": r["megatron"],
             "adapted": r["adapted"], "megatron_sp_adapted": r["megatron_sp_adapted"],
             "megatron_computed": megatron_layer_bytes(data["s"], data["b"], data["h"], data["a"], r["t"],
                                                       r["sp"] == "on") / 2**20,
             "malloc_over_adapted": r["malloc"] / r["adapted"]} for r in data["activation_rows"]]


def pipeline_bubble(p: int, m: int, v: int = 1) -> float:
    """The theoretical bubble of GPipe and 1F1B (v = 1) and Interleaved1F1B (v stages per rank):
    (p - 1) / (v * m + p - 1)."""
    return (p - 1) / (v * m + p - 1)


def pp_bubble_series(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One series per pipeline degree and schedule: the cases run, (m, measured, least rank,
    greatest rank, recorded theory) each, the theory computed here (None for ZBVZeroBubble, whose
    theory bench_pp.py does not print), and the cases not run."""
    out: list[dict[str, Any]] = []
    for r in data["bubble_rows"]:
        key = (r["p"], r["schedule"])
        if not out or (out[-1]["p"], out[-1]["schedule"]) != key:
            out.append({"p": r["p"], "schedule": r["schedule"], "v": r["v"], "points": [], "not_run": []})
        s = out[-1]
        if r["measured"] is None:
            s["not_run"].append((r["m"], r["not_run"]))
            continue
        theory = None if r["schedule"] == "ZBVZeroBubble" else pipeline_bubble(r["p"], r["m"], r["v"])
        s["points"].append({"m": r["m"], "measured": r["measured"], "ranks_min": r["ranks_min"],
                            "ranks_max": r["ranks_max"], "theory": r["theory"], "theory_computed": theory})
    return out


def pp_memory_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stage: GPipe's and 1F1B's activation memory, their ratio computed from the printed medians,
    bench_pp.py's ratio (from its unrounded medians) and the expected m / (p - stage)."""
    p, m = data["memory_p"], data["memory_m"]
    return [{"stage": r["stage"], "gpipe": r["gpipe"], "one_f_one_b": r["one_f_one_b"],
             "ratio": r["gpipe"] / r["one_f_one_b"], "ratio_recorded": r["gpipe_over_1f1b"],
             "expected": m / (p - r["stage"])} for r in data["memory_rows"]]


def sac_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per shape and policy: saved MiB, recomputed GFLOP, step CPU s, and saved MiB and step CPU s
    over the shape's ``none`` computed here (bench_sac.py's 'vs none' columns, printed to 2 decimals)."""
    none = {r["shape"]: r for r in data["rows"] if r["policy"] == "none"}
    return [{"shape": r["shape"], "policy": r["policy"], "saved_mib": r["saved_mib"],
             "recomputed_gflop": r["recomputed_gflop"], "step_cpu_s": r["step_cpu_s"],
             "saved_vs_none": r["saved_mib"] / none[r["shape"]]["saved_mib"],
             "step_vs_none": r["step_cpu_s"] / none[r["shape"]]["step_cpu_s"]} for r in data["rows"]]


def moe_model_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model: held-out loss, tokens/s (median, p10, p90), tokens/s and loss against dense's."""
    dense = next(r for r in data["models"] if r["model"] == "dense")
    return [{"model": r["model"], "params": r["params"], "active_params": r["active_params"],
             "val_loss": r["val_loss"], "loss_minus_dense": r["val_loss"] - dense["val_loss"],
             "tok_per_s": r["tok_per_s_median"], "p10": r["tok_per_s_p10"], "p90": r["tok_per_s_p90"],
             "vs_dense": r["tok_per_s_median"] / dense["tok_per_s_median"]} for r in data["models"]]


def moe_load_series(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """With and without the bias: the steps, each block's max/mean load along them, and per step the
    mean, least and greatest over the blocks."""
    steps = [r["step"] for r in data["load_rows"]]
    out = {}
    for key in ("with_bias", "without_bias"):
        per_step = [r[key] for r in data["load_rows"]]
        out[key] = {"steps": steps, "blocks": [list(b) for b in zip(*per_step)],
                    "mean": [sum(v) / len(v) for v in per_step], "least": [min(v) for v in per_step],
                    "greatest": [max(v) for v in per_step]}
    return out


# ---- drawing

def _log_label(value: float, _position) -> str:
    """A log axis labelled 10, 20, 50, 100, 200, 500, ... in plain numbers; its other ticks unlabelled."""
    text = f"{value:g}"
    return text if text[0] in "125" else ""


def _draw_plan(plt, data: dict[str, Any], note: str, path: str) -> None:
    points = plan_points(data)
    cases = [plan_case_ratios(r) for r in data["records"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.8), sharex=True, sharey=True,
                             subplot_kw={"xscale": "log", "yscale": "log"})
    values = [p[k] for p in points for k in ("planned_mib", "measured_mib", "without_fixed_mib")]
    lo, hi = min(values) / 1.25, max(values) * 1.25
    line = [lo, hi]
    panels = (("measured_mib", 0, "measured peak (raw)"),
              ("without_fixed_mib", 1, "measured peak less the fixed bytes (the modelled part)"))
    for ax, (key, which, title) in zip(axes, panels):
        ax.fill_between(line, [x * (1 - BAND) for x in line], [x * (1 + BAND) for x in line], color="0.88",
                        label=f"within {BAND:.0%} of the plan")
        ax.plot(line, line, color="black", linewidth=1, label="measured = planned")
        for i, layout in enumerate(dict.fromkeys(p["layout"] for p in points)):
            mine = [p for p in points if p["layout"] == layout]
            ax.plot([p["planned_mib"] for p in mine], [p[key] for p in mine], marker=LAYOUT_MARKERS.get(layout, "x"),
                    color=f"C{i % 10}", linestyle="none", markersize=6, alpha=0.8, label=layout)
        ratios = [p[key] / p["planned_mib"] for p in points]
        inside = sum(1 - BAND <= r <= 1 + BAND for r in ratios)
        case = [c[which] for c in cases]
        ax.text(0.03, 0.97, f"per case and rank: {min(ratios):.3f}-{max(ratios):.3f}, {inside} of {len(ratios)} "
                            f"within {BAND:.0%}\nper case (larger rank, as the table): {min(case):.3f}-{max(case):.3f}"
                            f" over {len(case)} cases", transform=ax.transAxes, va="top", fontsize=8)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(_log_label)
            axis.set_minor_formatter(_log_label)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("planned peak per rank, MiB (planning.memory_per_rank)")
    axes[0].set_ylabel("measured peak per rank, MiB (malloc bytes in use)")
    axes[1].legend(loc="lower right", fontsize=7, ncol=2)
    fig.suptitle("plan against measurement: peak memory per rank (bench_plan.py, fp32, 2 gloo ranks)", fontsize=10)
    save_with_footnote(plt, fig, path, "fixed = measured rest - planned state (and a pipeline's receive buffers): "
                                       "what a process holds besides them, which the plan does not model. " + note)


def _draw_fsdp(plt, data: dict[str, Any], note: str, path: str) -> None:
    rows = fsdp_rows(data)
    ns = sorted({r["n"] for r in rows})
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 5.2))
    width = 0.8 / len(stages)
    for j, stage in enumerate(stages):
        color = f"C{j}"
        mine = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["n"])
        xs = [ns.index(r["n"]) + (j - (len(stages) - 1) / 2) * width for r in mine]
        ax.bar(xs, [r["rest"] for r in mine], width * 0.9, color=color, label=f"{stage}: at rest")
        ax.bar(xs, [r["above_rest"] for r in mine], width * 0.9, bottom=[r["rest"] for r in mine], color=color,
               alpha=0.4, label=f"{stage}: the step's peak above rest")
        for x, r in zip(xs, mine):
            ax.text(x, r["peak"], f"{r['peak']:.1f}", ha="center", va="bottom", fontsize=7.5)
    for i, n in enumerate(ns):
        state = next(r["computed_state"] for r in rows if r["n"] == n)
        ax.hlines(state, i - 0.45, i + 0.45, color="black", linestyle="--", linewidth=1,
                  label="computed state, 16 B/param / N" if i == 0 else None)
    ax.set_xticks(range(len(ns)), [f"N = {n}" for n in ns])
    ax.set_xlabel("ranks (FSDP2 over N gloo processes)")
    ax.set_ylabel("memory per rank, MiB (malloc bytes in use, rank 0)")
    ax.set_ylim(0, max(r["peak"] for r in rows) * 1.12)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title("FSDP2 memory per rank by ZeRO stage (bench_fsdp.py --part memory): rank 0, step 2", fontsize=10)
    save_with_footnote(plt, fig, path, f"{data['model']}. {note}")


def _draw_cp(plt, data: dict[str, Any], note: str, path: str) -> None:
    series = cp_series(data)
    fig, axes = plt.subplots(1, len(series), figsize=(6.2 * len(series), 5.2), squeeze=False)
    for ax, (preset, lines) in zip(axes[0], series.items()):
        budget = data["memory"][preset]["budget_mib"]
        for i, s in enumerate(lines):
            xs, ys = zip(*s["points"])
            color = f"C{i}"
            ax.plot(xs, ys, marker="o", color=color, label=f"cp={s['cp']}")
            x = s["longest_within_budget"]
            if s["extrapolated"] and x > xs[-1]:
                ax.plot([xs[-1], x], [ys[-1], budget], color=color, linestyle=":")
            ax.plot(x, budget, marker="x", color=color, markersize=9, linestyle="none")
            ax.annotate(f"{x:,.0f} ({s['over_cp1']:.2f}x){' computed' if s['extrapolated'] else ''}", (x, budget),
                        xytext=(0, 8 + 11 * i), textcoords="offset points", ha="center", fontsize=7.5, color=color)
        ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"budget {budget:g} MiB per rank")
        seqs = [p[0] for p in lines[0]["points"]]
        ax.set_xlim(0, max(seqs + [s["longest_within_budget"] for s in lines]) * 1.1)
        ax.set_ylim(0, budget * 1.4)
        ax.set_xlabel("sequence length, tokens (x: the longest within the budget)")
        ax.set_ylabel("peak of a step (forward + backward), MiB per rank")
        ax.set_title(f"{preset} GPT (byte vocabulary, batch 1)", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Context parallel (ring attention): peak memory per rank against sequence length (bench_cp.py)",
                 fontsize=10)
    save_with_footnote(plt, fig, path, "Beyond the last measured point: along the last two (computed). " + note)


def _draw_groups(plt, data: dict[str, Any], note: str, path: str) -> None:
    rows = group_rows(data)
    fig, (ax, ax_calls) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 2.4), sharey=True,
                                       gridspec_kw={"width_ratios": [3, 2]})
    y = range(len(rows))
    groups = [r["groups"] for r in rows]
    ax.barh(y, groups, color="C0")
    for i, r in enumerate(rows):
        sizes = ", ".join(map(str, r["sizes"])) or r["note"]
        ax.text(r["groups"], i, f" {r['groups']} (sizes {sizes})" if r["sizes"] else f" 0 ({sizes})",
                va="center", fontsize=7.5)
    ax.set_yticks(list(y), [r["layout"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(groups) * 1.9)
    ax.set_xlabel("process groups this rank joins (each a distinct rank set)")
    calls = [r["new_group_calls"] for r in rows]
    ax_calls.barh(y, calls, color="C1")
    for i, c in enumerate(calls):
        ax_calls.text(c, i, f" {c:,}", va="center", fontsize=7.5)
    ax_calls.set_xlim(0, max(calls) * 1.2)
    ax_calls.set_xlabel("new_group calls every rank makes")
    fig.suptitle(f"Process groups per rank by layout at {data['world']:,} ranks (bench_process_groups.py)",
                 fontsize=10)
    save_with_footnote(plt, fig, path, "On GPUs each joined group is an NCCL communicator with its own buffers. "
                       + note)


def _case_label(t: int, sp: str) -> str:
    return f"t = {t}" if sp == "-" else f"t = {t}\nSP {sp}"


def _tp_positions(rows: list[dict[str, Any]]) -> list[float]:
    """x of each case: consecutive within a tp degree, a gap between degrees."""
    xs, x, last = [], -1.0, None
    for r in rows:
        x += 1 if r["t"] == last else 1.5
        xs.append(x)
        last = r["t"]
    return xs


SP_COLORS = {"-": "C0", "on": "C1", "off": "C2"}
"""Section 10's sequence-parallel settings -> colour (t = 1 has none: '-')."""


def _draw_tp(plt, data: dict[str, Any], note: str, path: str) -> None:
    mem, acts = tp_memory_rows(data), tp_activation_rows(data)
    fig, (ax, ax_act) = plt.subplots(1, 2, figsize=(13, 5.4))
    xs = _tp_positions(mem)
    for x, r in zip(xs, mem):
        color = SP_COLORS.get(r["sp"], "C3")
        ax.bar(x, r["rest"], 0.7, color=color)
        ax.bar(x, r["above_rest"], 0.7, bottom=r["rest"], color=color, alpha=0.4)
        ax.text(x, r["peak"], f"{r['peak']:.1f}", ha="center", va="bottom", fontsize=7.5)
        ax.text(x, r["rest"] / 2, f"{r['rest']:.1f}\n({r['rest_over_computed']:.2f}x)", ha="center", va="center",
                fontsize=7, color="white")
        ax.hlines(r["computed_state"], x - 0.4, x + 0.4, color="black", linestyle="--", linewidth=1)
    handles = [plt.Rectangle((0, 0), 1, 1, color="0.3"), plt.Rectangle((0, 0), 1, 1, color="0.3", alpha=0.4),
               plt.Line2D([], [], color="black", linestyle="--", linewidth=1)]
    ax.legend(handles, ["at rest (rest / computed state)", "the step's peak above rest",
                        "computed state, 16 B x local elements"], fontsize=7, loc="upper right")
    ax.set_xticks(xs, [_case_label(r["t"], r["sp"]) for r in mem], fontsize=8)
    ax.set_xlabel("tensor-parallel degree t (ranks), sequence parallel on / off")
    ax.set_ylabel("memory per rank, MiB (malloc bytes in use, rank 0)")
    ax.set_ylim(0, max(r["peak"] for r in mem) * 1.12)
    ax.set_title("memory per rank, step 2", fontsize=9)
    xs = _tp_positions(acts)
    width = 0.3
    for x, r in zip(xs, acts):
        ax_act.bar(x - width / 2, r["malloc"], width, color="C0")
        ax_act.bar(x + width / 2, r["saved"], width, color="C4")
        ax_act.text(x - width / 2, r["malloc"], f"{r['malloc']:.2f}", ha="center", va="bottom", fontsize=6.5)
        ax_act.hlines(r["megatron"], x - 0.42, x + 0.42, color="black", linewidth=1.5)
        ax_act.hlines(r["adapted"], x - 0.42, x + 0.42, color="C3", linestyle="--", linewidth=1.2)
        if r["megatron_sp_adapted"] is not None:
            ax_act.hlines(r["megatron_sp_adapted"], x - 0.42, x + 0.42, color="C2", linestyle=":", linewidth=1.5)
    handles = [plt.Rectangle((0, 0), 1, 1, color="C0"), plt.Rectangle((0, 0), 1, 1, color="C4"),
               plt.Line2D([], [], color="black", linewidth=1.5),
               plt.Line2D([], [], color="C3", linestyle="--", linewidth=1.2),
               plt.Line2D([], [], color="C2", linestyle=":", linewidth=1.5)]
    ax_act.legend(handles, ["measured: malloc", "measured: what autograd saved",
                            "Megatron's formula (16-bit, dropout masks, softmax)",
                            "the formula adapted to this model (fp32)",
                            "adapted, SP inputs kept sharded (Megatron's SP)"], fontsize=7, loc="upper right")
    ax_act.set_xticks(xs, [_case_label(r["t"], r["sp"]) for r in acts], fontsize=8)
    ax_act.set_xlabel("tensor-parallel degree t (ranks), sequence parallel on / off")
    ax_act.set_ylabel("activations per layer, MiB (block 1 of 6, rank 0)")
    ax_act.set_ylim(0, max(r["malloc"] for r in acts) * 1.45)
    ax_act.set_title("activations per transformer layer against the formulas", fontsize=9)
    fig.suptitle("Tensor parallel: memory per rank and activations per layer (bench_tp.py, fp32, gloo)", fontsize=10)
    save_with_footnote(plt, fig, path, f"GPT 'small', n_head 8: {data['layers']} layers, h={data['h']}, "
                                       f"a={data['a']}, batch {data['b']} x seq {data['s']}, AdamW. {note}")


PP_SCHEDULES = {"GPipe": ("C0", "o"), "1F1B": ("C1", "s"), "Interleaved1F1B": ("C2", "^"),
                "ZBVZeroBubble": ("C3", "D")}
"""Section 11's schedules -> (colour, marker)."""


def _draw_pp(plt, data: dict[str, Any], note: str, path: str) -> None:
    series, mem = pp_bubble_series(data), pp_memory_rows(data)
    degrees = sorted({s["p"] for s in series})
    fig, axes = plt.subplots(1, len(degrees) + 1, figsize=(5 * len(degrees) + 4.5, 5.4),
                             gridspec_kw={"width_ratios": [3] * len(degrees) + [2.2]})
    ms = sorted({r["m"] for r in data["bubble_rows"]})
    top = max(max(p["ranks_max"], p["theory"] or 0) for s in series for p in s["points"])
    for ax, p in zip(axes, degrees):
        mine = [s for s in series if s["p"] == p]
        for j, s in enumerate(mine):
            color, marker = PP_SCHEDULES.get(s["schedule"], (f"C{j + 4}", "x"))
            shift = (j - (len(mine) - 1) / 2) * 0.09
            pts = s["points"]
            if not pts:
                continue
            xs = [ms.index(q["m"]) + shift for q in pts]
            below = [q["measured"] - q["ranks_min"] for q in pts]
            above = [q["ranks_max"] - q["measured"] for q in pts]
            ax.errorbar(xs, [q["measured"] for q in pts], yerr=[below, above],
                        color=color, marker=marker, capsize=3, linewidth=1.2, label=f"{s['schedule']} (v={s['v']})")
            theory = [(x, q["theory"]) for x, q in zip(xs, pts) if q["theory"] is not None]
            if theory:
                ax.plot(*zip(*theory), color=color, marker=marker, markerfacecolor="none", linestyle="--",
                        linewidth=0.9, alpha=0.8)
        skipped = [f"{s['schedule']} m={m}" for s in mine for m, _ in s["not_run"]]
        if skipped:
            ax.text(0.02, 0.02, "\n".join(textwrap.wrap("not run (m < stages): " + ", ".join(skipped), 60)),
                    transform=ax.transAxes, fontsize=6.5, va="bottom")
        ax.set_xticks(range(len(ms)), [str(m) for m in ms])
        ax.set_xlim(-0.5, len(ms) - 0.5)
        ax.set_ylim(0, top * 1.15)
        ax.set_xlabel("micro-batches m")
        ax.set_title(f"bubble, p = {p} ({p} ranks on 2 cores)", fontsize=9)
    axes[0].plot([], [], color="0.4", linestyle="--", marker="o", markerfacecolor="none", label="theory (open, dashed)")
    axes[0].set_ylabel("bubble: idle fraction of the schedule step\n(mean over ranks, bars: least to greatest rank)")
    axes[0].legend(fontsize=7, loc="upper right")
    ax = axes[-1]
    width = 0.38
    for i, r in enumerate(mem):
        for j, (key, name) in enumerate((("gpipe", "GPipe"), ("one_f_one_b", "1F1B"))):
            color = PP_SCHEDULES[name][0]
            ax.bar(i + (j - 0.5) * width, r[key], width * 0.95, color=color, label=name if i == 0 else None)
            ax.text(i + (j - 0.5) * width, r[key], f"{r[key]:.1f}", ha="center", va="bottom", fontsize=7.5)
        ax.text(i, max(r["gpipe"], r["one_f_one_b"]) * 1.07, f"GPipe / 1F1B {r['ratio_recorded']:.2f}\n"
                f"expected m/(p-s) = {r['expected']:g}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(mem)), [f"stage {r['stage']}" for r in mem])
    ax.set_ylim(0, max(r["gpipe"] for r in mem) * 1.35)
    ax.set_ylabel("activation memory per stage, MiB\n(malloc peak during the step - the level before)")
    ax.set_title(f"activation memory per stage\np = {data['memory_p']}, m = {data['memory_m']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Pipeline parallel: bubble per schedule and activation memory, GPipe vs 1F1B (bench_pp.py, fp32, "
                 "gloo)", fontsize=10)
    save_with_footnote(plt, fig, path, "Theory: (p - 1) / (v*m + p - 1); none for ZBVZeroBubble. At p = 4 ranks "
                                       "wait for a core as well as for their neighbour. " + note)


SAC_POLICIES = {"none": ("C0", "o"), "selective": ("C1", "s"), "selective every_other": ("C2", "^"),
                "block k=2": ("C4", "v"), "full": ("C3", "D")}
"""Section 7's policies -> (colour, marker)."""


def _draw_sac(plt, data: dict[str, Any], note: str, path: str) -> None:
    rows = sac_rows(data)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 5.2))
    for ax, shape in zip(axes, shapes):
        mine = [r for r in rows if r["shape"] == shape]
        for r in mine:
            color, marker = SAC_POLICIES.get(r["policy"], ("C5", "x"))
            ax.plot(r["saved_mib"], r["step_cpu_s"], marker=marker, color=color, markersize=8, linestyle="none",
                    label=f"{r['policy']}: {r['saved_mib']:.1f} MiB ({r['saved_vs_none']:.2f}x), {r['step_cpu_s']:.3f} s "
                          f"({r['step_vs_none']:.2f}x), recomputes {r['recomputed_gflop']:.2f} GFLOP")
        top_mib = max(r["saved_mib"] for r in mine)
        times = [r["step_cpu_s"] for r in mine]
        ax.set_xlim(0, top_mib * 1.1)
        spread = max(times) - min(times)
        ax.set_ylim(min(times) - 0.5 * spread, max(times) + 0.1 * spread)  # room for the legend below
        ax.set_xlabel("activations saved for backward, MiB (after forward, each storage once)")
        ax.set_title(shape, fontsize=9)
        ax.legend(fontsize=7, loc="lower left")
    axes[0].set_ylabel("step CPU time, s (best of 3 interleaved steps)")
    fig.suptitle(f"Activation checkpointing: memory kept against step time per policy (bench_sac.py, "
                 f"{data['setting']})", fontsize=10)
    save_with_footnote(plt, fig, path, "In the legend: saved MiB and step CPU time, over the shape's none; GFLOP of "
                                       "matmul/attention recomputed in backward (selective reruns only pointwise "
                                       "ops). " + note)


MOE_COLORS = {"dense": "C0", "moe (bias 1e-3)": "C1", "moe_nobias": "C3"}
"""Section 14's models -> colour."""


def _draw_moe(plt, data: dict[str, Any], note: str, path: str) -> None:
    models, load = moe_model_rows(data), moe_load_series(data)
    fig, (ax_loss, ax_tok, ax_load) = plt.subplots(1, 3, figsize=(15, 5.2), gridspec_kw={"width_ratios": [2, 2, 3.4]})
    xs = range(len(models))
    colors = [MOE_COLORS.get(r["model"], "C5") for r in models]
    labels = [f"{r['model']}\n{r['active_params'] / 1e6:.2f}M active\nof {r['params'] / 1e6:.2f}M" for r in models]
    ax_loss.bar(xs, [r["val_loss"] for r in models], 0.6, color=colors)
    for x, r in zip(xs, models):
        ax_loss.text(x, r["val_loss"], f"{r['val_loss']:.3f}" + (f"\n({r['loss_minus_dense']:+.3f})"
                     if r["model"] != "dense" else ""), ha="center", va="bottom", fontsize=7.5)
    low = min(r["val_loss"] for r in models)
    ax_loss.set_ylim(low - 0.15, max(r["val_loss"] for r in models) + 0.06)
    ax_loss.set_xticks(list(xs), labels, fontsize=7.5)
    ax_loss.set_ylabel(f"held-out loss after {data['steps']} steps (mean of 20 val batches)")
    ax_loss.set_title("held-out loss (the axis does not start at 0)", fontsize=9)
    ax_tok.bar(xs, [r["tok_per_s"] for r in models], 0.6, color=colors,
               yerr=[[r["tok_per_s"] - r["p10"] for r in models], [r["p90"] - r["tok_per_s"] for r in models]],
               capsize=4, ecolor="0.3")
    for x, r in zip(xs, models):
        ax_tok.text(x, 150, f"{r['tok_per_s']:,}\n{r['vs_dense']:.2f}x dense", ha="center", va="bottom",
                    fontsize=7.5, color="white")
    ax_tok.set_ylim(0, max(r["p90"] for r in models) * 1.1)
    ax_tok.set_xticks(list(xs), labels, fontsize=7.5)
    ax_tok.set_ylabel("tokens/s, median (bars: p10-p90 of the steps)")
    ax_tok.set_title("throughput, the three models in lockstep", fontsize=9)
    for key, name in (("with_bias", "moe (bias 1e-3)"), ("without_bias", "moe_nobias")):
        s, color = load[key], MOE_COLORS[name]
        for block in s["blocks"]:
            ax_load.plot(s["steps"], block, color=color, linewidth=0.7, alpha=0.45)
        ax_load.plot(s["steps"], s["mean"], color=color, linewidth=2, marker="o", markersize=4,
                     label=f"{'with' if key == 'with_bias' else 'without'} the bias: mean of the {data['blocks']} "
                           "blocks (thin: each block)")
    ax_load.axhline(1.0, color="black", linestyle="--", linewidth=1, label="1.0: every expert equally loaded")
    ax_load.set_xticks(load["with_bias"]["steps"])
    ax_load.set_ylim(0, data["experts"] / 2 * 1.1)
    ax_load.set_xlabel("training step")
    ax_load.set_ylabel(f"max/mean tokens per expert ({data['experts']} experts, top-2)")
    ax_load.set_title("load balance with and without the balancing bias", fontsize=9)
    ax_load.legend(fontsize=7, loc="lower right")
    fig.suptitle("Mixture of experts against dense at equal active parameters (bench_moe.py quality, fp32, "
                 "2,048 tokens per step)", fontsize=10)
    save_with_footnote(plt, fig, path, "4.0 = half of all assignments on one of the 8 experts. " + note)


DRAW = {"cpu-plan-vs-measured": _draw_plan, "cpu-fsdp-memory": _draw_fsdp, "cpu-cp-memory": _draw_cp,
        "cpu-process-groups": _draw_groups, "cpu-tp-memory": _draw_tp, "cpu-pp-bubble-memory": _draw_pp,
        "cpu-sac": _draw_sac, "cpu-moe": _draw_moe}


def plot_results(inputs: list[str], out_dir: str, command: str = "", fmt: str = "svg") -> dict[str, Any]:
    """Write the figures of ``inputs`` (see the module's docstring) into ``out_dir``. Returns the
    files written (``files``: figure name -> path), the figures not written and why (``skipped``),
    and the numbers drawn (``plan``, ``fsdp_memory``, ``cp_memory``, ``process_groups``,
    ``tp_memory``, ``tp_activations``, ``pp_bubble``, ``pp_memory``, ``sac``, ``moe_models``,
    ``moe_load``; None where the benchmark is not among the inputs)."""
    check_format(fmt)
    results = load_results(inputs)
    from lightning_disttrain.planning.plot import pyplot  # matplotlib on Agg, or what to install

    plt = pyplot()
    os.makedirs(out_dir, exist_ok=True)
    files, skipped = {}, {}
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": "lightning-disttrain cpu_figures"}):
        for name, benchmark in FIGURES.items():
            if benchmark not in results:
                skipped[name] = f"no {benchmark} result among the inputs"
                continue
            path = os.path.join(out_dir, f"{name}.{fmt}")
            DRAW[name](plt, results[benchmark], footnote(results[benchmark], command), path)
            files[name] = path

    def drawn(benchmark: str, numbers):
        return numbers(results[benchmark]) if benchmark in results else None

    return {"files": files, "skipped": skipped, "plan": drawn("bench_plan", plan_points),
            "fsdp_memory": drawn("bench_fsdp_memory", fsdp_rows), "cp_memory": drawn("bench_cp", cp_series),
            "process_groups": drawn("bench_process_groups", group_rows),
            "tp_memory": drawn("bench_tp_memory", tp_memory_rows),
            "tp_activations": drawn("bench_tp_memory", tp_activation_rows),
            "pp_bubble": drawn("bench_pp_bubble_memory", pp_bubble_series),
            "pp_memory": drawn("bench_pp_bubble_memory", pp_memory_rows), "sac": drawn("bench_sac", sac_rows),
            "moe_models": drawn("bench_moe_quality", moe_model_rows),
            "moe_load": drawn("bench_moe_quality", moe_load_series)}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="draw the figures of recorded CPU benchmark results")
    p.add_argument("--plot", metavar="DIR", required=True, help="write the figures (cpu-*.svg) into DIR")
    p.add_argument("--format", default="svg", choices=PLOT_FORMATS, help="the figures' format (default svg)")
    p.add_argument("inputs", nargs="+", metavar="JSON_OR_DIR",
                   help="recorded results (JSON files with benchmark, date, machine, command, source), or "
                        "directories holding them")
    args = p.parse_args(argv)
    return run_plot(plot_results, args.inputs, args.plot, render_command("cpu_figures.py", argv), args.format)


if __name__ == "__main__":
    raise SystemExit(main())
