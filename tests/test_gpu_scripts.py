"""The GPU scripts (benchmarks/gpu*.py, gpu.sh) on CPU: the cheap parts, so that a syntax or import
error, or a check that could no longer fail, fails the suite. The whole smoke run is
``bash benchmarks/gpu.sh --smoke`` (minutes: it compiles and launches torchrun), not a test."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_layouts
import gpu_ring
import gpu_sac
import gpu_versions
from gpu_bench import fp8_comparison
from gpu_report import SectionReport, merge_reports


def test_muon_clip_section_runs_on_cpu_at_smoke_size():
    # gpu_paths' muon_clip section, CPU: ShardedMuon and QKClip with and without cpu_offload (on a GPU
    # the offloaded shards live on the host while the mesh is on the device)
    import gpu_paths
    import torch.distributed as dist

    from dist_utils import in_this_process
    from lightning_disttrain.parallel.mesh import release_all_meshes

    environ = dict(os.environ)
    try:
        result = in_this_process(gpu_paths.muon_clip, gpu_paths.Shape(smoke=True), torch.device("cpu"), 3)
    finally:
        # its one-device NDParallelStrategy fits start a process group in this process and set
        # Lightning's launch variables (LOCAL_RANK, MASTER_PORT, ...): left there, a later test's
        # 2-rank command took itself for an already launched rank 0 and waited for a rank 1
        release_all_meshes()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert not dist.is_initialized() and "LOCAL_RANK" not in os.environ
    for key in ("no_offload", "offload"):
        assert result[key]["optimizers"][0] == "ShardedMuon" and result[key]["clipped_heads"] > 0
    assert result["max_abs_loss_gap"] < 1e-4


def test_ring_attention_cases_pass_on_cpu_at_smoke_size():
    # gpu_paths' ring_attention section, CPU's kernel: the checks hold and could fail (a case that
    # misses its tolerance raises)
    result = gpu_ring.measure(torch.device("cpu"), smoke=True)
    assert set(result) == {"bf16_long", "fp32", "bf16_wide"}
    assert all(r["passed"] for r in result.values())
    assert result["fp32"]["ring_max_err_vs_fp32 [out, dq, dk, dv]"][0] < 1e-5


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


# ---- gpu.sh's versions check, multi-rank layouts (gpu_layouts.py) and merged report: the parts that
# need no GPU and no multi-rank launch. The layouts themselves: `python benchmarks/gpu_layouts.py --smoke`.

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


def test_gpu_sh_parses():
    assert subprocess.run(["bash", "-n", str(BENCH / "gpu.sh")], capture_output=True).returncode == 0


def test_layouts_dry_run_plans_torchrun_per_gpu_count_and_names_what_it_skips(capsys):
    # The script as gpu.sh starts it once (its entry point and imports); the other GPU counts
    # through its main() in this process (each start costs ~4 s of imports).
    eight = _run(str(BENCH / "gpu_layouts.py"), "--dry-run", "--gpus", "8")
    assert eight.returncode == 0, eight.stderr[-3000:]
    assert "torchrun --standalone --nproc-per-node 2" in eight.stdout
    assert "torchrun --standalone --nproc-per-node 4" in eight.stdout and "--worker hsdp" in eight.stdout
    assert "skipped: hsdp" not in eight.stdout and "--reference dense float8 moe" in eight.stdout
    assert gpu_layouts.main(["--dry-run", "--gpus", "1"]) == 0
    one = capsys.readouterr().out
    for name, layout in gpu_layouts.LAYOUTS.items():
        assert f"skipped: {name} needs {layout.nproc} GPUs (have 1)" in one
    assert "would run" not in one
    assert gpu_layouts.main(["--dry-run", "--smoke"]) == 0
    smoke = capsys.readouterr().out
    assert "skipped: async_tp needs CUDA" in smoke and "skipped: hsdp needs 4 GPUs (have 2)" in smoke


def test_layout_plan_checks_every_layout_against_the_strategy():
    run, skipped = gpu_layouts.plan(8, False, list(gpu_layouts.LAYOUTS))
    assert {"tp_setup", "offload_clip", "tp", "pp", "ep", "hsdp", "float8_tp", "async_tp", "cp"} == set(run)
    assert not skipped  # every layout the script knows, the strategy accepts on 8 GPUs


def test_layout_checks_fail_when_they_should():
    ok = gpu_layouts.compare_losses([4.0, 3.9], [4.0, 3.90001], 1e-4)
    assert ok["ok"] and not ok["bitwise"] and ok["max_abs_diff"] == pytest.approx(1e-5, rel=1e-3)
    assert not gpu_layouts.compare_losses([4.0, 3.9], [4.0, 3.8], 1e-4)["ok"]
    assert not gpu_layouts.compare_losses([4.0], [4.0, 3.8], 1e-4)["ok"]
    ref = {"a": torch.ones(4), "b": torch.zeros(2, 2)}
    same = gpu_layouts.compare_init([{"a": torch.ones(4)}, {"b": torch.zeros(2, 2)}], ref)  # two stages
    assert same["ok"] and same["bitwise_equal"] == 2 and same["max_abs_diff"] == 0
    off = gpu_layouts.compare_init([{"a": torch.ones(4) + 1e-7, "b": torch.zeros(2, 2)}], ref)
    assert not off["ok"] and off["bitwise_equal"] == 1 and off["first_unequal"] == "a" and 0 < off["max_abs_diff"] < 1e-6
    assert gpu_layouts.compare_init([{"a": torch.ones(4)}], ref)["missing"] == ["b"]
    split = gpu_layouts.compare_init([{"a": torch.ones(4), "b": torch.zeros(2, 2)}, {"a": torch.zeros(4)}], ref)
    assert not split["ok"] and split["ranks_disagree"] == ["a"]
    tp = {"param_meshes": ["dp_shard_cp,tp=1x2"], "param_local_devices": ["cuda"], "blocks_here": 4, "n_layer": 4}
    assert gpu_layouts._fact_check("tp", [tp, tp])[0] and not gpu_layouts._fact_check("ep", [tp])[0]
    assert not gpu_layouts._fact_check("offload", [tp])[0] and not gpu_layouts._fact_check("pp", [tp, tp])[0]
    stages = [dict(tp, blocks_here=2), dict(tp, blocks_here=2)]
    assert gpu_layouts._fact_check("pp", stages)[0]
    assert not gpu_layouts._fact_check("async_tp", [dict(tp, op_counts={})])[0]
    assert gpu_layouts._fact_check("async_tp", [dict(tp, op_counts={"symm_mem::fused_all_gather_matmul": 4})])[0]
    # cp=2 alone: the parameters are sharded over the world's own "cp" dimension (no flattened copy
    # over the same ranks); with dp_shard > 1 over the flattened "dp_shard_cp". Both are cp's sharding.
    cp = {"param_meshes": ["cp=2"], "parallelized_steps": ["context_parallel: cp=2 (head-tail)"]}
    assert gpu_layouts._fact_check("cp", [cp, cp])[0]
    assert gpu_layouts._fact_check("cp", [dict(cp, param_meshes=["dp_shard_cp=2"])])[0]
    assert not gpu_layouts._fact_check("cp", [dict(cp, param_meshes=["tp=2"])])[0]
    assert not gpu_layouts._fact_check("cp", [dict(cp, parallelized_steps=[])])[0]


def test_one_device_reference_run_records_losses_weights_and_settings(monkeypatch):
    # What every layout's rank and the reference run, on one CPU process (the cheap part).
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    precision, deterministic = torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled()
    try:
        result, init = gpu_layouts.fit("dense", "auto", accelerator="cpu", devices=1, count_ops=("aten::mm",))
        again, _ = gpu_layouts.fit("dense", "auto", accelerator="cpu", devices=1)
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.use_deterministic_algorithms(deterministic)
    assert len(result["losses"]) == gpu_layouts.STEPS and result["losses"] == again["losses"]
    assert result["float32_matmul_precision"] == "highest" and result["deterministic"]
    assert sum(result["op_counts"].values()) > 0  # the profiler of the async-TP check counts ops
    fresh = gpu_layouts.ParityGPT(gpu_layouts.DENSE)
    fresh.configure_model()
    assert init.keys() == {name for name, _ in fresh.model.named_parameters()}


def test_versions_check_reads_the_pins_and_names_each_difference():
    pins = gpu_versions.pinned_versions()
    assert pins["torch"]["exact"] == "2.13.0" and pins["lightning"]["spec"] and pins["torchao"]["spec"]
    same = {"torch": "2.13.0+cu128", "lightning": "2.6.6", "torchao": "0.18.0", "cuda_runtime": "12.8",
            "driver_cuda": "12.9", "cuda_available": True}
    assert gpu_versions.differences(same, pins) == []
    other = dict(same, torch="2.14.0+cu130", torchao=None, lightning="2.4.0", cuda_runtime="13.0")
    diff = gpu_versions.differences(other, pins)
    assert len(diff) == 4 and any("2.14.0+cu130 installed, 2.13.0 pinned" in d for d in diff)
    assert any(d.startswith("torchao: not installed") for d in diff) and any("lightning: 2.4.0" in d for d in diff)
    assert any("driver supports up to 12.9" in d for d in diff)


def test_merged_report_holds_every_part(tmp_path):
    (tmp_path / "gpu_layouts.json").write_text(json.dumps({"sections": {"tp": {"ok": False}}, "errors": {},
                                                           "skipped": {"hsdp": "needs 4 GPUs (have 2)"},
                                                           "failed": ["tp"]}))
    (tmp_path / "gpu_versions.json").write_text(json.dumps({"differences": ["torch: x"]}))
    merged = merge_reports(str(tmp_path))
    assert json.loads((tmp_path / "gpu_report.json").read_text()) == json.loads(json.dumps(merged))
    assert merged["missing"] == ["gpu_bench.json", "gpu_paths.json"]
    assert merged["summary"]["gpu_layouts"] == {"skipped": ["hsdp"], "failed_checks": ["tp"]}
    assert merged["summary"]["gpu_versions"] == {"differences": ["torch: x"]}


# ---- the figures of the recorded GPU run (gpu_report.py --plot; docs/benchmarks.md 9.1)

RESULTS = BENCH / "results" / "h200-2026-12-04"


def test_figures_of_the_gpu_runs_from_their_recorded_jsons(tmp_path):
    pytest.importorskip("matplotlib")
    from gpu_report import load_runs, plot_reports

    runs = load_runs([str(RESULTS)])  # a directory: its gpu_bench / gpu_paths / gpu_versions JSONs
    assert [(r["label"], r["kind"]) for r in runs] == [
        ("run1", "bench"), ("run1", "paths"), ("run1", "versions"), ("run2", "bench"), ("run2", "paths"),
        ("run3", "bench"), ("run3", "paths"), ("run4", "bench"), ("run4", "paths"), ("run4", "versions"),
        ("run5", "paths"), ("run6", "paths"), ("run7", "bench"), ("run8", "paths")]
    inputs = [str(RESULTS / f"run{n}_gpu_{part}.json") for n in (1, 2, 3) for part in ("bench", "paths")]
    result = plot_reports(inputs, str(tmp_path), command="python benchmarks/gpu_report.py --plot ...")
    assert not result["skipped"]
    for name in ("gpu-throughput", "gpu-fp8-speedup", "gpu-sac", "gpu-async-save"):
        text = (tmp_path / f"{name}.svg").read_text()
        assert result["files"][name] == str(tmp_path / f"{name}.svg")
        assert text.startswith("<?xml") and "<svg" in text
        assert "NVIDIA H200" in text and "2.11.0+cu130" in text and "2026-12-04T" in text  # machine and date

    # float8 over bf16, recomputed here from the rows: one section of one JSON each
    expected = {}
    for n in (1, 2, 3):
        rows = json.loads((RESULTS / f"run{n}_gpu_bench.json").read_text())["results"]
        bf16 = {r["section"]: r["tokens_per_s"] for r in rows if r["precision"] == "bf16"}
        expected |= {(f"run{n}", r["section"], r["precision"].removeprefix("fp8 ")): r["tokens_per_s"] / bf16[r["section"]]
                     for r in rows if r["precision"].startswith("fp8 ")}
    speedups = {(s["run"], s["section"], s["recipe"]): s["speedup"] for s in result["fp8_speedup"]}
    assert len(speedups) == 5 and speedups == pytest.approx(expected)
    recorded = json.loads((RESULTS / "run3_gpu_bench.json").read_text())["fp8_wide"]["tensorwise"]["speedup"]
    assert speedups[("run3", "fp8_wide", "tensorwise")] == pytest.approx(recorded, abs=1e-9)  # gpu_bench.py's own
    assert speedups[("run1", "fp8", "tensorwise")] == pytest.approx(1.0321, abs=1e-3)  # docs/benchmarks.md 9.1
    assert speedups[("run2", "fp8_wide", "tensorwise")] == pytest.approx(1.279, abs=1e-3)
    assert speedups[("run3", "fp8_wide", "tensorwise")] == pytest.approx(1.278, abs=1e-3)

    assert len(result["throughput"]) == 10  # every row of every bench JSON, none deduplicated
    assert [(s["run"], s["mode"], s["backend"]) for s in result["sac"]][-1] == ("run2", "compiled", "flash")
    assert len(result["sac"]) == 7 and all(len(s["points"]) == 3 for s in result["sac"])
    assert [s["run"] for s in result["async_save"]] == ["run3"]  # only the benchmark that waits untimed
    assert max(result["async_save"][0]["async"]) < min(result["async_save"][0]["sync"])

    again = plot_reports(inputs, str(tmp_path / "again"), command="python benchmarks/gpu_report.py --plot ...")
    for name, path in result["files"].items():  # no date, fixed ids: the same bytes
        assert Path(path).read_bytes() == Path(again["files"][name]).read_bytes(), name
