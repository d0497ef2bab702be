"""PreemptionCheckpoint: signals only set a flag, all ranks agree and save, exit, resume bitwise.

Two launches of 2 gloo ranks (tests/callbacks/preemption_run.py) carry the multi-process cases:
- "first": a run whose rank 0 gets SIGTERM during validation (the validation stops at the end of
  the batch in progress and step 4 is saved); two runs whose rank 1's disk fills up during the
  step-4 save (on_save_error="warn" and "stop"), the stopped one relaunched with
  ckpt_path="auto"; a third whose async step-4 save fails that way and is still in flight when
  rank 0 gets SIGTERM in step 5 (the preemption's wait for it raises); a run checkpointing to s3:// on a local S3 server (moto, 127.0.0.1) whose
  rank 0 gets SIGTERM during step 3, relaunched with "auto"; a run whose rank 1 alone gets SIGTERM
  during step 5;
- "second": that run resumed with ckpt_path="last" (no save_last); the validation run resumed with
  ckpt_path="auto"; a run without any PreemptionCheckpoint whose rank 1 gets SIGTERM in step 3;
  two runs with check_every_n_steps="auto" (the default; the runs above that assert the exact
  step of a save pass 1): 40 steps with a SIGTERM to rank 0 in step 20, 7 steps with one to rank
  1 in step 6; then the same run from scratch, uninterrupted
  (the reference losses) until rank 1 is SIGKILLed while its step-8 checkpoint is being written
  (async save in flight).
The rest runs in this process (one device, Lightning's own strategy) or needs no Trainer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import lightning as L
import pytest
from dist_utils import _env, kill_tree, popen

from lightning_disttrain.callbacks import (
    AWSSpotNotice,
    GCPPreemptionNotice,
    PreemptionCheckpoint,
    PreemptionExit,
)
from lightning_disttrain.callbacks.preemption import (
    AGREEMENT_SHARE,
    MAX_INTERVAL,
    Agreement,
    agreement_interval,
)
from lightning_disttrain.callbacks.preemption_notices import NoticePoller
from lightning_disttrain.checkpoint import (
    find_latest_checkpoint,
    list_checkpoints,
    read_manifest,
    verify_checkpoint,
)

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "preemption_run.py"
EXIT_CODE = 42  # preemption_run.EXIT_CODE
EXIT_BOUND_S = 60  # a rank whose peer was SIGKILLed exits within this (measured: a few seconds)


def _launch(command: str, data: Path, out: Path, timeout: float = 400,
            env: dict | None = None) -> tuple[int, float, str]:
    proc = popen([sys.executable, str(SCRIPT), command, str(data), str(out)], env=env)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except Exception:
        kill_tree(proc)
        raise
    return proc.returncode, time.time(), output


def _ranks(out: Path, run: str) -> list[dict]:
    return [json.loads((out / f"{run}.rank{r}.json").read_text()) for r in range(2)]


def _launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    sys.path.insert(0, str(HERE.parent / "checkpoint" / "scripts"))
    from harness import write_indexed_shard

    write_indexed_shard(root / "data")
    out = root / "out"
    from s3_server import ENV, local_s3

    with local_s3("ldt-preemption") as endpoint:  # the local S3 server the first launch saves to
        first = _launch("first", root / "data", out, env=_env({ENV: endpoint}))
    # What the first launch left, before the second one adds to the directory.
    pre_listing = sorted(p.name for p in (out / "pre_ckpt").iterdir())
    pre_last = (out / "pre_ckpt" / "last.ckpt").resolve()
    second = _launch("second", root / "data", out)
    return {"out": out, "first": first, "second": second, "pre_listing": pre_listing, "pre_last": pre_last}


BACKGROUND = {"launches": _launches}  # run beside the other slow tests (tests/conftest.py)


@pytest.fixture(scope="module")
def launches(background):
    return background(__name__, "launches")


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_on_every_rank_and_exits_with_the_code(launches):
    rc, _, output = launches["first"]
    assert rc == EXIT_CODE, output[-4000:]
    ranks = _ranks(launches["out"], "preempted")
    assert [r["exit_code"] for r in ranks] == [EXIT_CODE, EXIT_CODE]
    assert [r["step"] for r in ranks] == [5, 5]  # the boundary right after the signal: nothing lost
    assert ranks[0]["reason"] is None and ranks[1]["reason"] == "received SIGTERM"  # only rank 1 was told
    path = Path(ranks[0]["path"])
    manifest = verify_checkpoint(path)  # every file re-hashed against the manifest
    assert manifest.world_size == 2 and manifest.global_step == 5
    assert launches["pre_last"] == path.resolve()  # last.ckpt, as the first launch left it
    # The async step-4 save that was in flight completed before the preemption save.
    assert "step=004.ckpt" in launches["pre_listing"]
    assert read_manifest(path.parent / "step=004.ckpt").global_step == 4
    assert "Preempted (signalled on another rank): saved step 5" in output


@pytest.mark.slow
def test_without_the_callback_a_sigterm_on_one_rank_stops_every_rank_instead_of_hanging(launches):
    # Before: Lightning's handler broadcast inside the signal handler and both ranks hung for good.
    _, _, output = launches["second"]
    ranks = _ranks(launches["out"], "no_callback")
    assert [r["exit_code"] for r in ranks] == [143, 143], [r.get("error") for r in ranks]
    # The strategy's callback agrees "auto": it stopped at the first agreement after the signal
    # (in step 3), within the interval the formula set; none of its agreements before saw a signal.
    stop = _first_stop(ranks, signalled_in_step=3)
    assert [r["step"] for r in ranks] == [stop.step] * 2 and [r["path"] for r in ranks] == [None, None]
    assert ranks[0]["check_every_n_steps"] == "auto"
    assert "this run has no PreemptionCheckpoint, so nothing was saved" in output
    assert "--trainer.callbacks+=lightning_disttrain.callbacks.PreemptionCheckpoint" in output


def _agreements(ranks: list[dict]) -> list[Agreement]:
    """The agreements of a run, checked identical on both ranks and counted at the comm seam: one
    comm.all_reduce from the callback per agreement, none between."""
    agreements = [[Agreement(*a) for a in r["agreements"]] for r in ranks]
    assert agreements[0] == agreements[1]  # same boundaries, steps, pace (all-reduced), intervals, flags
    assert [r["flag_collectives"] for r in ranks] == [len(agreements[0])] * 2
    return agreements[0]


def _replayed(ranks: list[dict], ended_at_boundary: int | None = None) -> list[Agreement]:
    """The "auto" schedule replayed with the formula: the first agreement at boundary 1, each next
    one ``interval`` boundaries after the previous, each interval ``agreement_interval`` of the pace
    all-reduced at that agreement (so ``interval * pace <= AGREEMENT_SHARE * grace`` unless 1); the
    last may be the end of training (``ended_at_boundary``) or the stop."""
    agreements, grace = _agreements(ranks), ranks[0]["grace_period_s"]
    assert agreements and agreements[0].boundary == 1
    previous = 1
    for a, b in zip(agreements, agreements[1:]):
        assert a.interval == agreement_interval(a.seconds_per_boundary, grace, previous)
        assert a.interval == 1 or a.interval * a.seconds_per_boundary <= AGREEMENT_SHARE * grace
        assert b.boundary - a.boundary == a.interval or b.boundary == ended_at_boundary, (a, b)
        previous = a.interval
    return agreements


def _first_stop(ranks: list[dict], signalled_in_step: int, ended_at_boundary: int | None = None) -> Agreement:
    """The agreement that stopped the run: the last one, the first to see the signal, at a step at or
    after the signalled one; every agreement before it ran before the signal (its flag was clear)."""
    agreements = _replayed(ranks, ended_at_boundary)
    *before, stop = agreements
    assert stop.stop and not any(a.stop for a in before), agreements
    assert stop.step >= signalled_in_step and all(a.step < signalled_in_step for a in before)
    return stop


@pytest.mark.slow
def test_auto_agrees_a_few_times_at_the_same_boundaries_on_every_rank_and_saves_at_the_next(launches):
    # Before: one world-wide all-reduce per optimizer step and per validation batch (4 per 2 steps here).
    rc, _, output = launches["second"]
    ranks = _ranks(launches["out"], "auto_steps")
    assert [r["exit_code"] for r in ranks] == [EXIT_CODE, EXIT_CODE], [r.get("error") for r in ranks]
    assert ranks[0]["check_every_n_steps"] == "auto" and ranks[0]["reason"] == "received SIGTERM"
    stop = _first_stop(ranks, signalled_in_step=20)
    # Every optimizer step and validation batch is a boundary; the callback's collectives are a
    # small fraction of them (the intervals double from 1 while the pace allows: 2, 4, 8, ...).
    assert stop.boundary >= 38 and 4 * ranks[0]["flag_collectives"] <= stop.boundary, _agreements(ranks)
    # The save: the agreed step on every rank, complete (manifest), the exit code on both.
    assert [r["step"] for r in ranks] == [stop.step] * 2 and ranks[0]["path"] == ranks[1]["path"]
    assert verify_checkpoint(Path(ranks[0]["path"])).global_step == stop.step
    assert [len(r["losses"]) for r in ranks] == [stop.step] * 2  # trained up to the save, no further


@pytest.mark.slow
def test_auto_a_signal_after_the_last_agreement_is_saved_at_the_end_of_training(launches):
    ranks = _ranks(launches["out"], "auto_end")
    assert [r["exit_code"] for r in ranks] == [EXIT_CODE, EXIT_CODE], [r.get("error") for r in ranks]
    # 7 steps, validation (2 batches) after every second: step 7 is boundary 13; the agreements at
    # boundaries 1, 3, 7 (intervals 2, 4, 8 while the pace allows), then 15 > 13, so the signal in
    # step 6 (boundary 10) is agreed on in on_train_end, at boundary 13, unless the pace made an
    # interval end earlier.
    stop = _first_stop(ranks, signalled_in_step=6, ended_at_boundary=13)
    assert [r["step"] for r in ranks] == [stop.step] * 2 and stop.step <= 7
    assert verify_checkpoint(Path(ranks[0]["path"])).global_step == stop.step


@pytest.mark.slow
def test_relaunch_with_last_resumes_bitwise_at_the_preemption_step(launches):
    _, _, output = launches["second"]
    ref, pre, resumed = (_ranks(launches["out"], run) for run in ("reference", "preempted", "resumed"))
    assert [r["start_step"] for r in resumed] == [5, 5], output[-4000:]
    for rank in range(2):
        assert len(ref[rank]["losses"]) == 8
        assert pre[rank]["losses"] == ref[rank]["losses"][:5]  # float.hex: bitwise
        assert resumed[rank]["losses"] == ref[rank]["losses"][5:]  # steps 6..8 after the resume
    assert "Resuming from" in output and "preempted-step=000005.ckpt" in output
    # The resumed run saved steps 6 and 8 beside it: the newest complete one is what a relaunch takes.
    assert PreemptionCheckpoint.resume_path(launches["out"] / "pre_ckpt").endswith("step=008.ckpt")


@pytest.mark.slow
def test_sigterm_during_validation_stops_it_at_the_next_batch_saves_and_auto_resumes_bitwise(launches):
    pre, resumed, ref = (_ranks(launches["out"], run) for run in ("val_preempted", "val_resumed", "reference"))
    assert [r["exit_code"] for r in pre] == [EXIT_CODE, EXIT_CODE], pre[0].get("error")
    assert pre[0]["reason"] == "received SIGTERM" and pre[1]["reason"] is None
    # Rank 0 was signalled as the validation after step 4 started its first batch: both ranks
    # agreed at the end of that batch and saved step 4. The validation's second batch and step 5
    # never ran (before: the whole validation, then step 5, then the save).
    for rank in range(2):
        assert pre[rank]["val_batches"] == [[2, 0], [2, 1], [4, 0]]
        assert [s for s, _ in pre[rank]["losses"]] == [1, 2, 3, 4]
    assert [r["step"] for r in pre] == [4, 4]
    path = Path(pre[0]["path"])
    assert path.name == "preempted-step=000004.ckpt" and verify_checkpoint(path).global_step == 4
    assert [r["start_step"] for r in resumed] == [4, 4]  # ckpt_path="auto" found preempted-step=000004
    for rank in range(2):
        assert len(ref[rank]["losses"]) == 8
        assert pre[rank]["losses"] == ref[rank]["losses"][:4]
        assert resumed[rank]["losses"] == ref[rank]["losses"][4:]  # bitwise, dropout included
        # The cut validation is not run again; the later ones are whole.
        assert resumed[rank]["val_batches"] == [[6, 0], [6, 1], [8, 0], [8, 1]]


@pytest.mark.slow
def test_a_failed_async_save_in_flight_at_preemption_is_logged_and_every_rank_still_saves_and_exits(launches):
    rc, _, output = launches["first"]
    ranks = _ranks(launches["out"], "inflight_failed")
    assert [r.get("exit_code") for r in ranks] == [EXIT_CODE, EXIT_CODE], ranks[0].get("error")
    assert [r["step"] for r in ranks] == [5, 5]
    assert "the checkpoint save in flight failed" in output and "step=004.ckpt" in output
    ckpt_dir = launches["out"] / "inflight_ckpt"
    path = Path(ranks[0]["path"])
    assert path == ckpt_dir / "preempted-step=000005.ckpt" and verify_checkpoint(path).global_step == 5
    assert (ckpt_dir / "last.ckpt").resolve() == path.resolve()
    assert not next(c for c in list_checkpoints(ckpt_dir) if c.path.name == "step=004.ckpt").complete


@pytest.mark.slow
def test_disk_full_on_one_rank_with_warn_keeps_training_and_the_previous_checkpoint(launches):
    ranks = _ranks(launches["out"], "disk_warn")
    assert all("error" not in r for r in ranks), ranks[0].get("error")
    assert [len(r["losses"]) for r in ranks] == [8, 8]  # trained to the end
    assert any("step=004.ckpt" in w and "No space left on device" in w for w in ranks[0]["warnings"])
    # The failed step-4 save (async) is found when the step-6 save starts; at step 7, with
    # save_top_k=1, step 2 is still there and complete and step 4's files are gone (an empty
    # directory stays, for a last.ckpt link that may point at it).
    at7 = next(p for p in ranks[0]["probes"] if p["step"] == 7)["dirs"]
    assert at7["step=002.ckpt"]["manifest"] and at7["step=004.ckpt"] == {"manifest": False, "metadata": False}, at7
    ckpt_dir = launches["out"] / "warn_ckpt"
    assert not (ckpt_dir / "step=004.ckpt").exists()  # retention removed it later
    # Once step 6 was complete, retention went on as configured: only the newest is kept.
    assert sorted(c.path.name for c in list_checkpoints(ckpt_dir) if c.path.name != "last.ckpt") == ["step=008.ckpt"]
    assert verify_checkpoint(ckpt_dir / "step=008.ckpt").global_step == 8


@pytest.mark.slow
def test_disk_full_on_one_rank_with_stop_ends_every_rank_and_auto_resumes_from_the_previous(launches):
    ranks = _ranks(launches["out"], "disk_stop")
    assert [r.get("error_type") for r in ranks] == ["CheckpointSaveError"] * 2  # together, no hang
    assert all("step=004.ckpt" in r["error"] and "No space left on device" in r["error"] for r in ranks)
    assert [len(r["losses"]) for r in ranks] == [4, 4]
    ckpt_dir = launches["out"] / "stop_ckpt"
    # The relaunch (auto_resume) took step 2, the newest complete one, and trained to the end
    # exactly as an uninterrupted run (the reference, same seed and data) did.
    auto, ref = _ranks(launches["out"], "auto_resume"), _ranks(launches["out"], "reference")
    assert [r["start_step"] for r in auto] == [2, 2]
    for rank in range(2):
        assert ranks[rank]["losses"] == ref[rank]["losses"][:4]
        assert auto[rank]["losses"] == ref[rank]["losses"][2:]
    assert verify_checkpoint(ckpt_dir / "step=008.ckpt").global_step == 8


@pytest.mark.slow
def test_preemption_to_object_storage_and_auto_resume_from_it(launches):
    pre, resumed, ref = (_ranks(launches["out"], run) for run in ("s3_preempted", "s3_resumed", "reference"))
    assert [r["exit_code"] for r in pre] == [EXIT_CODE, EXIT_CODE]
    assert [r["path"] for r in pre] == ["s3://ldt-preemption/run/checkpoints/preempted-step=000003.ckpt"] * 2
    assert [r["start_step"] for r in resumed] == [3, 3]  # "auto" listed the bucket and took the newest
    for rank in range(2):
        assert pre[rank]["losses"] == ref[rank]["losses"][:3]
        assert resumed[rank]["losses"] == ref[rank]["losses"][3:]


def test_auto_starts_from_scratch_then_resumes_under_lightnings_strategy(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    class StartStep(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.step = trainer.global_step

    def fit(max_steps: int) -> int:
        start = StartStep()
        callbacks = [PreemptionCheckpoint(), start, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)]
        _boring_trainer(tmp_path, callbacks, max_steps=max_steps).fit(BoringModel(), ckpt_path="auto")
        return start.step

    assert fit(2) == 0  # the first launch: nothing there yet, from scratch
    assert fit(3) == 2  # the relaunch, same command: from the newest save (Lightning's checkpoint files)


def test_resume_path_of_an_empty_directory_is_none(tmp_path):
    assert PreemptionCheckpoint.resume_path(tmp_path) is None  # a first launch starts from scratch


@pytest.mark.slow
def test_sigkill_of_one_rank_during_a_save(launches):
    rc, ended, output = launches["second"]
    assert rc != 0  # the surviving rank fails, it does not hang
    killed = json.loads((launches["out"] / "reference.rank1.json").read_text())
    assert ended - killed["killed_at"] < EXIT_BOUND_S, output[-4000:]
    print(f"the launch ended {ended - killed['killed_at']:.1f} s after rank 1's SIGKILL")
    ckpt_dir = launches["out"] / "kill_ckpt"
    by_name = {c.path.name: c for c in list_checkpoints(ckpt_dir)}
    assert not by_name["step=008.ckpt"].complete  # the partial one: no manifest
    with pytest.warns(UserWarning, match="step=008.ckpt"):
        assert find_latest_checkpoint(ckpt_dir) == (ckpt_dir / "step=006.ckpt").resolve()
    assert verify_checkpoint(ckpt_dir / "step=006.ckpt").global_step == 6
    # The survivor left last.ckpt at the newest complete checkpoint, so ckpt_path="last" resumes.
    assert (ckpt_dir / "last.ckpt").resolve() == (ckpt_dir / "step=006.ckpt").resolve()


# ---- one process ----------------------------------------------------------------------------


def _boring_trainer(tmp_path, callbacks, max_steps=4):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0, default_root_dir=str(tmp_path))


class _Steps(L.Callback):
    """Counts training batches; raises SIGTERM in this process when step ``signal_at`` starts."""

    def __init__(self, signal_at: int | None = None) -> None:
        self.batches, self.signal_at = 0, signal_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches += 1
        if self.signal_at is not None and trainer.global_step == self.signal_at - 1:
            signal.raise_signal(signal.SIGTERM)


def test_unwritable_checkpoint_dir_fails_at_start(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    steps = _Steps()
    trainer = _boring_trainer(tmp_path, [PreemptionCheckpoint(dirpath=blocker / "ckpts"), steps])
    with pytest.raises(ValueError, match="not writable.*a_file"):
        trainer.fit(BoringModel())
    assert steps.batches == 0


def test_sigterm_single_process_under_lightnings_strategy(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    leaked = []
    previous = signal.signal(signal.SIGTERM, lambda *a: leaked.append(a))  # catches a missed signal
    try:
        steps = _Steps(signal_at=2)
        trainer = _boring_trainer(tmp_path, [PreemptionCheckpoint(exit_code=7), steps])
        with pytest.raises(PreemptionExit) as info:
            trainer.fit(BoringModel())
        assert info.value.code == 7 and info.value.step == 2 and steps.batches == 2
        assert Path(info.value.path).exists()  # Lightning's own format here: one file
        assert not leaked and not trainer.received_sigterm  # neither Lightning's handler nor the default ran
        handler = signal.getsignal(signal.SIGTERM)
        assert not isinstance(getattr(handler, "__self__", None), PreemptionCheckpoint)  # restored
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_last_link_follows_the_newest_save_without_save_last(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=2, monitor="step", mode="max")
    _boring_trainer(tmp_path, [PreemptionCheckpoint(), mc], max_steps=7).fit(BoringModel())
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert (tmp_path / "ckpt" / "last.ckpt").resolve().name == "epoch=0-step=6.ckpt"


class _ValSignal(L.Callback):
    """Raises SIGTERM in this process at validation batch ``at_batch`` after step ``after``; counts
    the validation batches that end after it."""

    def __init__(self, after: int, at_batch: int = 0) -> None:
        self.after, self.at_batch, self.sent, self.after_signal = after, at_batch, False, 0

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking and trainer.global_step == self.after and batch_idx == self.at_batch:
            self.sent = True
            signal.raise_signal(signal.SIGTERM)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.after_signal += self.sent


def _signalled_in_validation(tmp_path, sanity_batches: int, **callback_kwargs):
    """BoringModel for up to 6 steps, validation every 2 (5 batches); SIGTERM in the validation after
    step 2, at its batch 1. Returns (PreemptionExit, the validation recorder, the step counter)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    previous = signal.getsignal(signal.SIGTERM)
    try:
        steps, val = _Steps(), _ValSignal(after=2, at_batch=1)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=sanity_batches, limit_val_batches=5,
                            val_check_interval=2, default_root_dir=str(tmp_path),
                            callbacks=[steps, val, PreemptionCheckpoint(exit_code=7, **callback_kwargs)])
        with pytest.raises(PreemptionExit) as info:
            trainer.fit(BoringModel())
        return info.value, val, steps
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_in_validation_stops_it_at_the_next_batch_under_lightnings_strategy(tmp_path):
    exit_, val, steps = _signalled_in_validation(tmp_path, sanity_batches=2)
    # The sanity check (2 batches) did not agree to anything; the validation after step 2 was
    # signalled at its batch 1 and stopped at that batch's end: 1 of its 5 batches ran after.
    assert exit_.code == 7 and exit_.step == 2 and Path(exit_.path).exists()
    assert val.after_signal == 1 and steps.batches == 2


