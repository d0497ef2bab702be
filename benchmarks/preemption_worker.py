"""One training process of bench_preemption.py (2 gloo ranks through Lightning's launcher).

    python preemption_worker.py DATA CKPT_DIR OUT RUN STEPS [last]

The project's pieces (NDParallelStrategy with async DCP saves every 3 steps, GPTModule with
dropout, TokenDataModule over the indexed shard of tests/checkpoint/scripts/harness.py) and
``PreemptionCheckpoint`` with its defaults (SIGTERM, exit code 143). Each rank writes
``OUT/RUN.rank<R>.json`` (losses as float.hex, the agreement's time per step) and, while
training, ``OUT/RUN.pid<R>`` and ``OUT/RUN.steps<R>`` (one "time step" line per batch start;
"time V step" / "time v step" when a validation starts / ends, "time B step" when a validation
batch ends), so that the bench can signal a rank and tell which step (or validation) it
interrupted and how many validation batches ran after the signal.

Environment: ``BENCH_VALIDATE=1`` validates (2 batches) after every third step;
``BENCH_ON_SAVE_ERROR=warn`` sets the strategy's ``on_save_error`` (default "stop").
"""

from __future__ import annotations

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
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "checkpoint" / "scripts")]
from harness import DATA_SEED, MICRO_BATCH, SEQ_LEN, Recorder, build_data, build_module  # noqa: E402

from lightning_disttrain.callbacks import PreemptionCheckpoint, PreemptionExit  # noqa: E402
from lightning_disttrain.data import TokenDataModule  # noqa: E402
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402


class StepLog(L.Callback):
    def __init__(self, out: Path, run: str) -> None:
        self.out, self.run, self.file = out, run, None

    def on_train_start(self, trainer, pl_module) -> None:
        (self.out / f"{self.run}.pid{trainer.global_rank}").write_text(str(os.getpid()))
        self.file = open(self.out / f"{self.run}.steps{trainer.global_rank}", "a", buffering=1)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.file.write(f"{time.time()} {trainer.global_step + 1}\n")  # the step now starting (1-based)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.file is not None:
            self.file.write(f"{time.time()} V {trainer.global_step}\n")

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.file is not None:
            self.file.write(f"{time.time()} v {trainer.global_step}\n")


class ValidationBatchLog(L.Callback):
    """StepLog's "time B step" line at each validation batch's end; before PreemptionCheckpoint in
    the callbacks, so that the batch at whose end the ranks agree to stop is logged too."""

    def __init__(self, step_log: StepLog) -> None:
        self.step_log = step_log

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.step_log.file is not None:
            self.step_log.file.write(f"{time.time()} B {trainer.global_step}\n")


class AlignedAllReduce(L.Callback):
    """Right after the agreement (ranks aligned by it), the same all_reduce again, timed: the
    collective's own cost, without the wait for the slower rank that the agreement's time includes."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import torch.distributed as dist

        flag = torch.zeros(1, dtype=torch.int32)
        start = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.seconds.append(time.perf_counter() - start)


def main() -> None:
    data, ckpt_dir, out, run, steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    ckpt_path = sys.argv[6] if len(sys.argv) > 6 else None
    L.seed_everything(1234, workers=True)
    rec, pre = Recorder(), PreemptionCheckpoint(check_every_n_steps=1)  # section 15: one agreement per step
    probe = [AlignedAllReduce()] if os.environ.get("BENCH_PROBE") else []
    mc = ModelCheckpoint(dirpath=ckpt_dir, filename="{step:03d}", every_n_train_steps=3, save_top_k=2,
                         monitor="step", mode="max")
    validate = bool(os.environ.get("BENCH_VALIDATE"))
    step_log = StepLog(out, run)
    strategy = NDParallelStrategy(async_save=True, on_save_error=os.environ.get("BENCH_ON_SAVE_ERROR", "stop"))
    trainer = L.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_steps=steps,
                        callbacks=[rec, ValidationBatchLog(step_log), pre, *probe, step_log, mc], logger=False,
                        enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                        limit_val_batches=None if validate else 0, val_check_interval=3 if validate else None,
                        default_root_dir=str(out))
    datamodule = (TokenDataModule(source=data, tokenizer="bytes", seq_len=SEQ_LEN, batch_size=MICRO_BATCH,
                                  val_batches=2, val_source=data, seed=DATA_SEED) if validate else build_data(data))
    result: dict = {}
    try:
        trainer.fit(build_module(total_steps=steps), datamodule=datamodule, ckpt_path=ckpt_path)
    except PreemptionExit as exc:
        result.update(exit_code=exc.code, saved_step=exc.step, path=exc.path, exit_time=time.time())
        raise
    except Exception as exc:
        result.update(error=f"{type(exc).__name__}: {exc}"[:800], error_time=time.time())
        raise
    finally:
        result.update(losses=rec.losses, start_step=rec.start_step, agreement_s=pre.agreement_seconds,
                      aligned_all_reduce_s=probe[0].seconds if probe else [], reason=pre.reason)
        path = out / f"{run}.rank{trainer.global_rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(result))
        path.with_suffix(".tmp").replace(path)


if __name__ == "__main__":
    main()
