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
  the ratio expected (m / (p - stage));
- ``cpu-sac`` (``bench_sac``: section 7): per model shape, the activation memory kept for backward
  against the step's CPU time for each activation checkpointing policy, both against ``none``,
  with the GFLOP each recomputes;
- ``cpu-moe`` (``bench_moe_quality``: section 14): MoE (with and without the balancing bias) against
  the dense model of equal active parameters, held-out loss and tokens/s (median, p10-p90); and the
  max/mean expert load per block along training, with and without the bias;
- ``cpu-fsdp-throughput`` (``bench_fsdp_throughput``: section 5, ``bench_fsdp.py --part
  throughput``, runs A and B): s/step per round of ours, the hand-written loop and Lightning's
  ModelParallelStrategy, with the load average before each round; and each against the hand-written
  loop (per round, ratio of the medians, best-of; computed here from the per-repeat s/step) with
  the 0.95 target;
- ``cpu-checkpoint-stall`` (``bench_checkpoint``: section 6): training blocked per save, sync against
  async; the ordinary step, the step after a save and save start to complete; the fit's total;
- ``cpu-eval`` (``bench_eval``: section 13): the time per checkpoint of each eval task (median,
  min-max, ms per request); the steps ending in a checkpoint against an ordinary step with no evals,
  inline and in a separate process, the pause computed as bench_eval.py does; the fit's total and
  the part waited at its end;
- ``cpu-preemption`` (``bench_preemption``: sections 15 and 15a): SIGTERM to the exit of every
  process per run (median, min-max) with the trials' outcomes; the agreement's all_reduce at the
  step boundary and on aligned ranks;
- ``cpu-end-to-end`` (``bench_end_to_end``: section 18): the median time of each phase, stacked, for
  plain, fit and fit-auto (07:30 UTC) and plain, lightning, fit and fit-auto (16:13 UTC), with the
  median totals; and each phase's difference to plain (computed);
- ``cpu-fault-tolerance`` (``bench_fault_tolerance``: section 19): the median step per round of the
  four runs; the kill-to-step-alone time per heartbeat timeout; heal times by model size; and the
  work lost per failure, checkpoint/restart against fault tolerance (computed, as printed);
- ``cpu-setup-memory`` (``bench_setup_memory``: section 22): tensor, malloc and RSS peaks per rank
  while setting a model up, meta build against the eager one, with the model, half of it and the
  bound;
- ``cpu-accumulation-memory`` (``bench_accumulation_memory``: section 23): measured against planned
  peak and held between micro-batches, sharded and unsharded accumulation, and the modes' difference;
- ``cpu-muon`` (``bench_muon``: ``bench_muon.py``'s own record, section 24): collectives per
  optimizer step and its time, ShardedMuon against torch.optim.Muon on the shards and AdamW, for
  the tiny and small presets on 2 and 4 ranks, and the computed busiest owner's Newton-Schulz
  FLOPs against the mean for gpt2-1558m and llama3-70b at 64 and 1,024 ranks.

The recorded JSONs other than bench_plan's, bench_cp's and bench_muon's (their benchmarks' own output)
are transcribed from docs/benchmarks.md; each says which section and
run in ``source``. Every benchmark behind one now writes its own record in the same schema when run
with ``--record FILE`` (its provenance from ``record.py``) and draws its figure with ``--plot DIR``. A figure
whose benchmark is not among the inputs is not written, and said so. As in gpu_report.py (both save
through ``figure_output.py``): SVG text stays text, no creation date, fixed element ids, so the same
inputs and command render the same bytes.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import textwrap
from typing import Any

from figure_output import PLOT_FORMATS, check_format, json_inputs, render_command, run_plot, save_with_footnote

REQUIRED = ("benchmark", "date", "machine", "command", "source")
"""The fields every recorded JSON carries."""
FIGURES = {"cpu-plan-vs-measured": "bench_plan", "cpu-fsdp-memory": "bench_fsdp_memory",
           "cpu-cp-memory": "bench_cp", "cpu-process-groups": "bench_process_groups",
           "cpu-tp-memory": "bench_tp_memory", "cpu-pp-bubble-memory": "bench_pp_bubble_memory",
           "cpu-sac": "bench_sac", "cpu-moe": "bench_moe_quality", "cpu-fsdp-throughput": "bench_fsdp_throughput",
           "cpu-checkpoint-stall": "bench_checkpoint", "cpu-eval": "bench_eval", "cpu-preemption": "bench_preemption",
           "cpu-end-to-end": "bench_end_to_end", "cpu-fault-tolerance": "bench_fault_tolerance",
           "cpu-setup-memory": "bench_setup_memory", "cpu-accumulation-memory": "bench_accumulation_memory",
           "cpu-muon": "bench_muon"}
"""Figure name -> the benchmark whose JSON it is drawn from."""
LAYOUT_MARKERS = {"fsdp2": "o", "tp": "s", "pp-1f1b": "^", "pp-interleaved": "v", "pp-gpipe": "D", "ep": "P",
                  "cp": "X"}
"""bench_plan's layouts -> marker (another layout: x)."""
BAND = 0.10
"""The plan-vs-measured figure's band around y = x: +-10%."""


def load_results(inputs: list[str]) -> dict[str, dict[str, Any]]:
    """benchmark -> its recorded JSON (plus ``path``), from files and directories, in order."""
    results: dict[str, dict[str, Any]] = {}
    for path in json_inputs(inputs):
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


