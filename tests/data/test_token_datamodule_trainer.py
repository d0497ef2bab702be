"""TokenDataModule under a real Lightning Trainer: exact resume, strategy-given data parallelism, errors."""

from types import SimpleNamespace

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader

from lightning_disttrain.data import TokenDataModule, write_shard

SEQ = 8


class Recorder(L.LightningModule):
    """A tiny model that remembers every batch it trains and validates on."""

    def __init__(self, block_size=None, vocab_size=None):
        super().__init__()
        self.emb = torch.nn.Embedding(257, 4)
        self.head = torch.nn.Linear(4, 257)
        if block_size is not None:
            self.config = SimpleNamespace(block_size=block_size, vocab_size=vocab_size or 257)
        self.train_batches, self.val_batches = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.train_batches.append(x.clone())
        logits = self.head(self.emb(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def validation_step(self, batch, batch_idx):
        self.val_batches.append(batch[0].clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer_shards")
    rng = np.random.default_rng(3)
    write_shard(d / "t_train_000000.bin", rng.integers(0, 257, 4000))
    write_shard(d / "t_val_000000.bin", rng.integers(0, 257, 400))
    # 20 windows of 8 tokens: one Lightning epoch is 5 batches of 4, so runs cross epochs.
    write_shard(d / "small" / "s_train_000000.bin", rng.integers(0, 257, 20 * SEQ + 1))
    write_shard(d / "small" / "s_val_000000.bin", rng.integers(0, 257, 8 * SEQ + 1))
    return d


def fit(source, max_steps, ckpt_path=None, save_to=None, accumulate=1, validate=False, callbacks=(),
        strategy="auto", model=None, **dm_kwargs):
    dm = TokenDataModule(str(source), **{"tokenizer": "bytes", "seq_len": SEQ, "batch_size": 4,
                                         "val_batches": 2 if validate else 0, **dm_kwargs})
    model = model or Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, accumulate_grad_batches=accumulate,
        limit_val_batches=None if validate else 0, num_sanity_val_steps=0, enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks), logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return model, dm, trainer


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for i, (a, b) in enumerate(zip(batches_a, batches_b)):
        assert torch.equal(a, b), f"batch {i} differs"


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_gives_exactly_the_uninterrupted_batches(shards, tmp_path, accumulate):
    full, _, _ = fit(shards, 12, accumulate=accumulate)
    first, dm, _ = fit(shards, 6, save_to=tmp_path / "step6.ckpt", accumulate=accumulate)
    assert dm.consumed_samples == 6 * accumulate * 4, "prefetched-but-unused batches are not counted"
    ckpt = torch.load(tmp_path / "step6.ckpt", weights_only=False)
    assert ckpt["TokenDataModule"]["consumed_samples"] == 6 * accumulate * 4
    second, dm2, trainer = fit(shards, 12, ckpt_path=tmp_path / "step6.ckpt", accumulate=accumulate)
    assert trainer.global_step == 12 and len(full.train_batches) == 12 * accumulate
    assert_same(first.train_batches, full.train_batches[: 6 * accumulate])
    assert_same(second.train_batches, full.train_batches[6 * accumulate :])
    assert dm2.consumed_samples == 12 * accumulate * 4


def test_resume_from_a_checkpoint_saved_mid_run(shards, tmp_path):
    # ModelCheckpoint saves in on_train_batch_end, while the loader has already prefetched the
    # next batch: the saved position must still be the batch after the last one trained on.
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1, filename="{step}")
    full, _, _ = fit(shards / "small", 12, validate=True, callbacks=[every])
    second, _, _ = fit(shards / "small", 12, ckpt_path=tmp_path / "step=5.ckpt", validate=True)
    assert_same(second.train_batches, full.train_batches[5:])
    # Validation is the same fixed 2 batches at every epoch end, in both runs.
    assert len(full.val_batches) >= 4 and len(second.val_batches) >= 2
    assert_same(second.val_batches, full.val_batches[-len(second.val_batches) :])
    assert all(torch.equal(v, full.val_batches[i % 2]) for i, v in enumerate(full.val_batches))


def test_epochs_continue_the_sample_sequence(shards):
    model, dm, trainer = fit(shards / "small", 12)
    assert trainer.current_epoch >= 2, "5 batches per epoch: 12 steps span three epochs"
    expected = TokenDataModule(str(shards / "small"), tokenizer="bytes", seq_len=SEQ, batch_size=20, val_batches=0)
    expected.setup("fit")
    loader = expected.train_dataloader()
    data_epochs = []
    for epoch in range(3):  # each data epoch: a different permutation of all 20 windows
        expected._consumed = 20 * epoch
        data_epochs.append(next(iter(loader))[0])
    assert torch.equal(torch.cat(model.train_batches), torch.cat(data_epochs)[:48])


class TwoReplicaRankOne(SingleDeviceStrategy):
    """A single-device strategy claiming to be data-parallel rank 1 of 2 (like a TP rank of replica 1)."""

    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": 2, "rank": 1}


def test_data_parallel_rank_comes_from_the_strategy(shards):
    model, dm, _ = fit(shards, 3, strategy=TwoReplicaRankOne(device=torch.device("cpu")))
    assert dm.data_parallel == (2, 1) and dm.global_batch_size == 8 and dm.consumed_samples == 24
    manual = TokenDataModule(str(shards), tokenizer="bytes", seq_len=SEQ, batch_size=4, val_batches=0)
    manual.set_data_parallel(2, 1)
    manual.setup("fit")
    assert_same(model.train_batches, [x for x, _ in list(manual.train_dataloader())[:3]])


def test_lightning_keeps_our_sampler_under_ddp(shards):
    # Lightning swaps in a DistributedSampler for loaders whose sampler is not one; ours must be kept.
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    dm = TokenDataModule(str(shards), tokenizer="bytes", seq_len=SEQ, batch_size=4, val_batches=2)
    dm.set_data_parallel(2, 0)
    dm.setup("fit")
    connector = trainer._data_connector
    assert connector._requires_distributed_sampler(DataLoader(list(range(8))))  # the control: plain loaders
    assert not connector._requires_distributed_sampler(dm.train_dataloader())
    assert not connector._requires_distributed_sampler(dm.val_dataloader())


def test_module_on_before_batch_transfer_still_runs(shards):
    class Doubling(Recorder):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch[0] * 0, batch[1]

    model, dm, _ = fit(shards, 2, model=Doubling())
    assert all(not b.any() for b in model.train_batches) and dm.consumed_samples == 8


def test_seq_len_above_block_size(shards):
    with pytest.raises(ValueError, match=r"seq_len=8 exceeds the model's block_size=4"):
        fit(shards, 1, model=Recorder(block_size=4))
    fit(shards, 1, model=Recorder(block_size=8))


def test_model_vocab_smaller_than_tokenizer(shards):
    with pytest.raises(ValueError, match=r"vocab_size=100 is smaller than .*n_vocab=257"):
        fit(shards, 1, model=Recorder(block_size=8, vocab_size=100))


def test_model_that_adopts_the_data_vocab_in_configure_model(shards):
    # GPTModule takes the datamodule's vocab_size in configure_model, after the datamodule's setup.
    class Adopting(Recorder):
        def configure_model(self):
            self.config.vocab_size = self.trainer.datamodule.vocab_size

    model, _, _ = fit(shards, 1, model=Adopting(block_size=8, vocab_size=100))
    assert model.config.vocab_size == 257


def test_training_step_with_dataloader_iter_is_refused(shards):
    class IterStep(Recorder):
        def training_step(self, dataloader_iter):
            return super().training_step(next(dataloader_iter), 0)

    with pytest.raises(ValueError, match="dataloader_iter"):
        fit(shards, 1, model=IterStep())


class RankRecorder(Recorder):
    """Saves the batches each process trains on, since DDP's processes do not share memory."""

    def __init__(self, out_dir):
        super().__init__()
        self.out_dir = str(out_dir)

    def on_train_end(self):
        torch.save({"batches": self.train_batches, "dp": self.trainer.datamodule.data_parallel,
                    "consumed": self.trainer.datamodule.consumed_samples},
                   f"{self.out_dir}/rank{self.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_real_ddp_two_processes_then_resume_on_one(shards, tmp_path):
    """Two CPU processes under Lightning's DDP: each rank gets its slice, the global sequence is the
    single-process one, and a checkpoint from 2 ranks resumes on 1 with the next samples."""
    dm_kwargs = {"tokenizer": "bytes", "seq_len": SEQ, "batch_size": 4, "val_batches": 0}
    # The checkpoint is written inside the DDP processes: after ddp_fork the parent's trainer has
    # no loop state to save.
    every = ModelCheckpoint(dirpath=tmp_path, filename="ddp", every_n_train_steps=4, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=4, limit_val_batches=0,
                        callbacks=[every], logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(RankRecorder(tmp_path), datamodule=TokenDataModule(str(shards), **dm_kwargs))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["dp"] for r in ranks] == [(2, 0), (2, 1)] and all(r["consumed"] == 32 for r in ranks)
    ddp_samples = torch.cat([torch.cat([a, b]) for a, b in zip(ranks[0]["batches"], ranks[1]["batches"])])

    full, _, _ = fit(shards, 16)  # one process, batch 4: the same global sample sequence
    assert torch.equal(ddp_samples, torch.cat(full.train_batches)[:32])
    resumed, dm, _ = fit(shards, 8, ckpt_path=tmp_path / "ddp.ckpt")  # global_step 4 -> 8 on one rank
    assert dm.consumed_samples == 32 + 16
    assert torch.equal(torch.cat(resumed.train_batches), torch.cat(full.train_batches)[32:48])


def test_with_the_real_gpt_module(shards):
    from lightning_disttrain.module import GPTModule

    overrides = {"n_layer": 1, "n_head": 2, "n_kv_head": 2, "n_embd": 16, "block_size": SEQ}
    with pytest.raises(ValueError, match=r"seq_len=16 exceeds the model's block_size=8"):
        fit(shards, 1, model=GPTModule("tiny", model_overrides=overrides), seq_len=16)
    module = GPTModule("tiny", model_overrides=overrides, max_steps=3)
    _, dm, trainer = fit(shards, 3, model=module)
    assert trainer.global_step == 3 and module.config.vocab_size == dm.vocab_size == 257
    assert dm.consumed_samples == 12
