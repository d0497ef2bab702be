"""Multi-process checkpoint scenarios through L.Trainer, run by tests/checkpoint/test_resume.py.

Lightning's subprocess launcher re-runs this script once per rank. Every rank writes
``OUT/rank{r}.json``; the test reads them.

    python ckpt_run.py train  --data SHARDS --out OUT --devices 2 --steps 12 --ckpt-dir DIR [--async-save] ...
    python ckpt_run.py resume --data SHARDS --out OUT --devices 2 --jobs JOBS.json

``train --then RUNS.json`` trains again in the same processes after the first run, once per entry
(a list of further ``train`` arguments, each with its own ``--out``): several independent trainings
pay Python's and Lightning's start-up once. ``--slow-write`` slows every DCP write from then on, so
a run that uses it goes last.

``resume`` runs several fits in one process (one per job in JOBS.json: resume from a path or
"last", or expect a failure); each records its losses, sample ids or error message.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

torch.set_num_threads(1)  # 2 busy cores; and one thread keeps CPU kernels bitwise reproducible
warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from harness import (  # noqa: E402
    build_data,
    Recorder,
    build_module,
    build_strategy,
    strategy_kind,
)


def _trainer(args, strategy, steps: int, callbacks: list) -> L.Trainer:
    return L.Trainer(strategy=strategy, devices=args.devices, accelerator="cpu", max_steps=steps,
                     callbacks=callbacks, logger=False, enable_progress_bar=False,
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                     enable_model_summary=False, use_distributed_sampler=False,
                     num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=args.out)


def _checkpointing(directory: str, every: int, top_k: int, save_last: str = "link") -> ModelCheckpoint:
    # monitor="step", mode="max": Lightning's way of "keep the last K" (save_top_k=K).
    # save_last=True writes "last.ckpt" as a second full save right after the top-k one.
    return ModelCheckpoint(dirpath=directory, filename="{step:03d}", every_n_train_steps=every,
                           save_top_k=top_k, monitor="step", mode="max",
                           save_last=True if save_last == "true" else save_last)


def cmd_train(args) -> tuple[int, dict]:
    if args.slow_write:
        _slow_down_writes(args.slow_write)
    L.seed_everything(1234, workers=True)
    strategy = build_strategy(async_save=args.async_save, tp=args.tp)
    durations = _time_saves(strategy)
    out = Path(args.out)
    rec = Recorder(probe_dir=args.ckpt_dir if args.async_save else None,
                   logits_to=out / "logits.pt" if args.logits else None,
                   full_state_to=out / "final_state.pt" if args.dump_state else None)
    callbacks = [rec]
    if args.every:
        callbacks.append(_checkpointing(args.ckpt_dir, args.every, args.top_k, args.save_last))
    trainer = _trainer(args, strategy, args.steps, callbacks)
    trainer.fit(build_module(total_steps=args.total_steps), datamodule=build_data(args.data))
    result = {"losses": rec.losses, "samples": rec.samples, "probes": rec.probes, "save_seconds": durations,
              "strategy": strategy_kind(strategy), "world_size": trainer.world_size}
    if args.jobs:  # resume jobs in the same processes, e.g. onto another layout of the same ranks
        result["jobs"] = cmd_resume(args)[1]
    return trainer.global_rank, result


def cmd_resume(args) -> tuple[int, dict]:
    jobs = json.loads(Path(args.jobs).read_text())
    results = {}
    for job in jobs:
        name = job["name"]
        L.seed_everything(99, workers=True)  # a different seed: everything must come from the checkpoint
        strategy = build_strategy(async_save=False, tp=job.get("tp", 1), pp=job.get("pp", 1), ep=job.get("ep", 1))
        out = Path(args.out)
        rec = Recorder(dump_state_to=out / f"{name}_restored.pt" if job.get("dump_state") else None,
                       full_state_to=out / f"{name}_final.pt" if job.get("dump_final") else None,
                       init_from=job.get("init_from"),
                       start_logits_to=out / f"{name}_start_logits.pt" if job.get("init_from") else None)
        callbacks = [rec]
        if job.get("last_dir"):  # the same callback as the run that saved (its state is restored)
            callbacks.append(_checkpointing(job["last_dir"], 2, 2))
        if job.get("save_dir"):  # a job that trains from scratch and keeps every checkpoint
            callbacks.append(_checkpointing(job["save_dir"], job["save_every"], -1))
        trainer = _trainer(args, strategy, job["steps"], callbacks)
        module = build_module(total_steps=job.get("total_steps", 12), untied=job.get("untied", False),
                              moe=job.get("moe", False))
        data = build_data(args.data)
        with warnings.catch_warnings(record=True) as caught, _recording_info() as infos:
            warnings.simplefilter("always")
            try:
                trainer.fit(module, datamodule=data, ckpt_path=job["ckpt_path"])
                outcome = {"ok": True}
            except Exception as err:  # the bad-input jobs expect this
                outcome = {"ok": False, "error": f"{type(err).__name__}: {err}",
                           "traceback": traceback.format_exc()[-3000:]}
        outcome.update(losses=rec.losses, samples=rec.samples, start_step=rec.start_step,
                       warnings=[str(w.message) for w in caught if "checkpoint" in str(w.message).lower()],
                       infos=[m for m in infos if "checkpoint" in m.lower()], ckpt_path_after=str(trainer.ckpt_path),
                       strategy=strategy_kind(strategy), world_size=trainer.world_size)
        results[name] = outcome
        rank = trainer.global_rank
    return rank, results


@contextmanager
def _recording_info():
    # Lightning's info lines (rank_zero_info: rank 0 only), e.g. which checkpoint it restored.
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _time_saves(strategy) -> list[float]:
    # How long each save blocks the training loop (the async claim).
    durations: list[float] = []
    original = strategy.save_checkpoint

    def timed(*a, **kw):
        t0 = time.perf_counter()
        original(*a, **kw)
        durations.append(time.perf_counter() - t0)

    strategy.save_checkpoint = timed
    return durations


def _slow_down_writes(seconds: float) -> None:
    # Make the (real) DCP file write take a known minimum time, so the test can see that the
    # training loop runs on while the files are written and that the manifest waits for them.
    from torch.distributed.checkpoint import filesystem

    original = filesystem._FileSystemWriter.write_data

    def slow(self, plan, planner):
        time.sleep(seconds)
        return original(self, plan, planner)

    filesystem._FileSystemWriter.write_data = slow


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=("train", "resume"))
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--total-steps", type=int, default=12, help="length of the LR schedule")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--save-last", choices=("link", "true"), default="link")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (train)")
    p.add_argument("--slow-write", type=float, default=0.0)
    p.add_argument("--logits", action="store_true", help="save logits on a fixed input after training")
    p.add_argument("--dump-state", action="store_true", help="save the full state after training")
    p.add_argument("--jobs", default=None, help="resume jobs (resume; with train: run after training)")
    p.add_argument("--then", default=None, help="train: JSON list of argument lists, trained after this run")
    p.add_argument("--data", required=True, help="directory of token shards (harness.write_indexed_shard)")
    return p


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    runs = [args]
    if args.then:
        if args.command != "train":
            parser.error("--then goes with train")
        for more in json.loads(Path(args.then).read_text()):
            runs.append(parser.parse_args(["train", *more, "--data", args.data, "--devices", str(args.devices)]))
    for run in runs:
        if run.slow_write and run is not runs[-1]:
            parser.error("--slow-write slows every later save too: give it to the last run only")
        Path(run.out).mkdir(parents=True, exist_ok=True)
        rank, result = cmd_train(run) if run.command == "train" else cmd_resume(run)
        (Path(run.out) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