def fsdp_throughput_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per run and variant: the per-repeat s/step, their min / median / max, tok/s at the best and
    median s/step (tokens per step / s), and against the hand-written loop (its s/step over the
    variant's: ``None`` for the loop itself): best-of, ratio of the medians, and per round (the
    same round's hand / variant) with their min / median / max, all computed here from the
    per-repeat s/step (bench_fsdp.py's computed them from the unrounded ones)."""
    out = []
    for run in data["runs"]:
        hand = next(v for v in run["variants"] if v["variant"].startswith("hand-written"))
        for v in run["variants"]:
            steps = v["s_per_step"]
            row = {"run": run["run"], "variant": v["variant"], "s_per_step": steps, "min": min(steps),
                   "median": statistics.median(steps), "max": max(steps),
                   "tok_s_best": data["tokens_per_step"] / min(steps),
                   "tok_s_median": data["tokens_per_step"] / statistics.median(steps),
                   "load_before_round": run["load_before_round"], "is_hand": v is hand}
            if v is not hand:
                rounds = [h / s for h, s in zip(hand["s_per_step"], steps, strict=True)]
                row |= {"vs_hand_best_of": min(hand["s_per_step"]) / min(steps),
                        "vs_hand_median": statistics.median(hand["s_per_step"]) / statistics.median(steps),
                        "per_round": rounds, "per_round_min": min(rounds),
                        "per_round_median": statistics.median(rounds), "per_round_max": max(rounds)}
            out.append(row)
    return out


def checkpoint_modes(data: dict[str, Any]) -> dict[str, Any]:
    """Per mode (sync, async): each save's blocking time and their median, the ordinary step, the
    step after a save, save start to complete, the fit's total; and async against sync: the stall
    ratio (blocked medians) and the fit's total."""
    modes = {m["mode"]: m | {"blocked_median": statistics.median(m["blocked_s"])} for m in data["modes"]}
    sync, asyn = modes["sync"], modes["async"]
    return {"modes": modes, "stall_ratio": asyn["blocked_median"] / sync["blocked_median"],
            "total_ratio": asyn["fit_total_s"] / sync["fit_total_s"],
            "async_after_save_minus_step": asyn["step_after_save_s"] - asyn["step_s"]}


def eval_task_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per task: items, requests, s min / median / max, ms per request as printed (bench_eval.py's,
    from the unrounded s min: drawn) and computed here as bench_eval.py does (1000 x s min /
    requests, from the printed s min); the last row, ``total``, as printed."""
    return [{"task": t["task"], "items": t["items"], "requests": t["requests"], "s_min": t["s_min"],
             "s_median": t["s_median"], "s_max": t["s_max"], "ms_per_request": t["ms_per_request"],
             "ms_per_request_computed": 1000 * t["s_min"] / t["requests"]} for t in [*data["tasks"], data["total"]]]


def eval_pause_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per mode: the ordinary step, the checkpoint steps, each one's pause over the ordinary step and
    their median (bench_eval.py's 'pause over a step'), that median over the save-only run's, the
    fit's total, its part waited at the end and the rest."""
    none = statistics.median(c - data["pause"][0]["step_s"] for c in data["pause"][0]["checkpoint_steps_s"])
    out = []
    for p in data["pause"]:
        pauses = [c - p["step_s"] for c in p["checkpoint_steps_s"]]
        out.append({"mode": p["mode"], "step_s": p["step_s"], "checkpoint_steps_s": p["checkpoint_steps_s"],
                    "pauses": pauses, "pause_median": statistics.median(pauses),
                    "over_save_only": statistics.median(pauses) - none, "fit_total_s": p["fit_total_s"],
                    "waited_at_end_s": p["waited_at_end_s"], "training_s": p["fit_total_s"] - p["waited_at_end_s"]})
    return out


def preemption_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per run: the signal-to-exit times (median, min, max; None where not given), the trials'
    outcomes, and where measured the agreement's cost: at the step boundary, on aligned ranks, and
    that over the median step (computed; the section prints it as a percentage)."""
    out = []
    for r in data["runs"]:
        row = dict(r)
        if r.get("agreement_aligned_ms") is not None:
            row["aligned_share"] = r["agreement_aligned_ms"] / r["median_step_ms"]
        out.append(row)
    return out


def end_to_end_runs(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per run: the variants, the phases (median s per variant), the median totals, each phase's
    and the total's difference to plain, the total over plain's (ratio of the medians) and, where
    the run gives its totals per round, fit / plain and fit-auto / plain round by round."""
    out = []
    for run in data["runs"]:
        variants = run["variants"]
        diffs = {v: {p["phase"]: p["s"][v] - p["s"]["plain"] for p in run["phases"]} for v in variants if v != "plain"}
        row = {"run": run["run"], "variants": variants, "phases": run["phases"], "total_s": run["total_s"],
               "minus_plain": diffs, "total_minus_plain": {v: run["total_s"][v] - run["total_s"]["plain"]
                                                           for v in variants if v != "plain"},
               "over_plain": {v: run["total_s"][v] / run["total_s"]["plain"] for v in variants}}
        rounds = run.get("totals_per_round")
        if rounds:
            row["per_round_over_plain"] = {v: [a / b for a, b in zip(rounds[v], rounds["plain"], strict=True)]
                                           for v in variants if v != "plain"}
        out.append(row)
    return out


def fault_tolerance_numbers(data: dict[str, Any]) -> dict[str, Any]:
    """Overhead: per run its step per round and their median, and per round one group alone / one
    process and two groups / HSDP; failure: the kill-to-step-alone times per heartbeat timeout; heal:
    per model, the survivor's heal step less its step (serving the state); work lost per failure
    (computed, as bench_fault_tolerance.py does, from the rounded C, R, wait and relaunch the section
    prints): the Young/Daly interval sqrt(2 C M), checkpoint/restart 2 x (interval / 2 + R), fault
    tolerance wait - step + relaunch, and their ratio."""
    runs = {r["run"]: r["step_ms_rounds"] for r in data["overhead"]}
    one, alone, hsdp, groups = (runs[r["run"]] for r in data["overhead"])
    w = data["work_lost_inputs"]
    fault_tolerant = w["survivor_wait_s"] - w["survivor_step_s"] + w["relaunch_to_heal_s"]
    lost = []
    for r in data["work_lost"]:
        interval = math.sqrt(2 * w["checkpoint_save_s"] * r["mtbf_h"] * 3600)
        restart = 2 * (interval / 2 + w["restart_to_first_step_s"])
        lost.append({"mtbf_h": r["mtbf_h"], "interval_s": interval, "restart_s": restart,
                     "fault_tolerant_s": fault_tolerant, "ratio": restart / fault_tolerant, "recorded": r})
    return {"overhead": [{"run": name, "rounds": ms, "median": statistics.median(ms)} for name, ms in runs.items()],
            "alone_over_one_process": [a / b for a, b in zip(alone, one, strict=True)],
            "groups_over_hsdp": [a / b for a, b in zip(groups, hsdp, strict=True)],
            "failure": data["failure"],
            "heal": [h | {"serving_ms": h["survivor_heal_step_ms"] - h["survivor_step_ms"]} for h in data["heal"]],
            "work_lost": lost}


def setup_memory_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case: the bound computed here (1.1 x (half the model + its largest parameter), from the
    printed MiB), the peaks, and the tensor peak over the bound and over the whole model."""
    return [c | {"bound_computed": 1.1 * (c["model_fp32"] / 2 + c["largest_parameter"]),
                 "half_model": c["model_fp32"] / 2, "peak_over_bound": c["tensor_peak"] / c["bound"],
                 "peak_over_model": c["tensor_peak"] / c["model_fp32"]} for c in data["cases"]]


def accumulation_rows(data: dict[str, Any]) -> dict[str, Any]:
    """Per mode: measured and planned peak, their ratio, measured held between micro-batches and the
    planned states (bytes); and the two modes' differences (unsharded - default), measured and
    planned."""
    rows = [r | {"ratio_computed": r["measured_peak"] / r["planned_peak"]} for r in data["rows"]]
    default, unsharded = rows
    return {"rows": rows, "differences": {
        "measured_peak": unsharded["measured_peak"] - default["measured_peak"],
        "held_between": unsharded["held_between"] - default["held_between"],
        "planned_peak": unsharded["planned_peak"] - default["planned_peak"],
        "planned_states": unsharded["planned_states"] - default["planned_states"]}}


def muon_rows(data: dict[str, Any]) -> dict[str, Any]:
    """Per measured run (preset, ranks) and variant: collectives, bytes sent by the busiest rank,
    Newton-Schulz FLOPs of the busiest rank against total / ranks, median and min ms, and the
    median over ShardedMuon's; per computed row (FSDP2 alone) the busiest owner's FLOPs over the
    mean."""
    runs = []
    for run in data["runs"]:
        results = run["results"]
        sharded = results["sharded"]["median_ms"] if "sharded" in results else None
        runs.append({"preset": run["preset"], "ranks": run["ranks"], "variants": [
            {"variant": k, "collectives": v["collectives"], "sent_mib": max(v["sent_bytes_per_rank"]) / 2 ** 20,
             "ns_gflop_busiest": max(v["ns_flops_per_rank"]) / 1e9, "ns_gflop_mean": v["ns_flops_mean"] / 1e9,
             "median_ms": v["median_ms"], "min_ms": v["min_ms"],
             "over_sharded": v["median_ms"] / sharded if sharded else None} for k, v in results.items()]})
    computed = [{"model": r["model"], "ranks": r["ranks"], "busiest_over_mean": r["ns_flops_busiest"] / r["ns_flops_mean"],
                 "ns_gflop_busiest": r["ns_flops_busiest"] / 1e9, "ns_gflop_mean": r["ns_flops_mean"] / 1e9,
                 "planned_muon_s": r["planned_muon_s"], "planned_step_s": r["planned_step_s"]}
                for r in data["computed"] if " x TP" not in r["layout"]]
    return {"runs": runs, "computed": computed}


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
    step = data["model"].split(" reported")[0].rsplit(", ", 1)[-1]  # '..., step k reported, rank 0'
    ax.set_title(f"FSDP2 memory per rank by ZeRO stage (bench_fsdp.py --part memory): rank 0, {step}", fontsize=10)
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
    ax.set_title(f"memory per rank, {data['memory_unit'].split(', ')[1].split(' (')[0]}", fontsize=9)  # 'step k'
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
    ax_act.set_ylabel(f"activations per layer, MiB (block 1 of {data['layers']}, rank 0)")
    ax_act.set_ylim(0, max(r["malloc"] for r in acts) * 1.45)
    ax_act.set_title("activations per transformer layer against the formulas", fontsize=9)
    fig.suptitle("Tensor parallel: memory per rank and activations per layer (bench_tp.py, fp32, gloo)", fontsize=10)
    preset = data["model"].split('"')[1]  # 'GPTModule "<preset>" with ...'
    save_with_footnote(plt, fig, path, f"GPT '{preset}', n_head {data['a']}: {data['layers']} layers, h={data['h']}, "
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
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 5.2), squeeze=False)  # a run of one shape
    for ax, shape in zip(axes[0], shapes):
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
    best = data["setting"].split("best of ")[1].split()[0] if "best of " in data["setting"] else "the"
    axes[0][0].set_ylabel(f"step CPU time, s (best of {best} interleaved steps)")
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


FSDP_VARIANTS = {"ours": ("C0", "o"), "hand-written": ("0.25", "s"), "GPTModule + Lightning": ("C1", "^")}
"""Section 5's variants (by the start of their name) -> (colour, marker)."""


def _fsdp_style(variant: str) -> tuple[str, str]:
    return next((style for start, style in FSDP_VARIANTS.items() if variant.startswith(start)), ("C5", "x"))


def _draw_fsdp_throughput(plt, data: dict[str, Any], note: str, path: str) -> None:
    rows = fsdp_throughput_rows(data)
    runs = list(dict.fromkeys(r["run"] for r in rows))
    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(5 * len(runs) + 5, 5.4),
                             gridspec_kw={"width_ratios": [3] * len(runs) + [2.6]})
    steps = [s for r in rows for s in r["s_per_step"]]
    for ax, run in zip(axes, runs):
        mine = [r for r in rows if r["run"] == run]
        for r in mine:
            color, marker = _fsdp_style(r["variant"])
            ax.plot(range(len(r["s_per_step"])), r["s_per_step"], color=color, marker=marker, linewidth=1.2,
                    label=f"{r['variant']}: median {r['median']:.3f}")
        loads = mine[0]["load_before_round"]
        ax.set_xticks(range(len(loads)), [f"{i}\n{load:.2f}" for i, load in enumerate(loads)], fontsize=8)
        ax.set_ylim(min(steps) * 0.8, max(steps) * 1.08)
        ax.set_xlabel("round (below: 1-min load average before it)")
        ax.set_title(f"run {run}, {next(x['date'] for x in data['runs'] if x['run'] == run)}", fontsize=9)
        ax.legend(fontsize=7, loc="lower left")
    timed = data["setting"].split(" timed steps")[0].rsplit(" ", 1)[-1]  # '..., N timed steps after ...'
    axes[0].set_ylabel(f"s/step, mean of one repeat's {timed} timed steps (rank 0)")
    ax = axes[-1]
    others = [r for r in rows if not r["is_hand"]]
    for i, r in enumerate(others):
        color, marker = _fsdp_style(r["variant"])
        ax.errorbar(i, r["per_round_median"], yerr=[[r["per_round_median"] - r["per_round_min"]],
                                                    [r["per_round_max"] - r["per_round_median"]]],
                    color=color, marker=marker, capsize=4, markersize=7, linestyle="none")
        ax.plot(i + 0.22, r["vs_hand_median"], marker="D", color=color, markerfacecolor="none", linestyle="none")
        ax.plot(i + 0.22, r["vs_hand_best_of"], marker="x", color=color, markersize=7, linestyle="none")
        ax.text(i, r["per_round_max"] + 0.01, f"{r['vs_hand_median']:.3f}\n{r['vs_hand_best_of']:.3f}",
                ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.axhline(data["target_vs_hand"], color="C3", linestyle="--", linewidth=1,
               label=f"target {data['target_vs_hand']:g} (as fast as the loop within 5%)")
    ax.plot([], [], color="0.4", marker="o", linestyle="none", label="per round (the same round's): median, min-max")
    ax.plot([], [], color="0.4", marker="D", markerfacecolor="none", linestyle="none",
            label="ratio of the medians (upper number)")
    ax.plot([], [], color="0.4", marker="x", linestyle="none", label="best-of (lower number)")
    ax.set_xticks(range(len(others)), [f"run {r['run']}\n" + ("ours" if r["variant"].startswith("ours")
                                                              else "Lightning's") for r in others], fontsize=8)
    ax.set_xlim(-0.5, len(others) - 0.3)
    ax.set_ylim(0.72, 1.6)
    ax.set_ylabel("hand-written loop's s/step / the variant's")
    ax.set_title("against the hand-written loop (>= 1: as fast or faster)", fontsize=9)
    ax.legend(fontsize=6.5, loc="upper left")
    fig.suptitle("FSDP2 throughput on 2 ranks: ours vs hand-written vs Lightning's ModelParallelStrategy "
                 "(bench_fsdp.py --part throughput, gloo, 1 thread per rank)", fontsize=10)
    save_with_footnote(plt, fig, path, f"{data['setting']}; {data['tokens_per_step']:,} tokens per step. Measured: "
                                       "s/step per repeat; computed here from them: the medians and ratios. " + note)


CHECKPOINT_COLORS = {"sync": "C3", "async": "C0"}
"""Section 6's modes -> colour."""


def _draw_checkpoint(plt, data: dict[str, Any], note: str, path: str) -> None:
    numbers = checkpoint_modes(data)
    modes = numbers["modes"]
    fig, (ax, ax_step, ax_total) = plt.subplots(1, 3, figsize=(13, 4.9), gridspec_kw={"width_ratios": [3, 3, 1.6]})
    width = 0.38
    saves = len(next(iter(modes.values()))["blocked_s"])
    for j, (mode, m) in enumerate(modes.items()):
        xs = [i + (j - 0.5) * width for i in range(saves)]
        ax.bar(xs, m["blocked_s"], width * 0.95, color=CHECKPOINT_COLORS[mode],
               label=f"{mode}: median {m['blocked_median']:.3f} s")
        for x, b in zip(xs, m["blocked_s"]):
            ax.text(x, b, f"{b:.3f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(saves), [f"save {i + 1}\n(step {(i + 1) * data['every']})" for i in range(saves)], fontsize=8)
    ax.set_ylabel("training blocked by the save, s")
    ax.set_ylim(0, max(b for m in modes.values() for b in m["blocked_s"]) * 1.2)
    ax.text(0.98, 0.8, f"async / sync (medians): {numbers['stall_ratio']:.3f}\n(bench_checkpoint.py, from the "
                       f"unrounded: {data['less_blocking']:g}x less blocking)", transform=ax.transAxes, ha="right",
            va="top", fontsize=8)
    ax.legend(fontsize=7.5, loc="upper right")
    ax.set_title(f"training blocked per save ({data['ckpt_mib']} MiB each)", fontsize=9)
    groups = (("step_s", "ordinary step"), ("step_after_save_s", "the step after a save"),
              ("complete_after_s", "save start ->\ncheckpoint complete"))
    for j, (mode, m) in enumerate(modes.items()):
        xs = [i + (j - 0.5) * width for i in range(len(groups))]
        values = [m[key] for key, _ in groups]
        ax_step.bar(xs, values, width * 0.95, color=CHECKPOINT_COLORS[mode], label=mode)
        for x, v in zip(xs, values):
            ax_step.text(x, v, f"{v:.3f}", ha="center", va="bottom", fontsize=7)
    ax_step.set_xticks(range(len(groups)), [name for _, name in groups], fontsize=8)
    ax_step.set_ylabel("s (medians)")
    ax_step.set_ylim(0, max(m[key] for m in modes.values() for key, _ in groups) * 1.2)
    ax_step.legend(fontsize=7.5, loc="upper left")
    ax_step.set_title("the background write competes for the 2 cores", fontsize=9)
    for j, (mode, m) in enumerate(modes.items()):
        ax_total.bar(j, m["fit_total_s"], 0.6, color=CHECKPOINT_COLORS[mode])
        ax_total.text(j, m["fit_total_s"], f"{m['fit_total_s']:.1f}", ha="center", va="bottom", fontsize=7.5)
    ax_total.set_xticks(range(len(modes)), list(modes), fontsize=8)
    ax_total.set_ylim(0, max(m["fit_total_s"] for m in modes.values()) * 1.25)
    ax_total.set_ylabel("whole fit, s")
    ax_total.set_title(f"fit total: async {1 - numbers['total_ratio']:.0%} sooner", fontsize=9)
    fig.suptitle("Async vs sync checkpoint: training stall per save (bench_checkpoint.py, 2 CPU ranks, "
                 f"{data['strategy']})", fontsize=10)
    save_with_footnote(plt, fig, path, f"{data['setting']}. Measured: every number drawn; computed here: the "
                                       "stall ratio and the fit's total ratio. " + note)


EVAL_MODES = {"none": "0.55", "inline": "C3", "subprocess": "C0"}
"""Section 13's modes -> colour."""


def _draw_eval(plt, data: dict[str, Any], note: str, path: str) -> None:
    tasks, pause = eval_task_rows(data), eval_pause_rows(data)
    total = tasks[-1]
    tasks = tasks[:-1]
    fig, (ax, ax_pause, ax_total) = plt.subplots(1, 3, figsize=(15, 5.4), gridspec_kw={"width_ratios": [3.2, 2.8, 1.5]})
    y = range(len(tasks))
    ax.barh(y, [t["s_median"] for t in tasks], 0.6, color="C2",
            xerr=[[t["s_median"] - t["s_min"] for t in tasks], [t["s_max"] - t["s_median"] for t in tasks]],
            capsize=3, ecolor="0.3")
    for i, t in enumerate(tasks):
        ax.text(t["s_max"] + min(0.4, 0.03 * max(u["s_max"] for u in tasks)), i,
                f"{t['s_median']:.2f} s; {t['requests']} requests, {t['ms_per_request']:.1f} ms each", va="center",
                fontsize=7)
    ax.set_yticks(list(y), [f"{t['task']} ({t['items']} items)" for t in tasks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(t["s_max"] for t in tasks) * 1.75)
    rounds = data["setting"].split(" rounds")[0].rsplit(" ", 1)[-1]  # 'tasks: ..., N rounds; pause: ...'
    ax.set_xlabel(f"seconds per checkpoint, median of {rounds} rounds (bars: min-max)")
    ax.set_title(f"time per task: total {total['s_median']:.2f} s (min {total['s_min']:.2f}, max "
                 f"{total['s_max']:.2f}) for {total['items']} items,\n{total['requests']} requests, "
                 f"{total['ms_per_request']:.1f} ms per request (ms/request: s min / requests)", fontsize=8.5)
    width = 0.26
    for i, p in enumerate(pause):
        color = EVAL_MODES.get(p["mode"], "C5")
        values = [p["step_s"], *p["checkpoint_steps_s"]]
        for j, v in enumerate(values):
            x = i + (j - 1) * width
            ax_pause.bar(x, v, width * 0.92, color=color, alpha=0.45 if j == 0 else 1.0)
            ax_pause.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6.5)
        top = max(max(q["checkpoint_steps_s"]) for q in pause)
        ax_pause.text(i, max(values) + min(2.2, 0.1 * top), f"pause: median {p['pause_median']:.2f} s\n"
                                            f"({p['over_save_only']:+.2f} s vs the save alone)",
                      ha="center", va="bottom", fontsize=7)
    ax_pause.set_xticks(range(len(pause)), [p["mode"] for p in pause])
    ax_pause.set_ylim(0, max(max(p["checkpoint_steps_s"]) for p in pause) * 1.35)
    ax_pause.set_ylabel("step wall time, s")
    # bench_eval.py's record says its steps and checkpoint interval; the one transcribed from section 13 (on a
    # loaded machine, said in the footnote): 8 steps, a checkpoint every 4
    steps, every = data.get("steps", 8), data.get("every", 4)
    saves = [str(k) for k in range(every, steps + 1, every)]
    saves_text = " and ".join([", ".join(saves[:-1]), saves[-1]] if len(saves) > 1 else saves)
    ax_pause.set_title("per mode: ordinary step (light), the steps ending in a checkpoint\n"
                       f"(steps {saves_text}: the save, and inline the evaluation)", fontsize=8.5)
    for i, p in enumerate(pause):
        color = EVAL_MODES.get(p["mode"], "C5")
        ax_total.bar(i, p["training_s"], 0.6, color=color)
        ax_total.bar(i, p["waited_at_end_s"], 0.6, bottom=p["training_s"], color=color, alpha=0.35, hatch="//")
        ax_total.text(i, p["fit_total_s"], f"{p['fit_total_s']:.1f}", ha="center", va="bottom", fontsize=7.5)
    ax_total.legend([plt.Rectangle((0, 0), 1, 1, facecolor="0.85", hatch="//", edgecolor="0.3")],
                    ["waited at the end\nfor the evaluations"], fontsize=7, loc="upper left")
    ax_total.set_xticks(range(len(pause)), [p["mode"] for p in pause], fontsize=8)
    ax_total.set_ylim(0, max(p["fit_total_s"] for p in pause) * 1.3)
    ax_total.set_ylabel("fit total, s")
    ax_total.set_title(f"the fit ({steps} steps)", fontsize=8.5)
    fig.suptitle("Checkpoint evals: time per task, and the training pause inline vs in a separate process "
                 "(bench_eval.py, small GPT, 1 thread)", fontsize=10)
    save_with_footnote(plt, fig, path, "Measured: the times (ms per request as bench_eval.py prints it); computed "
                                       "here: the pause (checkpoint step - ordinary step, median, as bench_eval.py "
                                       "does) and its difference to the save alone. "
                       + ("Loaded machine (1-min load 2.8-3.7). " if "steps" not in data else "") + note)


def _draw_preemption(plt, data: dict[str, Any], note: str, path: str) -> None:
    rows = preemption_rows(data)
    fig, (ax, ax_agree) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [3, 1.7]})
    for i, r in enumerate(rows):
        e = r["exit_s"]
        color = f"C{i}"
        low = e["min"] if e["min"] is not None else e["median"]
        ax.plot([low, e["max"]], [i, i], color=color, linewidth=2)
        ax.plot(e["median"], i, marker="o", color=color, markersize=8)
        if e["min"] is not None:
            ax.plot(e["min"], i, marker="|", color=color, markersize=10)
        ax.plot(e["max"], i, marker="|", color=color, markersize=10)
        outcome = (f"{r['preempted']} of {r['trials']} trials saved and exited 143; {r['resumed_bitwise']}/"
                   f"{r['resumed_compared']} resumed bitwise; {r['steps_lost']} steps lost; {r['corrupted_accepted']} "
                   f"corrupt of {r['reverified']} re-verified accepted")
        ax.text(0.3, i - 0.3, outcome, fontsize=6.5, va="center", color="0.25")
        ax.text(e["max"] + 0.3, i, f"{e['median']:.1f} s" + (f" ({e['min']:.1f}-{e['max']:.1f})" if e["min"] is not None
                                                             else f" (max {e['max']:.1f}; min not given)"),
                va="center", fontsize=7.5)
    ax.axvline(data["grace_period_s"], color="C3", linestyle="--", linewidth=1)
    docs = any("section" in r for r in rows)  # transcribed from docs/benchmarks.md: each run names its section
    ax.text(data["grace_period_s"] - 0.2, len(rows) - 0.45, f"grace_period_s=\"auto\" = {data['grace_period_s']} s\n"
            + ("(15a's new callback)" if docs else "(PreemptionCheckpoint's default)"), ha="right", va="bottom",
            fontsize=7, color="C3")
    ax.set_yticks(range(len(rows)), [f"{r['run']}\n" + (f"section {r['section']}, " if "section" in r else "")
                                     + f"median step {r['median_step_ms']} ms" for r in rows], fontsize=7.5)
    ax.set_ylim(len(rows) - 0.4, -0.7)
    ax.set_xlim(0, max(max(r["exit_s"]["max"] for r in rows) * 1.28, data["grace_period_s"] * 1.1))
    ax.set_xlabel("SIGTERM to the exit of every process, s (saved trials: median, min-max)")
    ax.set_title("signal to exit: finishing the step, the async save in flight, the synchronous save, teardown",
                 fontsize=8.5)
    measured = [r for r in rows if "aligned_share" in r]
    width = 0.38
    for i, r in enumerate(measured):
        ax_agree.bar(i - width / 2, r["agreement_boundary_ms"], width * 0.95, color="C7")
        ax_agree.bar(i + width / 2, r["agreement_aligned_ms"], width * 0.95, color="C0")
        ax_agree.plot(i + width / 2, r["agreement_aligned_max_ms"], marker="_", color="C0", markersize=14, mew=2)
        ax_agree.text(i - width / 2, r["agreement_boundary_ms"], f"{r['agreement_boundary_ms']:g}", ha="center",
                      va="bottom", fontsize=7)
        ax_agree.text(i + width / 2, r["agreement_aligned_ms"], f"{r['agreement_aligned_ms']:g}", ha="center",
                      va="bottom", fontsize=7)
        ax_agree.text(i + width / 2, r["agreement_aligned_max_ms"], f"max {r['agreement_aligned_max_ms']:g}",
                      ha="center", va="bottom", fontsize=7)
        ax_agree.text(i, -0.14, f"aligned: {r['agreement_share']:g}% of the\n{r['median_step_ms']} ms step "
                                f"(as printed)",
                      transform=ax_agree.get_xaxis_transform(), ha="center", va="top", fontsize=7)
    ax_agree.set_xticks(range(len(measured)), [r["run"] for r in measured], fontsize=7.5)
    ax_agree.set_ylim(0, max(r["agreement_aligned_max_ms"] for r in measured) * 1.6)
    ax_agree.set_ylabel("all_reduce(MAX) of one int32 per step, ms")
    ax_agree.set_title("cost of the agreement (the reference run)", fontsize=8.5)
    ax_agree.legend([plt.Rectangle((0, 0), 1, 1, color="C7"), plt.Rectangle((0, 0), 1, 1, color="C0")],
                    ["at the step boundary (mostly waiting\nfor the slower rank), median",
                     "the same all_reduce on aligned ranks,\nmedian (dash: max)"], fontsize=7, loc="upper left")
    fig.suptitle("Preemption: SIGTERM to a random rank at a random moment, exit time and cost of the agreement "
                 "(bench_preemption.py, tiny GPT, 2 gloo ranks)", fontsize=10)
    load = "The runs differ in machine load (median step 57-583 ms): compare within a section. " if docs else ""
    save_with_footnote(plt, fig, path, "Measured: every time drawn; computed here: the aligned all_reduce over the "
                                       "median step. " + load + note, right=1.0)


E2E_PHASES = {"interpreter start": "0.75", "imports": "C1", "CLI + Trainer setup": "C3", "data preparation": "0.6",
              "model build": "C4", "before the first step": "C8", "first step": "C6", "steady steps": "C0",
              "validation": "C2", "checkpoint save": "C9", "teardown": "C5"}
"""Section 18's phases -> colour."""


def _draw_end_to_end(plt, data: dict[str, Any], note: str, path: str) -> None:
    runs = end_to_end_runs(data)
    fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(15, 6.4), gridspec_kw={"width_ratios": [3.2, 2.4]})
    y, labels, seen = 0.0, [], set()
    ys = []
    for run in runs:
        for v in run["variants"]:
            left = 0.0
            for p in run["phases"]:
                value = p["s"][v]
                ax.barh(y, value, 0.7, left=left, color=E2E_PHASES.get(p["phase"], "C7"),
                        label=p["phase"] if p["phase"] not in seen else None)
                seen.add(p["phase"])
                if value >= 1.3:
                    ax.text(left + value / 2, y, f"{value:.2f}", ha="center", va="center", fontsize=6.5,
                            color="white")
                left += value
            total = run["total_s"][v]
            ax.plot(total, y, marker="|", color="black", markersize=16, mew=2)
            ratio = f" ({run['over_plain'][v]:.3f}x plain)" if v != "plain" else ""
            ax.text(total + 0.4, y, f"{total:.2f} s{ratio}", va="center", fontsize=7.5)
            labels.append(f"{run['run']}: {v}")
            ys.append(y)
            y += 1
        y += 0.6
    ax.plot([], [], marker="|", color="black", markersize=12, mew=2, linestyle="none",
            label="median total (spawn to exit)")
    ax.set_yticks(ys, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(t for r in runs for t in r["total_s"].values()) * 1.3)
    rounds = len(next((r["totals_per_round"]["plain"] for r in data["runs"] if "totals_per_round" in r), [0] * 3))
    ax.set_xlabel(f"seconds, median of {rounds} runs per phase (the phases' medians need not add up to the median "
                  "total)")
    ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4)
    ax.set_title("where the time goes, phase by phase", fontsize=9)
    series = []
    for run in runs:
        for v in run["variants"]:
            if v == "plain" or (run["run"] == runs[-1]["run"] and v == "fit-auto"):
                continue
            series.append((f"{run['run']}: {v} - plain", run["minus_plain"][v]))
    phases = list(dict.fromkeys(p["phase"] for run in runs for p in run["phases"]))
    height = 0.8 / len(series)
    for j, (name, diffs) in enumerate(series):
        yy = [i + (j - (len(series) - 1) / 2) * height for i, phase in enumerate(phases) if phase in diffs]
        values = [diffs[phase] for phase in phases if phase in diffs]
        ax_diff.barh(yy, values, height * 0.95, color=f"C{j}", label=name)
    ax_diff.axvline(0, color="black", linewidth=0.8)
    ax_diff.set_yticks(range(len(phases)), phases, fontsize=8)
    ax_diff.invert_yaxis()
    ax_diff.set_xlabel("difference to plain, s (median phase - plain's median phase)")
    ax_diff.legend(fontsize=7, loc="lower right")
    ax_diff.set_title("the gap to the plain PyTorch script, per phase", fontsize=9)
    docs = any("note" in r for r in data["runs"])  # transcribed from section 18: its two runs, each with a note
    steps = data["setting"].split(" optimizer steps")[0].rsplit(" ", 1)[-1]
    fig.suptitle(f"End to end: the tiny GPT, {steps} steps, plain PyTorch script vs lightning-disttrain fit "
                 f"(bench_end_to_end.py, 1 process{', 2 threads' if docs else ' per run'})", fontsize=10)
    runs_note = ("07:30: before one-process runs skipped FSDP2 (fit = FSDP2 on a one-rank mesh); 16:13: after that and "
                 "the loggers-only logging, with lightning, a hand-written L.Trainer script, and no rows for interpreter "
                 "start, data preparation and the first step. ") if docs else ""
    save_with_footnote(plt, fig, path, runs_note + "Measured: the phase and total medians; computed here: the "
                                       "differences and ratios (the section's headline ratios are round by round). "
                       + note)


