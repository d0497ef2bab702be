"""Checkpoint cadence: the Young/Daly arithmetic, the writer's save timings, and CheckpointCadence."""

from __future__ import annotations

import math
import time

import pytest
from ckpt_helpers import save

from lightning_disttrain.checkpoint import CheckpointWriter
from lightning_disttrain.checkpoint.cadence import checkpoint_cadence, job_mtbf_seconds


def test_job_mtbf_divides_the_device_mtbf_and_adds_preemptions():
    assert job_mtbf_seconds(50_000, devices=1000) == pytest.approx(50 * 3600)
    # 1000 devices at 50,000 h (0.02/h) plus 0.03 preemptions/h: one failure per 20 h
    assert job_mtbf_seconds(50_000, devices=1000, preemptions_per_hour=0.03) == pytest.approx(20 * 3600)
    assert job_mtbf_seconds(None, preemptions_per_hour=0.5) == pytest.approx(2 * 3600)


def test_young_daly_interval_and_steps():
    c = checkpoint_cadence(cost_s=10, mtbf_s=50 * 3600, write_s=30, step_s=2.0)
    assert c.interval_s == pytest.approx(math.sqrt(2 * 10 * 180_000))  # 1897.4 s
    assert c.every_n_steps == 949  # 1897.4 / 2, rounded
    assert c.expected_overhead == pytest.approx(10 / c.interval_s + c.interval_s / (2 * 180_000))
    assert "every 949 steps" in c.describe()


def test_interval_never_shorter_than_a_whole_write():
    # sqrt(2 * 0.5 * 100) = 10 s, but a write takes 40 s and a save waits for the previous one.
    c = checkpoint_cadence(cost_s=0.5, mtbf_s=100, write_s=40, step_s=3.0)
    assert c.interval_s == 40 and c.every_n_steps == 13
    assert checkpoint_cadence(cost_s=1e-3, mtbf_s=1.0, step_s=10.0).every_n_steps == 1  # at least every step


@pytest.mark.parametrize("call, match", [
    (lambda: job_mtbf_seconds(0, devices=8), "device_mtbf_hours=0"),
    (lambda: job_mtbf_seconds(50_000, devices=0), "devices=0"),
    (lambda: job_mtbf_seconds(None), "no failure rate"),
    (lambda: job_mtbf_seconds(50_000, preemptions_per_hour=-1), "preemptions_per_hour=-1"),
    (lambda: checkpoint_cadence(0, 100), "checkpoint cost"),
    (lambda: checkpoint_cadence(1, 100, step_s=0), "step_s=0"),
])
def test_bad_input_names_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_writer_records_blocking_and_total_time(tmp_path, trained, monkeypatch):
    module, opt = trained
    writer = CheckpointWriter()
    save(tmp_path / "sync.ckpt", module, opt, step=1, writer=writer)
    assert len(writer.timings) == 1 and writer.timings[0].blocking_s == writer.timings[0].total_s > 0

    # Async: the write takes >= 0.5 s in the background; save() returns before that.
    from torch.distributed.checkpoint import filesystem

    original = filesystem._FileSystemWriter.write_data

    def slow(self, plan, planner):
        time.sleep(0.5)
        return original(self, plan, planner)

    monkeypatch.setattr(filesystem._FileSystemWriter, "write_data", slow)
    writer.async_save = True
    save(tmp_path / "async.ckpt", module, opt, step=2, writer=writer)
    timing = writer.timings[1]
    assert timing.total_s is None  # still being written
    writer.close()
    assert timing.total_s >= 0.5 > timing.blocking_s


def test_cadence_callback_sets_every_n_train_steps(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_disttrain.callbacks import CheckpointCadence

    # cost 0.01 s, MTBF 1 h of one device: interval sqrt(2 * 0.01 * 3600) = 8.5 s
    cadence = CheckpointCadence(device_mtbf_hours=1.0, checkpoint_cost_s=0.01, apply=True)
    mc = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=5, callbacks=[cadence, mc], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=str(tmp_path))
    trainer.fit(BoringModel())
    c = cadence.cadence
    assert c.interval_s == pytest.approx(math.sqrt(2 * 0.01 * 3600))
    assert c.every_n_steps == max(1, round(c.interval_s / c.step_s)) == mc._every_n_train_steps
    assert c.every_n_steps > 5  # a BoringModel step is far below 8.5 s: no save after the decision at step 3
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=2.ckpt"]