def test_stop_validation_false_waits_for_the_next_step_boundary(tmp_path):
    exit_, val, steps = _signalled_in_validation(tmp_path, sanity_batches=0, stop_validation=False)
    assert exit_.step == 3 and val.after_signal == 4 and steps.batches == 3


def test_a_failure_in_the_exit_paths_wait_still_logs_links_last_and_exits_with_the_code(tmp_path, caplog):
    import logging

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class InFlightSaveLost(SingleDeviceStrategy):
        """A strategy whose save in flight cannot be waited for (its writer lost a peer)."""

        def wait_for_checkpoint(self):
            raise RuntimeError("waiting for the save in flight: Connection closed by peer")

    previous = signal.getsignal(signal.SIGTERM)
    ckpt = tmp_path / "ckpt"
    try:
        mc = ModelCheckpoint(dirpath=ckpt, every_n_train_steps=1, save_top_k=-1)
        trainer = L.Trainer(strategy=InFlightSaveLost(device="cpu"), max_steps=5, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=0, default_root_dir=str(tmp_path),
                            callbacks=[PreemptionCheckpoint(exit_code=7), _Steps(signal_at=3), mc])
        with caplog.at_level(logging.ERROR, logger="lightning_disttrain.callbacks.preemption"):
            with pytest.raises(PreemptionExit) as info:
                trainer.fit(BoringModel())
        assert info.value.code == 7 and info.value.path is None and info.value.step == 3
        assert not (ckpt / "preempted-step=000003.ckpt").exists()  # nothing half-done was started
        newest = ckpt / "epoch=0-step=2.ckpt"
        assert (ckpt / "last.ckpt").resolve() == newest.resolve()
        message = next(r.getMessage() for r in caplog.records if "could not be saved" in r.getMessage())
        assert "Connection closed by peer" in message and str(newest) in message and "code 7" in message
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_grace_period_defaults_fit_the_schedulers(monkeypatch):
    from lightning_disttrain.callbacks.preemption import WINDOW_ENV

    monkeypatch.delenv(WINDOW_ENV, raising=False)
    assert PreemptionCheckpoint().grace_period_s == 20.0  # inside Kubernetes' / GCP's 30 s, 10 s to spare
    assert PreemptionCheckpoint(grace_period_s=45).grace_period_s == 45.0  # explicit seconds as given
    assert PreemptionCheckpoint.grace_period_for(120) == 110.0  # SLURM --signal=USR1@120
    monkeypatch.setenv(WINDOW_ENV, "120")  # e.g. the pod's terminationGracePeriodSeconds, passed through
    assert PreemptionCheckpoint().grace_period_s == 110.0
    assert PreemptionCheckpoint(grace_period_s="auto").grace_period_s == 110.0
    monkeypatch.setenv(WINDOW_ENV, "15")
    assert PreemptionCheckpoint().grace_period_s == 5.0
    for bad, match in (("10", "10 s safety margin.*terminationGracePeriodSeconds"), ("half a minute", "number")):
        monkeypatch.setenv(WINDOW_ENV, bad)
        with pytest.raises(ValueError, match=f"{WINDOW_ENV}=.*{match}"):
            PreemptionCheckpoint()


