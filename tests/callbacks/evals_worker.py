"""CheckpointEval runs on 1 and 2 ranks: ``fit_run(RUN, DEVICES)`` (2 ranks: in the suite's shared
launch, ``tests/multi_worker.py``; 1 rank: in the test process).

- ``fsdp2`` / ``ddp`` / ``tp`` (tp=2, sequence and loss parallel) / ``pp`` (pp=2, 1F1B) / ``single``:
  lr 0, so every layout evaluates the same weights; checkpoints every 2 steps (fsdp2: async
  saves), held-out loss and three task formats.
- ``gate``: fsdp2, trained normally; the weights are zeroed at step 8, just before that save.
  Rules: held-out loss at most 5% above its best -> fail_checkpoint, and -> stop.
- ``gate_resume``: resumes ``gate``'s run to step 8 with ``ckpt_path="last"`` (discovery must skip the failed
  step-8 checkpoint and take step 6), zeroes the weights at step 8 again and evaluates that
  checkpoint in a separate process (``mode="subprocess"``): only the restored gate state knows a
  best to compare with.
- ``cli_yaml``: ``configs/evals.yaml`` through LightningCLI (steps, paths and items made small), CSVLogger.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_disttrain import GPTModule, TokenDataModule
from lightning_disttrain.callbacks import CheckpointEval
from lightning_disttrain.checkpoint import find_latest_checkpoint, verify_checkpoint
from lightning_disttrain.strategies import FSDP2Strategy, NDParallelStrategy

REPO = Path(__file__).resolve().parents[2]
EVALS = REPO.parent / "shared" / "evals"
TASKS = ["heldout", "piqa", "winogrande", "lambada_openai"]
GATE = [{"metric": "eval/heldout/loss", "max_increase_pct": 5, "action": "fail_checkpoint"},
        {"metric": "eval/heldout/loss", "max_increase_pct": 5, "action": "stop"}]


BASE: Path | None = None
"""Where runs write; set by the test for in-process runs. Launched ranks use multi_worker.py's output
folder, the same on every rank (Lightning relaunches it with the same argv)."""


def out_dir(run: str) -> Path:
    return (BASE or Path(sys.argv[1])) / f"evals_{run}"


class ZeroWeightsAt(L.Callback):
    """Breaks the model: every parameter zeroed after optimizer step ``step`` (before that step's save)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.zero_()


class GateAtStart(L.Callback):
    def __init__(self, cb: CheckpointEval):
        self.cb, self.state = cb, None

    def on_train_start(self, trainer, pl_module):
        self.state = self.cb.gate.state_dict()


def _data() -> TokenDataModule:
    return TokenDataModule(source="embedded", tokenizer="bytes", seq_len=32, batch_size=4, val_batches=2)


def _module(lr: float) -> GPTModule:
    # untied: the pp=2 run's first and last stage cannot share the embedding
    return GPTModule("tiny", model_overrides={"n_layer": 2, "n_embd": 64, "n_head": 2, "tie_embeddings": False},
                     lr=lr, warmup_steps=0)


def _trainer(devices: int, strategy, dirpath: Path, steps: int, callbacks: list) -> L.Trainer:
    ckpt = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last="link",
                           enable_version_counter=False)
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     callbacks=[*callbacks, ckpt])


def _evals_files(dirpath: Path) -> dict:
    found = {}
    for d in sorted(dirpath.glob("epoch=*")):
        evals = d / "evals.json" if d.is_dir() else d.with_name(d.name + ".evals.json")
        if evals.is_file():
            record = json.loads(evals.read_text())
            listed = d.is_dir() and "evals.json" in verify_checkpoint(d).files
            found[d.name] = {"metrics": record["metrics"], "gate": record["gate"], "listed": listed}
    return found


def equal_weights_run(run: str, devices: int) -> dict:
    L.seed_everything(0)
    dirpath = out_dir(run)
    strategy = {"fsdp2": FSDP2Strategy(async_save=True), "ddp": "ddp", "single": "auto",
                "tp": NDParallelStrategy(tp=2), "pp": NDParallelStrategy(pp=2, pp_microbatches=2)}[run]
    cb = CheckpointEval(tasks=TASKS, data_dir=str(EVALS), limit=6, heldout_windows=4, batch_size=4, print_table=False)
    trainer = _trainer(devices, strategy, dirpath, 4, [cb])
    trainer.fit(_module(lr=0.0), datamodule=_data())
    if trainer.is_global_zero:  # the held-out windows, for the eval command to score the same ones
        torch.save(cb.suite.windows, dirpath / "heldout.pt")
    return {"history": cb.history, "evals": _evals_files(dirpath) if trainer.is_global_zero else {},
            "dir": str(dirpath)}


def gate_run(run: str, devices: int) -> dict:
    L.seed_everything(0)
    dirpath = out_dir("gate")
    resume = run == "gate_resume"
    cb = CheckpointEval(tasks=["heldout", "piqa"], data_dir=str(EVALS), limit=4, heldout_windows=4, batch_size=4,
                        gate=GATE, print_table=False, mode="subprocess" if resume else "inline")
    at_start = GateAtStart(cb)
    trainer = _trainer(devices, "fsdp2", dirpath, 8 if resume else 10, [cb, at_start, ZeroWeightsAt(8)])
    trainer.fit(_module(lr=3e-3), datamodule=_data(), ckpt_path="last" if resume else None)
    out = {"history": cb.history, "global_step": trainer.global_step, "gate_at_start": at_start.state,
           "gate_at_end": cb.gate.state_dict()}
    if trainer.is_global_zero:
        out["evals"] = _evals_files(dirpath)
        with __import__("warnings").catch_warnings():
            __import__("warnings").simplefilter("ignore")
            out["latest"] = find_latest_checkpoint(dirpath).name
    return out


def cli_yaml_run(run: str, devices: int) -> dict:
    from lightning_disttrain.cli import DistTrainCLI

    root = out_dir(run)
    config = yaml.safe_load((REPO / "configs" / "evals.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=4, val_check_interval=2, default_root_dir=str(root), enable_progress_bar=False)
    trainer["logger"]["init_args"]["save_dir"] = str(root)
    # the config's PreemptionCheckpoint stays in (a SIGTERM-safe run, as shipped)
    (checkpoint,) = [c for c in trainer["callbacks"] if c["class_path"].endswith(".ModelCheckpoint")]
    (evals,) = [c for c in trainer["callbacks"] if c["class_path"].endswith(".CheckpointEval")]
    checkpoint["init_args"].update(dirpath=str(root / "checkpoints"), every_n_train_steps=2)
    evals["init_args"].update(data_dir=str(EVALS), limit=4, heldout_windows=4, print_table=False)
    config["model"]["init_args"]["model_overrides"] = {"n_layer": 2}
    config["data"]["init_args"].update(seq_len=64, val_batches=2)
    path = root / "evals.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    cli = DistTrainCLI(args=["fit", "--config", str(path)])
    if not cli.trainer.is_global_zero:
        return {}
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return {"rows": [{k: v for k, v in r.items() if v != ""} for r in rows],
            "evals": _evals_files(root / "checkpoints")}


def fit_run(run: str, devices: int) -> dict:
    if run in ("fsdp2", "ddp", "single", "tp", "pp"):
        return equal_weights_run(run, devices)
    if run in ("gate", "gate_resume"):
        return gate_run(run, devices)
    return cli_yaml_run(run, devices)
