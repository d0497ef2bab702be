"""TokenDataModule without a Trainer: the global sample sequence, resume, data-parallel resizing, errors."""

import itertools

import numpy as np
import pytest
import torch

from lightning_disttrain.data import TokenDataModule, write_shard
from lightning_disttrain.data.sampling import TokenWindows, global_windows

SEQ = 16


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    """Two train shards and a val shard of random byte-tokenizer ids (each token value unique-ish)."""
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    write_shard(d / "toy_train_000000.bin", rng.integers(0, 257, 3000))
    write_shard(d / "toy_train_000001.bin", rng.integers(0, 257, 2001))
    write_shard(d / "toy_val_000000.bin", rng.integers(0, 257, 1500))
    return d


def make_dm(source, dp_size=1, dp_rank=0, consumed=0, **kwargs):
    kwargs = {"tokenizer": "bytes", "seq_len": SEQ, "batch_size": 4, "val_batches": 3, **kwargs}
    dm = TokenDataModule(str(source), **kwargs)
    dm.set_data_parallel(dp_size, dp_rank)
    dm.setup("fit")
    if consumed:
        dm.load_state_dict({"consumed_samples": consumed, "seed": dm.seed})
    return dm


def global_batches(source, dp_size, n, consumed=0, **kwargs):
    """The next n global batches as one (dp_size*B, T) tensor pair each: rank slices concatenated."""
    loaders = [iter(make_dm(source, dp_size, r, consumed, **kwargs).train_dataloader()) for r in range(dp_size)]
    out = []
    for _ in range(n):
        parts = [next(it) for it in loaders]
        out.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return out


def samples_of(batches):
    return torch.cat([x for x, _ in batches])


def test_batches_shape_dtype_and_shift(shard_dir):
    dm = make_dm(shard_dir)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, SEQ) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert dm.vocab_size == 257 and dm.tokenizer.name == "bytes" and dm.global_batch_size == 4


def test_windows_cover_each_shard_without_crossing(shard_dir):
    windows = TokenWindows(sorted(shard_dir.glob("*train*")), SEQ)
    assert len(windows) == (3000 - 1) // SEQ + (2001 - 1) // SEQ
    first_of_second = (3000 - 1) // SEQ
    assert windows.locate(first_of_second) == (1, 0) and windows.locate(first_of_second - 1) == (0, 2992 - SEQ)


def test_global_sample_is_pure_function_of_seed_and_index():
    a = global_windows(seed=7, start=0, count=50, n_windows=20)
    assert sorted(a[:20].tolist()) == list(range(20)), "each epoch is a permutation of all windows"
    assert sorted(a[20:40].tolist()) == list(range(20)) and not np.array_equal(a[:20], a[20:40])
    assert np.array_equal(global_windows(7, 13, 30, 20), a[13:43]), "any slice equals the full sequence's"
    assert not np.array_equal(global_windows(8, 0, 20, 20), a[:20])
    assert global_windows(7, 25, 3, 20, shuffle=False).tolist() == [5, 6, 7]


def test_resume_same_dp_size_gives_the_next_batches(shard_dir):
    full = global_batches(shard_dir, 2, 12)
    resumed = global_batches(shard_dir, 2, 6, consumed=6 * 8)
    for (x, y), (rx, ry) in zip(full[6:], resumed):
        assert torch.equal(x, rx) and torch.equal(y, ry)


