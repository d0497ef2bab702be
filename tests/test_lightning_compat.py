"""The Lightning seam (``lightning_disttrain/_lightning_compat.py``): every private it relies on
exists in the installed Lightning, each accessor works on the real objects, and a private that is
gone fails with a message naming it and the checked versions, never a silent fallback."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar

from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain.module import GPTModule


@pytest.fixture
def trainer(tmp_path):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, default_root_dir=tmp_path,
                     callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2), RichProgressBar()])


def test_every_private_the_seam_relies_on_exists():
    compat.check(cosmetic=True)


def test_check_names_a_missing_private_and_the_checked_versions(monkeypatch):
    monkeypatch.setattr(compat, "PRIVATES", compat.PRIVATES + (("lightning.pytorch.callbacks.ModelCheckpoint",
                                                                  "_gone_in_a_future_release"),))
    monkeypatch.setattr(compat, "_CHECKED", set())
    with pytest.raises(compat.LightningCompatError, match=r"ModelCheckpoint\._gone_in_a_future_release.*"
                                                          r"checked against lightning 2\.6"):
        compat.check()


def test_trainer_of_a_detached_and_an_attached_module(trainer):
    module = GPTModule(config="tiny", vocab_size=64)
    assert compat.trainer_of(module) is None and compat.trainer_of(None) is None
    module.trainer = trainer
    assert compat.trainer_of(module) is trainer


def test_resume_path_reads_and_renames_what_the_restore_prints(trainer):
    assert compat.resume_path(trainer) is None
    compat.rename_resume_path(trainer, "/runs/step=4")
    assert trainer.ckpt_path == "/runs/step=4"  # the public getter sees it
    assert not trainer._checkpoint_connector._user_managed  # unlike the public setter: not kept for test()


def test_translate_resume_path_runs_once(trainer, monkeypatch):
    connector = trainer._checkpoint_connector
    seen = []
    monkeypatch.setattr(type(connector), "resume_start", lambda self, path=None, weights_only=None: seen.append(path))
    compat.translate_resume_path_once(trainer, lambda p: "/found" if p == "auto" else p)
    connector.resume_start("auto")
    connector.resume_start("auto")  # the instance patch removed itself after one restore
    assert seen == ["/found", "auto"]


def test_signal_handlers_route_to_ours(trainer):
    def handler(*_):
        pass

    compat.route_lightning_signal_handlers(trainer, handler)
    assert trainer._signal_connector._sigterm_notifier_fn is handler
    assert trainer._signal_connector._slurm_sigusr_handler_fn is handler


def test_model_checkpoint_cadence_and_newest_save(trainer):
    cb = trainer.checkpoint_callback
    assert compat.every_n_train_steps(cb) == 2
    compat.set_every_n_train_steps(cb, 7)
    assert compat.every_n_train_steps(cb) == 7
    assert compat.last_checkpoint_saved(cb) == ""


def test_rich_bar_says_epoch_0_not_0_of_minus_2_under_max_steps(trainer):
    # Issue 28, finding 7: with max_steps, Lightning sets max_epochs=-1 and its rich bar printed
    # "Epoch 0/-2"; a bounded epoch count keeps Lightning's own label.
    bar = trainer.progress_bar_callback
    trainer.fit_loop.max_epochs = -1  # what fit() sets for max_steps without max_epochs
    bar.setup(trainer, None, stage="fit")
    assert type(bar) is RichProgressBar
    assert bar._get_train_description(0).startswith("Epoch 0/-2")  # Lightning's, before the fix
    compat.fix_epoch_description(trainer)
    assert bar._get_train_description(0).strip() == "Epoch 0"
    bounded = L.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, callbacks=[RichProgressBar()])
    bounded.progress_bar_callback.setup(bounded, None, stage="fit")
    compat.fix_epoch_description(bounded)
    assert bounded.progress_bar_callback._get_train_description(0).startswith("Epoch 0/2")


def test_parser_accessors():
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser()
    parser.add_argument("--steps", type=int)
    assert "steps" in compat.parser_option_names(parser)
    assert isinstance(compat.parser_instantiators(parser), dict)


@pytest.mark.parametrize("remove, call", [
    ("trainer._checkpoint_connector", lambda t, m: compat.resume_path(t)),
    ("trainer._signal_connector", lambda t, m: compat.route_lightning_signal_handlers(t, print)),
    ("callback._every_n_train_steps", lambda t, m: compat.every_n_train_steps(t.checkpoint_callback)),
    ("callback._last_checkpoint_saved", lambda t, m: compat.last_checkpoint_saved(t.checkpoint_callback)),
    ("module._trainer", lambda t, m: compat.trainer_of(m)),
    ("module._device_mesh", lambda t, m: compat.set_module_device_mesh(m, None)),
])
def test_an_accessor_whose_private_is_gone_fails_loudly(trainer, remove, call):
    module = GPTModule(config="tiny", vocab_size=64)
    owner, attr = remove.split(".")
    obj = {"trainer": trainer, "callback": trainer.checkpoint_callback, "module": module}[owner]
    object.__delattr__(obj, attr) if owner != "module" else vars(obj).pop(attr)
    with pytest.raises(compat.LightningCompatError, match=rf"{attr}.*checked against"):
        call(trainer, module)
