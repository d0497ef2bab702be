"""Pieces the multi-process benchmarks (``bench_fsdp.py``, ``bench_tp.py``) share: the launcher
(ranks started with env:// variables, no torchrun agent), the Trainer they time, the per-step
memory windows, and the helpers their reports use.

Worker-side helpers import torch and Lightning when called, so the launcher stays light.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIB = 2**20
PHASES = ("fwd", "bwd", "opt")
"""The three windows of a step (see ``phase_probe``)."""

WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read at import: Lightning's teardown deletes it
RANK = int(os.environ.get("RANK", "0"))


# -- parent process ---------------------------------------------------------------------------


def launch(script: str, out_dir: Path, nprocs: int, tag: str, worker_args: list[str],
           extra_env: dict[str, str] | None = None, timeout: float = 1200) -> None:
    """Run ``nprocs`` ranks of ``script`` (each gets ``--nprocs``); logs to ``out_dir``. A rank that
    fails or outlives ``timeout`` ends the benchmark (and every other rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), NODE_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]),
                   **(extra_env or {}))
        log = open(out_dir / f"worker_{tag}_rank{rank}.log", "w")  # noqa: SIM115 (closed after the wait below)
        procs.append((subprocess.Popen([sys.executable, script, *worker_args, "--nprocs", str(nprocs)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = None
    for proc, log in procs:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            rc = "timeout"
        log.close()
        if rc != 0 and failed is None:
            failed = f"worker failed (exit {rc}); see {log.name}"
    if failed:
        raise SystemExit(failed)


def load1() -> float:
    return os.getloadavg()[0]


# -- worker processes -------------------------------------------------------------------------


def dataset(args, n_samples: int):
    """Random tokens (seed 0): ``n_samples`` (input, target) pairs of ``args.seq`` tokens."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (n_samples, args.seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def trainer(strategy, max_steps, callbacks, accelerator="cpu", logger=False):
    """The Trainer every benchmark times: clipping 1.0, no checkpoints, no validation, no progress bar."""
    import lightning as L

    return L.Trainer(strategy=strategy, devices=WORLD, accelerator=accelerator, max_steps=max_steps,
                     gradient_clip_val=1.0, logger=logger, log_every_n_steps=10, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                     limit_val_batches=0, callbacks=callbacks)


def step_timer(warmup: int):
    """A callback timing each optimizer step after ``warmup`` untimed ones (``.step_times()``) and
    recording every step's loss (``.losses``)."""
    import itertools
    import time

    import lightning as L

    class StepTimer(L.Callback):
        def __init__(self):
            self.marks, self.losses = [], []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == warmup:
                self.marks.append(time.perf_counter())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx >= warmup:
                self.marks.append(time.perf_counter())
            self.losses.append(float(outputs["loss"]))

        def step_times(self) -> list[float]:
            return [b - a for a, b in itertools.pairwise(self.marks)]

    return StepTimer()


def rotated_rounds(variants: dict, repeats: int, out_file: Path, extra: dict) -> None:
    """Run each of ``variants`` (name -> () -> (step times, losses)) once per round, the order
    rotated each round, after a garbage collection and a barrier; rank 0 writes the step times,
    losses, each round's order and load average, and ``extra`` to ``out_file`` as JSON."""
    import gc
    import json

    import torch.distributed as dist

    names = list(variants)
    steps = {name: [] for name in names}
    losses = {name: [] for name in names}
    rounds = []
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        rounds.append({"order": order, "load1_before": load1()})
        for name in order:
            gc.collect()
            dist.barrier()
            ts, loss = variants[name]()
            steps[name].append(ts)
            losses[name].append(loss)
        if dist.get_rank() == 0:
            print(f"round {r} done, load {load1():.2f}", flush=True)
    if dist.get_rank() == 0:
        out_file.write_text(json.dumps({"steps": steps, "losses": losses, "rounds": rounds, **extra}))


def local_bytes(tensors) -> int:
    """Known-tensor sum (for comparison only): bytes of the local shards of ``tensors``."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def phase_probe(meter):
    """A callback marking three windows per step on ``meter``, in Lightning's hook order: forward
    (batch start -> before backward; the previous step's gradients are held through it, Lightning's
    zero_grad frees them just before ``on_before_backward``), backward (-> after backward),
    optimizer (-> batch end: clipping, AdamW step, logging). The step's peak is the largest of the
    three; the marks between them are the levels after forward / backward / the step."""
    import lightning as L

    class Probe(L.Callback):
        def __init__(self):
            self.i = None

        def on_train_start(self, trainer, module):
            meter.mark("setup")

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.i = batch_idx
            meter.begin_window(f"step{batch_idx}.fwd")

        def on_before_backward(self, trainer, module, loss):
            meter.end_window(f"step{self.i}.fwd")
            meter.begin_window(f"step{self.i}.bwd")

        def on_after_backward(self, trainer, module):
            meter.end_window(f"step{self.i}.bwd")
            meter.begin_window(f"step{self.i}.opt")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            meter.end_window(f"step{batch_idx}.opt")

    return Probe()


# -- reports ----------------------------------------------------------------------------------


def level_at(r: dict, step: int, when: str, key: str = "levels") -> int:
    """A worker record's level at the end of ``when`` (a phase) of ``step``."""
    return r[key][f"step{step}.{when}:end"]


def step_peak(r: dict, step: int, key: str = "peaks") -> tuple[int, str]:
    """The largest window peak of ``step`` and the phase it fell in."""
    return max((r[key][f"step{step}.{ph}"], ph) for ph in PHASES)


def spread(xs) -> str:
    return f"{min(xs):.3f} {statistics.median(xs):.3f} {max(xs):.3f}"
