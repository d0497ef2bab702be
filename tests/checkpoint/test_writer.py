"""CheckpointWriter in one process: sync/async saves, deferred removal, failures, overwrite, RNG."""

from __future__ import annotations

import json
import os
import random
import threading
import time

import numpy as np
import pytest
import torch
from ckpt_helpers import VOCAB, Wrapper, dcp_state, save, train_a_bit
from lightning_disttrain.models.gpt import GPT, GPTConfig
from disk_full import fill_disk
from torch.distributed.checkpoint import filesystem

from lightning_disttrain.checkpoint import MANIFEST_NAME, CheckpointWriter, load_sharded, rng, verify_checkpoint
from lightning_disttrain.checkpoint.dcp_io import CheckpointSaveError, Comm, _prepare_directory, aside_path, load_meta
from lightning_disttrain.checkpoint.discovery import find_latest_checkpoint


@pytest.fixture
def slow_writes(monkeypatch):
    """Make DCP's real file write take at least `delay` seconds (the write runs in the background)."""
    original = filesystem._FileSystemWriter.write_data

    def install(delay: float = 0.5, fail: bool = False):
        def write_data(self, plan, planner):
            time.sleep(delay)
            if fail:
                raise OSError("disk full (simulated)")
            return original(self, plan, planner)

        monkeypatch.setattr(filesystem._FileSystemWriter, "write_data", write_data)

    return install


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_sync_round_trip_restores_model_and_optimizer(ckpt, trained):
    module, opt = trained
    fresh = Wrapper(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5.0)  # a different lr: must come back as 1e-3
    load_sharded(ckpt, fresh, [[fresh_opt]], Comm())
    _assert_same(module, fresh)
    assert fresh_opt.param_groups[0]["lr"] == 1e-3
    for p, q in zip(module.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key])
    # Continuing from the restored copy is identical to continuing the original: the same batch
    # and one step of each restored optimizer give bitwise the same weights and moments.
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 257, (2, 16), generator=g)
    for m, o in ((module, opt), (fresh, fresh_opt)):
        m.model(x).float().square().mean().backward()
        o.step()
    _assert_same(module, fresh)
    for p, q in zip(module.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])
    assert load_meta(ckpt) == {"global_step": 2, "epoch": 0}


def test_checkpoints_with_the_nested_optimizer_form_still_load(tmp_path, trained):
    # Written before the optimizer state was saved flattened (parameter groups as lists of names).
    module, opt = trained
    old = tmp_path / "nested.ckpt"
    CheckpointWriter().save(old, dcp_state(module, opt, nested=True), {"global_step": 2, "epoch": 0},
                            global_step=2, epoch=0)
    fresh = Wrapper(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5.0)
    load_sharded(old, fresh, [[fresh_opt]], Comm())
    _assert_same(module, fresh)
    assert fresh_opt.param_groups[0]["lr"] == 1e-3
    for p, q in zip(module.parameters(), fresh.parameters()):
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])


def test_optimizer_count_mismatch_names_the_fix(ckpt):
    fresh = Wrapper()
    opts = [[torch.optim.AdamW(fresh.parameters())], [torch.optim.SGD(fresh.parameters(), lr=0.1)]]
    with pytest.raises(ValueError, match="holds 1 optimizer state.*configures 2.*configure_optimizers"):
        load_sharded(ckpt, fresh, opts, Comm())


