"""Preemption scenarios on 2 gloo ranks, run by tests/callbacks/test_preemption.py.

    python preemption_run.py first  DATA OUT   # val_preempted: rank 0 SIGTERMed during validation;
                                               # disk_warn / disk_stop: rank 1's disk full during the
                                               # step-4 save (on_save_error "warn" / "stop"), then
                                               # inflight_failed: the same async step-4 save fails and
                                               # rank 0 is SIGTERMed during step 5 (the preemption's
                                               # wait for the save in flight raises), then
                                               # auto_resume: ckpt_path="auto" after the stop;
                                               # s3_preempted / s3_resumed: checkpoints in a bucket of
                                               # the local S3 server at $LDT_TEST_S3_ENDPOINT, rank 0
                                               # SIGTERMed during step 3, resumed with "auto"; last, a
                                               # run whose rank 1 alone is SIGTERMed during step 5
                                               # (these agree every step: check_every_n_steps=1)
    python preemption_run.py second DATA OUT   # that run resumed with ckpt_path="last", val_preempted
                                               # with ckpt_path="auto"; no_callback: a run without a
                                               # PreemptionCheckpoint whose rank 1 is SIGTERMed in step
                                               # 3; auto_steps / auto_end: check_every_n_steps="auto"
                                               # (the default), 40 steps with rank 0 SIGTERMed in step
                                               # 20 / 7 steps with rank 1 SIGTERMed in step 6 (after
                                               # the last agreement in a step); then the same run uninterrupted
                                               # from scratch (the reference losses), whose rank 1 is
                                               # SIGKILLed while writing its step-8 checkpoint

Every run validates (2 batches) after every second step.

The project's own pieces throughout (NDParallelStrategy with async DCP saves, GPTModule with
dropout, TokenDataModule; tests/checkpoint/scripts/harness.py). Each rank writes
``OUT/<run>.rank<R>.json``. The signals are real: ``os.kill`` of this process. Every
``comm.all_reduce`` that the preemption callback issues is counted at the comm seam (``flag_collectives``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch

torch.set_num_threads(1)
warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE.parent / "checkpoint" / "scripts")]
from disk_full import fill_disk  # noqa: E402
from harness import DATA_SEED, MICRO_BATCH, SEQ_LEN, Recorder, build_module  # noqa: E402
from s3_server import ENV as S3_ENV  # noqa: E402
from s3_server import use_endpoint  # noqa: E402

from lightning_disttrain import comm  # noqa: E402
from lightning_disttrain.callbacks import PreemptionCheckpoint, PreemptionExit  # noqa: E402
from lightning_disttrain.checkpoint.dcp_io import CheckpointSaveError  # noqa: E402
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402

STEPS = 8
S3_BUCKET = "ldt-preemption"  # created by the test, on the local server
SIGNAL_AT = 5  # rank 1 is signalled during this (1-based) step
EXIT_CODE = 42
AUTO_STEPS, AUTO_SIGNAL_AT = 40, 20  # auto_steps: rank 0 is signalled during step 20 of 40
END_STEPS, END_SIGNAL_AT = 7, 6  # auto_end: rank 1 is signalled during step 6 of 7

_FLAG_COLLECTIVES: list[str] = []  # this run's comm.all_reduce calls from callbacks/preemption.py
_all_reduce = comm.all_reduce


def _counted_all_reduce(*args, **kwargs):
    """comm.all_reduce, counting the calls made from the preemption callback's module."""
    if Path(sys._getframe(1).f_code.co_filename).match("callbacks/preemption.py"):
        _FLAG_COLLECTIVES.append(sys._getframe(1).f_code.co_name)
    return _all_reduce(*args, **kwargs)


comm.all_reduce = _counted_all_reduce  # the callback looks it up on the module at each call


class SignalSelf(L.Callback):
    """Sends ``signum`` to this process on ``rank`` when step ``at`` starts (mid-step: before its forward)."""

    def __init__(self, rank: int, at: int, signum: int) -> None:
        self.rank, self.at, self.signum = rank, at, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.at - 1:
            os.kill(os.getpid(), self.signum)


