"""Hugging Face weights under ``fsdp2`` on two CPU processes (one launch, ``hf_fsdp2_worker.py``):
training starts from the imported weights (meta-device build), each rank can load only its shards,
and the 2-rank checkpoint exports to Hugging Face and loads with ``from_pretrained`` on one process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from dist_utils import read_ranks, run_lightning_script  # noqa: E402
from hf_fixtures import VOCAB, hf_gpt2, hf_logits, save, tokens  # noqa: E402

from lightning_disttrain.checkpoint import (  # noqa: E402
    export_consolidated,
    verify_checkpoint,
)
from lightning_disttrain.checkpoint.command import export_main  # noqa: E402
from lightning_disttrain.cli import main  # noqa: E402

transformers = pytest.importorskip("transformers")
TOL = 1e-5


@pytest.mark.slow
def test_fsdp2_trains_from_hf_weights_and_its_checkpoint_exports_to_hf(tmp_path, capsys):
    sys.path.insert(0, str(HERE))
    from hf_fsdp2_worker import batches

    hf = hf_gpt2(dropout=0.0)
    hf_dir = save(hf, tmp_path / "hf")
    run_lightning_script(HERE / "hf_fsdp2_worker.py", str(hf_dir), str(tmp_path), timeout=400)
    ranks = read_ranks(tmp_path, "hf_fsdp2", 2)

    # Training started from the imported weights: the first step's loss (mean of the two ranks'
    # halves of the batch) is transformers' loss on that batch; training then went on.
    x, y = batches()[0]
    with torch.no_grad():
        expected = float(F.cross_entropy(hf_logits(hf, x).flatten(0, 1), y.flatten()))
    first = (ranks[0]["losses"][0] + ranks[1]["losses"][0]) / 2
    assert first == pytest.approx(expected, abs=TOL)
    assert ranks[0]["sharded"] == "DTensor" and len(ranks[0]["losses"]) == 4
    assert ranks[0]["losses"][-1] != ranks[0]["losses"][0]

    # Loaded straight into shards: FSDP2's Shard(0) (uneven: 128 padded rows -> 64 + 64) and Shard(1).
    for r in ranks:
        assert r["placements"] == "(Shard(dim=0),)" and r["wte_local_rows"] == 64
        assert r["fsdp_equal"] and all(r["fsdp_equal"].values()), r["fsdp_equal"]
        assert r["col_equal"] and all(r["col_equal"].values()), r["col_equal"]

    # The 2-rank checkpoint, exported to HF in one process: transformers gives the trained logits.
    ckpt = tmp_path / "ckpt"
    verify_checkpoint(ckpt)
    main(["export", str(ckpt), str(tmp_path / "export"), "--format", "hf"])  # `lightning-disttrain export`
    assert "(Hugging Face format" in capsys.readouterr().out
    out = tmp_path / "export"
    trained = torch.tensor(ranks[0]["logits"])
    assert torch.equal(trained, torch.tensor(ranks[1]["logits"]))
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert (reloaded(input_ids=tokens()).logits - trained).abs().max() < TOL
    assert (hf_logits(hf, tokens()) - trained).abs().max() > 1e-3  # the trained weights went out, not the initial ones
    assert reloaded.config.vocab_size == VOCAB

    # The same through a default-format export file: identical tensors.
    from safetensors.torch import load_file

    exported = export_consolidated(ckpt, tmp_path / "model.pt")
    again = export_main([str(exported), str(tmp_path / "export2"), "--format", "hf"])
    a, b = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
