"""MFUMonitor: tokens/s, achieved TFLOP/s, MFU, step time, data wait and peak memory, per step.

What one "step" is: one optimizer step. With gradient accumulation its micro-batches are summed
(tokens, FLOPs, compute and fetch time) and its time runs from the end of the previous optimizer
step to the end of this one, so it includes the optimizer and everything between batches.
Validation inside ``fit`` is subtracted from the step it interrupts.

What is measured, per step. Step, compute and validation spans are marks on the device's timeline
(``step_clock``): on a GPU, CUDA events recorded in the current stream, so a span is the time
the device took to get from one mark to the next, with no ``torch.cuda.synchronize``: the monitor
waits for its last event only at the steps whose values it computes (the logged ones). On CPU
the marks are ``time.perf_counter`` values. ``MFUMonitor(device_timing=False)`` uses host clocks
on a GPU too (the host's enqueueing, which runs ahead of the device).

- ``data wait``: host time blocked in the training loop's ``next()`` on the dataloader. Lightning
  times exactly that call as its profiler action ``[_TrainingEpochLoop].train_dataloader_next``;
  the monitor wraps the Trainer's profiler (delegating everything to it) to read that one span. A
  gap between ``on_train_batch_end`` and the next ``on_train_batch_start`` would also count
  checkpoint saving, logging and other callbacks as "waiting for data". On a GPU the host may
  wait there while the device still runs queued work: an upper bound of what the data costs.
- ``compute``: ``on_train_batch_start`` to ``on_train_batch_end`` of each micro-batch: forward,
  backward, optimizer and, on several GPUs, the collectives inside them (FSDP, DDP), which cannot
  be told apart from compute at this level.
- the rest (``1 - data_wait - compute``): loop overhead, other callbacks, checkpoints, logging
  (on a GPU: the part of it the device sat idle for).

FLOPs per token come from (first that applies) ``MFUMonitor(flops_per_token=...)``, the
LightningModule's ``flops_per_token(seq_len)`` (GPTModule's: 6·N + 12·L·H·Dh·T), or are measured on
the first training micro-batch of each sequence length: 3 x its forward's matmul and attention
FLOPs, counted by ``FlopCounterMode`` (``peak_flops.forward_flop_counter`` says what is counted and
why). Neither discounts the causal mask (as PaLM, nanoGPT and torchtitan count, so MFUs compare);
MoE models must count *active* parameters (a measurement does). ``flops_source`` says which.

Achieved FLOP/s per device = FLOPs per token x global tokens/s / world size. ``perf/mfu`` is that
over the device's dense bf16 peak, also in float8 runs (as torchtitan reports it), a measured fp32
matmul on CPU. When the model has float8 ``Float8Linear`` layers, ``perf/mfu_fp8`` is the same
FLOP/s over the dense fp8 peak (all model FLOPs, also those of the matmuls left in bf16: the
attention, the head).
"""

from __future__ import annotations

import resource
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_disttrain.callbacks.fetch_timing import FetchTimingProfiler
from lightning_disttrain.callbacks.step_clock import clock_for
from lightning_disttrain.peak_flops import forward_flop_counter, measure_cpu_peak_flops, table_peak
from lightning_disttrain.parallel.float8 import has_float8

@dataclass
class _Step:
    start: Any
    """Clock mark where the step began (where the previous one ended)."""
    end: Any
    batches: list[tuple[Any, Any]]
    """Clock marks of each micro-batch's start and end."""
    validations: list[tuple[Any, Any]]
    """Clock marks of the validation runs inside the step (subtracted from its time)."""
    tokens: int
    """Global tokens of the step (all micro-batches, all data-parallel ranks)."""
    flops: float
    """Global model FLOPs of the step."""
    fetch_s: float
    micro_tokens: int
    """Tokens of one micro-batch on this rank (the largest of the step)."""
    time_s: float = 0.0
    compute_s: float = 0.0
    timed: bool = False
    """``time_s`` and ``compute_s`` were read off the marks (which are then dropped)."""

    def read_times(self, clock: Any) -> None:
        if self.timed:
            return
        val_s = sum(clock.seconds(a, b) for a, b in self.validations)
        self.time_s = max(clock.seconds(self.start, self.end) - val_s, 1e-9)
        self.compute_s = sum(clock.seconds(a, b) for a, b in self.batches)
        self.timed, self.start, self.end, self.batches, self.validations = True, None, None, [], []