class ValidationBatches(L.Callback):
    """Records ``[global_step, batch_idx]`` of every validation batch that ends during fit."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self.batches.append([trainer.global_step, batch_idx])


class SignalInValidation(L.Callback):
    """Sends ``signum`` to this process on ``rank`` in the validation that follows step ``after``."""

    def __init__(self, rank: int, after: int, signum: int) -> None:
        self.rank, self.after, self.signum = rank, after, signum

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.after and batch_idx == 0:
            os.kill(os.getpid(), self.signum)


def _data(data: str):  # harness.build_data with a validation set: every run validates every 2 steps
    from lightning_disttrain.data import TokenDataModule

    return TokenDataModule(source=data, tokenizer="bytes", seq_len=SEQ_LEN, batch_size=MICRO_BATCH,
                           val_batches=2, val_source=data, seed=DATA_SEED)


def _fit(out: Path, run: str, data: str, ckpt_dir: Path, callbacks: list, ckpt_path=None, *, async_save=True,
         on_save_error="stop", save_top_k=-1, steps=STEPS, save_every=2) -> dict:
    L.seed_everything(1234, workers=True)
    rec, val = Recorder(probe_dir=str(ckpt_dir)), ValidationBatches()
    mc = ModelCheckpoint(dirpath=ckpt_dir, filename="{step:03d}", every_n_train_steps=save_every, save_top_k=save_top_k)
    trainer = L.Trainer(strategy=NDParallelStrategy(async_save=async_save, on_save_error=on_save_error), devices=2,
                        accelerator="cpu", max_steps=steps, callbacks=[rec, val, *callbacks, mc], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        num_sanity_val_steps=0, val_check_interval=2, default_root_dir=str(out))
    global _RECORDER
    _RECORDER, result = rec, {}
    _FLAG_COLLECTIVES.clear()
    start = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(build_module(total_steps=steps), datamodule=_data(data), ckpt_path=ckpt_path)
        result["warnings"] = [str(w.message)[:300] for w in caught if "failed" in str(w.message)]
    except PreemptionExit as exc:
        result.update(exit_code=exc.code, path=exc.path, step=exc.step)
        raise
    except BaseException as exc:
        result.update(error=f"{type(exc).__name__}: {exc}"[:600], error_type=type(exc).__name__,
                      error_after_s=time.monotonic() - start)
        raise
    finally:
        _write(out, run, trainer.global_rank, result | _recorded(rec, trainer) | {"val_batches": val.batches})
    return result


_RECORDER: Recorder | None = None


def _recorded(rec: Recorder, trainer) -> dict:
    # The run's PreemptionCheckpoint: its own, or the one the strategy installs without one.
    pre = next((c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)
    return {"losses": rec.losses, "start_step": rec.start_step, "probes": rec.probes,
            "agreement_seconds": pre.agreement_seconds if pre else [], "reason": pre.reason if pre else None,
            "agreements": [list(a) for a in getattr(pre, "agreements", [])],
            "check_every_n_steps": pre.check_every_n_steps if pre else None,
            "grace_period_s": pre.grace_period_s if pre else None, "flag_collectives": len(_FLAG_COLLECTIVES)}


def _write(out: Path, run: str, rank: int, data: dict) -> None:
    path = out / f"{run}.rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(data))
    path.with_suffix(".tmp").replace(path)


def first(data: str, out: Path) -> None:
    # SIGTERM on rank 0 only, in the validation after step 4 (at its first batch's start): the ranks
    # agree at the end of that batch, save step 4 and exit; the validation's second batch never runs.
    try:
        _fit(out, "val_preempted", data, out / "val_ckpt",
             [PreemptionCheckpoint(exit_code=EXIT_CODE, check_every_n_steps=1),
              SignalInValidation(rank=0, after=4, signum=signal.SIGTERM)])
    except PreemptionExit:
        pass  # both ranks; the next runs use the same processes
    # Rank 1's disk fills up during the step-4 checkpoint; save_top_k=1 would then delete step 2.
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    undo = fill_disk("step=004.ckpt/__", budget=4096) if rank == 1 else (lambda: None)
    try:
        _fit(out, "disk_warn", data, out / "warn_ckpt", [PreemptionCheckpoint()], on_save_error="warn",
             save_top_k=1)
        try:
            _fit(out, "disk_stop", data, out / "stop_ckpt", [PreemptionCheckpoint()], async_save=False)
        except CheckpointSaveError:
            pass  # raised on both ranks together: recorded in disk_stop.rank*.json
        # The async step-4 save fails on rank 1 (its disk is still full for it) and nothing waits for
        # it before rank 0's SIGTERM in step 5: the preemption's wait for the save in flight raises.
        try:
            _fit(out, "inflight_failed", data, out / "inflight_ckpt",
                 [PreemptionCheckpoint(exit_code=EXIT_CODE, check_every_n_steps=1),
                  SignalSelf(rank=0, at=5, signum=signal.SIGTERM)])
        except (PreemptionExit, CheckpointSaveError):
            pass  # recorded in inflight_failed.rank*.json
    finally:
        undo()
    # The relaunch after the stop, with the same command a first launch uses.
    _fit(out, "auto_resume", data, out / "stop_ckpt", [PreemptionCheckpoint()], ckpt_path="auto")
    # Checkpoints in object storage: preempted, then resumed from the bucket.
    use_endpoint(os.environ[S3_ENV])
    url = f"s3://{S3_BUCKET}/run/checkpoints"
    try:
        _fit(out, "s3_preempted", data, url, [PreemptionCheckpoint(exit_code=EXIT_CODE, check_every_n_steps=1),
                                              SignalSelf(rank=0, at=3, signum=signal.SIGTERM)])
    except PreemptionExit:
        pass
    _fit(out, "s3_resumed", data, url, [PreemptionCheckpoint()], ckpt_path="auto")
    # SIGTERM on rank 1 only, during step 5; every rank must save step 5 and exit with EXIT_CODE.
    _fit(out, "preempted", data, out / "pre_ckpt", [PreemptionCheckpoint(exit_code=EXIT_CODE, check_every_n_steps=1),
                                                    SignalSelf(rank=1, at=SIGNAL_AT, signum=signal.SIGTERM)])


def second(data: str, out: Path) -> None:
    # No ModelCheckpoint(save_last=...): "last" is the link the preemption save left.
    _fit(out, "resumed", data, out / "pre_ckpt", [PreemptionCheckpoint()], ckpt_path="last")
    _fit(out, "val_resumed", data, out / "val_ckpt", [PreemptionCheckpoint()], ckpt_path="auto")
    # No PreemptionCheckpoint at all: SIGTERM on rank 1 during step 3 must still stop every rank at the
    # step boundary (the strategy's save-nothing PreemptionCheckpoint), not hang in Lightning's handler.
    try:
        _fit(out, "no_callback", data, out / "nocb_ckpt", [SignalSelf(rank=1, at=3, signum=signal.SIGTERM)])
    except PreemptionExit:
        pass
    # check_every_n_steps="auto" (the default): a few agreements over many steps; a signal is agreed
    # on at the next one, mid-run (auto_steps) or at the end of training (auto_end), and saved.
    for run, steps, rank, at in (("auto_steps", AUTO_STEPS, 0, AUTO_SIGNAL_AT),
                                 ("auto_end", END_STEPS, 1, END_SIGNAL_AT)):
        try:
            _fit(out, run, data, out / f"{run}_ckpt", [PreemptionCheckpoint(exit_code=EXIT_CODE),
                 SignalSelf(rank=rank, at=at, signum=signal.SIGTERM)], steps=steps, save_every=10)
        except PreemptionExit:
            pass
    _kill_rank1_during_write_of(out, "step=008")
    _fit(out, "reference", data, out / "kill_ckpt", [PreemptionCheckpoint()])


def _kill_rank1_during_write_of(out: Path, name: str) -> None:
    # SIGKILL from inside DCP's file write of that checkpoint (an async save: a background thread
    # writes it), so the kill lands mid-save by construction. Rank 1 first records its losses.
    from torch.distributed.checkpoint import filesystem

    original = filesystem._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if name in str(self.path) and int(os.environ.get("LOCAL_RANK", "0")) == 1:
            _write(out, "reference", 1, {"losses": list(_RECORDER.losses), "killed_at": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, plan, planner)

    filesystem._FileSystemWriter.write_data = write_data


if __name__ == "__main__":
    command, data_dir, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out_dir.mkdir(parents=True, exist_ok=True)
    {"first": first, "second": second}[command](data_dir, out_dir)