def test_async_save_writes_the_manifest_only_after_the_files(tmp_path, trained, monkeypatch):
    # The (real) file write starts in the background and then waits for the test's go-ahead: if
    # `save` blocked on the write, it could not return before `release` is set.
    started, release = threading.Event(), threading.Event()
    original = filesystem._FileSystemWriter.write_data

    def gated(self, plan, planner):
        started.set()
        release.wait(timeout=30)
        return original(self, plan, planner)

    monkeypatch.setattr(filesystem._FileSystemWriter, "write_data", gated)
    module, opt = trained
    writer = CheckpointWriter(async_save=True)
    t0 = time.perf_counter()
    writer.save(tmp_path / "a.ckpt", dcp_state(module, opt), {"global_step": 2}, global_step=2)
    assert time.perf_counter() - t0 < 15, "save waited for the file write"
    assert started.wait(timeout=15) and not release.is_set()
    assert writer.in_flight == tmp_path / "a.ckpt"
    assert not (tmp_path / "a.ckpt" / MANIFEST_NAME).exists()
    assert not (tmp_path / "a.ckpt" / ".metadata").exists()
    # Training goes on and changes the weights in place; the checkpoint keeps the staged values.
    before = {k: v.clone() for k, v in module.state_dict().items()}
    train_a_bit(module, steps=1, seed=9)
    release.set()
    manifest = writer.wait()
    assert manifest is not None and manifest.extra["async_save"] is True
    assert verify_checkpoint(tmp_path / "a.ckpt").global_step == 2
    fresh = Wrapper(seed=3)
    load_sharded(tmp_path / "a.ckpt", fresh, [], Comm())
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, before[key]), key
    writer.close()


def test_removal_during_an_async_save_waits_for_it(tmp_path, trained, slow_writes):
    module, opt = trained
    old = save(tmp_path / "old.ckpt", module, opt, step=1)
    slow_writes(0.3)
    writer = CheckpointWriter(async_save=True)
    writer.save(tmp_path / "new.ckpt", dcp_state(module, opt), {}, global_step=2)
    writer.remove(old)  # what ModelCheckpoint does right after starting the new save
    assert old.is_dir(), "the last complete checkpoint must survive until the new one is complete"
    writer.wait()
    assert not old.exists() and verify_checkpoint(tmp_path / "new.ckpt")


def test_failed_async_write_raises_and_keeps_older_checkpoints(tmp_path, trained, slow_writes):
    module, opt = trained
    old = save(tmp_path / "old.ckpt", module, opt, step=1)
    slow_writes(0.0, fail=True)
    writer = CheckpointWriter(async_save=True)
    writer.save(tmp_path / "new.ckpt", dcp_state(module, opt), {}, global_step=2)
    writer.remove(old)
    with pytest.raises(RuntimeError, match="disk full"):
        writer.wait()
    assert verify_checkpoint(old)
    assert not (tmp_path / "new.ckpt" / MANIFEST_NAME).exists()
    assert writer.in_flight is None
    writer.close()


