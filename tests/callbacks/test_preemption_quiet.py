"""A preemption save says nothing it need not (issue 42, item 7): Lightning logged "`weights_only`
was not set, defaulting to `False`" on every rank at every SIGTERM save, from the callback's own
``trainer.save_checkpoint`` call. One process, Lightning's strategy, in this process."""

from __future__ import annotations

import logging
import signal

import lightning as L
import pytest

from lightning_disttrain.callbacks import PreemptionCheckpoint
from lightning_disttrain.callbacks.preemption import PreemptionExit


class _SignalAt(L.Callback):
    """Raises SIGTERM in this process when step ``at`` starts."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at - 1:
            signal.raise_signal(signal.SIGTERM)


def test_sigterm_save_logs_no_weights_only_note(tmp_path, caplog):
    from lightning.pytorch.demos.boring_classes import BoringModel

    previous = signal.getsignal(signal.SIGTERM)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=str(tmp_path), callbacks=[PreemptionCheckpoint(), _SignalAt(2)])
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"), pytest.raises(PreemptionExit) as info:
            trainer.fit(BoringModel())
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert info.value.step == 2 and info.value.path  # the save happened
    assert not [r.getMessage() for r in caplog.records if "weights_only" in r.getMessage()]
