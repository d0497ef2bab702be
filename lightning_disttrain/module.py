"""GPTModule: the GPT as a LightningModule (loss, optimizers, schedules, parallel plan, sampling)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric

from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain.models.context_parallel import whole_sequences
from lightning_disttrain.models.gpt import GPT, GPTConfig
from lightning_disttrain.models.hf import load_hf_weights_
from lightning_disttrain.models.hf_config import check_compatible, config_from_hf_dir
from lightning_disttrain.models.moe import moe_layers, update_moe_biases
from lightning_disttrain.optim import SCHEDULES, build_optimizer, build_scheduler
from lightning_disttrain.parallel.materialize import has_meta_tensors
from lightning_disttrain.parallel.pipeline import PipelinePlan
from lightning_disttrain.parallel.plan import ParallelPlan
from lightning_disttrain.parallel.tensor import vocabulary_padding_bias


def _config_from_hf(init_from: str, preset: str, overrides: dict[str, Any]) -> GPTConfig:
    """The config of a Hugging Face checkpoint, with the overrides that change no weight. A preset
    other than the default must describe the same model."""
    source = config_from_hf_dir(init_from)
    config = GPTConfig(**{**asdict(source), **overrides})
    where = f"init_from={init_from!r} (its config.json)"
    check_compatible(config, source, where=where)
    if preset != "tiny":
        check_compatible(GPTConfig.from_name(preset, **overrides), source, where=where)
    return config


def fp32_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (B, T, padded vocabulary) over their first ``vocab_size``
    columns, in fp32 whatever the logits' dtype: bf16 cross-entropy over 50k classes loses the small
    probabilities. The padding columns are never a prediction: cut off. Eager, this keeps the fp32
    log-softmax output for backward and holds two fp32 gradients in it (12 B per logit,
    ``planning/memory.py``); compiled (``GPTModule.compile_loss``), Inductor fuses the cast,
    log-softmax and gather."""
    logits = logits[..., :vocab_size].float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Perplexity(MeanMetric):
    """exp of the weighted mean loss: fed the same updates as a ``MeanMetric`` of the loss, so the two agree."""

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


def _monitored(trainer: L.Trainer, name: str) -> bool:
    """Whether a callback reads ``name`` from ``trainer.callback_metrics`` at every step it may act
    (``ModelCheckpoint(monitor=...)``, ``EarlyStopping(monitor=...)``)."""
    return any(getattr(callback, "monitor", None) == name for callback in trainer.callbacks)


