"""CheckpointEval in training: the same results on 1 rank, 2 ranks (DDP) and under fsdp2 (async
saves); evals.json in every checkpoint, listed in its manifest; the eval command gives the same
numbers from the checkpoint directory and from an exported file; the gate fires on a model whose
weights were zeroed mid-run and not before, marks and skips that checkpoint, stops training, and
its state survives a resume (evaluated in a separate process); configs/evals.yaml with CSVLogger
logs eval/<task>/<metric>. Runs: tests/callbacks/evals_worker.py."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest

import evals_worker as worker
from dist_utils import in_this_process

WORKER, LAUNCH = "evals_worker", {2: ["fsdp2", "ddp", "tp", "pp", "gate", "gate_resume", "cli_yaml"]}  # the shared 2-rank launch
pytestmark = pytest.mark.skipif(not worker.EVALS.is_dir(), reason="../shared/evals not present")


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-5), name


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    worker.BASE = tmp_path_factory.mktemp("evals_single")
    try:
        return in_this_process(worker.fit_run, "single", 1)
    finally:
        worker.BASE = None


@pytest.mark.slow
def test_same_results_on_one_rank_two_ranks_fsdp2_tensor_and_pipeline_parallel(launched, single):
    runs = launched(WORKER, 2)
    assert [h["step"] for h in single["history"]] == [2, 4]
    for h in single["history"]:
        assert {"eval/heldout/loss", "eval/piqa/acc", "eval/piqa/acc_norm", "eval/winogrande/acc",
                "eval/lambada_openai/acc", "eval/lambada_openai/ppl"} <= h["metrics"].keys()
    for run in ("fsdp2", "ddp", "tp", "pp"):
        for rank in runs[run]:
            assert [h["step"] for h in rank["history"]] == [2, 4]
            for mine, ref in zip(rank["history"], single["history"]):
                _close(mine["metrics"], ref["metrics"])
    fsdp2 = runs["fsdp2"][0]["evals"]  # rank 0: evals.json of every (async-saved) checkpoint, in its manifest
    assert sorted(fsdp2) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert all(e["listed"] for e in fsdp2.values())
    _close(fsdp2["epoch=0-step=4.ckpt"]["metrics"], single["history"][1]["metrics"])
    assert sorted(runs["ddp"][0]["evals"]) == sorted(single["evals"]) == sorted(fsdp2)  # beside the files


@pytest.mark.slow
def test_eval_command_on_the_fsdp2_checkpoint_and_its_export(launched, tmp_path):
    from lightning_disttrain.checkpoint import export_consolidated
    from lightning_disttrain.evals.command import eval_main

    run = launched(WORKER, 2)["fsdp2"][0]
    ckpt = Path(run["dir"]) / "epoch=0-step=4.ckpt"
    expected = run["evals"][ckpt.name]["metrics"]
    heldout = Path(run["dir"]) / "heldout.pt"  # the run's held-out windows (its validation set), saved by rank 0
    args = ["--tasks", ",".join(worker.TASKS), "--data-dir", str(worker.EVALS), "--limit", "6", "--heldout", str(heldout),
            "--batch-size", "4"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from_dir = eval_main([str(ckpt), *args, "--output", str(tmp_path / "dir.json")])
        exported = export_consolidated(ckpt, tmp_path / "model.pt")
        from_file = eval_main([str(exported), *args])
    _close(from_dir.flat(), expected)
    _close(from_file.flat(), expected)
    assert (tmp_path / "dir.json").is_file()
    with pytest.raises(SystemExit, match="unknown eval task 'nope'"):
        eval_main([str(ckpt), "--tasks", "nope"])


@pytest.mark.slow
def test_gate_fires_on_zeroed_weights_marks_stops_and_survives_resume(launched):
    runs = launched(WORKER, 2)
    for rank in runs["gate"]:
        steps = {h["step"]: h for h in rank["history"]}
        assert sorted(steps) == [2, 4, 6, 8]
        assert all(not steps[s]["violations"] for s in (2, 4, 6))  # normal training: no rule fired
        assert len(steps[8]["violations"]) == 2  # zeroed weights: uniform logits, loss = ln(257)
        assert steps[8]["metrics"]["eval/heldout/loss"] == pytest.approx(math.log(257), rel=1e-5)
        assert rank["global_step"] == 8  # the stop rule ended training before max_steps=10
    gate = runs["gate"][0]
    assert gate["evals"]["epoch=0-step=8.ckpt"]["gate"]["failed_checkpoint"] is True
    assert not gate["evals"]["epoch=0-step=6.ckpt"]["gate"]["failed_checkpoint"]
    assert gate["latest"] == "epoch=0-step=6.ckpt"  # discovery skips the failed one

    best_before = min(h["metrics"]["eval/heldout/loss"] for h in gate["history"] if h["step"] <= 6)
    for rank in runs["gate_resume"]:
        # resumed from step 6 (ckpt_path="last" skipped the failed step 8), with its gate state:
        # the bests include step 6's evaluation, made before that checkpoint was written
        assert rank["gate_at_start"]["lowest"]["eval/heldout/loss"] == pytest.approx(best_before)
        assert [h["step"] for h in rank["gate_at_start"]["failed"]] == []
    resumed = runs["gate_resume"][0]  # rank 0 ran the eval process and gated its results
    (last,) = [h for h in resumed["history"] if h["step"] == 8]
    assert last["violations"] and last["metrics"]["eval/heldout/loss"] == pytest.approx(math.log(257), rel=1e-5)
    assert resumed["evals"]["epoch=0-step=8.ckpt"]["gate"]["failed_checkpoint"] is True
    assert resumed["evals"]["epoch=0-step=8.ckpt"]["listed"]


@pytest.mark.slow
def test_cli_yaml_logs_eval_metrics_to_csv(launched):
    rank0 = launched(WORKER, 2)["cli_yaml"][0]
    logged = [r for r in rank0["rows"] if "eval/heldout/loss" in r]
    assert [int(r["step"]) for r in logged] == [2, 4]
    for name in ("eval/lambada_openai/acc", "eval/lambada_openai/ppl", "eval/piqa/acc_norm", "eval/arc_easy/acc",
                 "eval/winogrande/acc", "eval/copa/acc", "eval/heldout/ppl"):
        assert all(math.isfinite(float(r[name])) for r in logged), name
    assert sorted(rank0["evals"]) == ["epoch=0-step=4.ckpt"]  # the YAML keeps the newest checkpoint (save_top_k=1)