def count_tokens(batch: Any) -> tuple[int, int]:
    """(tokens, sequence length) of a batch: ``x`` of ``(x, y)``, a tensor, or a dict's ``input_ids``."""
    x = batch
    if isinstance(batch, (tuple, list)) and batch:
        x = batch[0]
    elif isinstance(batch, dict):
        x = next((batch[k] for k in ("input_ids", "x", "idx", "tokens") if k in batch), None)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"MFUMonitor cannot find the token ids in a batch of type {type(batch).__name__}; "
                         f"pass MFUMonitor(tokens_fn=lambda batch: (n_tokens, seq_len))")
    return x.numel(), int(x.shape[-1])


def diagnose(data_wait_frac: float, compute_frac: float, world_size: int, micro_tokens: int,
             device_type: str, data_wait_threshold: float = 0.2, small_batch_tokens: int = 8192
             ) -> list[tuple[str, str]]:
    """``(cause, advice)`` for a low MFU from the measured step breakdown, most likely first."""
    causes = []
    if data_wait_frac >= data_wait_threshold:
        causes.append(("dataloader", f"{data_wait_frac:.0%} of step time is spent waiting for the next batch; "
                       f"raise DataLoader num_workers / prefetch_factor, use pin_memory, pre-tokenize the data"))
    other = 1.0 - data_wait_frac - compute_frac
    if other >= 0.3:
        causes.append(("host overhead", f"{other:.0%} of step time is outside the training step and the "
                       f"dataloader (logging, checkpointing, callbacks)"))
    if world_size > 1 and data_wait_frac < data_wait_threshold:
        causes.append(("communication", f"on {world_size} devices with little data wait ({data_wait_frac:.0%}) "
                       f"the step likely waits on collectives (FSDP all-gather / reduce-scatter, gradient "
                       f"all-reduce); check the interconnect, FSDP prefetch and reshard_after_forward, or use HSDP"))
    if micro_tokens < small_batch_tokens:
        causes.append(("small batch", f"{micro_tokens} tokens per device per micro-batch under-fill the device; "
                       f"raise the batch size or the sequence length"))
    if not causes:
        causes.append(("kernel efficiency", "the step is compute-bound but slow; compile the blocks (strategy "
                       "compile=True), train in bf16-mixed, look for graph breaks"))
    if device_type == "cpu":
        causes.append(("cpu", "on CPU the peak is a measured fp32 matmul, which small shapes and non-matmul "
                       "ops stay far below"))
    return causes


