"""The one-GPU scripts (benchmarks/gpu*.py) on CPU: the cheap parts. The whole smoke run is
``bash benchmarks/gpu.sh --smoke`` (minutes: it compiles), not a test."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_sac
from gpu_bench import fp8_comparison
from gpu_report import SectionReport


def test_selective_checkpointing_runs_attention_forward_once_per_block():
    result = gpu_sac.measure(torch.device("cpu"), smoke=True)
    rows = {r["policy"]: r for r in result["rows"]}
    assert result["counted_by"] == "ops_per_block"
    assert {p: rows[p]["ops_per_block"] for p in rows} == {"none": 1, "selective": 1, "full": 2}
    assert rows["selective"]["ops_in_backward"] == 0  # served from SAC's cache, not run again
    assert rows["full"]["ops_in_backward"] == result["n_layer"]
    assert rows["full"]["saved_mib"] < rows["selective"]["saved_mib"] < rows["none"]["saved_mib"]
    assert all(result["attention_forward_per_block_as_expected"].values())


def test_section_report_skips_what_does_not_fit_and_keeps_errors(tmp_path):
    report = SectionReport("r.json", str(tmp_path), torch.device("cpu"), smoke=True, deadline=time.time() + 5)
    assert report.run("fits", 1, lambda: {"x": 1})["x"] == 1
    assert report.run("too_long", 60, lambda: {"x": 2}) is None
    assert report.run("broken", 1, lambda: 1 / 0) is None
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data["sections"]) == {"fits"} and "too_long" in data["skipped"]
    assert data["errors"]["broken"].startswith("ZeroDivisionError")


def test_fp8_comparison_gaps_step_by_step():
    base = {"precision": "bf16", "tokens_per_s": 100.0, "batch": 16, "losses": [10.0, 8.0, 6.0]}
    fp8 = {"precision": "fp8 rowwise", "tokens_per_s": 130.0, "batch": 16, "losses": [10.0, 8.4, 5.7]}
    c = fp8_comparison({None: base, "rowwise": fp8, "tensorwise": None})["rowwise"]
    assert c["speedup"] == pytest.approx(1.3)
    assert c["max_abs_loss_gap"] == pytest.approx(0.4) and c["mean_abs_loss_gap"] == pytest.approx(0.7 / 3)
    assert c["max_rel_loss_gap"] == pytest.approx(0.05) and c["final_loss_gap"] == pytest.approx(-0.3)
