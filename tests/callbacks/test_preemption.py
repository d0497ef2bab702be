"""PreemptionCheckpoint: signals only set a flag, all ranks agree and save, exit, resume bitwise.

Two launches of 2 gloo ranks (tests/callbacks/preemption_run.py) carry the multi-process cases:
- "first": a run whose rank 0 gets SIGTERM during validation; two runs whose rank 1's disk fills
  up during the step-4 save (on_save_error="warn" and "stop"), the stopped one relaunched with
  ckpt_path="auto"; a run checkpointing to s3:// on a local S3 server (moto, 127.0.0.1) whose
  rank 0 gets SIGTERM during step 3, relaunched with "auto"; a run whose rank 1 alone gets SIGTERM
  during step 5;
- "second": that run resumed with ckpt_path="last" (no save_last); the validation run resumed with
  ckpt_path="auto"; then the same run from scratch, uninterrupted
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
from dist_utils import kill_tree, popen

from lightning_disttrain.callbacks import (
    AWSSpotNotice,
    GCPPreemptionNotice,
    PreemptionCheckpoint,
    PreemptionExit,
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


def _launch(command: str, data: Path, out: Path, timeout: float = 400) -> tuple[int, float, str]:
    proc = popen([sys.executable, str(SCRIPT), command, str(data), str(out)])
    try:
        output, _ = proc.communicate(timeout=timeout)
    except Exception:
        kill_tree(proc)
        raise
    return proc.returncode, time.time(), output


def _ranks(out: Path, run: str) -> list[dict]:
    return [json.loads((out / f"{run}.rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("preemption")
    sys.path.insert(0, str(HERE.parent / "checkpoint" / "scripts"))
    from harness import write_indexed_shard

    write_indexed_shard(root / "data")
    out = root / "out"
    from s3_server import ENV, local_s3

    with local_s3("ldt-preemption") as endpoint:  # the local S3 server the first launch saves to
        os.environ[ENV] = endpoint
        try:
            first = _launch("first", root / "data", out)
        finally:
            del os.environ[ENV]
    # What the first launch left, before the second one adds to the directory.
    pre_listing = sorted(p.name for p in (out / "pre_ckpt").iterdir())
    pre_last = (out / "pre_ckpt" / "last.ckpt").resolve()
    second = _launch("second", root / "data", out)
    return {"out": out, "first": first, "second": second, "pre_listing": pre_listing, "pre_last": pre_last}


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
def test_sigterm_during_validation_saves_at_the_next_step_boundary_and_auto_resumes_bitwise(launches):
    pre, resumed, ref = (_ranks(launches["out"], run) for run in ("val_preempted", "val_resumed", "reference"))
    assert [r["exit_code"] for r in pre] == [EXIT_CODE, EXIT_CODE]
    assert [r["step"] for r in pre] == [5, 5]  # validation after step 4 finished, then step 5, then the save
    assert pre[0]["reason"] == "received SIGTERM" and pre[1]["reason"] is None
    assert [r["start_step"] for r in resumed] == [5, 5]  # ckpt_path="auto" found preempted-step=000005
    for rank in range(2):
        assert len(ref[rank]["losses"]) == 8
        assert pre[rank]["losses"] == ref[rank]["losses"][:5]
        assert resumed[rank]["losses"] == ref[rank]["losses"][5:]


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


@pytest.mark.parametrize("kwargs, match", [
    (dict(signals=("SIGTERM", "SIGBOGUS")), "unknown.*SIGBOGUS"),
    (dict(check_every_n_steps=0), "check_every_n_steps=0"),
    (dict(grace_period_s=0), "grace_period_s=0"),
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
