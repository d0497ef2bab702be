"""Consolidated export (one process, no process group) and loading it back."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch
from ckpt_helpers import VOCAB, Wrapper, save

from lightning_disttrain.checkpoint import (
    EXPORT_FORMAT,
    MANIFEST_NAME,
    CheckpointVerificationError,
    IncompleteCheckpointError,
    export_consolidated,
    gpt_from_exported,
    load_consolidated,
    load_consolidated_into,
    read_exported,
)
from lightning_disttrain.checkpoint.command import export_main
from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.module import GPTModule


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.arange(24).reshape(2, 12) % VOCAB)


def test_model_only_export_loads_into_a_plain_gpt(ckpt, trained, tmp_path):
    module, _ = trained
    out = export_consolidated(ckpt, tmp_path / "export" / "model.pt")
    state = load_consolidated(out)
    assert not any(k.startswith("model.") for k in state)  # LightningModule prefix stripped
    gpt = GPT(GPTConfig.from_name("tiny", vocab_size=VOCAB, n_layer=2))
    gpt.load_state_dict(state)
    assert torch.equal(_logits(gpt), _logits(module.model))
    assert not any("exp_avg" in k for k in state)


def test_full_export_is_a_lightning_style_file(ckpt, tmp_path):
    out = export_consolidated(ckpt, tmp_path / "full.pt", model_only=False)
    full = torch.load(out, weights_only=False)
    assert full["global_step"] == 2  # the Lightning state (meta.pt) comes along
    assert all(k.startswith("model.") for k in full["state_dict"])
    (optim,) = full["optimizer_states"]
    # flattened, keyed by parameter name: set_optimizer_state_dict(..., options=StateDictOptions(
    # full_state_dict=True, flatten_optimizer_state_dict=True)) loads it
    assert "state.model.wte.weight.exp_avg" in optim and optim["param_groups.model.wte.weight.lr"] == 1e-3
    gpt = GPT(GPTConfig.from_name("tiny", vocab_size=VOCAB, n_layer=2))
    gpt.load_state_dict(load_consolidated(out, prefix="model."))


def test_export_verifies_first(ckpt, tmp_path):
    (ckpt / MANIFEST_NAME).unlink()
    with pytest.raises(IncompleteCheckpointError):
        export_consolidated(ckpt, tmp_path / "m.pt")
    assert export_consolidated(ckpt, tmp_path / "m.pt", verify=False).is_file()


def test_export_dtype_cast(ckpt, tmp_path):
    state = load_consolidated(export_consolidated(ckpt, tmp_path / "m.pt", dtype=torch.bfloat16))
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.bfloat16}


def test_cli_exports_the_latest_complete(tmp_path, trained, capsys):
    module, opt = trained
    save(tmp_path / "ckpts" / "step=1.ckpt", module, opt, step=1)
    newest = save(tmp_path / "ckpts" / "step=2.ckpt", module, opt, step=2)
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # the newest is damaged: --latest skips it
    with pytest.warns(UserWarning, match="truncated"):
        out = export_main([str(tmp_path / "ckpts"), str(tmp_path / "m.pt"), "--latest"])
    printed = capsys.readouterr().out
    assert f"exported {str((tmp_path / 'ckpts' / 'step=1.ckpt').resolve())!r} (global step 1, completed " in printed
    assert f"the newest complete checkpoint in {str(tmp_path / 'ckpts')!r}" in printed
    expected = GPT(GPTConfig.from_name("tiny", vocab_size=VOCAB, n_layer=2)).state_dict()
    assert set(load_consolidated(out)) == set(expected)
    with pytest.raises(CheckpointVerificationError, match="truncated"):
        export_main([str(newest), str(tmp_path / "bad.pt")])
    with pytest.raises(SystemExit):
        export_main(["--help"])


def test_load_consolidated_into_a_module(ckpt, trained, tmp_path):
    module, _ = trained
    out = export_consolidated(ckpt, tmp_path / "m.pt")
    fresh = Wrapper(seed=7)
    load_consolidated_into(fresh.model, out)
    assert torch.equal(_logits(fresh.model), _logits(module.model))


# ---- the export format: weights + model config, and gpt_from_exported --------------------------


def _gpt_module_meta(step: int) -> dict:
    # What Lightning's dump_checkpoint puts in meta.pt for a GPTModule: dict(module.hparams),
    # whose "config" holds the GPTConfig fields (after the data's vocabulary was adopted).
    hparams = GPTModule("tiny", vocab_size=VOCAB, model_overrides={"n_layer": 2}).hparams
    return {"global_step": step, "epoch": 0, "hyper_parameters": dict(hparams), "hparams_name": "kwargs"}


@pytest.fixture
def gpt_ckpt(tmp_path, trained):
    module, opt = trained
    return save(tmp_path / "ckpts" / "step=2.ckpt", module, opt, step=2, meta=_gpt_module_meta(2))


def test_from_exported_rebuilds_the_model_with_real_vocab_logits(gpt_ckpt, trained, tmp_path):
    module, _ = trained
    out = export_consolidated(gpt_ckpt, tmp_path / "model.pt")
    gpt = gpt_from_exported(out)  # no config guessed by the user: it travels with the weights
    assert not gpt.training
    assert gpt.config == module.model.config and gpt.config.padded_vocab_size == 320
    logits = _logits(gpt)
    assert logits.shape == (2, 12, VOCAB)  # the 63 padding columns are not in the output
    assert torch.equal(logits, _logits(module.model)[..., :VOCAB])


def test_export_file_is_versioned_and_says_where_it_came_from(gpt_ckpt, tmp_path):
    out = export_consolidated(gpt_ckpt, tmp_path / "model.pt")
    raw = torch.load(out, weights_only=True)  # readable without trusting the file
    assert raw["format"] == EXPORT_FORMAT and raw["format_version"] == 1 and raw["contents"] == "model"
    assert raw["model_config"] == asdict(GPTConfig.from_name("tiny", vocab_size=VOCAB, n_layer=2))
    assert raw["hyper_parameters"]["lr"] == 6e-4
    # a name, not the local absolute path: the file is meant for sharing
    assert raw["source"]["checkpoint"] == gpt_ckpt.resolve().name and raw["source"]["global_step"] == 2
    assert str(gpt_ckpt.parent) not in repr(raw["source"])
    assert not any(k.startswith("model.") for k in raw["state_dict"])


def test_full_export_carries_the_config_too(gpt_ckpt, trained, tmp_path):
    module, _ = trained
    out = export_consolidated(gpt_ckpt, tmp_path / "full.pt", model_only=False)
    full = torch.load(out, weights_only=False)
    assert full["contents"] == "full" and full["global_step"] == 2 and len(full["optimizer_states"]) == 1
    assert torch.equal(_logits(gpt_from_exported(out)), _logits(module.model)[..., :VOCAB])


def test_files_from_before_the_format_still_load(trained, tmp_path):
    module, _ = trained
    config = module.model.config
    plain = tmp_path / "plain.pt"
    torch.save({k: v.clone() for k, v in module.model.state_dict().items()}, plain)  # the old model-only shape
    assert read_exported(plain).format_version == 0
    fresh = Wrapper(seed=7)
    load_consolidated_into(fresh.model, plain)
    assert torch.equal(_logits(fresh.model), _logits(module.model))
    with pytest.raises(ValueError, match=r"carries no model config.*config=GPTConfig"):
        gpt_from_exported(plain)
    assert gpt_from_exported(plain, config=config)(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, VOCAB)

    old_full = tmp_path / "old_full.pt"  # the old --full shape: Lightning keys, no format keys
    torch.save({**_gpt_module_meta(2), "state_dict": module.state_dict(), "optimizer_states": []}, old_full)
    assert set(load_consolidated(old_full, prefix="model.")) == set(module.model.state_dict())
    assert torch.equal(_logits(gpt_from_exported(old_full)), _logits(module.model)[..., :VOCAB])


def test_unknown_format_or_newer_version_is_refused(gpt_ckpt, tmp_path):
    raw = torch.load(export_consolidated(gpt_ckpt, tmp_path / "m.pt"), weights_only=True)
    torch.save({**raw, "format_version": 2}, tmp_path / "newer.pt")
    with pytest.raises(ValueError, match="newer than the 1 this lightning-disttrain reads; upgrade"):
        load_consolidated(tmp_path / "newer.pt")
    torch.save({**raw, "format": "huggingface/safetensors"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="has format 'huggingface/safetensors'"):
        load_consolidated(tmp_path / "other.pt")


def test_a_config_that_is_not_a_gpt_config_is_a_clear_error(gpt_ckpt, tmp_path):
    raw = torch.load(export_consolidated(gpt_ckpt, tmp_path / "m.pt"), weights_only=True)
    torch.save({**raw, "model_config": {"hidden_size": 64}}, tmp_path / "other_model.pt")
    with pytest.raises(ValueError, match="is not a GPTConfig"):
        gpt_from_exported(tmp_path / "other_model.pt")


def test_from_exported_keeps_the_exported_dtype(gpt_ckpt, tmp_path):
    out = export_consolidated(gpt_ckpt, tmp_path / "m.pt", dtype=torch.bfloat16)
    gpt = gpt_from_exported(out)
    assert gpt.wte.weight.dtype == torch.bfloat16 and _logits(gpt).shape[-1] == VOCAB


def test_hyper_parameters_that_need_unpickling_are_left_out(trained, tmp_path):
    module, opt = trained
    meta = _gpt_module_meta(2)
    meta["hyper_parameters"]["loss_fn"] = torch.nn.CrossEntropyLoss()
    ckpt = save(tmp_path / "step=2.ckpt", module, opt, step=2, meta=meta)
    # meta.pt now needs weights_only=False: the model-only export refuses to unpickle it.
    with pytest.warns(UserWarning, match="without its hyper-parameters or model config"):
        out = export_consolidated(ckpt, tmp_path / "m.pt")
    assert read_exported(out).model_config is None
    # A full export keeps them as saved, which unpickles meta.pt fully: only when trusted.
    with pytest.raises(ValueError, match="refusing to load .*meta.pt.*--trust-checkpoint"):
        export_consolidated(ckpt, tmp_path / "full.pt", model_only=False)
    full = export_consolidated(ckpt, tmp_path / "full.pt", model_only=False, trust_checkpoint=True)
    with pytest.raises(ValueError, match="if you trust the file, pass weights_only=False"):
        gpt_from_exported(full)
    assert gpt_from_exported(full, weights_only=False).config == module.model.config


def test_export_of_a_last_link_names_its_target(gpt_ckpt, trained, tmp_path, capsys):
    module, opt = trained
    folder = gpt_ckpt.parent
    newest = save(folder / "step=3.ckpt", module, opt, step=3, meta=_gpt_module_meta(3))
    os.symlink("step=3.ckpt", folder / "last.ckpt")
    export_main([str(folder / "last.ckpt"), str(tmp_path / "m.pt")])
    printed = capsys.readouterr().out
    assert f"exported {str(newest.resolve())!r} (global step 3, completed " in printed
    assert f"the target of {str(folder / 'last.ckpt')!r}" in printed
    assert read_exported(tmp_path / "m.pt").source["global_step"] == 3


def test_export_of_a_stale_last_warns_and_says_how_to_get_the_newest(gpt_ckpt, trained, tmp_path, capsys):
    # save_last=True with the version counter: last.ckpt (an older run's) beside a newer checkpoint.
    module, opt = trained
    folder = gpt_ckpt.parent
    os.symlink("step=2.ckpt", folder / "last.ckpt")
    save(folder / "last-v1.ckpt", module, opt, step=1, meta=_gpt_module_meta(1))  # newer, lower step
    with pytest.warns(UserWarning, match=r"last\.ckpt' is not the newest.*last-v1\.ckpt.*global step 1.*--latest"):
        export_main([str(folder / "last.ckpt"), str(tmp_path / "m.pt")])
    assert "(global step 2, completed" in capsys.readouterr().out  # exported as asked
