"""One replica group of a fault-tolerant run (or the HSDP run it is compared with), for
tests/strategies/test_fault_tolerance.py and benchmarks/bench_fault_tolerance.py.

    python ft_replica.py OUT DATA RUN --devices N --replica-id G --groups R --lighthouse ADDR
    python ft_replica.py OUT DATA RUN --devices 2N --hsdp          # dp_replicate=2 x dp_shard=N, no torchft
    python ft_replica.py OUT DATA RUN --plain                      # NDParallelStrategy() on --devices, no torchft

The project's pieces throughout: NDParallelStrategy(fault_tolerance=...), GPTModule (dropout, a
cosine schedule), TokenDataModule over the indexed shard of tests/checkpoint/scripts/harness.py
(a batch tells which global samples it holds). ``L.Trainer(devices=N)`` launches the group's other
ranks. Every rank appends one JSON line per step to ``OUT/RUN.g<G>.rank<R>.jsonl``: the step,
its own loss (float.hex), the sample ids it trained on, the data position, a SHA-256 of its local
parameter shards (bitwise comparison between groups), the fault-tolerance metrics and its pid.
With ``--final-state`` it saves its local shards after the last step (``RUN.g<G>.rank<R>.pt``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

torch.set_num_threads(1)
warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent / "checkpoint" / "scripts")]
from harness import build_data, build_module, sample_ids  # noqa: E402

from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402


def local_state(module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters()}


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StepLog(L.Callback):
    """The per-step record; with ``gate``: waits at the start for ``gate/go`` and, after a step,
    while ``gate/hold`` exists (the test's way to keep a survivor from finishing before a
    relaunched group has started)."""

    def __init__(self, path: Path, sleep: float, gate: Path | None = None) -> None:
        self.path, self.sleep, self.gate = path, sleep, gate
        self.records: list[dict] = []

    def on_train_start(self, trainer, pl_module) -> None:
        torch.manual_seed(1000 + trainer.strategy.distributed_sampler_kwargs["rank"])  # as harness.Recorder
        self._write({"event": "start", "pid": os.getpid(), "step": trainer.global_step})
        while self.gate is not None and not (self.gate / "go").exists():
            time.sleep(0.02)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        strategy = trainer.strategy
        self._write({"event": "step", "step": trainer.global_step, "loss": float(loss.detach().float()).hex(),
                     "samples": sample_ids(batch[0].cpu()), "consumed": trainer.datamodule.consumed_samples,
                     "weights": digest(local_state(pl_module)), "ft": dict(getattr(strategy, "ft_metrics", {}) or {}),
                     "rebuilt": trainer.datamodule.stale_batches_rebuilt, "pid": os.getpid(), "t": time.time()})
        if self.sleep:
            time.sleep(self.sleep)
        if self.gate is not None and (self.gate / "hold").exists():
            self._write({"event": "held", "step": trainer.global_step})
            while (self.gate / "hold").exists():
                time.sleep(0.02)
            self._write({"event": "released", "step": trainer.global_step, "t": time.time()})

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        writes = getattr(trainer.strategy, "writes_checkpoints", lambda: True)()
        self._write({"event": "save", "step": trainer.global_step, "writer": bool(writes)})

    def _write(self, record: dict) -> None:
        self.records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


LAYOUTS = {"fsdp": {}, "tp": {"tp": 2}, "pp": {"pp": 2}, "muon": {}}
"""The layout inside one replica group of 2 ranks (the HSDP reference: 2 replicas of it); ``muon``:
fsdp's with ``optimizer="muon"`` (its Newton-Schulz in fp32: HSDP's owners differ from the groups'
and the averaged gradients agree to fp32 rounding, which bf16's iteration could flip)."""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("data")
    parser.add_argument("run")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--replica-id", type=int, default=0)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--lighthouse", default=None)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--connect-timeout", type=float, default=5.0)
    parser.add_argument("--hsdp", action="store_true")
    parser.add_argument("--plain", action="store_true", help="no fault tolerance, one data-parallel world of --devices")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--final-state", action="store_true")
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--gate", default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--layout", default="fsdp", choices=sorted(LAYOUTS),
                        help="inside each group (and the reference's replicas): dp_shard, tp or pp over --devices")
    return parser


def fit(args: argparse.Namespace) -> StepLog:
    L.seed_everything(args.seed, workers=True)
    layout = LAYOUTS[args.layout]
    if args.hsdp or args.plain:
        strategy = NDParallelStrategy(dp_replicate=2, **(layout or {"dp_shard": args.devices // 2})) if args.hsdp \
            else NDParallelStrategy()
        group = 0
    else:
        strategy = NDParallelStrategy(**layout, fault_tolerance=dict(
            num_replica_groups=args.groups, replica_id=args.replica_id, lighthouse=args.lighthouse,
            min_replicas=args.min_replicas, timeout_s=20, quorum_timeout_s=60, connect_timeout_s=args.connect_timeout))
        group = args.replica_id
    out = Path(args.out)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    log = StepLog(out / f"{args.run}.g{group}.rank{rank}.jsonl", args.sleep, Path(args.gate) if args.gate else None)
    callbacks: list = [log]
    if args.save_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=out / f"{args.run}.ckpt", filename="{step:03d}",
                                         every_n_train_steps=args.save_every, save_top_k=-1))
    trainer = L.Trainer(strategy=strategy, devices=args.devices, accelerator="cpu", max_steps=args.steps,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=bool(args.save_every),
                        default_root_dir=str(out))
    module = build_module(total_steps=args.steps, untied=args.layout == "pp")
    if args.layout == "muon":
        module.hparams.optimizer = "muon"
        configure = module.configure_optimizers

        def fp32_muon():
            out = configure()
            for part in out["optimizer"].optimizers[:-1]:
                part.ns_dtype = torch.float32
            return out

        module.configure_optimizers = fp32_muon
    if args.model != "tiny":
        from lightning_disttrain.module import GPTModule

        module = GPTModule(config=args.model, vocab_size=257, lr=3e-3, schedule="cosine", warmup_steps=3,
                           max_steps=args.steps)
    trainer.fit(module, datamodule=build_data(args.data))
    if args.final_state:
        torch.save(local_state(module), out / f"{args.run}.g{group}.rank{trainer.global_rank}.pt")
    log._write({"event": "end", "step": trainer.global_step, "pid": os.getpid()})
    return log


HSDP_STEPS = 5


def fit_run(run: str, devices: int) -> dict:
    """The reference (2 replicas of a 2-rank layout: "hsdp" = dp_replicate=2 x dp_shard=2, "hsdp_tp",
    "hsdp_pp") inside the suite's shared 4-rank launch."""
    from harness import write_indexed_shard

    layout = {"hsdp": "fsdp", "hsdp_tp": "tp", "hsdp_pp": "pp", "hsdp_muon": "muon"}[run]
    assert devices == 4, (run, devices)
    out = Path(os.environ["LDT_LAUNCH_OUT"])
    data = out / f"ft_data.{os.getpid()}"  # the deterministic indexed shard, one copy per process
    write_indexed_shard(data)
    log = fit(parser().parse_args([str(out), str(data), f"ft_{run}", "--hsdp", "--devices", "4", "--steps",
                                   str(HSDP_STEPS), "--final-state", "--layout", layout]))
    import torch.distributed as dist

    return {"records": [r for r in log.records if r["event"] == "step"],
            "state": str(out / f"ft_{run}.g0.rank{dist.get_rank()}.pt")}


def main() -> None:
    fit(parser().parse_args())


if __name__ == "__main__":
    main()