@pytest.mark.parametrize("where", ["rng_file", "dcp_shard"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_holds_retention(tmp_path, trained, where):
    module, opt = trained
    old = save(tmp_path / "step=1.ckpt", module, opt, step=1)
    writer = CheckpointWriter()
    # The disk fills up part-way through this rank's RNG file (written before DCP's collectives)
    # or through its DCP shard file (inside DCP's write, reported through DCP's own collectives).
    undo = fill_disk("step=2.ckpt" + ("/__" if where == "dcp_shard" else ""), budget=4096)
    try:
        with pytest.raises(CheckpointSaveError, match="No space left on device") as err:
            save(tmp_path / "step=2.ckpt", module, opt, step=2, writer=writer)
        writer.remove(old)  # what ModelCheckpoint(save_top_k=1) does next when it is told to go on
    finally:
        undo()
    assert err.value.path == str(tmp_path / "step=2.ckpt")
    assert verify_checkpoint(old).global_step == 1, "retention must not delete the last good checkpoint"
    assert not any((tmp_path / "step=2.ckpt").iterdir()), "the partial files are removed (they hold the disk)"
    assert find_latest_checkpoint(tmp_path) == old
    save(tmp_path / "step=3.ckpt", module, opt, step=3, writer=writer)  # space again: the next save works
    assert not old.exists(), "the deletion held back is done once a newer save is complete"
    assert verify_checkpoint(tmp_path / "step=3.ckpt").global_step == 3


def test_disk_full_while_overwriting_last_in_place_puts_the_old_one_back(tmp_path, trained):
    module, opt = trained
    last = save(tmp_path / "last.ckpt", module, opt, step=1)  # ModelCheckpoint(save_last=True) reuses the name
    undo = fill_disk("last.ckpt", budget=4096)
    try:
        with pytest.raises(CheckpointSaveError):
            save(last, module, opt, step=2)
    finally:
        undo()
    assert verify_checkpoint(last).global_step == 1 and not aside_path(last).exists()
    save(last, module, opt, step=3)
    assert verify_checkpoint(last).global_step == 3 and not aside_path(last).exists()


def test_a_process_killed_while_overwriting_in_place_leaves_the_old_one_discoverable(tmp_path, trained):
    module, opt = trained
    last = save(tmp_path / "last.ckpt", module, opt, step=1)
    refusal, aside = _prepare_directory(last)  # the start of the overwrite, then nothing: killed
    assert refusal is None and aside == aside_path(last) and not any(last.iterdir())
    assert find_latest_checkpoint(tmp_path) == aside and verify_checkpoint(aside).global_step == 1


def test_overwrite_drops_stale_files_and_never_writes_through_a_link(tmp_path, trained):
    module, opt = trained
    target = save(tmp_path / "step=1.ckpt", module, opt, step=1)
    target_manifest = (target / MANIFEST_NAME).read_text()
    os.symlink("step=1.ckpt", tmp_path / "last.ckpt")
    save(tmp_path / "last.ckpt", module, opt, step=2)  # Lightning's save_last=True reuses the name
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert (target / MANIFEST_NAME).read_text() == target_manifest
    (tmp_path / "last.ckpt" / "__7_0.distcp").write_bytes(b"stale shard of a bigger world")
    save(tmp_path / "last.ckpt", module, opt, step=3)
    assert not (tmp_path / "last.ckpt" / "__7_0.distcp").exists()
    assert verify_checkpoint(tmp_path / "last.ckpt").global_step == 3


def test_rng_state_is_saved_per_rank_and_restored(ckpt):
    def draw():
        return torch.rand(4), random.random(), float(np.random.rand())

    rng.restore_rng_state(json.loads(rng.rng_file(ckpt, 0).read_text()))
    expected = draw()
    draw(), draw()  # the streams move on...
    rng.apply_rank_rng(*rng.load_rank_rng(ckpt, rank=0, saved_ranks=1))  # ...and are put back
    got = draw()
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]


def test_ranks_beyond_the_saved_ones_get_distinct_deterministic_seeds(ckpt):
    assert rng.load_rank_rng(ckpt, rank=0, saved_ranks=1)[0] is not None
    (s1, seed1), (_, seed2), (_, seed1_again) = (rng.load_rank_rng(ckpt, r, saved_ranks=1) for r in (1, 2, 1))
    assert s1 is None and seed1 == seed1_again and seed1 != seed2
    rng.apply_rank_rng(None, seed1)
    a = torch.rand(3)
    rng.apply_rank_rng(None, seed1)
    assert torch.equal(a, torch.rand(3))
    assert rng.load_rank_rng(ckpt, rank=0, saved_ranks=0) == (None, None)


def test_saving_over_a_directory_that_is_not_a_checkpoint_refuses(tmp_path, trained):
    module, opt = trained
    precious = tmp_path / "experiments"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not a checkpoint directory.*new path"):
        save(precious, module, opt)
    assert (precious / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert verify_checkpoint(save(empty, module, opt))  # an empty directory is fine


def test_hybrid_optimizer_parts_round_trip(tmp_path, trained):
    # GPTModule's Muon option: one HybridOptimizer whose `.optimizers` DCP gets as a list.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lightning_disttrain.checkpoint.dcp_io import unwrap_optimizer
    from lightning_disttrain.optim import build_optimizer

    module, _ = trained
    hybrid = build_optimizer(module, "muon", lr=1e-3, muon_lr=0.02)
    parts = unwrap_optimizer(hybrid)
    assert len(parts) == 2 and isinstance(parts[0], torch.optim.Muon)
    x = torch.randint(0, 257, (2, 16))
    module.model(x).float().square().mean().backward()
    hybrid.step()
    state = {"state_dict": module.state_dict(), "optimizer_0": get_optimizer_state_dict(module, parts)}
    CheckpointWriter().save(tmp_path / "h.ckpt", state, {})
    fresh = Wrapper(seed=4)
    fresh_parts = unwrap_optimizer(build_optimizer(fresh, "muon", lr=1e-3, muon_lr=0.02))
    load_sharded(tmp_path / "h.ckpt", fresh, [fresh_parts], Comm())
    _assert_same(module, fresh)
    for old, new in zip(parts, fresh_parts):
        for p, q in zip((p for g in old.param_groups for p in g["params"]),
                        (q for g in new.param_groups for q in g["params"])):
            for key, value in old.state[p].items():
                assert torch.equal(value, new.state[q][key]), key


def test_a_moe_muon_checkpoint_from_before_expert_muon_says_how_to_resume(tmp_path):
    # Before 2026-12-04 optimizer='muon' left a mixture of experts' stacks to AdamW (2 parts); now
    # they take ExpertMuon (3 parts). The old checkpoint resumes with muon_experts=False, and the
    # default run's load names that instead of DCP's bare missing key.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lightning_disttrain.checkpoint.dcp_io import unwrap_optimizer
    from lightning_disttrain.optim import build_optimizer

    def moe(seed):
        module = Wrapper(seed=seed)
        module.model = GPT(GPTConfig.from_name("tiny-moe", vocab_size=VOCAB, n_layer=2))
        return module

    module = moe(0)
    old = build_optimizer(module, "muon", muon_experts=False)
    assert [type(p).__name__ for p in old.optimizers] == ["ShardedMuon", "AdamW"]
    module.model(torch.randint(0, VOCAB, (2, 16))).float().square().mean().backward()
    old.step()
    state = {"state_dict": module.state_dict(), "optimizer_0": get_optimizer_state_dict(module, old.optimizers)}
    CheckpointWriter().save(tmp_path / "old.ckpt", state, {})
    now = moe(1)
    with pytest.raises(ValueError, match=r"muon_experts=False"):
        load_sharded(tmp_path / "old.ckpt", now, [unwrap_optimizer(build_optimizer(now, "muon"))], Comm())
    with pytest.raises(ValueError, match=r"holds 2 optimizers, this run has 3 .*muon_experts=False"):
        build_optimizer(now, "muon").load_state_dict({"optimizers": [o.state_dict() for o in old.optimizers]})
    again = moe(2)
    load_sharded(tmp_path / "old.ckpt", again, [unwrap_optimizer(build_optimizer(again, "muon", muon_experts=False))],
                 Comm())
    _assert_same(module, again)


@pytest.mark.parametrize("version, pinned", [((2, 11), False), ((2, 13), True)])
def test_async_staging_follows_what_the_torch_version_can_stage(monkeypatch, caplog, version, pinned):
    """On CUDA the writer keeps one pinned DefaultStager; on a torch whose DefaultStager cannot copy a
    DTensor (2.11: KeyError <class 'type'>, seen on an H200) it leaves staging to the storage writer
    (``async_stager=None``) and says so once. (A DefaultStager with non-blocking copies needs an
    accelerator to be built: here its options are recorded instead.)"""
    from torch.distributed.checkpoint import staging

    from lightning_disttrain import _torch_compat
    from lightning_disttrain.checkpoint import dcp_io

    built = []
    monkeypatch.setattr(staging, "DefaultStager", lambda options: built.append(options) or options)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_torch_compat, "torch_version", lambda: version)
    monkeypatch.setattr(dcp_io, "_warned_unpinned", [])
    writer = CheckpointWriter(async_save=True)
    with caplog.at_level("WARNING", logger=dcp_io.__name__):
        first, second = writer._get_stager(), writer._get_stager()
    warned = [r for r in caplog.records if "cannot stage DTensors" in r.getMessage()]
    if pinned:
        assert len(built) == 1 and first is second is built[0] and built[0].use_pinned_memory and not warned
    else:
        assert first is second is None and not built and len(warned) == 1