def test_check_every_n_steps_defers_the_save_to_a_checking_step(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    previous = signal.getsignal(signal.SIGTERM)
    try:
        trainer = _boring_trainer(tmp_path, [PreemptionCheckpoint(check_every_n_steps=3), _Steps(signal_at=1)],
                                  max_steps=6)
        with pytest.raises(PreemptionExit) as info:
            trainer.fit(BoringModel())
        assert info.value.step == 3
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_agreement_interval_fits_a_share_of_the_grace_period_and_at_most_doubles():
    assert AGREEMENT_SHARE == 0.25 and MAX_INTERVAL == 1000
    # 20 s of grace: 5 s of boundaries between agreements.
    assert agreement_interval(0.1, 20.0, previous=1000) == 50  # 50 x 0.1 s = 5 s
    assert agreement_interval(0.1, 20.0, previous=8) == 16  # at most twice the previous interval
    assert agreement_interval(0.3, 20.0, previous=100) == 16  # floor(5 / 0.3): never over the budget
    assert agreement_interval(6.0, 20.0, previous=4) == 1  # a boundary longer than the budget: every one
    assert agreement_interval(0.001, 110.0, previous=800) == MAX_INTERVAL  # capped
    assert agreement_interval(0.0, 20.0, previous=3) == 6  # a clock that did not move: as fast as allowed
    assert agreement_interval(float("nan"), 20.0, previous=64) == 1  # unknown pace: agree at the next
    assert agreement_interval(float("inf"), 20.0, previous=64) == 1
    # The ramp from the first agreement at a steady 10 ms per boundary: 1, 2, 4, ... up to 500.
    intervals, n = [], 1
    for _ in range(10):
        n = agreement_interval(0.01, 20.0, previous=n)
        intervals.append(n)
    assert intervals == [2, 4, 8, 16, 32, 64, 128, 256, 500, 500]


def test_explicit_check_every_one_step_and_auto_are_accepted():
    assert PreemptionCheckpoint().check_every_n_steps == "auto"
    assert PreemptionCheckpoint(check_every_n_steps=1).check_every_n_steps == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(signals=("SIGTERM", "SIGBOGUS")), "unknown.*SIGBOGUS"),
    (dict(check_every_n_steps=0), "check_every_n_steps=0.*'auto'"),
    (dict(check_every_n_steps="often"), "check_every_n_steps='often'.*'auto'.*k >= 1"),
    (dict(check_every_n_steps=2.5), "check_every_n_steps=2.5.*whole number"),
    (dict(check_every_n_steps=True), "check_every_n_steps=True"),
    (dict(grace_period_s=0), "grace_period_s=0.*e.g. 20"),
    (dict(grace_period_s=float("nan")), "grace_period_s=nan"),
    (dict(grace_period_s="soon"), "grace_period_s='soon'.*'auto'"),
    (dict(exit_code=300), "exit_code=300"),
    (dict(poll_interval_s=-1), "poll_interval_s=-1"),
])
def test_bad_arguments_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PreemptionCheckpoint(**kwargs)


