"""QK-clip (``callbacks.QKClip``, MuonClip with Muon; issue 41): each head's largest logit is
measured exactly (against the explicit score matrix; per cp rank through the key ring), a clip
brings the heads over tau back to tau on the same inputs (multi-head and grouped-query, with
biases), a hard-trained model's logits stay bounded where the unclipped run's pass tau, and the
same clip runs under tensor, context, pipeline and data (FSDP2) parallel: losses and every step's
largest logit equal one process's (qk_clip_worker.py)."""

from __future__ import annotations

import math

import pytest
import torch

import qk_clip_worker as worker
from dist_utils import in_this_process
from lightning_disttrain.callbacks import QKClip
from lightning_disttrain.callbacks.qk_clip import clip_heads_
from lightning_disttrain.models import max_logit
from lightning_disttrain.models.context_parallel import local_positions
from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.models.ring_attention import LocalRing

WORKER, LAUNCH = "qk_clip_worker", {2: ["tp2", "cp2", "pp2", "fsdp2", "fsdp2_muon", "fsdp2_accum"],
                                    4: ["fsdp2_tp2"]}  # the suite's launches


def _explicit(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per query head, the largest causal logit from the whole score matrix."""
    t, groups = q.size(2), q.size(1) // k.size(1)
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) / math.sqrt(q.size(-1))
    return scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize(("chunk", "min_rows"), [(1 << 24, 128), (50, 1), (50, 5), (400, 3)])
def test_max_logit_equals_the_explicit_score_matrix_in_tiles(monkeypatch, kv_heads, chunk, min_rows):
    # one tile; a row and a key per tile; 5 rows x keys one at a time; 3 rows x 4-key tiles
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 12, 8), torch.randn(2, kv_heads, 12, 8)
    monkeypatch.setattr(max_logit, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(max_logit, "MIN_ROWS", min_rows)
    assert torch.allclose(max_logit.causal_max_logit(q, k), _explicit(q, k), atol=1e-6)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_ring_max_logit_over_the_cp_ranks_equals_the_whole_sequence(size):
    torch.manual_seed(size)
    seq = 2 * size * 3
    q, k = torch.randn(2, 4, seq, 8), torch.randn(2, 2, seq, 8)

    def rank(r, shift):
        mine = local_positions(seq, r, size)
        return max_logit.ring_max_logit(q[:, :, mine], k[:, :, mine], r, size, shift)

    per_rank = LocalRing(size).run(rank)
    assert torch.allclose(torch.stack(per_rank).amax(0), _explicit(q, k), atol=1e-6)


@pytest.mark.parametrize(("kv_heads", "bias"), [(4, False), (4, True), (2, True)])
def test_a_clip_brings_each_head_over_tau_back_to_tau_on_the_same_inputs(kv_heads, bias):
    # one layer: a clip of a layer changes the inputs of the layers after it
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_name("tiny", n_layer=1, n_embd=32, n_head=4, n_kv_head=kv_heads, vocab_size=64,
                                    block_size=16, bias=bias))
    with torch.no_grad():
        for block in model.blocks:
            for linear in (block.attn.wq, block.attn.wk):
                linear.weight.mul_(8)
                if bias:
                    linear.bias.normal_(0, 2)
    x = torch.randint(0, 64, (3, 16))
    attns = [b.attn for b in model.blocks]

    def measure():
        for a in attns:
            a.track_max_logit, a.max_logit = True, None
        model(x)
        return torch.stack([a.max_logit for a in attns])

    before = measure()
    tau = float(before.median())
    gamma = torch.where(before > tau, tau / before, torch.ones_like(before))
    for a, g in zip(attns, gamma):
        clip_heads_(a, g)
    after = measure()
    over = before > tau
    assert over.any() and (~over).any()
    if kv_heads == 4:  # each head's own query and key rows: exactly tau, the others untouched
        assert torch.allclose(after[over], torch.full_like(after[over], tau), rtol=1e-5)
        assert torch.equal(after[~over], before[~over])
    else:  # grouped keys untouched: the clipped heads' queries scaled by gamma
        assert torch.allclose(after[over], torch.full_like(after[over], tau), rtol=1e-5)
        assert torch.allclose(after[~over], before[~over], rtol=1e-6)


@pytest.mark.parametrize("tau", [0, -1.0, float("nan"), float("inf"), "100", True])
def test_tau_must_be_a_positive_number(tau):
    with pytest.raises(ValueError, match="tau"):
        QKClip(tau=tau)


def test_qk_norm_is_refused_before_any_step():
    import lightning as L

    from lightning_disttrain import GPTModule

    module = GPTModule("tiny", vocab_size=64, model_overrides=dict(n_layer=1, n_embd=16, n_head=2, qk_norm=True))
    trainer = L.Trainer(accelerator="cpu", max_steps=1, callbacks=[QKClip(tau=10)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="qk_norm=False"):
        trainer.fit(module, train_dataloaders=[(torch.zeros(1, 8, dtype=torch.long),) * 2])
    assert trainer.global_step == 0


@pytest.fixture(scope="module")
def single():
    return {run: in_this_process(worker.fit_run, run, 1)
            for run in ("one", "one_noclip", "one_muon", "one_mha", "one_accum")}


def test_the_clip_bounds_the_logits_where_the_unclipped_run_passes_tau(single):
    tau, clipped, free = worker.TAU, single["one"], single["one_noclip"]
    assert max(max(h) for h in free["final"]) > 3 * tau  # unclipped: the logits grow well past tau
    assert max(max(h) for h in clipped["final"]) <= 1.2 * tau  # clipped: held near tau
    assert sum(clipped["clipped"]) > 0 and clipped["clipped"][0] == 0
    # the step's largest logit is measured before its clip: it passes tau by one step's growth at most
    assert max(clipped["max_logits"]) < max(max(h) for h in free["final"])
    muon = single["one_muon"]  # MuonClip
    assert sum(muon["clipped"]) > 0 and max(max(h) for h in muon["final"]) <= 1.2 * tau
    assert all(run["tracking_off"] for run in single.values())  # fit's end turns the recording off
    for reference in ("one_mha", "one_accum"):  # the layouts' other references clip too
        assert sum(single[reference]["clipped"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "run"), [(2, "tp2"), (2, "cp2"), (2, "pp2"), (2, "fsdp2"), (2, "fsdp2_muon"),
                                              (2, "fsdp2_accum"), (4, "fsdp2_tp2")])
def test_the_clip_under_each_layout_equals_one_process(launched, single, devices, run):
    # tp2: each rank its two heads (one key head each); cp2: each rank's queries over the key ring;
    # pp2: each stage its layer; fsdp2: each rank half the data, its rows of the weights; fsdp2_tp2:
    # FSDP2 over tensor parallel (the query rows _StridedShard over dp, Shard over tp), multi-head
    # attention with biases (query and key rows, weights and biases, scaled); fsdp2_accum: two
    # micro-batches per optimizer step (one clip per step, over both micro-batches' logits)
    # The losses agree to fp32 rounding (1e-5); the logits, products of the query and key weights, to
    # 5e-4 relative: AdamW's first steps are sign-like (m / sqrt(v) = sign(g)), so a weight whose
    # gradient is at the rounding level moves by +-lr depending on the order of a sum (measured
    # 0.4-2.1e-4 over these layouts; Muon 0.7e-4).
    one = single[{"fsdp2_muon": "one_muon", "fsdp2_tp2": "one_mha", "fsdp2_accum": "one_accum"}.get(run, "one")]
    for rank in launched(WORKER, devices)[run]:
        assert rank["losses"] == pytest.approx(one["losses"], abs=1e-5)
        assert rank["max_logits"] == pytest.approx(one["max_logits"], rel=5e-4)
        assert rank["clipped"] == one["clipped"]
        if "final" in rank:
            assert [h for layer in rank["final"] for h in layer] == pytest.approx(
                [h for layer in one["final"] for h in layer], rel=5e-4)
