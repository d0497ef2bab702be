"""The figures of the CPU benchmarks (benchmarks/cpu_figures.py, issue 39) from their recorded results
in benchmarks/results/cpu-2026-12-04: drawn, saying where their data come from, and drawing numbers
recomputed here from the JSONs."""

import html
import json
import re
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCH / "results" / "cpu-2026-12-04"
sys.path.insert(0, str(BENCH))
COMMAND = "python benchmarks/cpu_figures.py --plot docs/img benchmarks/results/cpu-2026-12-04"


def _recorded(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _footnote(svg: str) -> str:
    """The grey footnote's lines, joined, without whitespace (its lines wrap at spaces and hyphens)."""
    lines = re.findall(r'<text style="[^"]*fill: #808080"[^>]*>([^<]*)</text>', svg)
    return re.sub(r"\s", "", html.unescape("".join(lines)))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    pytest.importorskip("matplotlib")
    from cpu_figures import plot_results

    out = tmp_path_factory.mktemp("figures")
    return out, plot_results([str(RESULTS)], str(out), command=COMMAND)


def test_every_figure_is_drawn_with_its_data_machine_date_and_command(rendered):
    out, result = rendered
    assert not result["skipped"]
    from cpu_figures import FIGURES

    names = dict(FIGURES)
    # every recorded result has its figure, and every figure its recorded result
    recorded = {json.loads(p.read_text())["benchmark"] for p in RESULTS.glob("*.json")}
    assert set(names.values()) == recorded and len(names) == len(recorded)
    assert set(result["files"]) == set(names)
    for figure, benchmark in names.items():
        assert result["files"][figure] == str(out / f"{figure}.svg")
        svg = (out / f"{figure}.svg").read_text()
        assert svg.startswith("<?xml") and "<svg" in svg
        data, note = _recorded(benchmark), _footnote(svg)
        for field in ("machine", "date", "command"):
            assert re.sub(r"\s", "", data[field]) in note, (figure, field)
        assert re.sub(r"\s", "", f"Rendered by: {COMMAND}") in note
        assert "<dc:date>" not in svg  # no creation date


def test_plan_figure_plots_every_case_and_rank_with_bench_plans_ratios(rendered):
    _, result = rendered
    data = _recorded("bench_plan")
    records = data["records"]
    assert data["date"] == "2026-12-04 17:48 UTC" and len(records) == 31
    points = result["plan"]
    assert len(points) == 62  # 31 cases x 2 ranks
    ranks = [(r["per_rank"][k], r["fixed_mib"][k]) for r in records for k in range(2)]
    assert [p["planned_mib"] for p in points] == [rank["planned_mib"] for rank, _ in ranks]
    assert [p["without_fixed_mib"] for p in points] == pytest.approx([rank["measured_mib"] - fixed
                                                                      for rank, fixed in ranks])
    # per case as bench_plan's table: the larger measured rank less its fixed bytes, over the larger planned
    from cpu_figures import plan_case_ratios

    corrected = []
    for r in records:
        ranks = r["per_rank"]
        top = max(range(2), key=lambda k: ranks[k]["measured_mib"])
        corrected.append((ranks[top]["measured_mib"] - r["fixed_mib"][top]) / max(p["planned_mib"] for p in ranks))
        assert plan_case_ratios(r) == pytest.approx((r["ratio"], r["ratio_without_fixed"]))
    assert corrected == pytest.approx([r["ratio_without_fixed"] for r in records])
    assert (round(min(corrected), 3), round(max(corrected), 3)) == (0.911, 1.077)  # docs/benchmarks.md 9.2
    ratios = [p["without_fixed_mib"] / p["planned_mib"] for p in points]
    assert all(0.9 <= x <= 1.1 for x in ratios)  # every point of the right panel inside the band


def test_fsdp_figure_splits_each_peak_at_rest(rendered):
    _, result = rendered
    rows = _recorded("bench_fsdp_memory")["rows"]
    drawn = {(r["n"], r["stage"]): r for r in result["fsdp_memory"]}
    assert set(drawn) == {(n, s) for n in (1, 2, 4) for s in ("zero3", "zero2")}
    for row in rows:
        bar = drawn[(row["n"], row["stage"])]
        assert bar["rest"] + bar["above_rest"] == pytest.approx(row["peak"])
        assert bar["above_rest"] == pytest.approx(row["peak_minus_rest"], abs=0.011)  # the table's own column
        assert row["computed_state"] * row["n"] == pytest.approx(165.09, abs=0.03)  # 16 B/param / N
    assert [drawn[(n, "zero3")]["peak"] for n in (1, 2, 4)] == [252.85, 176.34, 135.06]  # section 4


def test_cp_figure_draws_bench_cps_points_and_its_longest_sequences(rendered):
    _, result = rendered
    data = _recorded("bench_cp")
    assert data["source"] == "bench_cp.py's own output (this file)"
    assert sorted(result["cp_memory"]) == ["small", "tiny"]
    for preset, lines in result["cp_memory"].items():
        m = data["memory"][preset]
        assert [s["cp"] for s in lines] == [1, 2, 4]
        for s in lines:
            assert s["points"] == [(row["seq"], row["peak_mib"][str(s["cp"])]) for row in m["rows"]]
            # the same rule on the same (unrounded) points: bench_cp.py's figure
            assert s["longest_from_points"] == pytest.approx(s["longest_within_budget"], rel=1e-9)
        # issue 43's targets: ring attention extends the longest sequence with cp
        over = {s["cp"]: s["over_cp1"] for s in lines}
        assert over[2] >= 1.8 and over[4] >= 3.4, (preset, over)


def test_groups_figure_counts_one_group_per_rank_set_and_the_new_group_calls(rendered):
    _, result = rendered
    data = _recorded("bench_process_groups")
    for drawn, row in zip(result["process_groups"], data["rows"], strict=True):
        assert drawn["groups"] == row["groups_joined"] == row["distinct_rank_sets"] == len(row["sizes"])
        # every rank makes one new_group call per group of each rank-set size: world / size of them
        assert drawn["new_group_calls"] == sum(data["world"] // s for s in row["sizes"])


def test_tp_figure_splits_each_peak_at_rest_and_recomputes_megatrons_formula(rendered):
    _, result = rendered
    data = _recorded("bench_tp_memory")
    mem = {(r["t"], r["sp"]): r for r in result["tp_memory"]}
    assert list(mem) == [(1, "-"), (2, "on"), (2, "off"), (4, "on"), (4, "off")]
    for row in data["memory_rows"]:
        bar = mem[(row["t"], row["sp"])]
        assert bar["rest"] + bar["above_rest"] == pytest.approx(row["peak"])
        assert bar["above_rest"] == pytest.approx(row["peak_minus_rest"], abs=0.011)  # the table's own column
        assert bar["rest_over_computed"] == pytest.approx(row["rest_over_computed"], abs=0.0006)
        assert row["computed_state"] == pytest.approx(row["sharded_part"] + row["replicated_part"], abs=0.011)
    # t = 1: 16 B x every parameter; t = 2, 4: the sharded part halves
    assert mem[(1, "-")]["computed_state"] == pytest.approx(16 * data["parameters"] / 2**20, abs=0.005)
    parts = {r["t"]: r["sharded_part"] for r in data["memory_rows"]}
    assert parts[2] / parts[4] == pytest.approx(2, abs=0.001)
    assert [mem[(t, "on")]["peak"] for t in (2, 4)] == [136.72, 76.06]  # section 10
    acts = {(r["t"], r["sp"]): r for r in result["tp_activations"]}
    for row in data["activation_rows"]:
        drawn = acts[(row["t"], row["sp"])]
        # Megatron's s*b*h*(34 + 5as/h) [TP: 10 + 24/t + 5as/(ht); SP: all / t] bytes, from s, b, h, a
        assert drawn["megatron_computed"] == pytest.approx(row["megatron"], abs=0.0005)
        assert row["malloc"] / row["megatron"] == pytest.approx(row["malloc_over_megatron"], abs=0.0006)
        assert drawn["malloc_over_adapted"] == pytest.approx(row["malloc_over_adapted"], abs=0.0006)
        assert row["saved"] == row["adapted"]  # saved / adapted 1.0000
        if row["megatron_sp_adapted"] is not None:
            assert row["malloc"] / row["megatron_sp_adapted"] == pytest.approx(row["malloc_over_megatron_sp"],
                                                                               abs=0.0006)
    assert (data["s"], data["b"], data["h"], data["a"]) == (128, 4, 384, 8)
    assert acts[(1, "-")]["megatron_computed"] == 8.875  # 128 x 4 x 384 x (34 + 40/3) bytes, exactly


def test_pp_figure_recomputes_the_bubbles_theory_and_the_memory_ratios(rendered):
    _, result = rendered
    data = _recorded("bench_pp_bubble_memory")
    series = {(s["p"], s["schedule"]): s for s in result["pp_bubble"]}
    assert list(series) == [(p, s) for p in (2, 4) for s in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")]
    drawn = [q for s in series.values() for q in s["points"]]
    assert len(drawn) + sum(len(s["not_run"]) for s in series.values()) == len(data["bubble_rows"]) == 24
    assert len(drawn) == 16  # 10 at p = 2, 6 at p = 4; 8 cases not run (m < the stages)
    for s in series.values():
        for q in s["points"]:
            assert q["ranks_min"] <= q["measured"] <= q["ranks_max"]
            if s["schedule"] == "ZBVZeroBubble":
                assert q["theory"] is None and q["theory_computed"] is None
            else:  # (p - 1) / (v*m + p - 1), printed to 3 decimals
                assert q["theory_computed"] == pytest.approx(q["theory"], abs=0.0005), (s["p"], s["schedule"], q["m"])
    assert series[(4, "GPipe")]["not_run"] == [(2, "m < 4 stages")]
    assert [m for m, _ in series[(4, "Interleaved1F1B")]["not_run"]] == [2, 4]
    mem = result["pp_memory"]
    assert [r["stage"] for r in mem] == [0, 1]
    for drawn_row, row in zip(mem, data["memory_rows"], strict=True):
        # bench_pp's ratio is from its unrounded medians: within 0.02 of the printed ones' (7.087 vs 7.07)
        assert drawn_row["ratio"] == pytest.approx(row["gpipe_over_1f1b"], abs=0.02)
        assert drawn_row["expected"] == row["expected"]  # m / (p - stage)
    assert [r["expected"] for r in mem] == [4.0, 8.0]


def test_sac_figure_recomputes_each_policys_memory_and_time_against_none(rendered):
    _, result = rendered
    data = _recorded("bench_sac")
    drawn = {(r["shape"], r["policy"]): r for r in result["sac"]}
    policies = ["none", "selective", "selective every_other", "block k=2", "full"]
    assert list(drawn) == [(shape, p) for shape in ("small", "gpt2-124m") for p in policies]
    for row in data["rows"]:
        point = drawn[(row["shape"], row["policy"])]
        assert (point["saved_mib"], point["step_cpu_s"]) == (row["saved_mib"], row["step_cpu_s"])
        # saved MiB and step CPU s over the shape's none, as bench_sac's 'vs none' columns print them
        assert point["saved_vs_none"] == pytest.approx(row["saved_vs_none"], abs=0.005)
        assert point["step_vs_none"] == pytest.approx(row["step_vs_none"], abs=0.005)
    for shape in ("small", "gpt2-124m"):
        # selective recomputes no matmul/attention; full reruns every block: twice block k=2's
        assert drawn[(shape, "selective")]["recomputed_gflop"] == 0
        assert drawn[(shape, "full")]["recomputed_gflop"] == pytest.approx(
            2 * drawn[(shape, "block k=2")]["recomputed_gflop"], abs=0.011)
        # each policy keeps less than none and costs more time; full keeps the least
        kept = {p: drawn[(shape, p)]["saved_mib"] for p in policies}
        assert min(kept, key=kept.get) == "full" and max(kept, key=kept.get) == "none"
        assert all(drawn[(shape, p)]["step_vs_none"] > 1 for p in policies[1:])
    assert drawn[("gpt2-124m", "full")]["saved_vs_none"] == pytest.approx(0.31, abs=0.005)  # section 7: 0.31x


def test_moe_figure_recomputes_throughput_against_dense_and_the_load_per_step(rendered):
    _, result = rendered
    data = _recorded("bench_moe_quality")
    models = {r["model"]: r for r in result["moe_models"]}
    assert list(models) == ["dense", "moe (bias 1e-3)", "moe_nobias"]
    for row in data["models"]:
        drawn = models[row["model"]]
        assert drawn["tok_per_s"] == row["tok_per_s_median"] and drawn["p10"] <= drawn["tok_per_s"] <= drawn["p90"]
        assert drawn["vs_dense"] == pytest.approx(row["vs_dense"], abs=0.005)  # median / dense's median
    # equal active parameters: the MoE's active count within 0.1% of dense's; the loss 0.01-0.05 worse
    assert models["moe_nobias"]["active_params"] == pytest.approx(models["dense"]["params"], rel=0.001)
    assert [round(models[m]["loss_minus_dense"], 3) for m in ("moe (bias 1e-3)", "moe_nobias")] == [0.046, 0.014]
    load = result["moe_load"]
    rows = data["load_rows"]
    assert load["with_bias"]["steps"] == [0, 25, 50, 75, 100, 125, 150, 175, 199]
    for key in ("with_bias", "without_bias"):
        s = load[key]
        assert len(s["blocks"]) == data["blocks"] == 4
        assert s["mean"] == pytest.approx([sum(r[key]) / 4 for r in rows])
        assert all(1 <= x <= data["experts"] / 2 for block in s["blocks"] for x in block)  # top-2 of 8: at most 4
    assert load["without_bias"]["blocks"][3] == [r["without_bias"][3] for r in rows]  # block 3 along the steps
    assert rows[0]["with_bias"] == rows[0]["without_bias"]  # step 0: the same start
    # the section's reading: at the last step 1.6-2.2 with the bias, 2.1-3.5 without
    assert (load["with_bias"]["least"][-1], load["with_bias"]["greatest"][-1]) == (1.57, 2.24)
    assert (load["without_bias"]["least"][-1], load["without_bias"]["greatest"][-1]) == (2.1, 3.53)
    assert all(w < wo for w, wo in zip(load["with_bias"]["mean"][1:], load["without_bias"]["mean"][1:]))


def test_fsdp_throughput_figure_recomputes_each_variant_against_the_hand_written_loop(rendered):
    _, result = rendered
    data = _recorded("bench_fsdp_throughput")
    rows = {(r["run"], r["variant"]): r for r in result["fsdp_throughput"]}
    assert [run["run"] for run in data["runs"]] == ["A", "B"] and len(rows) == 6
    for run in data["runs"]:
        for v in run["variants"]:
            drawn = rows[(run["run"], v["variant"])]
            assert len(drawn["s_per_step"]) == 7  # --repeats 7
            # min / median / max over the repeats and tok/s (1,024 tokens per step): the printed table
            assert (drawn["min"], drawn["median"], drawn["max"]) == (v["min"], v["median"], v["max"])
            assert drawn["tok_s_best"] == pytest.approx(v["tok_s_best"], abs=1)  # printed from the unrounded s/step
            assert drawn["tok_s_median"] == pytest.approx(v["tok_s_median"], abs=1)
            if drawn["is_hand"]:
                continue
            # the 'vs hand' table, recomputed from the printed (rounded) per-repeat s/step
            for key in ("vs_hand_best_of", "vs_hand_median", "per_round_min", "per_round_median", "per_round_max"):
                assert drawn[key] == pytest.approx(v[key], abs=0.0015), (run["run"], v["variant"], key)
    ours = {run: rows[(run, "ours: GPTModule + FSDP2Strategy")] for run in ("A", "B")}
    # section 5: ratio of medians 0.991 (A) and 0.972 (B); per round 1.006 and 1.004; best-of 0.904 and 0.963
    assert [round(ours[r]["vs_hand_median"], 3) for r in ("A", "B")] == [0.991, 0.972]
    assert [ours[r]["per_round_median"] for r in ("A", "B")] == pytest.approx([1.006, 1.004], abs=0.0015)
    assert [round(ours[r]["vs_hand_best_of"], 3) for r in ("A", "B")] == [0.904, 0.963]
    # 'the hand loop in A: 0.951 to 1.365 s/step'
    hand = rows[("A", "hand-written FSDP2 loop")]
    assert (hand["min"], hand["max"]) == (0.951, 1.365)


def test_checkpoint_figure_recomputes_the_stall_ratio_from_each_save(rendered):
    _, result = rendered
    data = _recorded("bench_checkpoint")
    numbers = result["checkpoint_stall"]
    modes = numbers["modes"]
    assert list(modes) == ["sync", "async"]
    for m in data["modes"]:
        assert len(m["blocked_s"]) == 4  # 12 steps, a save every 3
        # 'save blocks' is the median of the four saves
        assert modes[m["mode"]]["blocked_median"] == pytest.approx(m["blocked_median_s"], abs=0.0005)
    # section 6: stall ratio 0.103, 9.7x less blocking; the fit 13% sooner; the step after an async save 2.3 s slower
    assert round(numbers["stall_ratio"], 3) == data["stall_ratio"] == 0.103
    assert 1 / numbers["stall_ratio"] == pytest.approx(data["less_blocking"], abs=0.06)
    assert round(1 - numbers["total_ratio"], 2) == 0.13
    assert round(numbers["async_after_save_minus_step"], 1) == 2.3


def test_eval_figure_recomputes_the_tasks_total_and_the_pause_per_mode(rendered):
    _, result = rendered
    data = _recorded("bench_eval")
    tasks = result["eval_tasks"]
    total = tasks[-1]
    assert [t["task"] for t in tasks[:-1]] == [t["task"] for t in data["tasks"]] and total["task"] == "total"
    # the total's items and requests are the tasks' sums; its median equals the sum of theirs (82.77 s)
    assert total["items"] == sum(t["items"] for t in tasks[:-1]) == 358
    assert total["requests"] == sum(t["requests"] for t in tasks[:-1]) == 958
    assert sum(t["s_median"] for t in tasks[:-1]) == pytest.approx(total["s_median"], abs=0.005)
    for t in tasks:  # ms/request = 1000 x s min / requests (s min printed to 0.01 s)
        assert t["ms_per_request_computed"] == pytest.approx(t["ms_per_request"], abs=5 / t["requests"] + 0.05)
    assert total["ms_per_request"] == 74.0  # section 13: 'about 74 ms per log-likelihood request'
    pause = {p["mode"]: p for p in result["eval_pause"]}
    for p in data["pause"]:  # median(checkpoint step - ordinary step): bench_eval.py's 'pause over a step'
        assert pause[p["mode"]]["pause_median"] == pytest.approx(p["pause_median_s"], abs=0.006)
    # 'evaluating inline added about 16 s of stall per checkpoint'; subprocess: no more than the save alone
    assert round(pause["inline"]["over_save_only"]) == 16
    assert pause["subprocess"]["pause_median"] < pause["none"]["pause_median"]
    assert pause["subprocess"]["waited_at_end_s"] == 67.6


def test_preemption_figure_recomputes_the_agreements_share_of_the_step(rendered):
    _, result = rendered
    data = _recorded("bench_preemption")
    rows = {r["run"]: r for r in result["preemption"]}
    assert len(rows) == len(data["runs"]) == 5
    for r in rows.values():
        e = r["exit_s"]
        assert e["median"] <= e["max"] and (e["min"] is None or e["min"] <= e["median"])
        assert r["resumed_bitwise"] == r["resumed_compared"] and r["steps_lost"] == 0 and r["corrupted_accepted"] == 0
        outcomes = [r["preempted"], r["ended_exit_0"], r["shutdown_exit_15"]]
        assert sum(x or 0 for x in outcomes) <= r["trials"]
        if r["ended_exit_0"] is not None:
            assert sum(outcomes) == r["trials"]
    # section 15: the aligned all_reduce is 0.58% (seed 2, 1.5 of 254 ms) and 0.25% (seed 1, 0.70 of 278 ms)
    seed2, seed1 = rows["seed 2, --validate (c65afad)"], rows["seed 1 (05f01ec)"]
    assert 100 * seed2["aligned_share"] == pytest.approx(0.58, abs=0.015)
    assert 100 * seed1["aligned_share"] == pytest.approx(0.25, abs=0.005)
    assert (seed2["exit_s"]["median"], seed1["exit_s"]["max"]) == (4.2, 19.9)


def test_end_to_end_figure_recomputes_the_gap_to_plain(rendered):
    _, result = rendered
    data = _recorded("bench_end_to_end")
    first, second = result["end_to_end"]
    assert first["variants"] == ["plain", "fit", "fit-auto"]
    assert second["variants"] == ["plain", "lightning", "fit", "fit-auto"]
    phases = data["runs"][0]["phases"]
    for p in phases:  # the table's fit - plain and fit-auto - plain columns
        assert first["minus_plain"]["fit"][p["phase"]] == pytest.approx(p["fit_minus_plain"], abs=0.011)
        assert first["minus_plain"]["fit-auto"][p["phase"]] == pytest.approx(p["fit_auto_minus_plain"], abs=0.011)
    # section 18: +10.49 s of 32.79; ratio of the medians 1.470; round by round 1.434 / 1.455 / 1.513
    assert first["total_minus_plain"]["fit"] == pytest.approx(10.49, abs=0.005)
    assert round(first["over_plain"]["fit"], 3) == 1.470
    rounds = sorted(first["per_round_over_plain"]["fit"])
    assert [round(x, 3) for x in rounds] == [1.434, 1.455, 1.513]
    assert [round(x, 3) for x in sorted(first["per_round_over_plain"]["fit-auto"])] == [1.158, 1.187, 1.242]
    # the steady steps are 63% of the gap
    assert round(first["minus_plain"]["fit"]["steady steps"] / first["total_minus_plain"]["fit"], 2) == 0.63
    assert second["total_s"]["lightning"] / second["total_s"]["plain"] == pytest.approx(1.128, abs=0.0005)


def test_fault_tolerance_figure_recomputes_the_overhead_ratios_and_the_work_lost(rendered):
    _, result = rendered
    data = _recorded("bench_fault_tolerance")
    n = result["fault_tolerance"]
    assert [r["run"] for r in n["overhead"]] == [r["run"] for r in data["overhead"]]
    # the ratios round by round, from the printed median steps: section 19's 1.182 1.231 1.311 and 0.644 0.648 0.801
    for drawn, key in ((n["alone_over_one_process"], "one group alone / one process"),
                       (n["groups_over_hsdp"], "two groups / HSDP")):
        printed = data["overhead_ratios"][key]
        assert sorted(drawn) == pytest.approx([printed["min"], printed["median"], printed["max"]], abs=0.0015)
    # the wait after a kill is the heartbeat timeout plus about one step (60 ms)
    for r in n["failure"]:
        assert 0 < statistics.median(r["kill_to_step_alone_s"]) - r["heartbeat_timeout_ms"] / 1000 < 0.08
    assert [h["serving_ms"] for h in n["heal"]][-1] == 9454 - 1871  # 'grew by 7.6 s for gpt2-124m'
    assert round(n["heal"][-1]["serving_ms"] / 1000, 1) == 7.6
    # work lost, from the rounded C, R, wait and relaunch: the table's (computed from the unrounded)
    for lost in n["work_lost"]:
        r = lost["recorded"]
        assert lost["interval_s"] == pytest.approx(r["interval_s"], abs=0.75)
        assert lost["restart_s"] == pytest.approx(r["restart_s"], abs=0.5)
        assert lost["fault_tolerant_s"] == pytest.approx(r["fault_tolerant_s"], abs=0.05)
        assert r["restart_s"] / r["fault_tolerant_s"] == pytest.approx(r["ratio"], abs=0.05)
    assert [round(x["ratio"]) for x in n["work_lost"]] == [9, 37]


def test_setup_memory_figure_recomputes_the_bound_of_issue_38(rendered):
    _, result = rendered
    rows = {r["build"]: r for r in result["setup_memory"]}
    for r in rows.values():  # 1.1 x (half the model + its largest parameter), from the printed MiB
        assert r["bound_computed"] == pytest.approx(r["bound"], abs=1.5)
    meta, eager = rows["meta"], rows["eager"]
    # section 22: the meta build under the bound (3278 < 3606), the eager build above the whole model (3199 > 2953)
    assert (meta["tensor_peak"], meta["bound"]) == (3278, 3606) and meta["tensor_peak"] < meta["bound"]
    assert (eager["tensor_peak"], eager["model_fp32"]) == (3199, 2953) and eager["peak_over_model"] > 1
    assert meta["held_after_setup"] == meta["half_model"]  # 2971 held after setup: the model's half


def test_accumulation_figure_recomputes_planned_against_measured(rendered):
    _, result = rendered
    data = _recorded("bench_accumulation_memory")
    numbers = result["accumulation_memory"]
    for drawn, row in zip(numbers["rows"], data["rows"], strict=True):
        assert round(drawn["ratio_computed"], 3) == row["ratio"]  # section 23: 0.953, 0.957
    # the modes differ by 1,683,968 B at the peak, 1,684,992 B between micro-batches and 1,684,992 planned
    d = numbers["differences"]
    assert (d["measured_peak"], d["held_between"], d["planned_states"], d["planned_peak"]) == (
        1683968, 1684992, 1684992, 1684992)
    recorded = data["differences"]
    assert d == {"measured_peak": recorded["measured_peak"], "held_between": recorded["held_between"],
                 "planned_peak": recorded["planned"], "planned_states": recorded["planned"]}


def test_muon_figure_draws_bench_muons_record_as_section_24_rounds_it(rendered):
    _, result = rendered
    data = _recorded("bench_muon")
    assert data["source"] == "bench_muon.py's own output (this file)" and "--append" in data["command"]
    assert data["command"].startswith("torchrun --nproc-per-node 2 benchmarks/bench_muon.py")
    runs = {(r["preset"], r["ranks"]): {v["variant"]: v for v in r["variants"]} for r in result["muon"]["runs"]}
    assert list(runs) == [("tiny", 2), ("small", 2), ("tiny", 4), ("small", 4)]
    for (preset, ranks), variants in runs.items():
        assert list(variants) == ["sharded", "torch", "adamw"]
        assert variants["sharded"]["collectives"] == 2 and variants["adamw"]["collectives"] == 0
        # ShardedMuon: each rank 1/ranks of the work (equal shapes split evenly here); torch's: all of it
        assert variants["sharded"]["ns_gflop_busiest"] == pytest.approx(variants["sharded"]["ns_gflop_mean"])
        assert variants["torch"]["ns_gflop_busiest"] == pytest.approx(ranks * variants["torch"]["ns_gflop_mean"])
    # section 24's table: collectives of torch's path, and the figure's ratio above each group
    assert [runs[k]["torch"]["collectives"] for k in runs] == [364, 546, 364, 606]
    assert [round(runs[k]["torch"]["over_sharded"], 1) for k in runs] == [8.4, 3.6, 22.1, 9.6]
    # bytes a rank sends: its pieces' share that is not its own, there and back (2 (r-1)/r of 1/r of the bf16 matrices)
    assert [round(runs[k]["sharded"]["sent_mib"], 3) for k in runs] == [0.75, 10.125, 0.562, 7.594]
    computed = {(c["model"], c["ranks"]): c for c in result["muon"]["computed"]}
    assert round(computed[("llama3-70b", 1024)]["busiest_over_mean"], 2) == 3.41
    assert round(computed[("llama3-70b", 64)]["busiest_over_mean"], 2) == 1.04


def test_bench_muon_records_what_cpu_figures_reads(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_muon
    from cpu_figures import muon_rows

    from cpu_figures import REQUIRED, plot_results
    from record import write_record

    recorded = _recorded("bench_muon")
    data = bench_muon.measured_record(recorded["runs"], 8, 2)  # measure()'s results as the ranks gathered them
    assert all(data[field] for field in REQUIRED) and data["source"] == "bench_muon.py's own output (this file)"
    assert data["command"].startswith("torchrun --nproc-per-node 2 benchmarks/bench_muon.py")  # how it runs
    assert data["computed"] == recorded["computed"]  # the arithmetic, recomputed now
    result = plot_results([str(write_record(data, tmp_path / "bench_muon.json"))], str(tmp_path / "img"), command="x")
    assert list(result["files"]) == ["cpu-muon"] and result["muon"] == muon_rows(recorded)


def test_rendering_twice_writes_the_same_bytes(rendered, tmp_path):
    from cpu_figures import plot_results

    out, result = rendered
    again = plot_results([str(RESULTS)], str(tmp_path), command=COMMAND)
    for name, path in result["files"].items():
        assert Path(path).read_bytes() == Path(again["files"][name]).read_bytes(), name


def test_a_figure_without_data_is_skipped_and_said(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from cpu_figures import main

    assert main(["--plot", str(tmp_path), str(RESULTS / "bench_process_groups.json")]) == 0
    printed = capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["cpu-process-groups.svg"]
    for name in ("cpu-plan-vs-measured", "cpu-fsdp-memory", "cpu-cp-memory", "cpu-tp-memory", "cpu-pp-bubble-memory",
                 "cpu-sac", "cpu-moe", "cpu-fsdp-throughput", "cpu-checkpoint-stall", "cpu-eval", "cpu-preemption",
                 "cpu-end-to-end", "cpu-fault-tolerance", "cpu-setup-memory", "cpu-accumulation-memory", "cpu-muon"):
        assert f"# {name}: not drawn (no " in printed
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "bench_plan"}))
    assert main(["--plot", str(tmp_path / "img"), str(tmp_path / "other.json")]) == 2  # no date, machine, ...


def test_bench_plan_records_what_cpu_figures_reads(tmp_path, monkeypatch):
    # bench_plan.py writes bench_plan.json beside its report.json, with the fields every recorded
    # JSON carries; --plot draws the figure from it (here: the recorded run's records).
    pytest.importorskip("matplotlib")
    import bench_plan
    from cpu_figures import REQUIRED, plot_results

    (tmp_path / "fsdp2_tiny_none_rank0.json").write_text("{}")  # a per-rank record: its time is the date
    monkeypatch.setattr(bench_plan, "OUT", tmp_path)
    data = bench_plan.recorded_results(_recorded("bench_plan")["records"], report_only=True)
    assert all(data[field] for field in REQUIRED) and data["benchmark"] == "bench_plan"
    assert "re-read" in data["source"] and data["date"].endswith(" UTC")
    path = tmp_path / "bench_plan.json"
    path.write_text(json.dumps(data))
    result = plot_results([str(path)], str(tmp_path / "img"), command="python benchmarks/bench_plan.py --plot ...")
    assert list(result["files"]) == ["cpu-plan-vs-measured"]


# ---- each benchmark writes its own record (``--record FILE``, benchmarks/record.py) in the schema its
# figure reads. Each test calls the script's record-building function on measurements in the form the
# script's measuring code produces them, rebuilt from the transcribed record (so that the figure's
# numbers can be compared with the transcribed record's; none of these benchmarks runs in under a
# second), checks the five provenance fields, that cpu_figures draws exactly that figure from it,
# and that a plotted quantity recomputed from it equals the one from the transcribed record.

MIB = 2**20


def _draws(tmp_path, data: dict, figure: str) -> dict:
    """``data`` (a record a benchmark built) carries the provenance fields, says it is the script's own
    output, and ``cpu_figures.plot_results`` draws exactly ``figure`` from it (through the JSON file
    ``record.write_record`` writes): its answer."""
    from cpu_figures import FIGURES, REQUIRED, plot_results
    from record import write_record

    assert all(data[field] for field in REQUIRED) and data["benchmark"] == FIGURES[figure]
    script = data["command"].split()[1].removeprefix("benchmarks/")
    assert data["command"].startswith("python benchmarks/bench_") and data["source"] == f"{script}'s own output (this file)"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", data["date"]) and re.search(r"\d+ CPU cores, torch \S", data["machine"])
    path = write_record(data, tmp_path / "record.json")
    result = plot_results([str(path)], str(tmp_path / "img"), command="python benchmarks/... --plot ...")
    assert list(result["files"]) == [figure] and Path(result["files"][figure]).stat().st_size > 10_000
    return result


def test_provenance_is_one_header_for_every_record():
    from record import provenance

    data = provenance("bench_x", "bench_x.py", "gloo", argv=["--steps", "2", "a b"], source=None)
    assert list(data) == ["benchmark", "date", "machine", "command", "source"]
    assert data["command"] == "python benchmarks/bench_x.py --steps 2 'a b'"
    assert data["source"] == "bench_x.py's own output (this file)" and data["machine"].endswith(", gloo")


def test_bench_process_groups_records_what_cpu_figures_reads(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_process_groups
    from cpu_figures import group_rows

    recorded = _recorded("bench_process_groups")
    # main's rows: per layout, what it counted (no note: record adds the default group's)
    rows = [{k: v for k, v in r.items() if k != "sizes_note"} | {"build_s": 0.01} for r in recorded["rows"]]
    data = bench_process_groups.record(recorded["world"], recorded["rank"], rows)
    result = _draws(tmp_path, data, "cpu-process-groups")
    assert result["process_groups"] == group_rows(recorded)


def test_bench_accumulation_memory_records_what_cpu_figures_reads(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_accumulation_memory as bench
    from cpu_figures import accumulation_rows

    recorded = _recorded("bench_accumulation_memory")
    # rank 0's worker output per run: the peak and the bytes held after each of the 3 first micro-batches
    results = {run: {"peak": r["measured_peak"], "between": [r["held_between"] - 4096, r["held_between"], 0],
                     "accumulate_unsharded_grads": "unsharded" in run} for run, r in
               zip(("accum_unsharded", "accum_sharded"), recorded["rows"][::-1])}
    data = bench.record(results)
    drawn, expected = _draws(tmp_path, data, "cpu-accumulation-memory")["accumulation_memory"], accumulation_rows(recorded)
    assert [r["mode"] for r in data["rows"]] == [r["mode"] for r in recorded["rows"]]
    for key in ("measured_peak", "held_between"):  # measured: as recorded
        assert drawn["differences"][key] == expected["differences"][key]
    # planned: planning/memory.py's plan now, against the one the section printed
    assert drawn["differences"]["planned_states"] == pytest.approx(expected["differences"]["planned_states"], rel=0.02)
    assert [r["ratio_computed"] for r in drawn["rows"]] == pytest.approx(
        [r["ratio_computed"] for r in expected["rows"]], rel=0.02)


def test_bench_setup_memory_records_a_case_per_run_and_appends(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_setup_memory
    from cpu_figures import setup_memory_rows
    from record import write_record

    recorded = _recorded("bench_setup_memory")
    data = None
    for case in recorded["cases"]:  # one run each: the model's facts and every rank's row (bytes)
        facts = {"model_bytes": case["model_fp32"] * MIB, "largest_param_bytes": case["largest_parameter"] * MIB}
        rows = [{"rank": r, "tensor_peak": case["tensor_peak"] * MIB - r, "tensor_after": (case["held_after_setup"] or 0) * MIB,
                 "malloc_peak": case["malloc_peak"] * MIB, "rss_peak": case["rss_peak"] * MIB} for r in range(2)]
        one = bench_setup_memory.record(case["preset"], "false" if case["build"] == "eager" else "auto", facts, rows)
        path = write_record(one, tmp_path / "setup.json", append="cases" if data else None)
        data = json.loads(path.read_text())
    assert [c["build"] for c in data["cases"]] == ["meta", "eager"]
    drawn, expected = _draws(tmp_path, data, "cpu-setup-memory")["setup_memory"], setup_memory_rows(recorded)
    for mine, theirs in zip(drawn, expected, strict=True):
        assert (mine["tensor_peak"], mine["peak_over_model"]) == (theirs["tensor_peak"], theirs["peak_over_model"])
        assert mine["bound"] == pytest.approx(theirs["bound"], abs=1)  # from the bytes, not the rounded MiB


def test_bench_checkpoint_records_what_cpu_figures_reads(tmp_path):
    pytest.importorskip("matplotlib")
    from argparse import Namespace

    import bench_checkpoint
    from cpu_figures import checkpoint_modes

    recorded = _recorded("bench_checkpoint")
    every, steps = recorded["every"], 12
    results = {}
    for m in recorded["modes"]:  # run_one's JSON: every step's time, every save; a save every 3 steps
        saved = set(range(every, steps + 1, every))
        times = [(s, m["step_after_save_s"] if s - 1 in saved else m["step_s"]) for s in range(1, steps + 1)]
        results[m["mode"]] = {"mode": m["mode"], "strategy": recorded["strategy"], "steps": times, "total": m["fit_total_s"],
                              "saves": [{"step": s, "blocked": b, "complete": m["complete_after_s"]}
                                        for s, b in zip(sorted(saved), m["blocked_s"])],
                              "ckpt_bytes": recorded["ckpt_mib"] * MIB}
    args = Namespace(config="small", vocab=50257, seq_len=128, batch=2, every=every, steps=steps)
    data = bench_checkpoint.record(results, args)
    # printed to 1 decimal, here from the printed (rounded) medians: 9.75 -> 9.8, the script's 9.7
    assert data["less_blocking"] == pytest.approx(recorded["less_blocking"], abs=0.1 + 1e-9)
    assert data["ckpt_mib"] == recorded["ckpt_mib"]
    drawn, expected = _draws(tmp_path, data, "cpu-checkpoint-stall")["checkpoint_stall"], checkpoint_modes(recorded)
    for key in ("stall_ratio", "total_ratio", "async_after_save_minus_step"):
        assert drawn[key] == pytest.approx(expected[key], rel=1e-12)


def test_bench_sac_records_what_cpu_figures_reads(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_sac
    from cpu_figures import sac_rows

    recorded = _recorded("bench_sac")
    rows = [{"shape": r["shape"], "policy": r["policy"], "saved": r["saved_mib"] * MIB, "saved_ratio": r["saved_vs_none"],
             "recomputed": r["recomputed_gflop"] * 1e9, "step": r["step_cpu_s"], "time_ratio": r["step_vs_none"],
             "step_wall": r["step_wall_s"]} for r in recorded["rows"]]  # measure's rows
    data = bench_sac.record(rows, batch=1, seq_len=512, steps=3, threads=1)
    assert data["setting"] == recorded["setting"]
    drawn = _draws(tmp_path, data, "cpu-sac")["sac"]
    for mine, theirs in zip(drawn, sac_rows(recorded), strict=True):
        assert (mine["shape"], mine["policy"]) == (theirs["shape"], theirs["policy"])
        for key in ("saved_mib", "recomputed_gflop", "step_cpu_s", "saved_vs_none", "step_vs_none"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-12), key


def test_bench_eval_records_what_cpu_figures_reads(tmp_path):
    pytest.importorskip("matplotlib")
    from argparse import Namespace

    import bench_eval
    from cpu_figures import eval_pause_rows, eval_task_rows

    recorded = _recorded("bench_eval")
    # part_tasks' rows (2 rounds: min and max) and part_pause's runs
    tasks = [{"task": t["task"], "items": t["items"], "requests": t["requests"], "seconds": [t["s_min"], t["s_max"]]}
             for t in [*recorded["tasks"], recorded["total"]]]
    pause = [{"mode": p["mode"], "plain": p["step_s"], "saved": p["checkpoint_steps_s"], "total": p["fit_total_s"],
              "end_wait": p["waited_at_end_s"]} for p in recorded["pause"]]
    args = Namespace(limit=50, heldout_windows=8, repeats=2, steps=8, every=4, pause_limit=10)
    result = _draws(tmp_path, bench_eval.record(tasks, pause, args), "cpu-eval")
    assert result["eval_pause"] == eval_pause_rows(recorded)
    for mine, theirs in zip(result["eval_tasks"], eval_task_rows(recorded), strict=True):
        assert mine["ms_per_request_computed"] == theirs["ms_per_request_computed"]
        assert mine["s_median"] == pytest.approx(theirs["s_median"], abs=0.005 + 1e-9)  # printed to 2 decimals


def test_bench_moe_records_what_cpu_figures_reads(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_moe
    from cpu_figures import moe_load_series, moe_model_rows

    recorded = _recorded("bench_moe_quality")
    names = {"dense": "dense", "moe (bias 1e-3)": "moe", "moe_nobias": "moe_nobias"}
    models = {names[m["model"]]: m for m in recorded["models"]}
    result = {"steps": recorded["steps"], "tokens_per_step": 2048,  # quality()'s report
              "val_loss": {n: m["val_loss"] for n, m in models.items()},
              "params": {n: {"total": m["params"], "active": m["active_params"]} for n, m in models.items()},
              "tok_per_s": {n: {"median": m["tok_per_s_median"], "p10": m["tok_per_s_p10"], "p90": m["tok_per_s_p90"]}
                            for n, m in models.items()},
              "load": {n: [{"step": r["step"], "max_mean": r[key]} for r in recorded["load_rows"]]
                       for n, key in (("moe", "with_bias"), ("moe_nobias", "without_bias"))}}
    drawn = _draws(tmp_path, bench_moe.record(result), "cpu-moe")
    assert drawn["moe_models"] == moe_model_rows(recorded) and drawn["moe_load"] == moe_load_series(recorded)


def test_bench_pp_records_what_cpu_figures_reads(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from argparse import Namespace

    import bench_pp
    from cpu_figures import pp_bubble_series, pp_memory_rows

    recorded = _recorded("bench_pp_bubble_memory")
    monkeypatch.setattr(bench_pp, "OUT", tmp_path)
    # the schedule workers' per-rank JSON: one timed step per case and rank whose idle fraction is
    # that rank's bubble (the least and greatest rank as recorded, the others making up the mean)
    for p in (2, 4):
        per_rank = [[] for _ in range(p)]
        for row in (r for r in recorded["bubble_rows"] if r["p"] == p):
            case = {"schedule": row["schedule"], "v": row["v"], "m": row["m"]}
            if row["measured"] is None:
                for cases in per_rank:
                    cases.append(case | {"skipped": row["not_run"]})
                continue
            middle = (p * row["measured"] - row["ranks_min"] - row["ranks_max"]) / (p - 2) if p > 2 else None
            for r, cases in enumerate(per_rank):
                bubble = row["ranks_min"] if r == 0 else row["ranks_max"] if r == p - 1 else middle
                cases.append(case | {"steps": [{"wall": row["step_s"], "busy": row["step_s"] * (1 - bubble)}]})
        for r, cases in enumerate(per_rank):
            (tmp_path / f"bubble_p{p}.rank{r}.json").write_text(json.dumps(cases))
    for row in recorded["memory_rows"]:  # the memory worker's: three timed steps' peaks per schedule (bytes)
        cases = [{"schedule": name, "m": recorded["memory_m"], "steps": [{}] * 3, "peaks": [row[key] * MIB] * 3}
                 for name, key in (("GPipe", "gpipe"), ("1F1B", "one_f_one_b"))]
        (tmp_path / f"memory_p{recorded['memory_p']}.rank{row['stage']}.json").write_text(json.dumps(cases))
    m, memory = bench_pp.memory_rows(2)
    args = Namespace(layers=8, n_embd=256, n_head=4, vocab=257, seq=128, mb_size=2)
    data = bench_pp.record(bench_pp.bubble_rows([2, 4]), 2, m, memory, args)
    result = _draws(tmp_path, data, "cpu-pp-bubble-memory")
    assert [r["ratio"] for r in result["pp_memory"]] == pytest.approx([r["ratio"] for r in pp_memory_rows(recorded)])
    for mine, theirs in zip(result["pp_bubble"], pp_bubble_series(recorded), strict=True):
        assert mine["not_run"] == theirs["not_run"]
        assert [q["theory_computed"] for q in mine["points"]] == [q["theory_computed"] for q in theirs["points"]]
        # p = 2: the mean of the least and greatest rank, each printed to 3 decimals, against the printed mean
        assert [q["measured"] for q in mine["points"]] == pytest.approx([q["measured"] for q in theirs["points"]],
                                                                         abs=0.0005 + 1e-9)


def _level_record(row: dict, step: int) -> dict:
    """A memory worker's levels and window peaks (bytes) with ``row``'s numbers (MiB) at ``step``."""
    return {"step": step, "levels": {"setup": row["setup"] * MIB, f"step{step}.fwd:end": row["after_fwd"] * MIB,
                                     f"step{step}.bwd:end": row["after_bwd"] * MIB, f"step{step}.opt:end": row["rest"] * MIB},
            "peaks": {f"step{step}.{ph}": row["peak"] * MIB if ph == row["peak_phase"] else 0 for ph in ("fwd", "bwd", "opt")},
            "known": {"params": row["known_tensors"] * MIB}}


def test_bench_fsdp_memory_records_what_cpu_figures_reads(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from argparse import Namespace

    import bench_fsdp
    from cpu_figures import fsdp_rows

    recorded = _recorded("bench_fsdp_memory")
    monkeypatch.setattr(bench_fsdp, "OUT", tmp_path)
    numel = 10_819_584  # the model of the recorded run (the section's), 6 blocks
    assert f"{numel:,} parameters" in recorded["model"]
    blocks = [1_774_464] * 6  # not drawn: the gathered parameters' column only
    for row in recorded["rows"]:  # rank 0's JSON of each memory worker (meter process)
        (tmp_path / f"memory_process_{row['n']}_{row['stage']}_rank0.json").write_text(json.dumps(
            _level_record(row, 2) | {"numel": numel, "block_numel": blocks, "meter_name": "malloc bytes in use"}))
    rows = bench_fsdp.memory_rows([1, 2, 4], ["zero3", "zero2"], "process")
    args = Namespace(device="cpu", preset="small", vocab=257, batch=4, seq=128, mem_steps=3)
    result = _draws(tmp_path, bench_fsdp.memory_record(rows, numel, 2, "malloc bytes in use", args), "cpu-fsdp-memory")
    for mine, theirs in zip(result["fsdp_memory"], fsdp_rows(recorded), strict=True):
        assert (mine["n"], mine["stage"]) == (theirs["n"], theirs["stage"])
        for key in ("rest", "peak", "above_rest"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-12), key
        assert mine["computed_state"] == pytest.approx(theirs["computed_state"], abs=0.005)  # printed to 2 decimals


def test_bench_fsdp_throughput_records_a_run_and_appends_the_next(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_fsdp
    from cpu_figures import fsdp_throughput_rows
    from record import write_record

    recorded = _recorded("bench_fsdp_throughput")
    args = {"preset": "small", "vocab": 257, "seq": 128, "batch": 4, "steps": 15, "warmup": 3, "repeats": 7}
    path = tmp_path / "throughput.json"
    for run in recorded["runs"]:  # the workers' throughput.json: one step per repeat at the repeat's s/step
        data = {"steps": {v["variant"]: [[s] for s in v["s_per_step"]] for v in run["variants"]}, "args": args,
                "rounds": [{"order": [], "load1_before": x} for x in run["load_before_round"]],
                "tokens_per_step": recorded["tokens_per_step"]}
        one = bench_fsdp.throughput_record(data, run["date"], run["load_start"], run["load_end"], run["seconds"], run["run"])
        write_record(one, path, append="runs" if run["run"] != "A" else None)
    data = json.loads(path.read_text())
    assert data["setting"] == recorded["setting"] and [r["run"] for r in data["runs"]] == ["A", "B"]
    result = _draws(tmp_path, data, "cpu-fsdp-throughput")
    for mine, theirs in zip(result["fsdp_throughput"], fsdp_throughput_rows(recorded), strict=True):
        assert (mine["run"], mine["variant"]) == (theirs["run"], theirs["variant"])
        for key in ("median", "tok_s_best", "vs_hand_best_of", "vs_hand_median", "per_round_median"):
            if theirs["is_hand"] and key.startswith(("vs_", "per_")):
                assert key not in mine
                continue
            assert mine[key] == pytest.approx(theirs[key], rel=1e-12), key


def test_bench_tp_records_what_cpu_figures_reads(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import bench_tp
    from cpu_figures import tp_activation_rows, tp_memory_rows

    recorded = _recorded("bench_tp_memory")
    monkeypatch.setattr(bench_tp, "OUT", tmp_path)
    shape = {"s": 128, "b": 4, "h": 384, "a": 8, "L": 6, "V": 257, "Vp": 320, "mlp": 1536}
    acts = {(r["t"], r["sp"]): r for r in recorded["activation_rows"]}
    runs = []
    for row in recorded["memory_rows"]:  # rank 0's JSON of each memory worker
        t, sp = row["t"], row["sp"] != "off"
        runs.append((t, sp))
        a = acts[(t, row["sp"])]
        (tmp_path / f"memory_{t}_{'sp' if sp else 'nosp'}_rank0.json").write_text(json.dumps(
            _level_record(row, 2) | {"preset": "small", "numel": recorded["parameters"], "shape": shape,
                                     "computed_local": row["computed_state"] * MIB / 16,
                                     "computed_sharded": row["sharded_part"] * MIB / 16,
                                     "computed_replicated": row["replicated_part"] * MIB / 16,
                                     "acts": {"input": {"shape": [int(d) for d in a["block_input"].split("x")]}}
                                     | {k: [a[k] * MIB] * 3 for k in ("malloc", "saved", "new_alive", "stock")}}))
    data = bench_tp.record(bench_tp.memory_rows(runs), bench_tp.activation_rows(runs), bench_tp._mem(*runs[0]))
    assert data["model"].startswith(recorded["model"].split(" (padded")[0])
    result = _draws(tmp_path, data, "cpu-tp-memory")
    for mine, theirs in zip(result["tp_memory"], tp_memory_rows(recorded), strict=True):
        assert (mine["rest"], mine["peak"]) == pytest.approx((theirs["rest"], theirs["peak"]), rel=1e-12)
    for mine, theirs in zip(result["tp_activations"], tp_activation_rows(recorded), strict=True):
        assert mine["megatron_computed"] == theirs["megatron_computed"]  # from s, b, h, a
        # bench_tp's formulas, unrounded, against the ones printed to 3 decimals
        assert mine["malloc_over_adapted"] == pytest.approx(theirs["malloc_over_adapted"], abs=0.001)


def test_bench_preemption_records_what_cpu_figures_reads(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_preemption
    from cpu_figures import preemption_rows

    recorded = _recorded("bench_preemption")
    theirs = next(r for r in recorded["runs"] if r["run"].startswith("seed 2"))
    # the seed 2 run's trial rows: 17 saved (signal to exit 3.5 / 4.2 / 5.0 s), resumed bitwise equal;
    # 3 had ended (exit 0); its 48 complete checkpoints spread over them
    e = theirs["exit_s"]
    saved = [{"exit_code": 143, "exit_s": x, "saved_step": 3, "interrupted_step": 4, "lost_steps": 0,
              "corrupted_accepted": 0, "complete_ckpts": 2, "resume_exit_code": 0, "resumed_from": 4, "resumed_equal": True}
             for x in [e["min"], *[e["median"]] * 15, e["max"]]]
    ended = [{"exit_code": 0, "exit_s": 1.0, "saved_step": None, "lost_steps": 0, "resumed_equal": True,
              "corrupted_accepted": 0, "complete_ckpts": c} for c in (4, 5, 5)]
    results = {"rows": saved + ended, "step_s": theirs["median_step_ms"] / 1e3,
               "agreement_s": [theirs["agreement_boundary_ms"] / 1e3],
               "aligned_s": [theirs["agreement_aligned_ms"] / 1e3] * 2 + [theirs["agreement_aligned_max_ms"] / 1e3]}
    data = bench_preemption.record(results, "seed 2, --validate", 12)
    assert data["grace_period_s"] == recorded["grace_period_s"]
    mine = _draws(tmp_path, data, "cpu-preemption")["preemption"][0]
    assert mine["aligned_share"] == pytest.approx(preemption_rows(recorded)[2]["aligned_share"], rel=1e-12)
    for key in ("trials", "preempted", "resumed_bitwise", "resumed_compared", "steps_lost", "corrupted_accepted",
                "reverified", "ended_exit_0", "shutdown_exit_15", "exit_s"):
        assert mine[key] == theirs[key], key


def test_bench_end_to_end_records_what_cpu_figures_reads(tmp_path):
    pytest.importorskip("matplotlib")
    from argparse import Namespace

    import bench_end_to_end as bench
    from cpu_figures import end_to_end_runs

    recorded = _recorded("bench_end_to_end")
    run = recorded["runs"][0]
    phases = {label.split(" (")[0]: key for key, label in bench.PHASES}
    # run_once's runs, 3 per variant: each phase at its median, the totals per round
    results = {v: [{phases[p["phase"]]: p["s"][v] for p in run["phases"]}
                   | {"total": total, "steady_per_step": run["steady_step_ms"][v] / 1e3}
                   for total in run["totals_per_round"][v]] for v in run["variants"]}
    args = Namespace(steps=400, batch=8, seq=128, val_every=100, val_batches=8, repeats=3)
    data = bench.record(results, args)
    assert [p["phase"] for p in data["runs"][0]["phases"]] == [p["phase"] for p in run["phases"]]
    mine, theirs = _draws(tmp_path, data, "cpu-end-to-end")["end_to_end"][0], end_to_end_runs(recorded)[0]
    assert mine["total_s"] == theirs["total_s"] and mine["per_round_over_plain"] == theirs["per_round_over_plain"]
    assert mine["minus_plain"] == theirs["minus_plain"]


def test_bench_fault_tolerance_records_what_cpu_figures_reads(tmp_path):
    pytest.importorskip("matplotlib")
    import bench_fault_tolerance as bench
    from cpu_figures import fault_tolerance_numbers

    recorded = _recorded("bench_fault_tolerance")
    # main's result: overhead per variant (the rounds' median steps, s; quorum wait and all-reduce per round)
    overhead = {name: {"step_s": [x / 1e3 for x in r["step_ms_rounds"]], "quorum_wait_ms": r.get("quorum_wait_ms", []),
                       "allreduce_ms": r.get("allreduce_ms", [])} for name, r in zip(bench.OVERHEAD_VARIANTS, recorded["overhead"])}
    names = list(bench.OVERHEAD_VARIANTS)
    overhead["ratio_1"] = [a / b for a, b in zip(overhead[names[1]]["step_s"], overhead[names[0]]["step_s"])]
    overhead["ratio_2"] = [a / b for a, b in zip(overhead[names[3]]["step_s"], overhead[names[2]]["step_s"])]
    failure = {f["heartbeat_timeout_ms"]: [{"kill_to_commit_s": k, "uncommitted": u, "median_step_s": f["step_before_ms"] / 1e3}
                                           for k, u in zip(f["kill_to_step_alone_s"], f["not_committed"])]
               for f in recorded["failure"] if f["command"] == 1}
    heal = {h["model"].split()[0]: {"params": h["params_m"] * 1e6, "survivor_median_step_s": h["survivor_step_ms"] / 1e3,
                                    "survivor_heal_step_s": h["survivor_heal_step_ms"] / 1e3,
                                    "apply_s": h["joiner_load_state_dict_ms"] / 1e3,
                                    "launch_to_heal_step_s": h["joiner_launch_to_heal_s"], "weights_equal": True}
            for h in recorded["heal"]}
    w = recorded["work_lost_inputs"]
    cost = {"save_s": w["checkpoint_save_s"], "step_s": w["step_ms"] / 1e3, "start_to_first_step_s": w["restart_to_first_step_s"]}
    result = {"overhead": overhead, "failure": failure, "heal": heal, "checkpoint": cost,
              "lost_work": bench.lost_work(heal["tiny"], failure, cost)}
    n = _draws(tmp_path, bench.record(result, "setting"), "cpu-fault-tolerance")["fault_tolerance"]
    theirs = fault_tolerance_numbers(recorded)
    for key in ("alone_over_one_process", "groups_over_hsdp"):
        assert n[key] == pytest.approx(theirs[key], rel=1e-12)
    assert [h["serving_ms"] for h in n["heal"]] == pytest.approx([h["serving_ms"] for h in theirs["heal"]])
    for lost in n["work_lost"]:  # the figure's, from the rounded inputs, against the script's lost_work as printed
        assert lost["interval_s"] == pytest.approx(lost["recorded"]["interval_s"], abs=0.75)
        assert lost["restart_s"] == pytest.approx(lost["recorded"]["restart_s"], abs=0.5)
        assert lost["fault_tolerant_s"] == pytest.approx(lost["recorded"]["fault_tolerant_s"], abs=0.05)
        assert lost["recorded"]["ratio"] == pytest.approx(lost["recorded"]["restart_s"] / lost["recorded"]["fault_tolerant_s"],
                                                          abs=0.1)
