"""End to end through L.Trainer on CPU/gloo: exact resume after a process restart, "last" with
fallback, async saves, retention, resharding 4 -> 2 ranks, bad checkpoints, consolidated export.

Three launches of ``scripts/ckpt_run.py`` (Lightning's launcher starts the other ranks: B, E and A
train one after another in one 2-rank launch, C in a 4-rank one, D resumes in new processes), shared
by the tests below through one module-scoped fixture:

A  2 ranks, 12 steps, async saves every 3 steps (DCP writes slowed by 2 s), keep 2: the reference
B  2 ranks, 6 steps, sync saves every 2 steps, keep 2: the run that is "interrupted"
C  4 ranks, 4 steps, one save at the end (plus the gathered full state): the reshard source
E  2 ranks, 8 steps, async saves every step with save_last=True (two saves back to back), keep 2
D  2 ranks, one new process, several fits: resume B (via "last"), A (async), C (reshard), E,
   a "last" whose newest checkpoint is incomplete, four damaged checkpoints, tensor parallel:
   train tp=2 and save, resume tp=2 from it, reshard it to tp=1; and pipeline parallel: train
   pp=2 and save, resume pp=2 from it, reshard it to pp=1, train on, reshard that back to pp=2
C also loads its own checkpoint as FSDP2 x TP 2x2 in the same 4 processes after training.
Every launch runs the project's NDParallelStrategy; a launch that hangs fails after its timeout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import kill_tree, popen

from lightning_disttrain.checkpoint import (
    MANIFEST_NAME,
    export_consolidated,
    find_latest_checkpoint,
    gpt_from_exported,
    load_consolidated,
    verify_checkpoint,
)
from lightning_disttrain.models.gpt import GPT, GPTConfig

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
SLOW_WRITE = 1.0  # seconds each DCP file write of run A takes at least (tiny steps take ~50 ms)
E_STEPS = 8  # run E: 16 saves, every two of them back to back


def _launch(out: Path, *args: str, devices: int = 2, timeout: float = 240) -> list[dict]:
    args = (*args, "--data", str(out.parent / "data"))
    cmd = [sys.executable, str(SCRIPTS / "ckpt_run.py"), *args, "--out", str(out), "--devices", str(devices)]
    proc = popen(cmd)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)  # rank 0 and the ranks Lightning launched from it
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung (killed after {timeout} s):\n{output[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-8000:]}"
    return _ranks(out, devices)


def _ranks(out: Path, devices: int = 2) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


def _damage(src: Path, dst: Path, how: str) -> str:
    """Copy a checkpoint and damage the copy; return the file that was damaged."""
    shutil.copytree(src, dst)
    shard = dst / "__1_0.distcp"
    if how == "corrupt":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "truncate":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif how == "missing_shard":
        shard.unlink()
    elif how == "no_manifest":
        (dst / MANIFEST_NAME).unlink()
        return str(dst / MANIFEST_NAME)
    return str(shard)


def _runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_e2e")
    sys.path.insert(0, str(SCRIPTS))
    from harness import write_indexed_shard

    write_indexed_shard(root / "data")  # TokenDataModule reads it: window ids decodable from tokens
    # B, E and A in one launch (A last: its slowed writes stay slow for the rest of the process).
    (root / "then.json").write_text(json.dumps([
        ["--out", str(root / "e"), "--steps", str(E_STEPS), "--total-steps", str(E_STEPS), "--ckpt-dir",
         str(root / "e_ckpt"), "--every", "1", "--top-k", "2", "--async-save", "--save-last", "true"],
        ["--out", str(root / "a"), "--steps", "12", "--ckpt-dir", str(root / "a_ckpt"), "--every", "3",
         "--top-k", "2", "--async-save", "--slow-write", str(SLOW_WRITE), "--logits"]]))
    b = _launch(root / "b", "train", "--steps", "6", "--ckpt-dir", str(root / "b_ckpt"), "--every", "2",
                "--top-k", "2", "--then", str(root / "then.json"), timeout=400)
    a, e = _ranks(root / "a"), _ranks(root / "e")
    listings = {name: sorted(p.name for p in (root / name).iterdir()) for name in ("a_ckpt", "b_ckpt")}
    link_targets = {name: (root / name / "last.ckpt").resolve().name for name in ("a_ckpt", "b_ckpt")}
    exported = export_consolidated(root / "a_ckpt" / "step=012.ckpt", root / "a_export.pt")
    # C, then in the same 4 processes: its step-4 checkpoint loaded as FSDP2 x TP 2x2 (reshard 4 -> 2x2).
    (root / "c_jobs.json").write_text(json.dumps([
        {"name": "to_2x2", "ckpt_path": str(root / "c_ckpt" / "step=004.ckpt"), "steps": 5, "tp": 2,
         "dump_state": True}]))
    c = _launch(root / "c", "train", "--steps", "4", "--ckpt-dir", str(root / "c_ckpt"), "--every", "4",
                "--top-k", "1", "--dump-state", "--jobs", str(root / "c_jobs.json"), devices=4, timeout=300)
    # "last" whose newest checkpoint never completed: a copy of B without step 6's manifest.
    shutil.copytree(root / "b_ckpt", root / "fallback_ckpt", symlinks=True)
    (root / "fallback_ckpt" / "step=006.ckpt" / MANIFEST_NAME).unlink()
    damaged = {how: _damage(root / "b_ckpt" / "step=006.ckpt", root / f"bad_{how}", how)
               for how in ("corrupt", "truncate", "missing_shard", "no_manifest")}
    jobs = [
        {"name": "sync_last", "ckpt_path": "last", "last_dir": str(root / "b_ckpt"), "steps": 12},
        {"name": "fallback", "ckpt_path": "last", "last_dir": str(root / "fallback_ckpt"), "steps": 12},
        {"name": "async", "ckpt_path": str(root / "a_ckpt" / "step=009.ckpt"), "steps": 12},
        {"name": "reshard", "ckpt_path": str(root / "c_ckpt" / "step=004.ckpt"), "steps": 6, "dump_state": True},
        {"name": "init_from_export", "ckpt_path": None, "init_from": str(exported), "steps": 1},
        *({"name": how, "ckpt_path": str(root / f"bad_{how}"), "steps": 12} for how in damaged),
        # Tensor parallel (tp=2, sequence + loss parallel, dropout on): train and save, resume on the
        # same layout, and reshard to plain FSDP2 (tp=1).
        {"name": "tp_train", "ckpt_path": None, "steps": 6, "tp": 2, "save_dir": str(root / "tp_ckpt"),
         "save_every": 3, "dump_final": True},
        {"name": "tp_resume", "ckpt_path": str(root / "tp_ckpt" / "step=003.ckpt"), "steps": 6, "tp": 2},
        {"name": "tp_to_1", "ckpt_path": str(root / "tp_ckpt" / "step=006.ckpt"), "steps": 7, "dump_state": True},
        # Pipeline parallel (pp=2, 1F1B, untied head, dropout on): train and save, resume on the same
        # layout, reshard to pp=1 (FSDP2 over both ranks), train on and save, reshard back to pp=2.
        {"name": "pp_train", "ckpt_path": None, "steps": 6, "pp": 2, "untied": True, "save_dir": str(root / "pp_ckpt"),
         "save_every": 3, "dump_final": True},
        {"name": "pp_resume", "ckpt_path": str(root / "pp_ckpt" / "step=003.ckpt"), "steps": 6, "pp": 2, "untied": True},
        {"name": "pp_to_1", "ckpt_path": str(root / "pp_ckpt" / "step=006.ckpt"), "steps": 8, "untied": True,
         "dump_state": True, "save_dir": str(root / "pp1_ckpt"), "save_every": 8, "dump_final": True},
        {"name": "pp_from_1", "ckpt_path": str(root / "pp1_ckpt" / "step=008.ckpt"), "steps": 9, "pp": 2,
         "untied": True, "dump_state": True},
        # Expert parallel (ep=2: two of the four experts per rank, tokens by all-to-all; dropout on):
        # train and save, resume on the same layout, reshard to ep=1 (plain FSDP2 over both ranks).
        {"name": "ep_train", "ckpt_path": None, "steps": 6, "ep": 2, "moe": True, "save_dir": str(root / "ep_ckpt"),
         "save_every": 3, "dump_final": True},
        {"name": "ep_resume", "ckpt_path": str(root / "ep_ckpt" / "step=003.ckpt"), "steps": 6, "ep": 2, "moe": True},
        {"name": "ep_to_1", "ckpt_path": str(root / "ep_ckpt" / "step=006.ckpt"), "steps": 7, "moe": True,
         "dump_state": True},
        {"name": "e_from_before_last", "ckpt_path": str(root / "e_ckpt" / f"step={E_STEPS - 1:03d}.ckpt"),
         "steps": E_STEPS, "total_steps": E_STEPS},
        {"name": "e_from_last", "ckpt_path": str(root / "e_ckpt" / "last.ckpt"), "steps": E_STEPS + 1, "total_steps": E_STEPS,
         "dump_state": True},
    ]
    (root / "jobs.json").write_text(json.dumps(jobs))
    d = _launch(root / "d", "resume", "--jobs", str(root / "jobs.json"))
    return {"root": root, "a": a, "b": b, "c": c, "d": d, "e": e, "damaged": damaged, "listings": listings,
            "link_targets": link_targets}


BACKGROUND = {"runs": _runs}  # the launches run beside the other slow tests (tests/conftest.py)


@pytest.fixture(scope="module")
def runs(background):
    return background(__name__, "runs")


def _steps(losses, after: int) -> dict:
    return {step: value for step, value in losses if step > after}


def test_runs_used_the_dcp_strategy(runs):
    kinds = {r["strategy"] for key in "abc" for r in runs[key]}
    assert kinds == {"NDParallelStrategy"}, kinds


def test_exact_resume_after_restart_is_bitwise(runs):
    # B trained 6 steps and saved; a new process resumed from "last" and trained to 12.
    for rank in (0, 1):
        job = runs["d"][rank]["sync_last"]
        assert job["ok"], job.get("traceback")
        assert job["start_step"] == 6
        reference = _steps(runs["a"][rank]["losses"], after=6)
        assert _steps(job["losses"], after=6) == reference, f"rank {rank}: losses after resume differ"
        assert len(reference) == 6
    # Sanity: the ranks drew different dropout masks, so per-rank RNG restore was exercised.
    assert runs["a"][0]["losses"] != runs["a"][1]["losses"]


def test_interrupted_run_matched_reference_before_save(runs):
    for rank in (0, 1):
        assert runs["b"][rank]["losses"] == runs["a"][rank]["losses"][:6]


def test_last_falls_back_to_previous_complete_checkpoint(runs):
    for rank in (0, 1):
        job = runs["d"][rank]["fallback"]
        assert job["ok"], job.get("traceback")
        assert job["start_step"] == 4
        assert _steps(job["losses"], after=4) == _steps(runs["a"][rank]["losses"], after=4)
    warned = " ".join(runs["d"][0]["fallback"]["warnings"])
    assert "step=006.ckpt" in warned and MANIFEST_NAME in warned and "incomplete" in warned


def test_restore_message_names_the_checkpoint_really_loaded(runs):
    root = runs["root"]
    for name, folder, loaded, step in (("fallback", "fallback_ckpt", "step=004.ckpt", 4),
                                       ("sync_last", "b_ckpt", "step=006.ckpt", 6)):
        job, real = runs["d"][0][name], str((root / folder / loaded).resolve())
        # Lightning's own line names the directory loaded, not the last.ckpt it asked for.
        assert f"Restored all states from the checkpoint at {real}" in job["infos"], job["infos"]
        assert any(m.startswith(f"Resuming from {real!r} (global step {step}, completed ")
                   for m in job["infos"]), job["infos"]
        # Lightning's path again once training ran: ModelCheckpoint never deletes trainer.ckpt_path.
        assert job["ckpt_path_after"] == str(root / folder / "last.ckpt")


def test_async_save_resumes_exactly(runs):
    for rank in (0, 1):
        job = runs["d"][rank]["async"]
        assert job["ok"], job.get("traceback")
        assert job["start_step"] == 9
        assert _steps(job["losses"], after=9) == _steps(runs["a"][rank]["losses"], after=9)


def test_async_save_does_not_block_and_manifest_comes_last(runs):
    a0 = runs["a"][0]
    # The first save had nothing in flight: it returned after staging, well before the write
    # (which takes at least SLOW_WRITE seconds) was done.
    assert a0["save_seconds"][0] < SLOW_WRITE, a0["save_seconds"]
    # One training step after the step-3 save started, its files were still being written and
    # there was no manifest yet; training went on meanwhile.
    probe = next(p for p in a0["probes"] if p["step"] == 4)
    assert probe["dirs"]["step=003.ckpt"] == {"manifest": False, "metadata": False}
    # Teardown waited for the last write: every checkpoint left is complete and verifies.
    ckpts = runs["root"] / "a_ckpt"
    for name in ("step=009.ckpt", "step=012.ckpt"):
        manifest = verify_checkpoint(ckpts / name)
        assert manifest.extra["async_save"] is True and manifest.world_size == 2


def test_retention_keeps_last_k_complete_directories(runs):
    # ModelCheckpoint(save_top_k=2, monitor="step", mode="max") removes through the strategy.
    for name, kept in (("a_ckpt", ["step=009.ckpt", "step=012.ckpt"]), ("b_ckpt", ["step=004.ckpt", "step=006.ckpt"])):
        assert runs["listings"][name] == sorted(kept + ["last.ckpt"])
        assert runs["link_targets"][name] == kept[-1]
    folder = runs["root"] / "a_ckpt"
    assert find_latest_checkpoint(folder) == (folder / "step=012.ckpt").resolve()
    # The resumed run (same callback, its state restored) went on saving and pruning in B's folder.
    folder = runs["root"] / "b_ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=010.ckpt", "step=012.ckpt"]
    assert (folder / "last.ckpt").resolve().name == "step=012.ckpt"
    assert verify_checkpoint(folder / "step=012.ckpt").global_step == 12


def test_reshard_4_to_2_restores_state_and_data_position(runs):
    saved = torch.load(runs["root"] / "c" / "final_state.pt", weights_only=False)
    restored = torch.load(runs["root"] / "d" / "reshard_restored.pt", weights_only=False)
    assert saved["model"].keys() == restored["model"].keys()
    for key, value in saved["model"].items():
        assert torch.equal(value, restored["model"][key]), key
    (s_opt,), (r_opt,) = saved["optimizers"], restored["optimizers"]
    assert s_opt["param_groups"] == r_opt["param_groups"]
    assert s_opt["state"].keys() == r_opt["state"].keys()
    for fqn, state in s_opt["state"].items():
        for name, value in state.items():
            assert torch.equal(value, r_opt["state"][fqn][name]), (fqn, name)

    for rank in (0, 1):
        job = runs["d"][rank]["reshard"]
        assert job["ok"], job.get("traceback")
        assert job["start_step"] == 4 and [s for s, _ in job["losses"]] == [5, 6]
    # C consumed global samples 0..31 (4 steps x 4 ranks x 2); D continues at 32 on 2 ranks.
    seen_c = {i for r in runs["c"] for _, ids in r["samples"] for i in ids}
    seen_d = [i for step in (5, 6) for r in runs["d"] for s, ids in r["reshard"]["samples"] if s == step for i in ids]
    from harness import expected_windows

    assert seen_c == set(expected_windows(0, 32))
    assert seen_d == expected_windows(32, 8)
    assert any("saved on 4 ranks" in w for w in runs["d"][0]["reshard"]["warnings"])


@pytest.mark.parametrize("how, reason", [("corrupt", "corrupted"), ("truncate", "truncated"),
                                         ("missing_shard", "missing"), ("no_manifest", "incomplete")])
def test_damaged_checkpoint_fails_naming_the_file(runs, how, reason):
    for rank in (0, 1):
        job = runs["d"][rank][how]
        assert not job["ok"]
        assert "CheckpointVerificationError" in job["error"] or "IncompleteCheckpointError" in job["error"]
        assert runs["damaged"][how] in job["error"] and reason in job["error"], job["error"]
        assert job["losses"] == []  # nothing trained on a bad checkpoint


def test_export_consolidated_gives_identical_logits(runs):
    # Exported in the test process (one process, no process group) from A's last checkpoint.
    sys.path.insert(0, str(SCRIPTS))
    from harness import VOCAB, probe_input

    model = GPT(GPTConfig.from_name("tiny", vocab_size=VOCAB, dropout=0.1))
    model.load_state_dict(load_consolidated(runs["root"] / "a_export.pt"))
    model.eval()
    with torch.no_grad():
        logits = model(probe_input())
    expected = torch.load(runs["root"] / "a" / "logits.pt")  # the sharded model, after training
    assert torch.equal(logits, expected), (logits - expected).abs().max()


def test_from_exported_gives_the_trained_logits_over_the_real_vocabulary(runs):
    sys.path.insert(0, str(SCRIPTS))
    from harness import VOCAB, probe_input

    model = gpt_from_exported(runs["root"] / "a_export.pt")  # config (dropout 0.1 too) from the file
    with torch.no_grad():
        logits = model(probe_input())
    expected = torch.load(runs["root"] / "a" / "logits.pt")  # padded: 257 real columns of 320
    assert logits.shape == (*probe_input().shape, VOCAB) and expected.shape[-1] == 320
    assert torch.equal(logits, expected[..., :VOCAB])


def test_export_loads_into_a_new_sharded_run(runs):
    job = runs["d"][0]["init_from_export"]
    assert job["ok"], job.get("traceback")
    logits = torch.load(runs["root"] / "d" / "init_from_export_start_logits.pt")
    assert torch.equal(logits, torch.load(runs["root"] / "a" / "logits.pt"))


def test_nd_parallel_strategy_inherits_the_mixin():
    from lightning_disttrain.strategies.nd_parallel import NDParallelStrategy
    from lightning_disttrain.strategies.checkpointing import DCPCheckpointMixin

    assert issubclass(NDParallelStrategy, DCPCheckpointMixin), (
        "NDParallelStrategy must inherit DCPCheckpointMixin first: "
        "class NDParallelStrategy(DCPCheckpointMixin, ParallelStrategy)")
    mro = NDParallelStrategy.__mro__
    assert mro.index(DCPCheckpointMixin) < mro.index(next(c for c in mro if c.__name__ == "ParallelStrategy"))


def test_back_to_back_async_saves_every_step_neither_hang_nor_corrupt(runs):
    # ModelCheckpoint with save_last=True saves the top-k checkpoint and then "last.ckpt" right
    # after it, every step (run E, E_STEPS steps): the second save starts while the first one's
    # background write still runs collectives on the checkpoint group. Each must wait for the
    # other; otherwise ranks pair different collectives (a hang: _launch's timeout fails the run
    # and kills its ranks, or one rank's file list taken for another's path).
    root, ckpts = runs["root"], runs["root"] / "e_ckpt"
    n = E_STEPS
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", f"step={n - 1:03d}.ckpt", f"step={n:03d}.ckpt"]
    for name, step in (("last.ckpt", n), (f"step={n - 1:03d}.ckpt", n - 1), (f"step={n:03d}.ckpt", n)):
        assert not (ckpts / name).is_symlink()
        manifest = verify_checkpoint(ckpts / name)
        assert manifest.global_step == step and manifest.extra["async_save"] is True
    for rank in (0, 1):
        before, from_last = runs["d"][rank]["e_from_before_last"], runs["d"][rank]["e_from_last"]
        assert before["ok"], before.get("traceback")
        assert before["start_step"] == n - 1
        assert _steps(before["losses"], after=n - 1) == _steps(runs["e"][rank]["losses"], after=n - 1)
        assert from_last["ok"] and from_last["start_step"] == n, from_last.get("traceback")
    # "last.ckpt" restores the weights the newest step checkpoint holds.
    restored = torch.load(root / "d" / "e_from_last_restored.pt", weights_only=False)["model"]
    exported = load_consolidated(export_consolidated(ckpts / f"step={n:03d}.ckpt", root / "e_last.pt", prefix=None))
    assert restored.keys() == exported.keys()
    for key, value in exported.items():
        assert torch.equal(value, restored[key]), key


def _assert_same_state(saved: dict, restored: dict) -> None:
    assert saved["model"].keys() == restored["model"].keys()
    for key, value in saved["model"].items():
        assert torch.equal(value, restored["model"][key]), key
    (s_opt,), (r_opt,) = saved["optimizers"], restored["optimizers"]
    assert s_opt["param_groups"] == r_opt["param_groups"] and s_opt["state"].keys() == r_opt["state"].keys()
    for fqn, state in s_opt["state"].items():
        for name, value in state.items():
            assert torch.equal(value, r_opt["state"][fqn][name]), (fqn, name)


def test_tensor_parallel_resumes_bitwise_on_the_same_layout(runs):
    # tp=2 with dropout: both TP ranks share one RNG stream (restored per rank), so the continuation
    # from step 3 reproduces steps 4-6 exactly.
    for rank in (0, 1):
        trained, resumed = runs["d"][rank]["tp_train"], runs["d"][rank]["tp_resume"]
        assert trained["ok"] and resumed["ok"], (trained.get("traceback"), resumed.get("traceback"))
        assert resumed["start_step"] == 3
        assert _steps(resumed["losses"], after=3) == _steps(trained["losses"], after=3)
        assert len(_steps(trained["losses"], after=3)) == 3
    # TP ranks of one replica read the same batches and compute the same loss.
    assert runs["d"][0]["tp_train"]["samples"] == runs["d"][1]["tp_train"]["samples"]
    assert runs["d"][0]["tp_train"]["losses"] == runs["d"][1]["tp_train"]["losses"]


def test_tensor_parallel_checkpoints_reshard_to_other_layouts(runs):
    root = runs["root"]
    # tp=2 -> tp=1 (2 ranks of FSDP2): weights and optimizer state equal.
    for rank in (0, 1):
        assert runs["d"][rank]["tp_to_1"]["ok"], runs["d"][rank]["tp_to_1"].get("traceback")
    _assert_same_state(torch.load(root / "d" / "tp_train_final.pt", weights_only=False),
                       torch.load(root / "d" / "tp_to_1_restored.pt", weights_only=False))
    # FSDP2 on 4 ranks -> FSDP2 x TP 2x2: equal as well.
    for r in runs["c"]:
        assert r["jobs"]["to_2x2"]["ok"], r["jobs"]["to_2x2"].get("traceback")
        assert r["jobs"]["to_2x2"]["start_step"] == 4
    _assert_same_state(torch.load(root / "c" / "final_state.pt", weights_only=False),
                       torch.load(root / "c" / "to_2x2_restored.pt", weights_only=False))


def test_expert_parallel_resumes_bitwise_and_reshards_to_ep1(runs):
    root = runs["root"]
    for rank in (0, 1):
        trained, resumed = runs["d"][rank]["ep_train"], runs["d"][rank]["ep_resume"]
        assert trained["ok"] and resumed["ok"], (trained.get("traceback"), resumed.get("traceback"))
        assert resumed["start_step"] == 3
        # the balancing bias, the experts' shards, their optimizer state, RNG and data all restored
        assert _steps(resumed["losses"], after=3) == _steps(trained["losses"], after=3)
        assert len(_steps(trained["losses"], after=3)) == 3
        assert runs["d"][rank]["ep_to_1"]["ok"], runs["d"][rank]["ep_to_1"].get("traceback")
    # ep=2 -> ep=1: the checkpoint holds whole [num_experts, ...] tensors; every weight (the bias
    # buffer included) and every optimizer state equal after loading them on the other layout.
    saved = torch.load(root / "d" / "ep_train_final.pt", weights_only=False)
    assert any(key.endswith("mlp.experts.w1") and value.shape[0] == 4 for key, value in saved["model"].items())
    assert any(key.endswith("mlp.expert_bias") and value.abs().sum() > 0 for key, value in saved["model"].items())
    _assert_same_state(saved, torch.load(root / "d" / "ep_to_1_restored.pt", weights_only=False))


def _stage_state(root: Path, name: str) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    from harness import merge_stage_states

    return merge_stage_states([root / "d" / f"{name}.rank{r}.pt" for r in (0, 1)])


def test_pipeline_parallel_resumes_bitwise_on_the_same_layout(runs):
    # pp=2 with dropout: each stage rank restores its own RNG stream; the loss every rank records
    # is the last stage's (sent to both), so both ranks hold the same, bitwise, after the resume.
    for rank in (0, 1):
        trained, resumed = runs["d"][rank]["pp_train"], runs["d"][rank]["pp_resume"]
        assert trained["ok"] and resumed["ok"], (trained.get("traceback"), resumed.get("traceback"))
        assert resumed["start_step"] == 3
        assert _steps(resumed["losses"], after=3) == _steps(trained["losses"], after=3)
        assert len(_steps(trained["losses"], after=3)) == 3
    assert runs["d"][0]["pp_train"]["losses"] == runs["d"][1]["pp_train"]["losses"]
    assert runs["d"][0]["pp_train"]["samples"] == runs["d"][1]["pp_train"]["samples"]  # one pipeline: one batch


def test_pipeline_checkpoints_reshard_to_pp1_and_back(runs):
    root = runs["root"]
    for rank in (0, 1):
        for name in ("pp_to_1", "pp_from_1"):
            assert runs["d"][rank][name]["ok"], runs["d"][rank][name].get("traceback")
    # pp=2 (each rank its stage) -> pp=1 (FSDP2 over both ranks): every weight and optimizer state equal.
    trained = _stage_state(root, "pp_train_final")
    _assert_same_state(trained, torch.load(root / "d" / "pp_to_1_restored.pt", weights_only=False))
    # ... and pp=1 -> pp=2 from the checkpoint pp_to_1 wrote after 2 more steps.
    _assert_same_state(torch.load(root / "d" / "pp_to_1_final.pt", weights_only=False),
                       _stage_state(root, "pp_from_1_restored"))
    # The data continues: pp=2 read 2 samples per step (one pipeline), FSDP2 on 2 ranks 4.
    from harness import expected_windows

    seen = {name: [i for s, ids in runs["d"][0][name]["samples"] for i in ids] for name in ("pp_train", "pp_from_1")}
    assert seen["pp_train"] == expected_windows(0, 12)
    to_1 = [i for step in (7, 8) for r in runs["d"] for s, ids in r["pp_to_1"]["samples"] if s == step for i in ids]
    assert sorted(to_1) == sorted(expected_windows(12, 8))
    assert seen["pp_from_1"] == expected_windows(20, 2)
    # export from the pp=2 checkpoint: the same single-file state dict as the unsplit model's.
    exported = load_consolidated(export_consolidated(root / "pp_ckpt" / "step=006.ckpt", root / "pp6.pt", prefix=None))
    assert exported.keys() == trained["model"].keys()
    for key, value in exported.items():
        assert torch.equal(value, trained["model"][key]), key
