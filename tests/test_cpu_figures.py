"""The figures of the CPU benchmarks (benchmarks/cpu_figures.py, issue 39) from their recorded results
in benchmarks/results/cpu-2026-12-04: drawn, saying where their data come from, and drawing numbers
recomputed here from the JSONs."""

import html
import json
import re
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
    names = {"cpu-plan-vs-measured": "bench_plan", "cpu-fsdp-memory": "bench_fsdp_memory",
             "cpu-cp-memory": "bench_cp", "cpu-process-groups": "bench_process_groups",
             "cpu-tp-memory": "bench_tp_memory", "cpu-pp-bubble-memory": "bench_pp_bubble_memory",
             "cpu-sac": "bench_sac", "cpu-moe": "bench_moe_quality"}
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
                 "cpu-sac", "cpu-moe"):
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