# ---- notices: a local metadata server (never the clouds') -----------------------------------


@pytest.fixture
def metadata_server():
    state = {"announced": False, "paths": []}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, code: int, body: str) -> None:
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body.encode())

        def do_PUT(self):
            state["paths"].append(("PUT", self.path, self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")))
            self._answer(200, "tok")

        def do_GET(self):
            state["paths"].append(("GET", self.path, self.headers.get("X-aws-ec2-metadata-token")
                                   or self.headers.get("Metadata-Flavor")))
            if self.path.endswith("/spot/instance-action"):
                self._answer(200, '{"action": "terminate"}') if state["announced"] else self._answer(404, "")
            elif self.path.endswith("/instance/preempted"):
                self._answer(200, "TRUE" if state["announced"] else "FALSE")
            else:
                self._answer(404, "")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()


def test_aws_and_gcp_notices(metadata_server):
    url, state = metadata_server
    aws, gcp = AWSSpotNotice(base_url=url), GCPPreemptionNotice(base_url=url)
    assert aws() is None and gcp() is None
    state["announced"] = True
    assert aws() == 'AWS spot instance-action: {"action": "terminate"}'
    assert gcp() == "GCP instance/preempted = TRUE"
    assert ("GET", "/latest/meta-data/spot/instance-action", "tok") in state["paths"]  # IMDSv2 token sent
    assert ("GET", "/computeMetadata/v1/instance/preempted", "Google") in state["paths"]


def test_notice_poller_sets_the_flag(metadata_server):
    url, state = metadata_server
    callback = PreemptionCheckpoint()
    poller = NoticePoller(GCPPreemptionNotice(base_url=url), 0.05, callback.request)
    poller.start()
    time.sleep(0.2)
    assert callback.reason is None
    state["announced"] = True
    poller.join(timeout=30)
    assert callback.reason == "GCP instance/preempted = TRUE"


def test_last_ckpt_is_never_made_beside_a_links_target_outside_the_run(tmp_path):
    # Issue 30: a checkpoint directory holding `init.ckpt -> ../user_data` made the preemption path
    # create `last.ckpt` in the parent, outside the run (beside the link's target).
    from lightning_disttrain.callbacks.preemption import _point_last_at

    run, outside = tmp_path / "ckpts", tmp_path / "user_data"
    run.mkdir()
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    (run / "init.ckpt").symlink_to("../user_data")
    assert not _point_last_at(run / "init.ckpt", run)
    assert not (tmp_path / "last.ckpt").exists() and not (run / "last.ckpt").exists()
    (run / "step=2.ckpt").mkdir()
    assert _point_last_at(run / "step=2.ckpt", run) and os.readlink(run / "last.ckpt") == "step=2.ckpt"
    assert (outside / "keep.txt").read_text() == "mine"