@pytest.mark.parametrize("old_dp, new_dp", [(2, 1), (1, 2), (2, 3)])
def test_resume_on_another_dp_size_continues_the_global_sequence(shard_dir, old_dp, new_dp):
    steps_before = 5
    consumed = steps_before * 4 * old_dp  # 2 -> 3: 40 samples, not a multiple of 12: handled exactly
    before = global_batches(shard_dir, old_dp, steps_before)
    after = global_batches(shard_dir, new_dp, 4, consumed=consumed)
    uninterrupted = samples_of(global_batches(shard_dir, 1, (consumed + 4 * 4 * new_dp) // 4 + 1))
    assert torch.equal(samples_of(before), uninterrupted[:consumed])
    assert torch.equal(samples_of(after), uninterrupted[consumed : consumed + 4 * 4 * new_dp])


def test_ranks_get_disjoint_slices_of_one_global_batch(shard_dir):
    x0, _ = next(iter(make_dm(shard_dir, 2, 0).train_dataloader()))
    x1, _ = next(iter(make_dm(shard_dir, 2, 1).train_dataloader()))
    (g, _), = global_batches(shard_dir, 1, 1, batch_size=8)
    assert torch.equal(torch.cat([x0, x1]), g)


def test_training_stream_crosses_epochs_deterministically(shard_dir):
    dm = make_dm(shard_dir)
    n_windows = len(dm.train_windows)
    per_epoch = len(dm.train_dataloader())
    assert per_epoch == n_windows // 4
    loader = dm.train_dataloader()
    first = list(loader)
    assert len(first) == per_epoch
    seen = torch.cat([x for x, _ in first])
    assert len({tuple(r.tolist()) for r in seen}) == per_epoch * 4, "no window twice within an epoch"
    dm._consumed = per_epoch * 4  # as training would have counted; next iter starts there
    second = next(iter(loader))[0]
    expect = global_batches(shard_dir, 1, 1, consumed=per_epoch * 4)[0][0]
    assert torch.equal(second, expect)


def test_seed_changes_order_and_shuffle_false_is_corpus_order(shard_dir):
    a = next(iter(make_dm(shard_dir).train_dataloader()))[0]
    b = next(iter(make_dm(shard_dir, seed=1).train_dataloader()))[0]
    assert not torch.equal(a, b)
    plain = next(iter(make_dm(shard_dir, shuffle=False).train_dataloader()))[0]
    tokens = np.fromfile(shard_dir / "toy_train_000000.bin", dtype="<u2", offset=1024)
    assert torch.equal(plain[1], torch.from_numpy(tokens[SEQ : 2 * SEQ].astype(np.int64)))


def test_workers_give_the_same_batches(shard_dir):
    plain = list(itertools.islice(make_dm(shard_dir).train_dataloader(), 5))
    workers = list(itertools.islice(make_dm(shard_dir, num_workers=1).train_dataloader(), 5))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(plain, workers))


def test_validation_is_fixed_and_sharded_across_ranks(shard_dir):
    one = list(make_dm(shard_dir, batch_size=8).val_dataloader())
    r0 = list(make_dm(shard_dir, 2, 0).val_dataloader())
    r1 = list(make_dm(shard_dir, 2, 1).val_dataloader())
    assert len(one) == len(r0) == len(r1) == 3
    for (g, _), (a, _), (b, _) in zip(one, r0, r1):
        assert torch.equal(g, torch.cat([a, b]))
    tokens = np.fromfile(shard_dir / "toy_val_000000.bin", dtype="<u2", offset=1024)
    assert torch.equal(one[0][0][0], torch.from_numpy(tokens[:SEQ].astype(np.int64))), "val is in corpus order"
    consumed = make_dm(shard_dir, consumed=40, batch_size=8)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, consumed.val_dataloader())), "independent of training"


def test_val_batches_capped_and_disabled(shard_dir):
    assert len(make_dm(shard_dir, val_batches=1000).val_dataloader()) == (1500 - 1) // SEQ // 4
    assert make_dm(shard_dir, val_batches=0).val_dataloader() == []


def test_state_dict_round_trip(shard_dir):
    dm = make_dm(shard_dir, consumed=24)
    state = dm.state_dict()
    assert state["consumed_samples"] == 24 and state["seed"] == 1337 and state["seq_len"] == SEQ
    other = make_dm(shard_dir, seed=5)
    with pytest.warns(UserWarning, match="checkpoint's seed 1337"):
        other.load_state_dict(state)
    assert other.seed == 1337 and other.consumed_samples == 24
    assert torch.equal(next(iter(other.train_dataloader()))[0], next(iter(dm.train_dataloader()))[0])


def test_val_source_and_glob_sources(shard_dir):
    dm = make_dm(str(shard_dir / "toy_train_*.bin"), val_source=str(shard_dir / "toy_val_000000.bin"))
    assert [p.name for p in dm.shards.train] == ["toy_train_000000.bin", "toy_train_000001.bin"]
    assert [p.name for p in dm.shards.val] == ["toy_val_000000.bin"]
    single = make_dm(str(shard_dir / "toy_train_000000.bin"), val_batches=0)
    assert [p.name for p in single.shards.train] == ["toy_train_000000.bin"] and single.shards.val == ()


# ------------------------------------------------------------------ bad input


def test_unknown_tokenizer(shard_dir):
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt5'.*gpt2, r50k_base, bytes"):
        TokenDataModule(str(shard_dir), tokenizer="gpt5")


