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
             "cpu-cp-memory": "bench_cp_memory", "cpu-process-groups": "bench_process_groups"}
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


def test_cp_figure_finds_the_sections_longest_sequences_from_its_points(rendered):
    _, result = rendered
    data = _recorded("bench_cp_memory")
    series = {s["cp"]: s for s in result["cp_memory"]}
    assert sorted(series) == [1, 2, 4]
    for cp, s in series.items():
        assert s["points"] == [(row["seq"], row["mib_per_rank"][str(cp)]) for row in data["rows"]]
        # recomputed from the table's points (rounded to 0.1 MiB): within a few tokens of bench_cp's
        assert s["longest_from_points"] == pytest.approx(s["longest_within_budget"], abs=5)
    assert {cp: s["longest_within_budget"] for cp, s in series.items()} == {1: 6869, 2: 5280, 4: 8873}
    assert [cp for cp, s in series.items() if s["extrapolated"]] == [4]  # 115.4 MiB at 8192: below 128
    for row in data["rows"]:
        m = row["mib_per_rank"]
        assert m["1"] / m["2"] == pytest.approx(row["cp1_over_cp2"], abs=0.006)


def test_groups_figure_counts_one_group_per_rank_set_and_the_new_group_calls(rendered):
    _, result = rendered
    data = _recorded("bench_process_groups")
    for drawn, row in zip(result["process_groups"], data["rows"], strict=True):
        assert drawn["groups"] == row["groups_joined"] == row["distinct_rank_sets"] == len(row["sizes"])
        # every rank makes one new_group call per group of each rank-set size: world / size of them
        assert drawn["new_group_calls"] == sum(data["world"] // s for s in row["sizes"])


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
    for name in ("cpu-plan-vs-measured", "cpu-fsdp-memory", "cpu-cp-memory"):
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
