"""EvalSuite: a fixed set of eval tasks, read once, run on a LightningModule through its strategy.

Used by the ``CheckpointEval`` callback (inline, on every rank of a training run) and by the
``lightning-disttrain eval`` command (on a checkpoint, on any number of devices). The model runs
the way the strategy has it (FSDP2-sharded, tensor-parallel): forwards go through the
LightningModule, in eval mode, without gradients, inside the precision plugin's forward context;
train mode is restored afterwards. Nothing random is drawn, so evaluation leaves every RNG
stream where training had it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_disttrain.evals.heldout import heldout_metrics, load_windows
from lightning_disttrain.evals.parallel_scoring import DataParallel, Forward, score_requests
from lightning_disttrain.evals.requests import Request, build_requests, task_metrics
from lightning_disttrain.evals.tasks import HELDOUT, Task, load_task, parse_task


@dataclass
class EvalResults:
    """Metrics of one evaluation: ``metrics[task][metric]``, plus bookkeeping."""

    metrics: dict[str, dict[str, float]]
    items: dict[str, int]
    """Items (held-out: windows) scored per task."""
    seconds: dict[str, float]
    """Wall time per task (and ``total``)."""

    def flat(self, prefix: str = "eval") -> dict[str, float]:
        """``{"eval/<task>/<metric>": value}``: the names loggers and the gate use."""
        return {f"{prefix}/{task}/{name}": value for task, values in self.metrics.items()
                for name, value in values.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"metrics": self.metrics, "items": self.items, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EvalResults:
        return cls(raw["metrics"], raw.get("items", {}), raw.get("seconds", {}))


@dataclass
class EvalSuite:
    """Which tasks to run and how.

    Args:
        tasks: task names (``piqa``, ``lambada_openai``, ..., ``heldout``), or ``NAME=FILE.jsonl`` /
            ``NAME=hub:org/dataset`` (``evals.tasks``).
        data_dir: directory of local JSONL sets (llm-foundry's layout), ``"bundled"`` (the package's samples) or ``"hub"``; None: the
            ``LDT_EVAL_DATA`` environment variable, else the hub through ``datasets``.
        limit: the first N items of each task (None: all of them).
        batch_size: sequences per forward.
        max_length: longest sequence fed to the model (None: the model's ``config.block_size``).
        heldout: the held-out corpus: ``"val"`` (the data module's validation set) or a ``.txt`` /
            ``.bin`` file.
        heldout_windows: windows of the held-out corpus to score (None: all).
        heldout_seq_len: window length for text and ``.bin`` held-out corpora (None: ``max_length``).
    """

    tasks: list[str]
    data_dir: str | None = None
    limit: int | None = None
    batch_size: int = 16
    max_length: int | None = None
    heldout: str = "val"
    heldout_windows: int | None = 32
    heldout_seq_len: int | None = None
    _loaded: dict[str, Task] = field(default_factory=dict, repr=False)
    _requests: dict[str, list[list[Request]]] = field(default_factory=dict, repr=False)
    _windows: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):
            self.tasks = [t for t in self.tasks.split(",") if t.strip()]
        if not self.tasks:
            raise ValueError("no eval tasks given; name at least one, e.g. tasks=['heldout', 'piqa']")
        names = [parse_task(t)[0] for t in self.tasks]  # checks every name before anything runs
        if len(set(names)) != len(names):
            raise ValueError(f"eval tasks {names} name a task twice; give each once")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: give at least 1 sequence per forward")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit}: give a positive number of items per task, or None for all")

    @property
    def windows(self) -> torch.Tensor | None:
        """The held-out windows (N, seq_len + 1), once ``prepare`` has read them."""
        return self._windows

    @property
    def names(self) -> list[str]:
        return [parse_task(t)[0] for t in self.tasks]

    def prepare(self, tokenizer, *, datamodule: Any = None, max_length: int = 1024) -> None:
        """Read the tasks and tokenize their requests once (every rank reads the same files)."""
        length = self.max_length or max_length
        for spec in self.tasks:
            name = parse_task(spec)[0]
            if name == HELDOUT:
                if self._windows is None:
                    self._windows = load_windows(self.heldout, tokenizer=tokenizer, datamodule=datamodule,
                                                 seq_len=self.heldout_seq_len or length, limit=self.heldout_windows)
            elif name not in self._loaded:
                task = load_task(spec, self.data_dir, self.limit)
                self._loaded[name] = task
                self._requests[name] = build_requests(task, tokenizer)

    def run(self, forward: Forward, dp: DataParallel, *, vocab: int, device: torch.device, max_length: int,
            multiple: int = 1, pad_id: int = 0) -> EvalResults:
        """Score every task (``prepare`` first). Collective over the data-parallel ranks."""
        length = self.max_length or max_length
        metrics, items, seconds = {}, {}, {}
        start_all = time.perf_counter()
        for name in self.names:
            start = time.perf_counter()
            if name == HELDOUT:
                windows = self._windows
                if windows.size(1) - 1 > length:
                    raise ValueError(f"held-out windows of {windows.size(1) - 1} tokens exceed the model's "
                                     f"{length}; set heldout_seq_len <= {length}")
                metrics[name] = heldout_metrics(forward, windows, dp, vocab=vocab, batch_size=self.batch_size,
                                                device=device, multiple=multiple)
                items[name] = len(windows)
            else:
                task, per_item = self._loaded[name], self._requests[name]
                flat = [r for reqs in per_item for r in reqs]
                scores = score_requests(forward, flat, dp, vocab=vocab, max_length=length,
                                        batch_size=self.batch_size, device=device, pad_id=pad_id, multiple=multiple)
                grouped, at = [], 0
                for reqs in per_item:
                    grouped.append(scores[at:at + len(reqs)])
                    at += len(reqs)
                metrics[name] = task_metrics(task, grouped)
                items[name] = len(task.items)
            seconds[name] = time.perf_counter() - start
        seconds["total"] = time.perf_counter() - start_all
        return EvalResults(metrics, items, seconds)

    def run_module(self, pl_module, trainer=None, *, tokenizer=None) -> EvalResults:
        """``prepare`` + ``run`` on a LightningModule, through ``trainer``'s strategy when given."""
        tokenizer = tokenizer or run_tokenizer(pl_module, trainer)
        max_length = model_max_length(pl_module)
        self.prepare(tokenizer, datamodule=getattr(trainer, "datamodule", None) if trainer else None,
                     max_length=max_length)
        strategy = getattr(trainer, "strategy", None)
        with eval_mode(pl_module, trainer) as forward:
            return self.run(forward, data_parallel(strategy), vocab=tokenizer.n_vocab, device=pl_module.device,
                            max_length=max_length, multiple=getattr(strategy, "sequence_multiple", 1) or 1,
                            pad_id=tokenizer.eot_token)


def data_parallel(strategy) -> DataParallel:
    """This rank among the data-parallel replicas, from the strategy (Lightning's sampler arguments)."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    size = int(kwargs.get("num_replicas", 1))
    return DataParallel(rank=int(kwargs.get("rank", 0)), size=size,
                        group=getattr(strategy, "dp_process_group", None) if size > 1 else None)


def run_tokenizer(pl_module, trainer=None):
    """The run's tokenizer: the data module's, else the module's own (``GPTModule.tokenizer``)."""
    dm = getattr(trainer, "datamodule", None) if trainer is not None else None
    tok = getattr(dm, "tokenizer", None) if dm is not None else None
    tok = tok or getattr(pl_module, "tokenizer", None)
    if tok is None or not callable(getattr(tok, "encode", None)):
        raise ValueError("CheckpointEval needs the run's tokenizer: give the data module a `tokenizer` attribute "
                         "(TokenDataModule has one), or pass CheckpointEval(tokenizer='gpt2' | 'bytes')")
    return tok


def model_max_length(pl_module) -> int:
    config = getattr(pl_module, "config", None) or getattr(getattr(pl_module, "model", None), "config", None)
    for name in ("block_size", "n_positions", "max_position_embeddings"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return 1024


def _logits(out: Any) -> torch.Tensor:
    out = getattr(out, "logits", out)  # Hugging Face models return an output object
    if hasattr(out, "full_tensor"):  # vocabulary-sharded (tensor parallel) logits
        out = out.full_tensor()
    return out


@contextmanager
def eval_mode(pl_module, trainer=None):
    """A forward for scoring: eval mode, no gradients, the precision plugin's context; train mode back after."""
    was_training = pl_module.training
    precision = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    context = precision.forward_context if precision is not None else nullcontext

    strategy = getattr(trainer, "strategy", None)
    pipelined = getattr(strategy, "pipeline_enabled", False)

    def forward(idx: torch.Tensor) -> torch.Tensor:
        with context():
            if pipelined:  # the stages' schedule, forward only; the logits reach every rank of the pipeline
                return strategy.pipeline_forward(idx)
            return _logits(pl_module(idx))

    pl_module.eval()
    try:
        with torch.no_grad():
            yield forward
    finally:
        pl_module.train(was_training)