@pytest.mark.parametrize("kwargs", [{"seq_len": 0}, {"batch_size": 0}, {"val_batches": -1}, {"num_workers": -2}])
def test_bad_numbers(shard_dir, kwargs):
    with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be an integer"):
        TokenDataModule(str(shard_dir), tokenizer="bytes", **kwargs)


def test_corpus_smaller_than_one_global_batch(shard_dir):
    with pytest.raises(ValueError, match=r"fewer than one global batch of 320 samples.*Lower batch_size or seq_len"):
        make_dm(shard_dir, batch_size=160, dp_size=2)
    with pytest.raises(ValueError, match=r"validation split .* Set val_batches=0"):
        make_dm(shard_dir, batch_size=100)
    make_dm(shard_dir, batch_size=100, val_batches=0)  # training alone fits


def test_source_matching_nothing(tmp_path):
    with pytest.raises(ValueError, match="matches no files"):
        make_dm(str(tmp_path / "fineweb_train_*.bin"))
    with pytest.raises(ValueError, match="does not exist"):
        make_dm(str(tmp_path / "nope.bin"))
    with pytest.raises(ValueError, match="does not exist"):
        make_dm(str(tmp_path / "corpus.jsonl"), cache_dir=str(tmp_path / "cache"))


def test_bad_shards(tmp_path):
    (tmp_path / "bad_train.bin").write_bytes(b"\x07" * 4096)
    with pytest.raises(ValueError, match=r"bad_train\.bin is not a llm\.c token shard"):
        make_dm(str(tmp_path / "bad_train.bin"))
    path = write_shard(tmp_path / "cut" / "c_train.bin", np.arange(5000) % 257)
    path.write_bytes(path.read_bytes()[:3000])
    with pytest.raises(ValueError, match=r"c_train\.bin is truncated"):
        make_dm(str(path))


def test_token_ids_beyond_the_tokenizer(tmp_path):
    write_shard(tmp_path / "g_train.bin", np.arange(10_000) % 50257)
    with pytest.raises(ValueError, match=r"token id 9999, outside tokenizer 'bytes' \(n_vocab 257\)"):
        make_dm(str(tmp_path), val_batches=0)


def test_only_validation_shards(tmp_path):
    write_shard(tmp_path / "x_val_000000.bin", np.arange(100))
    with pytest.raises(ValueError, match="only validation shards"):
        make_dm(str(tmp_path))


@pytest.mark.parametrize("workers", [0, 2])
def test_seek_moves_training_mid_epoch_and_rebuilds_prefetched_batches(shard_dir, workers):
    """Fault tolerance's heal: ``seek`` moves the next trained batch to another global sample,
    mid-iteration. Batches the loader fetched before the seek are rebuilt when trained on; later
    ones are produced at the new position. Rank 1 of 2, so the slice is a rank's, not the batch."""
    from types import SimpleNamespace

    dm = make_dm(shard_dir, 2, 1, num_workers=workers)
    dm.trainer = SimpleNamespace(training=True, lightning_module=None)
    loader = iter(dm.train_dataloader())
    fetched = [next(loader) for _ in range(3)]  # batches 0, 1, 2 (a prefetching loop holds some ahead)
    trained = [dm.on_before_batch_transfer(fetched[0], 0)]  # global samples [0, 8)
    dm.seek(96)  # a peer is at global sample 96: the next trained batch starts there
    trained += [dm.on_before_batch_transfer(b, 0) for b in fetched[1:]]
    trained += [dm.on_before_batch_transfer(next(loader), 0) for _ in range(2)]
    expected = [global_batches(shard_dir, 2, 1, consumed=c)[0][0][4:] for c in (0, 96, 104, 112, 120)]
    for got, want in zip(trained, expected):
        assert torch.equal(got[0], want)
    # Without workers exactly the two fetched ahead; workers prefetch more (2 x prefetch_factor 2).
    assert dm.consumed_samples == 128 and dm.stale_batches_rebuilt == (2 if workers == 0 else 4)
    # A fresh iterator (next epoch, or after resume) starts at the position, without a double shift.
    assert torch.equal(next(iter(dm.train_dataloader()))[0], global_batches(shard_dir, 2, 1, consumed=128)[0][0][4:])
    with pytest.raises(ValueError, match="a data position is a number of global samples >= 0"):
        dm.seek(-1)