class MFUMonitor(Callback):
    """Log throughput and model FLOPs utilisation through the Trainer's loggers under ``perf/``.

    Keys (averaged over the last ``window`` optimizer steps): ``perf/tokens_per_sec`` (global),
    ``perf/tokens_per_sec_per_device``, ``perf/tflops_per_device``, ``perf/mfu`` (a fraction, of the
    dense bf16 peak), ``perf/peak_tflops``, ``perf/step_time_s``, ``perf/data_wait_frac``,
    ``perf/compute_frac``, and ``perf/peak_mem_gib`` (CUDA ``max_memory_allocated``) or, on CPU,
    ``perf/peak_rss_gib`` (the process's peak resident memory: it includes everything the process
    holds, not only tensors). With ``Float8Linear`` layers in the model also ``perf/mfu_fp8`` and
    ``perf/peak_tflops_fp8`` (of the dense fp8 peak).

    Args:
        window: optimizer steps averaged per logged value, and the span the low-MFU check looks at.
        peak_flops: the device's dense bf16 peak FLOP/s; None looks it up by device name or
            measures it on CPU.
        warn_below: warn, with the likely cause, when MFU over a full window after warm-up is
            below this (0 turns the warning off).
        flops_per_token: training FLOPs per token, a number or ``fn(seq_len)``; None uses the
            LightningModule's ``flops_per_token(seq_len)`` method or attribute, else measures;
            ``"measure"`` measures even when the module has one (see the module docstring).
        warmup_steps: optimizer steps (compilation, allocator warm-up) before the check may fire.
        log_every_n_steps: None: the Trainer's ``log_every_n_steps``. Values are computed (and the
            low-MFU check made) at the logged steps only: on a GPU, the only steps where the
            monitor waits for the device.
        tokens_fn: ``batch -> (tokens on this rank, seq_len)``; default: ``x`` of an ``(x, y)`` batch.
        device_timing: time spans on the device's timeline (CUDA events) on a GPU; False: host clocks.
        peak_flops_fp8: the dense fp8 peak FLOP/s for ``perf/mfu_fp8``; None looks it up by name.
        data_wait_threshold: the share of step time spent waiting for the next batch from which the
            low-MFU warning names the dataloader as a cause (and no longer suspects communication).
        small_batch_tokens: tokens per device per micro-batch below which the warning names the
            batch as too small to fill the device.
    """

    def __init__(self, window: int = 20, peak_flops: float | None = None, warn_below: float = 0.30,
                 flops_per_token: float | Callable[[int], float] | str | None = None, warmup_steps: int = 3,
                 log_every_n_steps: int | None = None,
                 tokens_fn: Callable[[Any], tuple[int, int]] | None = None, device_timing: bool = True,
                 data_wait_threshold: float = 0.2, small_batch_tokens: int = 8192,
                 peak_flops_fp8: float | None = None) -> None:
        if window < 1 or warmup_steps < 0:
            raise ValueError(f"MFUMonitor(window={window}, warmup_steps={warmup_steps}): use window >= 1 "
                             f"and warmup_steps >= 0")
        for name, peak in (("peak_flops", peak_flops), ("peak_flops_fp8", peak_flops_fp8)):
            if peak is not None and peak <= 0:
                raise ValueError(f"{name}={peak} must be a positive FLOP/s figure, e.g. 989.4e12")
        if isinstance(flops_per_token, str) and flops_per_token != "measure":
            raise ValueError(f"flops_per_token={flops_per_token!r}: pass a number, fn(seq_len), "
                             f"'measure' or None")
        self.window, self.warn_below, self.warmup_steps = window, warn_below, warmup_steps
        self.log_every_n_steps, self.device_timing = log_every_n_steps, device_timing
        self.data_wait_threshold, self.small_batch_tokens = data_wait_threshold, small_batch_tokens
        self._peak_arg, self._peak_fp8_arg = peak_flops, peak_flops_fp8
        self._flops_arg, self._tokens_fn = flops_per_token, tokens_fn or count_tokens
        self.peak: float | None = None
        """Dense bf16 peak FLOP/s per device (None: unknown, MFU not logged)."""
        self.peak_source = ""
        """Where ``peak`` came from: ``user``, ``table: <chip> bf16 dense`` or ``measured: ...``."""
        self.peak_fp8: float | None = None
        """Dense fp8 peak FLOP/s per device, when the model has float8 layers and it is known."""
        self.flops_source = ""
        """Where the FLOPs per token come from: ``user``, ``analytic: <Module>.flops_per_token`` or
        ``measured: ...``."""
        self.flops_per_token: dict[int, float] = {}
        """Training FLOPs per token in use, by sequence length."""
        self.metrics: dict[str, float] = {}
        """The last values logged; after training, the last window's."""
        self.warnings: list[str] = []
        """Low-MFU warnings issued in this run."""
        self._steps: deque[_Step] = deque(maxlen=window)
        self._fetch: FetchTimingProfiler | None = None
        self._measuring: tuple[Any, int, int] | None = None

    # ---- set-up --------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not isinstance(trainer.profiler, FetchTimingProfiler):
            self._fetch = FetchTimingProfiler(trainer.profiler)
            trainer.profiler = self._fetch

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_measuring()
        if self._fetch is not None and trainer.profiler is self._fetch:
            trainer.profiler = self._fetch.inner  # before the Trainer's profiler.describe()
        self._fetch = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_measuring()  # a dispatch mode left on the stack would count every later op

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flops_fn, self.flops_source = self._resolve_flops(pl_module)
        dims = getattr(trainer.strategy, "_parallel_dims", None)
        tp, pp = getattr(dims, "tp", 1), getattr(dims, "pp", 1)
        if self._flops_fn is None and (tp > 1 or pp > 1):
            # FlopCounterMode sees a DTensor op whole (the TP group's work) but an op on local
            # shards (attention over this rank's heads) as that shard only; under pipeline
            # parallel a rank runs only its stages' blocks: no sound total either way.
            layout = f"tensor parallel (tp={tp})" if tp > 1 else f"pipeline parallel (pp={pp})"
            raise ValueError(f"MFUMonitor cannot measure FLOPs per token under {layout}; define "
                             f"flops_per_token(seq_len) on {type(pl_module).__name__} or pass "
                             f"MFUMonitor(flops_per_token=...)")
        self.flops_per_token = {}
        self._world = trainer.world_size
        self._dp = _data_parallel_size(trainer)
        self._device = pl_module.device
        self._clock = clock_for(self._device, self.device_timing)
        self._val_start: Any = None
        self.peak, self.peak_source = self._resolve_peak(pl_module)
        if self.peak is not None:
            rank_zero_info(f"MFUMonitor: peak {self.peak / 1e12:.4g} TFLOP/s per device ({self.peak_source})")
        if self._flops_fn is not None:
            rank_zero_info(f"MFUMonitor: FLOPs per token from {self.flops_source}")

    def _resolve_flops(self, pl_module: pl.LightningModule) -> tuple[Callable[[int], float] | None, str]:
        if self._flops_arg == "measure":
            return None, "measured"
        if self._flops_arg is not None:
            src, source = self._flops_arg, "user"
        else:
            src = getattr(pl_module, "flops_per_token", None)
            source = f"analytic: {type(pl_module).__name__}.flops_per_token"
        if src is None:
            return None, "measured"
        if callable(src):
            return (lambda seq_len: float(src(seq_len))), source
        value = float(src)
        return (lambda seq_len: value), source

    def _resolve_peak(self, pl_module: pl.LightningModule, float8: bool = False) -> tuple[float | None, str]:
        dtype = "fp8" if float8 else "bf16"
        user = self._peak_fp8_arg if float8 else self._peak_arg
        if user is not None:
            return float(user), "user"
        device = pl_module.device
        if device.type == "cuda":
            peak, source = table_peak(torch.cuda.get_device_name(device), float8=float8)
        elif device.type == "cpu":
            if float8:  # emulated there: an fp8 utilisation would mean nothing
                return None, "float8 is emulated on CPU"
            return measure_cpu_peak_flops(), "measured: fp32 matmul micro-benchmark on CPU"
        else:
            peak, source = None, f"no dense {dtype} peak known for {device.type!r} devices"
        if peak is None:
            arg = "peak_flops_fp8" if float8 else "peak_flops"
            rank_zero_warn(f"MFUMonitor: {source}; {'perf/mfu_fp8' if float8 else 'MFU'} is not logged. "
                           f"Pass MFUMonitor({arg}=...) (FLOP/s per device)")
        return peak, source

    # ---- per batch -----------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._steps.clear()
        self._last_global_step = trainer.global_step
        self._steps_seen = 0
        self._warned: set[str] = set()
        # Here, not in on_fit_start: Float8Training swaps Linears in its own on_fit_start.
        self.peak_fp8 = None
        if has_float8(pl_module):
            self.peak_fp8, _ = self._resolve_peak(pl_module, float8=True)
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        self._reset_step(self._clock.mark())

    def _reset_step(self, start: Any) -> None:
        self._step_start = start
        self._fetch_mark = self._fetch.fetch_s if self._fetch is not None else 0.0
        self._tokens = self._micro_tokens = 0
        self._flops = 0.0
        self._batches: list[tuple[Any, Any]] = []
        self._validations: list[tuple[Any, Any]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_start = self._clock.mark()
        tokens, seq_len = self._tokens_fn(batch)
        self._tokens += tokens * self._dp
        self._micro_tokens = max(self._micro_tokens, tokens)
        if seq_len not in self.flops_per_token:
            if self._flops_fn is None:
                # This batch's FLOPs are added once its forward has been counted.
                self._measuring = (forward_flop_counter().__enter__(), tokens, seq_len)
                return
            self.flops_per_token[seq_len] = self._flops_fn(seq_len)
        self._flops += tokens * self._dp * self.flops_per_token[seq_len]

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._finish_measuring()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._finish_measuring()  # when a strategy ran backward inside training_step

    def _stop_measuring(self) -> Any:
        measuring, self._measuring = self._measuring, None
        if measuring is not None:
            measuring[0].__exit__(None, None, None)
        return measuring

    def _finish_measuring(self) -> None:
        measuring = self._stop_measuring()
        if measuring is None:
            return
        counter, tokens, seq_len = measuring
        forward = counter.get_total_flops()
        if forward == 0:
            rank_zero_warn("MFUMonitor counted no matmul or attention FLOPs in the forward of the first "
                           "training micro-batch; pass MFUMonitor(flops_per_token=...)")
        self.flops_per_token[seq_len] = 3.0 * forward / tokens
        self.flops_source = (f"measured: FlopCounterMode, 3 x forward of the first micro-batch "
                             f"(seq_len {seq_len})")
        self._flops += tokens * self._dp * self.flops_per_token[seq_len]
        rank_zero_info(f"MFUMonitor: {self.flops_per_token[seq_len] / 1e6:.4g} MFLOP per token at "
                       f"seq_len {seq_len}, {self.flops_source}")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._finish_measuring()  # no backward ran (training_step returned None)
        end = self._clock.mark()
        self._batches.append((self._batch_start, end))
        if trainer.global_step == self._last_global_step:
            return  # a micro-batch of gradient accumulation: the optimizer step is still to come
        self._last_global_step = trainer.global_step
        fetch = (self._fetch.fetch_s if self._fetch is not None else 0.0) - self._fetch_mark
        self._steps.append(_Step(start=self._step_start, end=end, batches=self._batches,
                                 validations=self._validations, tokens=self._tokens, flops=self._flops,
                                 fetch_s=fetch, micro_tokens=self._micro_tokens))
        self._steps_seen += 1
        self._reset_step(end)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % max(every, 1) != 0:
            return  # nothing read off the clock: on a GPU, no wait for the device at this step
        self.metrics = self._window_metrics()
        for logger in trainer.loggers:
            # Lightning logs this optimizer step's train/loss at step global_step - 1: same row.
            logger.log_metrics(self.metrics, step=trainer.global_step - 1)
        self._check_low_mfu()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._steps and not self._steps[-1].timed:
            self.metrics = self._window_metrics()  # the last window's, for a reader after fit()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_start = self._clock.mark() if trainer.state.fn == TrainerFn.FITTING else None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._val_start is not None and not trainer.sanity_checking:
            self._validations.append((self._val_start, self._clock.mark()))
        self._val_start = None

    # ---- metrics -------------------------------------------------------------------------

    def _window_metrics(self) -> dict[str, float]:
        steps = list(self._steps)
        for step in steps:
            step.read_times(self._clock)
        total_s = sum(s.time_s for s in steps)
        tokens_per_s = sum(s.tokens for s in steps) / total_s
        flops_per_device = sum(s.flops for s in steps) / total_s / self._world
        m = {
            "perf/tokens_per_sec": tokens_per_s,
            "perf/tokens_per_sec_per_device": tokens_per_s / self._world,
            "perf/tflops_per_device": flops_per_device / 1e12,
            "perf/step_time_s": total_s / len(steps),
            "perf/data_wait_frac": sum(s.fetch_s for s in steps) / total_s,
            "perf/compute_frac": min(sum(s.compute_s for s in steps) / total_s, 1.0),
        }
        if self.peak is not None:
            m["perf/mfu"] = flops_per_device / self.peak
            m["perf/peak_tflops"] = self.peak / 1e12
        if self.peak_fp8 is not None:
            m["perf/mfu_fp8"] = flops_per_device / self.peak_fp8
            m["perf/peak_tflops_fp8"] = self.peak_fp8 / 1e12
        if self._device.type == "cuda":
            m["perf/peak_mem_gib"] = torch.cuda.max_memory_allocated(self._device) / 2**30
        else:
            # ru_maxrss is KiB on Linux, bytes on macOS.
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
            m["perf/peak_rss_gib"] = rss / 2**30
        return m

    def _check_low_mfu(self) -> None:
        mfu = self.metrics.get("perf/mfu")
        full_window = self._steps_seen >= self.warmup_steps + self.window
        if mfu is None or not full_window or mfu >= self.warn_below:
            return
        m = self.metrics
        causes = diagnose(m["perf/data_wait_frac"], m["perf/compute_frac"], self._world,
                          max(s.micro_tokens for s in self._steps), self._device.type,
                          self.data_wait_threshold, self.small_batch_tokens)
        if causes[0][0] in self._warned:
            return  # warn again only when the likely cause changes
        self._warned.add(causes[0][0])
        message = (f"MFU {mfu:.1%} over the last {self.window} steps is below {self.warn_below:.0%} "
                   f"(peak {self.peak_source}); likely cause: {causes[0][0]}: {causes[0][1]}"
                   + "".join(f"; also {c}: {advice}" for c, advice in causes[1:]))
        self.warnings.append(message)
        rank_zero_warn(message)


def _data_parallel_size(trainer: pl.Trainer) -> int:
    try:
        kwargs = trainer.strategy.distributed_sampler_kwargs
    except (AttributeError, RuntimeError):
        kwargs = None
    if kwargs and "num_replicas" in kwargs:
        return int(kwargs["num_replicas"])
    return trainer.world_size
