"""Consolidated export (one process, no process group) and loading it back."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import VOCAB, Wrapper, save

from lightning_disttrain.checkpoint import (
    MANIFEST_NAME,
    CheckpointVerificationError,
    IncompleteCheckpointError,
    export_consolidated,
    export_main,
    load_consolidated,
    load_consolidated_into,
)
from lightning_disttrain.models.gpt import GPT, GPTConfig


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
    assert "model.wte.weight" in optim["state"] and optim["param_groups"][0]["lr"] == 1e-3
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
    assert "step=1.ckpt" in capsys.readouterr().out
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