class GPTModule(L.LightningModule):
    """Next-token GPT pre-training.

    Args:
        config: a preset name (``"gpt2-124m"``, ``"small"``, ``"tiny"``, ...) or a ``GPTConfig``.
        vocab_size: overrides the config's vocabulary (the CLI links it to the data's tokenizer).
        model_overrides: further ``GPTConfig`` fields, e.g. ``{"pos_emb": "rope", "norm": "rmsnorm"}``;
            the ``moe_*`` fields make a mixture of experts (``{"moe_num_experts": 8, "moe_top_k": 2}``):
            its auxiliary losses join the training loss, its balancing bias moves after each
            optimizer step, and ``moe/layer{i}/...`` metrics are logged.
        optimizer: ``"adamw"`` or ``"muon"`` (Muon on the blocks' 2-D matrices and the routed
            experts' stacks, AdamW elsewhere; docs/guides/muon.md).
        lr: AdamW peak learning rate.
        weight_decay: applied to 2-D weights only (also Muon's weight decay).
        betas: AdamW's moment decay rates ``(beta1, beta2)``.
        eps: AdamW's denominator term.
        muon_lr: Muon's peak learning rate (``optimizer="muon"`` only).
        muon_momentum: Muon's momentum (Nesterov) coefficient.
        muon_experts: with ``optimizer="muon"`` and a mixture of experts, the routed experts'
            stacks train with Muon (``ExpertMuon``, each expert's matrix on its own); False keeps
            them on AdamW, as before 2026-12-04 (to resume such a run's checkpoint).
        schedule: ``"cosine"`` (warmup then cosine to ``min_lr_ratio``), ``"wsd"``
            (warmup-stable-decay, decaying over the last ``decay_fraction``) or ``"constant"``.
        warmup_steps: optimizer steps of linear warm-up from ``lr / warmup_steps`` to ``lr``
            (0: none); every schedule starts with it.
        max_steps: the schedule's length in optimizer steps; None takes the Trainer's
            ``estimated_stepping_batches``.
        min_lr_ratio: the learning rate at the end of the ``"cosine"`` and ``"wsd"`` decays, as a
            fraction of the peak.
        decay_fraction: with ``"wsd"``, the share of ``max_steps`` (at the end) over which the
            learning rate decays linearly to ``min_lr_ratio``.
        init_device: ``"meta"`` builds the model without memory, for models too large for one
            host; a lightning-disttrain strategy then shards and materialises it. None builds on
            whatever device the strategy's init context selects.
        tokenizer_name: tokenizer for ``generate`` on strings; defaults to the data module's.
        init_from: a Hugging Face model directory (GPT-2 or Llama family: ``config.json`` +
            ``model.safetensors`` or ``pytorch_model.bin``) to start from. Its config.json decides
            the architecture (leave ``config`` at its default, or give one that agrees);
            ``model_overrides`` may change only ``dropout``, ``block_size``, ``pad_vocab_multiple``,
            ``init_std``. The weights replace the random initialisation under every strategy, also
            on the meta device (each rank then reads only its shards). Loading a checkpoint of such a
            run needs no Hugging Face files: ``load_from_checkpoint(path, init_from=None)``.

    Logging: ``train/loss``, the mean over the data-parallel ranks, is logged at the end of the
    steps the loggers read (every ``log_every_n_steps``, the run's last step, and a step that stops
    the run): the mean is an all-reduce over those ranks, the whole world without TP (on the device
    under this package's strategies, nothing waits for it), which the other steps do not pay. A callback that monitors ``train/loss``
    (``ModelCheckpoint``, ``EarlyStopping``) gets it in ``trainer.callback_metrics`` every step, as
    under Lightning: then it is logged (and averaged) in every ``training_step``. Otherwise
    ``callback_metrics["train/loss"]`` holds the last logging step's value from the end of that step
    (after the callbacks' ``on_train_batch_end``), and the last step's after ``fit``. The progress bar shows it, with ``tok/s``, from those logging steps
    only: Lightning turns each progress-bar value into a number with ``.item()`` at every batch's
    end, a host sync that would keep rank 0 from running ahead of the accelerator and make the
    other ranks wait for it at the next collective. The values the loggers alone read (tokens,
    learning rates, MoE numbers) are logged at those steps only too, and all of them leave
    Lightning's result collection when the next batch starts (it would read the bar's again at
    every step otherwise), so a step that does not log reads nothing on the host
    (``tests/test_host_syncs.py``). Lightning's own strategies' reduce starts with a barrier that
    blocks the host under NCCL: under those, ``sync_dist`` costs a sync a step.
    """

    layout_independent_init = True
    """``init_weights`` draws each weight from a generator of its own (``models.param_init``), so
    strategies may initialise it after sharding and get the one-process weights under any layout."""

    independent_training_streams = True
    """This package's random-stream policy (``parallel.rng``): at setup the strategy restarts each
    rank's global generators from (seed, data-parallel rank, pipeline rank), so data-parallel ranks
    and pipeline stages draw independent dropout masks. A module without it keeps the streams as
    Lightning's strategies leave them."""

    def __init__(
        self,
        config: str | GPTConfig = "tiny",
        vocab_size: int | None = None,
        model_overrides: dict[str, Any] | None = None,
        optimizer: str = "adamw",
        lr: float = 6e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        muon_lr: float = 0.02,
        muon_momentum: float = 0.95,
        muon_experts: bool = True,
        schedule: str = "cosine",
        warmup_steps: int = 0,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        decay_fraction: float = 0.2,
        init_device: str | None = None,
        tokenizer_name: str | None = None,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        overrides = dict(model_overrides or {})
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        if init_from is not None and not isinstance(config, (GPTConfig, dict)):
            self.config = _config_from_hf(str(init_from), config, overrides)
        elif isinstance(config, GPTConfig):
            self.config = GPTConfig(**{**asdict(config), **overrides})
        elif isinstance(config, dict):  # as stored in a checkpoint's hyper-parameters
            self.config = GPTConfig(**{**config, **overrides})
        else:
            self.config = GPTConfig.from_name(config, **overrides)
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
        if init_device not in (None, "meta", "cpu", "cuda"):
            raise ValueError(f"init_device={init_device!r}; use None, 'meta', 'cpu' or 'cuda'")
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = asdict(self.config)
        if init_from is not None:
            self.hparams["init_from"] = str(init_from)
        self.model: GPT | None = None
        # Logged as Metric objects: Lightning computes them at epoch end (torchmetrics syncs the
        # ranks) and resets them, so no already-synced tensor is logged with sync_dist=False.
        self.val_loss, self.val_ppl = MeanMetric(), Perplexity()
        self.test_loss, self.test_ppl = MeanMetric(), Perplexity()
        self._schedule_steps: int | None = None  # the LR schedule's length, saved with checkpoints
        self._resumed_schedule_steps: int | None = None
        self.tokens_seen = 0
        self._tokenizer = None
        self._last_step_time: float | None = None
        self._tok_per_s: float | None = None
        # This step's values that only the loggers read, logged at their cadence (_log_step_values).
        self._step_lrs: dict[str, float] = {}
        self._aux_to_log: torch.Tensor | None = None
        self._steps_before_batch: int | None = None
        self._step_value_names: list[str] = []  # what _log_step logged at the last logging step
        # This step's loss, on the device, until it is known whether the loggers read this step
        # (then it is averaged over the ranks and logged, else dropped): see _log_train.
        self._unlogged_loss: torch.Tensor | None = None
        self._cross_entropy = fp32_cross_entropy  # compiled by compile_loss

    # ---- model construction -------------------------------------------------------------

    def setup(self, stage: str) -> None:
        # Metrics sync over the data-parallel ranks only: TP ranks of one replica hold the same batch.
        group = getattr(self.trainer.strategy, "dp_process_group", None)
        for metric in (self.val_loss, self.val_ppl, self.test_loss, self.test_ppl):
            metric.process_group = group

    def configure_model(self) -> None:
        """Build the GPT; Lightning calls this under the strategy's init/sharding context."""
        if self.model is not None:
            return
        self._adopt_data_vocab()
        if self.hparams.init_device is not None:
            with torch.device(self.hparams.init_device):
                self.model = GPT(self.config)
        else:
            self.model = GPT(self.config)
        if self.hparams.get("init_from") is not None and not has_meta_tensors(self.model):
            self._load_init_from()  # on the meta device: init_weights loads, after materialisation

    def _adopt_data_vocab(self) -> None:
        # Without an explicit vocab_size the model takes the data module's tokenizer's, so a YAML
        # names the tokenizer once. Stored in hparams so load_from_checkpoint rebuilds the same shape.
        trainer = compat.trainer_of(self)
        if self.hparams.vocab_size is not None or trainer is None:
            return
        vocab = getattr(getattr(trainer, "datamodule", None), "vocab_size", None)
        if self.hparams.get("init_from") is not None:  # the pretrained embedding decides the vocabulary
            if vocab is not None and vocab > self.config.vocab_size:
                raise ValueError(f"the data's tokenizer has {vocab} tokens, more than the {self.config.vocab_size} of "
                                 f"init_from={self.hparams.init_from!r}; tokenize the data with that model's tokenizer")
            return
        if vocab is not None and vocab != self.config.vocab_size:
            self.config = GPTConfig(**{**asdict(self.config), "vocab_size": int(vocab)})
            self.hparams["config"] = asdict(self.config)
            self.hparams["vocab_size"] = int(vocab)

    def init_weights(self) -> None:
        """(Re)initialise all weights in place; strategies call it after materialising meta tensors.
        With ``init_from`` that is the Hugging Face weights (on sharded parameters: each rank's shards)."""
        if self.hparams.get("init_from") is not None:
            self._load_init_from()
        else:
            self.model.init_weights()

    def _load_init_from(self) -> None:
        path = self.hparams.init_from
        if not os.path.isdir(path):
            raise ValueError(f"init_from={path!r} does not exist. To load a checkpoint of a run that started from "
                             f"it, pass init_from=None (GPTModule.load_from_checkpoint(ckpt, init_from=None), or "
                             f"init_from: null in the YAML): the checkpoint holds the weights")
        load_hf_weights_(self.model, path)

    def parallel_plan(self) -> ParallelPlan:
        from lightning_disttrain.parallel import gpt_tp

        self.configure_model()
        m, c = self.model, self.config
        groups = [] if c.tie_embeddings else [[m.wte], [m.ln_f, m.lm_head]]
        groups = [g for g in groups if all(x is not None for x in g)]  # a pipeline stage holds some
        return ParallelPlan(blocks=m.blocks, fsdp_groups=groups,
                            tp_block_plan=lambda options: gpt_tp.block_plan(c, options),
                            tp_root_plan=lambda options: gpt_tp.root_plan(c, options, prefix="model"),
                            moe_layers=list(moe_layers(m).values()),
                            # RoPE models have no wpe module (the attribute is None)
                            pipeline=PipelinePlan(m, first=("wte", "wpe") if c.pos_emb == "learned" else ("wte",),
                                                  last=("ln_f", "lm_head")))

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (6·N + 12·L·H·Dh·T); see ``GPT.flops_per_token``."""
        self.configure_model()
        return self.model.flops_per_token(seq_len)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, padded vocab); columns from ``config.vocab_size`` on are padding."""
        return self.model(idx)

    # ---- training -----------------------------------------------------------------------

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # An fp32 log-softmax: bf16 cross-entropy over 50k classes loses the small probabilities.
        # The vocabulary padding is never a prediction: cut off, or, for vocabulary-sharded logits
        # (tensor + loss parallel; slicing would gather them), masked with -inf.
        if isinstance(logits, DTensor):
            logits = logits.float() + vocabulary_padding_bias(logits, self.config.vocab_size)
            # Under loss_parallel (the strategy enters it around this step and its backward) the
            # cross-entropy works on the shards; its result is replicated on every TP rank.
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).full_tensor()
        if self._cross_entropy is not fp32_cross_entropy:  # compiled (compile_loss)
            return self._cross_entropy(logits, targets, self.config.vocab_size)
        # fp32_cross_entropy's two lines, inline: rebinding ``logits`` drops this frame's reference
        # to the 16-bit logits before the fp32 log-softmax is made (a call would hold them: 2 B per
        # logit more at the forward's end, measured on a GPU, docs/benchmarks.md 9.2).
        logits = logits[..., : self.config.vocab_size].float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def compile_loss(self, **options: Any) -> None:
        """``torch.compile`` the loss of plain (not vocabulary-sharded) logits with ``options``
        (``torch.compile``'s keyword arguments). The strategies call it with their ``compile``
        options after compiling the blocks (``parallel/recipe.py``); the tensor-parallel loss
        (DTensor logits under ``loss_parallel``) stays eager. A pickled copy of the module (a
        compiled function does not pickle) gets the eager loss: call it again after loading."""
        self._cross_entropy = torch.compile(fp32_cross_entropy, **options)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_cross_entropy"] = fp32_cross_entropy  # see compile_loss
        return state

    def _data_parallel_size(self) -> int:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self._log_train(self.loss_fn(self(x), y), x)
        return loss + self._moe_aux_loss() if self.config.moe_num_experts else loss

    # ---- mixture of experts -------------------------------------------------------------

    def _moe_aux_loss(self) -> torch.Tensor | float:
        """The MoE blocks' weighted auxiliary losses of the last forward (0 when all are off);
        kept for the loggers (``_log_step_values``)."""
        aux = self.model.moe_aux_loss
        self._aux_to_log = None if aux is None else aux.detach()
        return 0.0 if aux is None else aux

    def _log_moe_layers(self) -> None:
        """Each MoE layer's unweighted losses and, with a capacity, dropped assignments of the
        last forward; its load ratio and bias norm after the step; the auxiliary loss."""
        for i, layer in moe_layers(self.model).items():
            for name in ("balance_loss", "z_loss", "dropped_tokens"):
                if getattr(layer, name) is not None:
                    self._log_step(f"moe/layer{i}/{name}", getattr(layer, name).float())
            metrics = layer.metrics()
            self._log_step(f"moe/layer{i}/max_load_ratio", metrics["max_load_ratio"])
            self._log_step(f"moe/layer{i}/bias_norm", metrics["bias_norm"])
        if self._aux_to_log is not None:
            self._log_step("train/moe_aux_loss", self._aux_to_log)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.config.moe_num_experts:
            self._moe_after_step()

    def _moe_after_step(self) -> None:
        # Right after each optimizer step (with gradient accumulation: after the step's last
        # micro-batch), before any callback's on_train_batch_end can save a checkpoint: the
        # balancing bias moves on the whole step's load, summed over the data-parallel ranks so
        # that every replica keeps the same bias.
        layers = moe_layers(self.model)
        update_moe_biases(layers.values(), group=getattr(self.trainer.strategy, "dp_process_group", None))

    # Pipeline parallel (strategies/pipeline_steps.py): the strategy runs the schedule, the last
    # stage computes pipeline_loss per micro-batch, and these log what the steps above log.
    def pipeline_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, targets)

    def pipeline_aux_loss(self, stage: torch.nn.Module) -> torch.Tensor | None:
        """The weighted MoE auxiliary losses of ``stage``'s (a part of ``self.model``) last forward:
        the strategy adds their gradient to that stage's backward, as ``training_step`` adds them
        to the loss."""
        return getattr(stage, "moe_aux_loss", None) if self.config.moe_num_experts else None

    def pipeline_training_step(self, batch, batch_idx: int, loss: torch.Tensor,
                               aux_loss: torch.Tensor | None = None) -> torch.Tensor:
        """``loss``: the mean loss of the batch; ``aux_loss``: the MoE auxiliary losses summed over
        the stages (each stage's mean over the micro-batches). Logs and returns what
        ``training_step`` does. The per-layer MoE numbers are this rank's layers' (of the step's
        last micro-batch): each rank logs the stages it holds."""
        loss = self._log_train(loss, batch[0])
        self._aux_to_log = None
        if not self.config.moe_num_experts:
            return loss
        if aux_loss is None or not (self.config.moe_aux_loss_coef > 0 or self.config.moe_z_loss_coef > 0):
            return loss
        self._aux_to_log = aux_loss.detach()
        return loss + aux_loss

    def pipeline_validation_step(self, batch, batch_idx: int, loss: torch.Tensor) -> None:
        self._log_eval(loss, batch[0], "val", self.val_loss, self.val_ppl)

    def pipeline_test_step(self, batch, batch_idx: int, loss: torch.Tensor) -> None:
        self._log_eval(loss, batch[0], "test", self.test_loss, self.test_ppl)

    def _log_train(self, loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x is this rank's shard of the batch: context parallel ranks hold 1/cp of each sequence
        cp = int(getattr(self.trainer.strategy, "context_parallel_size", 1))
        self.tokens_seen += x.numel() * self._data_parallel_size() * cp
        # The mean over the data-parallel ranks (the world without TP) is an all-reduce: paid only at
        # the steps the loggers read (on_train_batch_end), unless a callback monitors the loss (ModelCheckpoint,
        # EarlyStopping): then every step, here, as under Lightning. Not in the progress bar here
        # (see the class doc).
        if _monitored(self.trainer, "train/loss"):
            self.log("train/loss", loss, on_step=True, on_epoch=False, sync_dist=self.trainer.world_size > 1)
        else:
            self._unlogged_loss = loss.detach()
        return loss

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self._steps_before_batch = self.trainer.global_step
        if self._step_value_names:  # the last logging step's values: the loggers have them now
            compat.drop_logged_values(self.trainer, "on_train_batch_end", self._step_value_names)
            self._step_value_names = []

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # Tokens/s over the last batch for the progress bar; MFUMonitor does the careful version.
        now = time.perf_counter()
        if self._last_step_time is not None:
            rate = batch[0].numel() * self._data_parallel_size() / max(now - self._last_step_time, 1e-9)
            self._tok_per_s = rate if self._tok_per_s is None else 0.8 * self._tok_per_s + 0.2 * rate
        self._last_step_time = now
        if self._loggers_read_this_step():
            self._log_step_values()
        elif self._unlogged_loss is not None and self._fit_ends_after_this_batch():
            # the run's last loss, averaged, for trainer.callback_metrics after fit (and the bar)
            self._log_step("train/loss", self._unlogged_loss, prog_bar=True, sync_dist=self.trainer.world_size > 1)
        self._unlogged_loss = None

    def _fit_ends_after_this_batch(self) -> bool:
        """Whether this batch is the run's last: ``max_steps`` reached, or the last batch of the last
        epoch (the same answer on every rank)."""
        trainer = self.trainer
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            return True
        last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
        return last_epoch and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)

    def _loggers_read_this_step(self) -> bool:
        """Whether Lightning hands this batch's metrics to the loggers once its hooks are done
        (``update_train_step_metrics``, right after this one, the LightningModule's, which runs
        after the callbacks'): when the optimizer stepped in it, every ``log_every_n_steps`` steps,
        and at a step that stops the run (``should_stop``, whoever set it during the step)."""
        trainer = self.trainer
        if self._steps_before_batch is None or trainer.global_step == self._steps_before_batch:
            return False  # a micro-batch of gradient accumulation: nothing goes to the loggers yet
        # global_step counts this step now, as Lightning's count does (also after a fault-tolerant
        # heal moved both during the step).
        return compat.loggers_write_step(trainer, trainer.global_step)

    def _log_step_values(self) -> None:
        """The values only the loggers and the progress bar read, at the steps the loggers read
        them: each ``self.log`` call costs Lightning's result collection host time every step it
        is made, whatever the logging cadence (docs/benchmarks.md, section 18), and each value in
        the bar a host read per step (see the class doc). The loss for the loggers is logged
        every step, in ``training_step``; the bar shows the same number, this step's."""
        if self._unlogged_loss is not None:  # this step's, averaged over the ranks now, for the loggers and the bar
            self._log_step("train/loss", self._unlogged_loss, prog_bar=True, sync_dist=self.trainer.world_size > 1)
        else:  # monitored: training_step logged it, averaged over the ranks
            loss = self.trainer.callback_metrics.get("train/loss")
            if loss is not None:
                self._log_step("train/loss", loss, prog_bar=True, logger=False)
        self._log_step("train/tokens", float(self.tokens_seen))
        for name, lr in self._step_lrs.items():  # the rates this step used (the schedulers have moved on)
            self._log_step(name, lr)
        if self._tok_per_s is not None:
            self._log_step("tok/s", self._tok_per_s, prog_bar=True, logger=False)
        if self.config.moe_num_experts:
            self._log_moe_layers()

    def _log_step(self, name: str, value, prog_bar: bool = False, logger: bool = True, sync_dist: bool = False) -> None:
        """``self.log`` of a value of this step only, dropped from Lightning's result collection
        when the next batch starts (``on_train_batch_start``), once the loggers and the bar have it."""
        self.log(name, value, prog_bar=prog_bar, logger=logger, on_step=True, on_epoch=False, sync_dist=sync_dist)
        self._step_value_names.append(name)

    def on_train_epoch_start(self) -> None:
        self._last_step_time = None

    def on_before_optimizer_step(self, optimizer) -> None:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # unwrap LightningOptimizer
        parts = getattr(optimizer, "optimizers", [optimizer])  # HybridOptimizer: Muon first, AdamW last
        self._step_lrs = {"train/lr": parts[-1].param_groups[0]["lr"]}
        if len(parts) > 1:
            self._step_lrs["train/lr_muon"] = parts[0].param_groups[0]["lr"]

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_loss, self.val_ppl)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_loss, self.test_ppl)

    def _evaluate(self, batch, stage: str, loss_metric: MeanMetric, ppl_metric: Perplexity) -> None:
        x, y = batch
        self._log_eval(self.loss_fn(self(x), y), x, stage, loss_metric, ppl_metric)

    def _log_eval(self, loss, x, stage: str, loss_metric: MeanMetric, ppl_metric: Perplexity) -> None:
        # Weighted by tokens: the epoch value is the mean loss per token over all batches and ranks.
        loss_metric.update(loss, weight=x.numel())
        ppl_metric.update(loss, weight=x.numel())
        self.log(f"{stage}/loss", loss_metric, prog_bar=stage == "val", on_step=False, on_epoch=True)
        self.log(f"{stage}/ppl", ppl_metric, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = build_optimizer(
            self, hp.optimizer, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas), eps=hp.eps,
            muon_lr=hp.muon_lr, muon_momentum=hp.muon_momentum, muon_experts=hp.get("muon_experts", True))
        total = hp.max_steps or int(self.trainer.estimated_stepping_batches)
        if not math.isfinite(total) or total <= 0:
            raise ValueError("set Trainer(max_steps=...) or GPTModule(max_steps=...) so the LR schedule knows its length")
        self._schedule_steps = int(total)
        scheduler = build_scheduler(optimizer, schedule=hp.schedule, warmup_steps=hp.warmup_steps,
                                    total_steps=total, min_lr_ratio=hp.min_lr_ratio,
                                    decay_fraction=hp.decay_fraction)
        # The AdamW is fused; under bf16-mixed Lightning's plugin would refuse to clip it, under any
        # strategy (this package's strategies do the same for every module).
        trainer = compat.trainer_of(self)
        if trainer is not None:
            compat.clip_fused_optimizers_under_bf16_mixed(trainer.precision_plugin)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen
        if self._schedule_steps is not None:
            checkpoint["schedule_steps"] = self._schedule_steps

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
        trainer = compat.trainer_of(self)
        if trainer is not None and trainer.state.fn == "fit":  # resuming, not loading weights
            self._resumed_schedule_steps = checkpoint.get("schedule_steps")

    def on_train_start(self) -> None:
        # Compared here, once both are known: strategies restore the checkpoint either before or
        # after configure_optimizers.
        old, new = self._resumed_schedule_steps, self._schedule_steps
        self._resumed_schedule_steps = None
        if old is None or new is None or old == new:
            return
        rank_zero_warn(
            f"GPTModule: the checkpoint's {self.hparams.schedule!r} LR schedule spans {old} steps, this run builds "
            f"it over {new} (max_steps changed). The restored step count now indexes the {new}-step schedule, "
            f"so the learning rate jumps to where that schedule is at this step. To continue the old schedule, "
            f"pass GPTModule(max_steps={old}) (--model.init_args.max_steps {old}); Trainer(max_steps) then only "
            "decides where training stops."
        )

    # ---- sampling -----------------------------------------------------------------------

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            name = self.hparams.tokenizer_name
            dm = getattr(compat.trainer_of(self), "datamodule", None)
            if name is None and dm is not None and getattr(dm, "tokenizer", None) is not None:
                self._tokenizer = dm.tokenizer
            else:
                from lightning_disttrain.data import get_tokenizer

                self._tokenizer = get_tokenizer(name or "gpt2")
        return self._tokenizer

    def _last_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits at the last position, whole on every rank (equal across a TP group)."""
        T = idx.size(1)
        strategy = getattr(compat.trainer_of(self), "strategy", None)
        multiple = getattr(strategy, "sequence_multiple", 1)  # sequence parallel: T % tp == 0
        if T % multiple:
            # Pad on the right: causal attention keeps the padding out of the positions before it.
            idx = torch.cat([idx, idx[:, -1:].expand(-1, multiple - T % multiple)], dim=1)
        if getattr(strategy, "pipeline_enabled", False):
            # The last stage has the logits; every rank runs the pipeline and receives them. Padded
            # to a power of two (causal: the padding cannot change position T - 1), so the
            # pipeline's stages, built per shape, are reused across the tokens of a generation.
            width = min(max(1 << (idx.size(1) - 1).bit_length(), multiple), self.config.block_size)
            if width > idx.size(1):
                idx = torch.cat([idx, idx[:, -1:].expand(-1, width - idx.size(1))], dim=1)
            return strategy.pipeline_logits(idx, T - 1)
        logits = self(idx)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return logits[:, T - 1]

    @torch.no_grad()
    def generate(self, prompt: str | torch.Tensor, max_new_tokens: int = 64, temperature: float = 1.0,
                 top_k: int | None = None, seed: int | None = None) -> str | torch.Tensor:
        """Sample a continuation. A string prompt returns text; a (B, T) id tensor returns ids.

        Every rank must call it under sharded strategies (each forward is collective); with
        ``seed`` all ranks draw the same tokens.
        """
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
        self.configure_model()
        as_text = isinstance(prompt, str)
        if as_text:
            ids = self.tokenizer.encode(prompt) or [self.tokenizer.eot_token]
            idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        else:
            idx = prompt.to(self.device)
        gen = torch.Generator(device=idx.device)
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        was_training = self.training
        self.eval()
        with whole_sequences(self):  # under context parallel every rank generates the whole sequence
            idx = self._sample_tokens(idx, max_new_tokens, temperature, top_k, gen)
        self.train(was_training)
        return self.tokenizer.decode(idx[0].tolist()) if as_text else idx

    def _sample_tokens(self, idx: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
                       gen: torch.Generator) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits = self._last_logits(idx[:, -self.config.block_size:])[:, : self.config.vocab_size].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=gen)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
