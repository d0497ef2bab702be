"""ProfilerCallback under ``strategy="fsdp2"`` on 2 ranks, run by ``tests/multi_worker.py`` in the
suite's shared 2-rank launch: ``fit_run(RUN, DEVICES)`` returns each rank's breakdown and what its
Chrome trace holds.

Runs: ``fsdp2`` (random tokens, steps 2-3 profiled), ``slow_data`` (every sample takes 50 ms to
load, steps 1-2 profiled), ``config`` (``configs/profile.yaml`` through the CLI, shortened).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import yaml
from torch.utils.data import DataLoader, Dataset

from lightning_disttrain.callbacks import ProfilerCallback
from lightning_disttrain.module import GPTModule

REPO = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 257, 64
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": SEQ}


class Tokens(Dataset):
    def __init__(self, n: int, sleep: float = 0.0):
        self.tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(0))
        self.sleep = sleep

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        if self.sleep:
            time.sleep(self.sleep)  # a loader that decodes or downloads in the training process
        return self.tokens[i, :-1], self.tokens[i, 1:]


def _shared_dir(run: str) -> Path:
    path = Path(os.environ["LDT_LAUNCH_OUT"]) / f"profiler_{run}"  # the launch's directory (tests/multi_worker.py)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _trace_facts(path: Path) -> dict:
    events = json.loads(path.read_text())["traceEvents"]
    names = Counter(e.get("name") for e in events if e.get("ph") == "X")
    return {"names": {n: c for n, c in names.items() if n and (n.startswith(("gloo:", "c10d::", "ldt_profiler::")))}}


def _fit(run: str, devices: int, sleep: float, start: int) -> dict:
    torch.manual_seed(0)
    out = _shared_dir(run)
    cb = ProfilerCallback(start_step=start, num_steps=2, dirpath=str(out))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="fsdp2", max_steps=start + 2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb])
    module = GPTModule("tiny", vocab_size=VOCAB, model_overrides=MODEL, lr=1e-3)
    trainer.fit(module, DataLoader(Tokens(8 * (start + 2) * devices, sleep), batch_size=4))
    rank = dist.get_rank()
    return {"breakdown": cb.result.to_dict(), "trace": _trace_facts(out / f"trace_rank{rank}.json"),
            "state": cb.state_dict()["done"], "files": sorted(p.name for p in out.iterdir()), "dir": str(out)}


def config(devices: int) -> dict:
    from lightning_disttrain.cli import DistTrainCLI

    out = _shared_dir("config")
    cfg = yaml.safe_load((REPO / "configs" / "profile.yaml").read_text())
    cfg["trainer"]["max_steps"] = 4
    cfg["trainer"]["default_root_dir"] = str(out)
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(out)
    cfg["trainer"]["callbacks"][0]["init_args"] |= {"start_step": 1, "num_steps": 2, "dirpath": str(out / "profiler")}
    cfg["data"]["init_args"] |= {"max_docs": 40, "cache_dir": str(out / "cache")}
    path = out / f"profile.rank{dist.get_rank()}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = DistTrainCLI(args=["fit", "--config", str(path)])
    cb = next(c for c in cli.trainer.callbacks if isinstance(c, ProfilerCallback))
    metrics = next(out.glob("logs/version_*/metrics.csv")).read_text() if dist.get_rank() == 0 else ""
    return {"breakdown": cb.result.to_dict(), "steps": cli.trainer.global_step, "dir": str(out),
            "logged": [c for c in metrics.splitlines()[0].split(",") if c.startswith("profiler/")] if metrics else []}


def fit_run(run: str, devices: int) -> dict:
    if run == "fsdp2":
        return _fit(run, devices, sleep=0.0, start=2)
    if run == "slow_data":
        return _fit(run, devices, sleep=0.05, start=1)
    if run == "config":
        return config(devices)
    raise ValueError(f"unknown run {run!r}")
