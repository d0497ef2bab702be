"""`TokenDataModule`: memory-mapped token shards as a stateful, data-parallel-aware LightningDataModule.

    dm = TokenDataModule(source="embedded", tokenizer="gpt2", seq_len=256, batch_size=8)
    trainer.fit(model, datamodule=dm)            # pass the datamodule itself, see "Resume"

Batches are `(x, y)` int64 tensors of shape (batch_size, seq_len), y = x shifted by one token.
Which windows they hold is fixed by the seed and a global sample index (see `sampling.py`):
global batch k is global samples [k*G, (k+1)*G) with G = batch_size * dp_size, and
data-parallel rank r gets the slice [r*B, (r+1)*B).

Data-parallel size and rank come from the strategy's `distributed_sampler_kwargs`, not from the
global rank: under tensor or pipeline parallelism several ranks share one model replica and must
see the same batch, and the strategy is what knows the data-parallel mesh. Strategies without
it (single device) count as (1, 0).

Resume: the datamodule counts the global samples *consumed by training* in
`on_before_batch_transfer`, which Lightning's training loop calls exactly once per batch it
trains on (training_epoch_loop.py, `advance`), after fetching, so batches the loader prefetched
but training never used are not counted. The count and the seed are saved in the checkpoint by
`state_dict`; after `load_state_dict` the train loader starts at that global sample. Because the
count is in global samples, a run may resume on a different number of data-parallel ranks: the
new run's first global batch is the next G' samples of the same sequence, whether or not the
count is a multiple of the new G' (batch boundaries shift, the sample sequence does not).
Validation is always the first `val_batches` global batches of the val split, in order.

One consequence of counting in that hook: a LightningModule's own `on_before_batch_transfer` is
called by ours (Lightning would otherwise ignore it and warn), and `training_step(dataloader_iter)`
is refused, since Lightning skips the hook in that mode.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import lightning.pytorch as L
import numpy as np
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.utils.data import DataLoader

from .sampling import GlobalSampleSampler, TokenWindows
from .shards import read_shard
from .sources import ShardSet, check_source_spelling, is_shard_source, resolve_source
from .tokenizer import canonical_tokenizer_name, get_tokenizer

log = logging.getLogger(__name__)
STATE_VERSION = 1
VOCAB_CHECK_TOKENS = 1 << 20  # tokens read from the first and last shard to check ids < n_vocab


class TokenDataModule(L.LightningDataModule):
    """Train/val batches of token windows from `source`, resumable to the exact batch.

    Args:
        source: "embedded" (the Python stdlib's sources, no download), a `.bin` shard, a
            directory of shards, a glob (`data/fineweb_*.bin`; names with "val" are validation,
            names with "train" training), a local .txt/.jsonl/.parquet file, or a Hugging Face
            dataset name. Non-shard sources are tokenized once and cached (see `sources.py`). A
            path that does not exist, or a misspelt keyword, is an error, never a hub lookup.
        tokenizer: "gpt2" (alias "r50k_base") or "bytes"; must be the one the shards were made with.
        seq_len: tokens per sample (the model's context); windows are seq_len + 1 tokens.
        batch_size: micro-batch per data-parallel rank.
        val_batches: global batches in the fixed validation set (0: no validation).
        seed: fixes the order of training windows; restored from a checkpoint on resume.
        num_workers: DataLoader worker processes (reading memory maps is cheap: 0 is often enough).
        pin_memory: pin host memory for faster copies to a GPU.
        cache_dir: where prepared sources are cached (default $LIGHTNING_DISTTRAIN_CACHE or
            ~/.cache/lightning_disttrain/tokens).
        val_source: shards for validation, overriding the val files of `source`.
        shuffle: shuffle training windows per epoch (False: corpus order, for debugging).
        val_fraction: share of documents (or of tokens, when there are too few documents) that
            go to validation when a non-shard source is prepared (see `prepare`).
        val_docs: take exactly the first `val_docs` documents as validation instead of
            `val_fraction`.
        text_field: the text column of json/jsonl/parquet/hub sources.
        dataset_config: the configuration name passed to `datasets.load_dataset` (hub datasets).
        split: the split passed to `datasets.load_dataset` (hub datasets).
        streaming: stream a hub dataset instead of downloading it (`datasets.load_dataset`).
        max_docs: stop preparing after this many documents (smoke tests, quick experiments).
            `val_fraction` through `max_docs` only affect non-shard sources, and are part of
            their cache key.
        num_proc: processes for preparing; default all cores.
    """

    def __init__(
        self,
        source: str = "embedded",
        tokenizer: str = "gpt2",
        seq_len: int = 256,
        batch_size: int = 8,
        val_batches: int = 20,
        seed: int = 1337,
        num_workers: int = 0,
        pin_memory: bool = False,
        cache_dir: str | None = None,
        val_source: str | None = None,
        shuffle: bool = True,
        val_fraction: float = 0.01,
        val_docs: int | None = None,
        text_field: str = "text",
        dataset_config: str | None = None,
        split: str = "train",
        streaming: bool = False,
        max_docs: int | None = None,
        num_proc: int | None = None,
    ) -> None:
        super().__init__()
        for name, value, low in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1),
                                 ("val_batches", val_batches, 0), ("num_workers", num_workers, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
        self.save_hyperparameters()
        self.source = os.fspath(source)
        # Only the spelling here: paths are checked when the data is needed (prepare_data, setup),
        # since a subclass may create them in its own prepare_data.
        check_source_spelling(self.source)
        self._tokenizer = get_tokenizer(tokenizer)  # unknown names fail here, before any work
        self.tokenizer_name = canonical_tokenizer_name(tokenizer)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_batches = val_batches
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.cache_dir = cache_dir
        self.val_source = val_source
        self.shuffle = shuffle
        self.prepare_kwargs = dict(val_fraction=val_fraction, val_docs=val_docs, text_field=text_field,
                                   dataset_config=dataset_config, split=split, streaming=streaming, max_docs=max_docs)
        self.num_proc = num_proc
        self.shards: ShardSet | None = None
        self.train_windows: TokenWindows | None = None
        self.val_windows: TokenWindows | None = None
        self._consumed = 0
        self._data_parallel_override: tuple[int, int] | None = None
        self._train_global_batch: int | None = None
        self._shift = 0  # samples the train loader's batches moved by (``seek``)
        self._train_sampler: GlobalSampleSampler | None = None
        self.stale_batches_rebuilt = 0
        """Batches fetched before a ``seek`` and rebuilt from the new position when trained on."""

    # ---------------------------------------------------------------- public properties

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.n_vocab

    @property
    def consumed_samples(self) -> int:
        """Global samples consumed by training so far (what a checkpoint stores)."""
        return self._consumed

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(dp_size, dp_rank): set explicitly, else the strategy's, else (1, 0)."""
        return self._data_parallel("distributed_sampler_kwargs")

    def _data_parallel(self, attribute: str) -> tuple[int, int]:
        if self._data_parallel_override is not None:
            return self._data_parallel_override
        strategy = getattr(self.trainer, "strategy", None)
        kwargs = getattr(strategy, attribute, None) or getattr(strategy, "distributed_sampler_kwargs", None)
        if not kwargs:
            return 1, 0
        return max(1, int(kwargs.get("num_replicas", 1))), int(kwargs.get("rank", 0))

    def set_data_parallel(self, dp_size: int, dp_rank: int) -> None:
        """Fix the data-parallel size and rank, for loops without a Lightning Trainer (Fabric, tests)."""
        if not (isinstance(dp_size, int) and isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_size={dp_size}, dp_rank={dp_rank}.")
        self._data_parallel_override = (dp_size, dp_rank)

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer micro-step across all data-parallel ranks: batch_size * dp_size."""
        return self.batch_size * self.data_parallel[0]

    # ---------------------------------------------------------------- Lightning hooks

    def prepare_data(self) -> None:
        # Lightning runs this on local rank 0 only (behind a barrier without timeout); the other
        # ranks find the cache complete in `setup`.
        if not is_shard_source(self.source):
            resolve_source(self.source, self.tokenizer_name, cache_dir=self.cache_dir,
                           val_source=self.val_source, prepare_kwargs=self._prepare_kwargs_for_run())

    def setup(self, stage: str | None = None) -> None:
        if self.train_windows is None:
            self.shards = resolve_source(self.source, self.tokenizer_name, cache_dir=self.cache_dir,
                                         val_source=self.val_source, prepare_kwargs=self._prepare_kwargs_for_run())
            self._check_tokenizer_matches(self.shards)
            self.train_windows = TokenWindows(self.shards.train, self.seq_len)
            self.val_windows = TokenWindows(self.shards.val, self.seq_len) if self.shards.val else None
            self._check_token_ids(self.shards)
        if stage in (None, "fit"):
            self._check_corpus_fits(self.global_batch_size)
        self._check_model()

    def train_dataloader(self) -> DataLoader:
        self._require_setup()
        self._check_model_vocab()
        dp_size, dp_rank = self.data_parallel
        global_batch = self.batch_size * dp_size
        self._check_corpus_fits(global_batch)
        self._train_global_batch = global_batch
        sampler = GlobalSampleSampler(
            self.train_windows, batch_size=self.batch_size, dp_size=dp_size, dp_rank=dp_rank, seed=self.seed,
            start=lambda: self._consumed, num_batches=len(self.train_windows) // global_batch, shuffle=self.shuffle,
            shift=lambda: self._shift,
        )
        self._train_sampler = sampler
        return self._loader(self.train_windows, sampler, resumable=True)

    def val_dataloader(self) -> DataLoader | list:
        self._require_setup()
        self._check_model_vocab()
        # A strategy's evaluation ranks where it has them (fault tolerance: each replica group
        # evaluates the whole set over its own ranks), else the training ones.
        dp_size, dp_rank = self._data_parallel("evaluation_sampler_kwargs")
        n_batches = self._val_batches_available(self.batch_size * dp_size)
        if n_batches == 0:
            return []
        sampler = GlobalSampleSampler(
            self.val_windows, batch_size=self.batch_size, dp_size=dp_size, dp_rank=dp_rank, seed=self.seed,
            start=0, num_batches=n_batches, shuffle=False,
        )
        return self._loader(self.val_windows, sampler, resumable=False)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Called once per batch that training consumes (not per batch fetched): see module docstring.
        trainer = self.trainer
        if trainer is not None and trainer.training:
            batch = self._batch_at_position(batch)
            self._consumed += self._train_global_batch or self.global_batch_size
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        if module is not None and is_overridden("on_before_batch_transfer", module, parent=L.LightningModule):
            batch = module.on_before_batch_transfer(batch, dataloader_idx)
        return batch

    def seek(self, consumed_samples: int) -> None:
        """Move training to global sample ``consumed_samples`` now, mid-epoch: the next batch trained
        on starts there. Fault tolerance uses it when a replica group joins and takes its peers'
        data position; batches the loader had already fetched are rebuilt from the new position
        when they are trained on, later ones are produced there."""
        consumed_samples = int(consumed_samples)
        if consumed_samples < 0:
            raise ValueError(f"seek({consumed_samples}): a data position is a number of global samples >= 0")
        self._shift += consumed_samples - self._consumed
        self._consumed = consumed_samples

    def _batch_at_position(self, batch: Any) -> Any:
        sampler = self._train_sampler
        if sampler is None or not sampler.produced:
            return batch
        position = sampler.produced.popleft()
        if position == self._consumed:
            return batch
        from torch.utils.data import default_collate

        self.stale_batches_rebuilt += 1
        return default_collate([self.train_windows[int(w)] for w in sampler.batch_windows(self._consumed)])

    def state_dict(self) -> dict[str, Any]:
        train_tokens = self.train_windows.num_tokens if self.train_windows is not None else None
        return {"version": STATE_VERSION, "consumed_samples": self._consumed, "seed": self.seed,
                "seq_len": self.seq_len, "train_tokens": train_tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("seed", self.seed) != self.seed:
            warnings.warn(
                f"TokenDataModule: resuming with the checkpoint's seed {state_dict['seed']} instead of "
                f"seed={self.seed}, so that the run continues the same sample sequence."
            )
            self.seed = int(state_dict["seed"])
        if state_dict.get("seq_len", self.seq_len) != self.seq_len:
            warnings.warn(
                f"TokenDataModule: the checkpoint was trained with seq_len={state_dict['seq_len']}, this run uses "
                f"{self.seq_len}; samples after resume are not those an uninterrupted run would have seen."
            )
        tokens = state_dict.get("train_tokens")
        if tokens is not None and self.train_windows is not None and tokens != self.train_windows.num_tokens:
            warnings.warn(
                f"TokenDataModule: the checkpoint's training corpus had {tokens} tokens, this one has "
                f"{self.train_windows.num_tokens}; the sample sequence after resume differs."
            )
        self._consumed = int(state_dict["consumed_samples"])

    # ---------------------------------------------------------------- helpers

    def _prepare_kwargs_for_run(self) -> dict:
        # num_proc changes how fast shards are made, not what is in them: not part of the key.
        return dict(self.prepare_kwargs, **({"num_proc": self.num_proc} if self.num_proc else {}))

    def _loader(self, windows: TokenWindows, sampler: GlobalSampleSampler, resumable: bool) -> DataLoader:
        cls = _ResumableDataLoader if resumable else DataLoader
        loader = cls(windows, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                     num_workers=self.num_workers, pin_memory=self.pin_memory,
                     persistent_workers=self.num_workers > 0)
        if resumable:
            loader.datamodule = self
        return loader

    def _require_setup(self) -> None:
        if self.train_windows is None:
            raise ValueError("TokenDataModule.setup() has not run; pass the datamodule to the Trainer or call setup('fit').")

    def _check_tokenizer_matches(self, shards: ShardSet) -> None:
        made_with = shards.meta.get("tokenizer")
        if made_with is not None and canonical_tokenizer_name(made_with) != self.tokenizer_name:
            raise ValueError(
                f"shards of {shards.description} were made with tokenizer {made_with!r} but tokenizer="
                f"{self.tokenizer_name!r} was given; pass tokenizer={made_with!r} or re-prepare the source."
            )

    def _check_token_ids(self, shards: ShardSet) -> None:
        # A cheap sample (first and last shard, 1M tokens each), not a full scan of 20 GB of shards.
        for path in dict.fromkeys([shards.train[0], shards.train[-1], *shards.val[:1]]):
            tokens = read_shard(path)[:VOCAB_CHECK_TOKENS]
            if tokens.size and int(np.max(tokens)) >= self.vocab_size:
                raise ValueError(
                    f"shard {path} holds token id {int(np.max(tokens))}, outside tokenizer {self.tokenizer_name!r} "
                    f"(n_vocab {self.vocab_size}); pass the tokenizer the shards were made with."
                )

    def _check_corpus_fits(self, global_batch: int) -> None:
        if len(self.train_windows) < global_batch:
            need = global_batch * self.seq_len + 1
            raise ValueError(
                f"the training split of {self.shards.description} has {self.train_windows.num_tokens} tokens "
                f"({len(self.train_windows)} windows of seq_len={self.seq_len}), fewer than one global batch of "
                f"{global_batch} samples needs (~{need} tokens). Lower batch_size or seq_len, or use a larger corpus."
            )
        if self.val_batches and self._val_batches_available(global_batch) == 0:
            have = self.val_windows.num_tokens if self.val_windows is not None else 0
            raise ValueError(
                f"the validation split of {self.shards.description} has {have} tokens, fewer than one global batch "
                f"of {global_batch} x seq_len {self.seq_len} needs. Set val_batches=0, lower batch_size or seq_len, "
                "or give more validation data (val_source=..., or a larger val_fraction when preparing)."
            )

    def _val_batches_available(self, global_batch: int | None = None) -> int:
        if not self.val_batches or self.val_windows is None:
            return 0
        available = len(self.val_windows) // (global_batch or self.global_batch_size)
        if 0 < available < self.val_batches:
            log.warning("TokenDataModule: val split holds %d global batches; using those, not val_batches=%d.",
                        available, self.val_batches)
        return min(self.val_batches, available)

    def _check_model(self) -> None:
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        if module is None:
            return
        config = getattr(module, "config", None)
        block_size = getattr(config, "block_size", None) or getattr(module, "block_size", None)
        if isinstance(block_size, int) and self.seq_len > block_size:
            raise ValueError(
                f"seq_len={self.seq_len} exceeds the model's block_size={block_size}; set the datamodule's "
                f"seq_len <= {block_size} or build the model with a larger block_size."
            )
        if is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
            raise ValueError(
                "TokenDataModule counts consumed samples in on_before_batch_transfer, which Lightning skips when "
                "training_step takes `dataloader_iter`; take `batch` as training_step's argument instead."
            )


    def _check_model_vocab(self) -> None:
        # Checked when the loaders are requested, not in `setup`: Lightning calls the datamodule's
        # setup before the module's configure_model, where a GPTModule adopts our vocab_size.
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        if module is None:
            return
        model_vocab = getattr(getattr(module, "config", None), "vocab_size", None) or getattr(module, "vocab_size", None)
        if isinstance(model_vocab, int) and model_vocab < self.vocab_size:
            raise ValueError(
                f"the model's vocab_size={model_vocab} is smaller than tokenizer {self.tokenizer_name!r}'s "
                f"n_vocab={self.vocab_size}; build the model with vocab_size >= {self.vocab_size}."
            )


class _ResumableDataLoader(DataLoader):
    """The train loader, resumable in Lightning's eyes (`state_dict`/`load_state_dict`).

    Its position is the datamodule's consumed count, the same number the datamodule saves itself:
    exposing it here makes Lightning treat the loader as resumable (and not warn on a mid-epoch
    resume) and restores the position even when only the loop state is loaded.
    """

    datamodule: TokenDataModule

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_samples": self.datamodule.consumed_samples}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.datamodule._consumed = int(state_dict["consumed_samples"])