def _draw_fault_tolerance(plt, data: dict[str, Any], note: str, path: str) -> None:
    n = fault_tolerance_numbers(data)
    fig, axes = plt.subplots(2, 2, figsize=(13, 10))
    (ax, ax_fail), (ax_heal, ax_lost) = axes
    for i, r in enumerate(n["overhead"]):
        ax.bar(i, r["median"], 0.6, color=f"C{i}", alpha=0.5)
        ax.plot([i] * len(r["rounds"]), r["rounds"], marker="o", color=f"C{i}", linestyle="none", markersize=5)
        ax.text(i, max(r["rounds"]) + 1, f"{r['median']:g}", ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(range(len(n["overhead"])), ["\n".join(textwrap.wrap(r["run"], 18)) for r in n["overhead"]],
                  fontsize=7.5)
    ax.set_ylim(0, max(max(r["rounds"]) for r in n["overhead"]) * 1.5)
    ax.set_ylabel(f"median step, ms (dots: rounds 1-{len(n['overhead'][0]['rounds'])}; bar: median)")
    ratios = "\n".join(f"{name}, per round (min median max): {r['min']:.3f} {r['median']:.3f} {r['max']:.3f}"
                       for name, r in data["overhead_ratios"].items())
    ax.text(0.02, 0.97, ratios, transform=ax.transAxes, va="top", fontsize=7.5)
    ax.set_title("overhead per step (tiny GPT)", fontsize=9)
    timeouts = sorted({r["heartbeat_timeout_ms"] for r in n["failure"]})
    width = 0.36
    for r in n["failure"]:
        t = r["heartbeat_timeout_ms"] / 1000
        x = timeouts.index(r["heartbeat_timeout_ms"]) + (r["command"] - 1.5) * width
        values = r["kill_to_step_alone_s"]
        mid = statistics.median(values)
        color = "C0" if r["command"] == 1 else "C1"
        ax_fail.bar(x, mid, width * 0.9, color=color, alpha=0.6,
                    yerr=[[mid - min(values)], [max(values) - mid]], capsize=3, ecolor="0.3")
        ax_fail.hlines(t, x - width * 0.45, x + width * 0.45, color="black", linestyle="--", linewidth=1)
        ax_fail.text(x, max(values) + 0.1, f"{mid:.3f} s\n({len(values)} run{'s' if len(values) > 1 else ''})\n"
                                           f"timeout {(mid - t) * 1000:+.0f} ms;\nstep {r['step_before_ms']:g} ms",
                     ha="center", va="bottom", fontsize=7)
    ax_fail.set_xticks(range(len(timeouts)), [f"heartbeat timeout {t:,} ms" for t in timeouts])
    ax_fail.set_ylim(0, max(max(r["kill_to_step_alone_s"]) for r in n["failure"]) * 1.45)
    ax_fail.set_ylabel("SIGKILL of a group -> survivor's first step alone, s")
    ax_fail.set_title("a group dies: the survivor waits the timeout plus about one step\n"
                      "(median, min-max; no survivor step lost in any run)", fontsize=9)
    ax_fail.legend([plt.Rectangle((0, 0), 1, 1, color="C0", alpha=0.6),
                    plt.Rectangle((0, 0), 1, 1, color="C1", alpha=0.6),
                    plt.Line2D([], [], color="black", linestyle="--", linewidth=1)],
                   ["first command", "second command", "the heartbeat timeout"], fontsize=7.5, loc="upper left")
    heal = n["heal"]
    params = [h["params_m"] for h in heal]
    for key, name, color, scale in (("survivor_step_ms", "survivor's step", "C7", 1e-3),
                                    ("survivor_heal_step_ms", "survivor's heal step (serving the state)", "C3", 1e-3),
                                    ("joiner_load_state_dict_ms", "joiner's load_state_dict", "C2", 1e-3),
                                    ("joiner_launch_to_heal_s", "joiner: launch -> heal step done", "C0", 1)):
        values = [h[key] * scale for h in heal]
        ax_heal.plot(params, values, marker="o", color=color, label=name)
        for x, v in zip(params, values):
            ax_heal.annotate(f"{v:g}", (x, v), xytext=(-4, 5), textcoords="offset points", fontsize=6.5, color=color,
                             ha="right")
    ax_heal.set_xscale("log")
    ax_heal.set_yscale("log")
    ax_heal.set_xticks(params, [f"{h['model']}\n{h['params_m']:g} M parameters" for h in heal], fontsize=7.5)
    ax_heal.minorticks_off()
    ax_heal.set_xlim(params[0] / 2.5, params[-1] * 2)
    ax_heal.set_ylabel("seconds")
    ax_heal.set_title("heal by model size: a new group joins, the survivor serves the state\n"
                      "(the joiner's weights bitwise the survivor's in every run)", fontsize=9)
    ax_heal.legend(fontsize=7, loc="lower right")
    width = 0.38
    for i, lost in enumerate(n["work_lost"]):
        r = lost["recorded"]
        ax_lost.bar(i - width / 2, r["restart_s"], width * 0.95, color="C3",
                    label="checkpoint/restart" if i == 0 else None)
        ax_lost.bar(i + width / 2, r["fault_tolerant_s"], width * 0.95, color="C0",
                    label="fault tolerant" if i == 0 else None)
        ax_lost.text(i - width / 2, r["restart_s"], f"{r['restart_s']:g}\n(interval {r['interval_s']:g} s)",
                     ha="center", va="bottom", fontsize=7)
        ax_lost.text(i + width / 2, r["fault_tolerant_s"], f"{r['fault_tolerant_s']:g}\n({r['ratio']:.1f}x less)",
                     ha="center", va="bottom", fontsize=7)
    ax_lost.set_xticks(range(len(n["work_lost"])), [f"job MTBF {r['mtbf_h']} h" for r in n["work_lost"]])
    ax_lost.set_ylim(0, max(r["recorded"]["restart_s"] for r in n["work_lost"]) * 1.25)
    ax_lost.set_ylabel("work lost per failure, group-seconds (2 groups)")
    w = data["work_lost_inputs"]
    ax_lost.set_title(f"work lost per failure, computed (C = {w['checkpoint_save_s'] * 1000:g} ms, "
                      f"R = {w['restart_to_first_step_s']:g} s,\nwait {w['survivor_wait_s']:g} s - a "
                      f"{w['survivor_step_s'] * 1000:g} ms step, relaunch {w['relaunch_to_heal_s']:g} s)", fontsize=9)
    ax_lost.legend(fontsize=7.5, loc="upper left")
    fig.suptitle("Fault tolerance across replica groups (torchft): quorum overhead, failure, heal by model size, "
                 "work lost (bench_fault_tolerance.py)", fontsize=10)
    save_with_footnote(plt, fig, path, "Work lost, as the section prints it (bench_fault_tolerance.py computed it "
                                       "from the unrounded C, R, wait and relaunch): checkpoint/restart 2 x "
                                       "(sqrt(2 C M) / 2 + R), fault tolerant wait - step + relaunch. Measured: the "
                                       "overhead, failure and heal times. Localhost, HTTP transport on 2 cores: not "
                                       "GPUs, NCCL or a network. " + note)


def _draw_setup_memory(plt, data: dict[str, Any], note: str, path: str) -> None:
    rows = setup_memory_rows(data)
    fig, ax = plt.subplots(figsize=(9.5, 5.6))
    bars = (("tensor_peak", "tensor peak (live storages)", "C0"), ("malloc_peak", "malloc peak", "C1"),
            ("rss_peak", "RSS peak (VmHWM)", "C2"))
    width = 0.22
    for i, r in enumerate(rows):
        for j, (key, name, color) in enumerate(bars):
            x = i + (j - 1) * width
            ax.bar(x, r[key], width * 0.92, color=color, label=name if i == 0 else None)
            ax.text(x, r[key], f"{r[key]:,}", ha="center", va="bottom", fontsize=7)
        span = (i - 0.45, i + 0.45)
        ax.hlines(r["model_fp32"], *span, color="black", linewidth=1.5, label="the model, fp32" if i == 0 else None)
        ax.hlines(r["bound"], *span, color="C3", linestyle="--", linewidth=1.5,
                  label="bound: 1.1 x (half the model + largest parameter)" if i == 0 else None)
        ax.hlines(r["half_model"], *span, color="0.5", linestyle=":", linewidth=1.5,
                  label="half the model (one rank's shard)" if i == 0 else None)
        ax.text(i + 0.45, r["model_fp32"], f" {r['model_fp32']:,}", va="center", fontsize=7)
        ax.text(i + 0.45, r["bound"], f" {r['bound']:,}", va="center", fontsize=7, color="C3")
        top = max(r["model_fp32"], *(r[key] for key, _, _ in bars))
        ax.text(i, top * 1.04, f"tensor peak {r['peak_over_bound']:.2f}x the bound, "
                                           f"{r['peak_over_model']:.2f}x the model", ha="center", va="bottom",
                fontsize=7.5)
    builds = {"meta": "meta build (default)", "eager": "eager build, empty_init=False (before)"}
    ax.set_xticks(range(len(rows)), [f"{r['preset']}: {builds.get(r['build'], r['build'])}" for r in rows],
                  fontsize=8)
    ax.set_xlim(-0.6, len(rows) - 0.25)
    ax.set_ylim(0, max(max(r["model_fp32"], r["bound"], *(r[key] for key, _, _ in bars)) for r in rows) * 1.25)
    ax.set_ylabel("MiB per rank (configure_model to strategy.setup)")
    ax.legend(fontsize=7, loc="upper right")
    fig.suptitle("Peak memory per rank while setting a model up under fsdp2, 2 gloo ranks (bench_setup_memory.py)",
                 fontsize=10)
    save_with_footnote(plt, fig, path, "Different models: read each against its own lines. Measured: the peaks; the "
                                       "bound as printed (1.1 x (half + largest)). " + note)


def _draw_accumulation(plt, data: dict[str, Any], note: str, path: str) -> None:
    numbers = accumulation_rows(data)
    rows, diffs = numbers["rows"], numbers["differences"]
    mib = 2**20
    fig, (ax, ax_diff) = plt.subplots(1, 2, figsize=(12.5, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    bars = (("measured_peak", "measured peak", "C0", 1.0), ("planned_peak", "planned peak", "C0", 0.4),
            ("held_between", "held between micro-batches (measured)", "C2", 1.0),
            ("planned_states", "planned states", "C2", 0.4))
    width = 0.2
    for i, r in enumerate(rows):
        for j, (key, name, color, alpha) in enumerate(bars):
            x = i + (j - 1.5) * width
            ax.bar(x, r[key] / mib, width * 0.92, color=color, alpha=alpha, label=name if i == 0 else None)
            ax.text(x, r[key] / mib, f"{r[key] / mib:.2f}", ha="center", va="bottom", fontsize=7)
        ax.text(i - width, r["planned_peak"] / mib * 1.07, f"measured / planned {r['ratio_computed']:.3f}",
                ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(range(len(rows)), ["default: reduce-scatter\nevery micro-batch", "accumulate_unsharded_grads=True"],
                  fontsize=8)
    ax.set_ylim(0, max(r["planned_peak"] for r in rows) / mib * 1.3)
    ax.set_ylabel("MiB per rank (rank 0, live tensor storages)")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set_title("planned against measured, per mode", fontsize=9)
    items = (("measured_peak", "at the peak\n(measured)", "C0", 1.0),
             ("held_between", "between micro-batches\n(measured)", "C2", 1.0), ("planned_states", "planned", "C2", 0.4))
    for i, (key, name, color, alpha) in enumerate(items):
        ax_diff.bar(i, diffs[key] / mib, 0.6, color=color, alpha=alpha)
        ax_diff.text(i, diffs[key] / mib, f"{diffs[key]:,} B", ha="center", va="bottom", fontsize=7.5)
    ax_diff.set_xticks(range(len(items)), [name for _, name, _, _ in items], fontsize=8)
    ax_diff.set_ylim(0, max(diffs.values()) / mib * 1.25)
    ax_diff.set_ylabel("accumulate_unsharded_grads=True - default, MiB")
    ax_diff.set_title("what unsharded accumulation adds: the unsharded half\nof the fp32 gradient", fontsize=9)
    fig.suptitle("Gradient accumulation under FSDP2 on 2 gloo ranks: planned against measured "
                 "(bench_accumulation_memory.py)", fontsize=10)
    save_with_footnote(plt, fig, path, f"{data['setting']}. Measured: the peaks and what is held; planned: "
                                       "planning/memory.py; computed here: the ratios and differences. " + note)


MUON_COLORS = {"sharded": "C0", "torch": "C3", "adamw": "0.5"}
"""Section 24's variants -> colour."""


def _draw_muon(plt, data: dict[str, Any], note: str, path: str) -> None:
    numbers = muon_rows(data)
    runs, computed = numbers["runs"], numbers["computed"]
    fig, (ax, ax_time, ax_plan) = plt.subplots(1, 3, figsize=(15, 5.4), gridspec_kw={"width_ratios": [3, 3, 2]})
    names = {"sharded": "ShardedMuon (now)", "torch": "torch.optim.Muon on the shards (before)", "adamw": "AdamW"}
    order, width = ("sharded", "torch", "adamw"), 0.26
    labels = [f"{r['preset']}\n{r['ranks']} ranks" for r in runs]
    for i, run in enumerate(runs):
        by = {v["variant"]: v for v in run["variants"]}
        for j, key in enumerate(order):
            if key not in by:
                continue
            v, x = by[key], i + (j - 1) * width
            ax.bar(x, v["collectives"], width * 0.92, color=MUON_COLORS[key], label=names[key] if i == 0 else None)
            ax.text(x, v["collectives"], f"{v['collectives']}", ha="center", va="bottom", fontsize=7.5)
            ax_time.bar(x, v["median_ms"], width * 0.92, color=MUON_COLORS[key],
                        label=names[key] if i == 0 else None)
            ax_time.plot(x, v["min_ms"], marker="_", color="black", markersize=10, mew=1.5)
            ax_time.text(x, v["median_ms"] * 1.06, f"{v['median_ms']:.0f}", ha="center", va="bottom", fontsize=7)
        if "torch" in by and "sharded" in by:
            ax_time.text(i, by["torch"]["median_ms"] * 1.6, f"{by['torch']['over_sharded']:.1f}x", ha="center",
                         va="bottom", fontsize=8, weight="bold")
    ax.set_xticks(range(len(runs)), labels, fontsize=7.5)
    ax.set_ylim(0, max(v["collectives"] for r in runs for v in r["variants"]) * 1.15)
    ax.set_ylabel("collectives in one optimizer step (CommDebugMode)")
    ax.set_title("collectives per optimizer step (ShardedMuon: 2, one all-to-all each way)", fontsize=9)
    ax.legend(fontsize=7.5, loc="upper left")
    ax_time.set_yscale("log")
    ax_time.yaxis.set_major_formatter(plt.FuncFormatter(_log_label))
    ax_time.set_xticks(range(len(runs)), labels, fontsize=7.5)
    top = max(v["median_ms"] for r in runs for v in r["variants"])
    ax_time.set_ylim(min(v["min_ms"] for r in runs for v in r["variants"]) * 0.6, top * 4)
    ax_time.set_ylabel("optimizer step, ms (median; dash: min)")
    ax_time.set_title("optimizer step time (bold: torch.optim.Muon / ShardedMuon)", fontsize=9)
    for i, row in enumerate(computed):
        ax_plan.bar(i - 0.18, row["ns_gflop_busiest"], 0.36, color="C0", label="busiest rank" if i == 0 else None)
        ax_plan.bar(i + 0.18, row["ns_gflop_mean"], 0.36, color="0.7", label="total / ranks" if i == 0 else None)
        ax_plan.text(i, row["ns_gflop_busiest"] * 1.15, f"{row['busiest_over_mean']:.2f}x", ha="center", fontsize=8)
    ax_plan.set_yscale("log")
    ax_plan.set_xticks(range(len(computed)), [f"{r['model']}\n{r['ranks']} ranks" for r in computed], fontsize=7.5)
    ax_plan.set_ylim(min(r["ns_gflop_mean"] for r in computed) * 0.5, max(r["ns_gflop_busiest"] for r in computed) * 5)
    ax_plan.set_ylabel("Newton-Schulz GFLOP per optimizer step")
    ax_plan.set_title("computed: busiest owner vs mean (FSDP2)", fontsize=9)
    ax_plan.legend(fontsize=7.5, loc="upper left")
    fig.suptitle("Muon under FSDP2: each matrix orthogonalised once, on its owner rank (bench_muon.py, gloo, "
                 "1 thread per rank)", fontsize=10)
    save_with_footnote(plt, fig, path, "Measured: collectives, times (4 ranks ran as 4 processes on 2 cores, so the "
                                       "work each rank saves does not shorten the step); computed: the owners as "
                                       "ShardedMuon places them (parallel.muon.owner_plan). " + note)


DRAW = {"cpu-plan-vs-measured": _draw_plan, "cpu-fsdp-memory": _draw_fsdp, "cpu-cp-memory": _draw_cp,
        "cpu-process-groups": _draw_groups, "cpu-tp-memory": _draw_tp, "cpu-pp-bubble-memory": _draw_pp,
        "cpu-sac": _draw_sac, "cpu-moe": _draw_moe, "cpu-fsdp-throughput": _draw_fsdp_throughput,
        "cpu-checkpoint-stall": _draw_checkpoint, "cpu-eval": _draw_eval, "cpu-preemption": _draw_preemption,
        "cpu-end-to-end": _draw_end_to_end, "cpu-fault-tolerance": _draw_fault_tolerance,
        "cpu-setup-memory": _draw_setup_memory, "cpu-accumulation-memory": _draw_accumulation, "cpu-muon": _draw_muon}


def plot_results(inputs: list[str], out_dir: str, command: str = "", fmt: str = "svg") -> dict[str, Any]:
    """Write the figures of ``inputs`` (see the module's docstring) into ``out_dir``. Returns the
    files written (``files``: figure name -> path), the figures not written and why (``skipped``),
    and the numbers drawn (``plan``, ``fsdp_memory``, ``cp_memory``, ``process_groups``,
    ``tp_memory``, ``tp_activations``, ``pp_bubble``, ``pp_memory``, ``sac``, ``moe_models``,
    ``moe_load``, ``fsdp_throughput``, ``checkpoint_stall``, ``eval_tasks``, ``eval_pause``,
    ``preemption``, ``end_to_end``, ``fault_tolerance``, ``setup_memory``, ``accumulation_memory``,
    ``muon``; None where the benchmark is not among the inputs)."""
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
            "moe_load": drawn("bench_moe_quality", moe_load_series),
            "fsdp_throughput": drawn("bench_fsdp_throughput", fsdp_throughput_rows),
            "checkpoint_stall": drawn("bench_checkpoint", checkpoint_modes),
            "eval_tasks": drawn("bench_eval", eval_task_rows), "eval_pause": drawn("bench_eval", eval_pause_rows),
            "preemption": drawn("bench_preemption", preemption_rows),
            "end_to_end": drawn("bench_end_to_end", end_to_end_runs),
            "fault_tolerance": drawn("bench_fault_tolerance", fault_tolerance_numbers),
            "setup_memory": drawn("bench_setup_memory", setup_memory_rows),
            "accumulation_memory": drawn("bench_accumulation_memory", accumulation_rows),
            "muon": drawn("bench_muon", muon_rows)}


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
