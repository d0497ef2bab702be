"""A callback that raises on chosen ranks, for the CLI's error-reporting tests (class_path: rank_failure.FailOnRank)."""

import lightning as L


class FailOnRank(L.Callback):
    """Raises `error(message)` on `rank` (-1: every rank) in `setup` or at the second training batch."""

    def __init__(self, rank: int = 1, hook: str = "setup", message: str = "failed on purpose",
                 error: str = "ValueError") -> None:
        if hook not in ("setup", "step"):
            raise ValueError(f"hook={hook!r}: use 'setup' or 'step'")
        self.rank, self.hook, self.message, self.error = rank, hook, message, error

    def _maybe_fail(self, trainer, hook: str) -> None:
        if hook == self.hook and self.rank in (-1, trainer.global_rank):
            raise {"ValueError": ValueError, "RuntimeError": RuntimeError}[self.error](self.message)

    def setup(self, trainer, pl_module, stage) -> None:
        self._maybe_fail(trainer, "setup")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:
            self._maybe_fail(trainer, "step")


class SignalOnRank(L.Callback):
    """In ``setup`` (before training), sends ``signal`` to this process on ``rank``, which then waits in
    a barrier; every other rank sleeps ``others_sleep_s`` first: the signalled rank's main thread is
    blocked in a collective when the signal must stop the run."""

    def __init__(self, rank: int = 0, signal: str = "SIGTERM", others_sleep_s: float = 300.0) -> None:
        self.rank, self.signal, self.others_sleep_s = rank, signal, others_sleep_s

    def setup(self, trainer, pl_module, stage) -> None:
        import os
        import signal
        import time

        import torch.distributed as dist

        if trainer.global_rank == self.rank:
            os.kill(os.getpid(), getattr(signal, self.signal))
        else:
            time.sleep(self.others_sleep_s)
        dist.barrier()
