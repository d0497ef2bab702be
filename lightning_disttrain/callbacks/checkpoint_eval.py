"""CheckpointEval: evaluate every checkpoint (or every N steps), store the results with it, gate regressions.

Runs an ``EvalSuite`` (held-out loss/perplexity and zero-shot tasks scored like
lm-evaluation-harness: ``lightning_disttrain.evals``) and sends the results to every logger as
``eval/<task>/<metric>``, into ``evals.json`` inside the checkpoint directory (listed in its
manifest) and into one table printed by rank 0. A ``RegressionGate`` checks them (``evals.gate``):
warn, mark the checkpoint failed (resume discovery and ``export --latest`` skip it), or stop.

When: at every checkpoint save (``on_checkpoint``), and/or every ``every_n_steps`` optimizer
steps. Inline, the evaluation runs in ``on_save_checkpoint``, on every rank, on exactly the weights
being saved, so the gate's state stored in that checkpoint already includes it (a resume from it
compares against the same bests). Lightning has no hook that runs after a checkpoint is written and
names its path, so the callback also observes the strategy's ``save_checkpoint`` from ``setup`` to
``teardown`` (the method is wrapped on that strategy object; nothing else changes) to store
``evals.json`` in the directory just written (and, for ``save_weights_only`` saves, which skip
``on_save_checkpoint``, to evaluate there). Two saves at one step (``save_last=True``) are
evaluated once.

How (``mode``):

- ``"inline"``: every rank scores its share of the items through the strategy (FSDP2-sharded
  forwards; see ``evals.parallel_scoring``), training pauses meanwhile. With an async save the
  write continues in the background during the evaluation; ``evals.json`` joins the checkpoint
  once its manifest exists.
- ``"subprocess"``: rank 0 hands the checkpoint, once complete, to ``lightning-disttrain eval`` in a
  separate process (``subprocess_devices`` x ``subprocess_accelerator``) and training continues;
  results are logged (at the checkpoint's step), stored and gated when the process finishes. A
  ``stop`` then stops training at the next step; ranks agree through one broadcast per step
  (only when a ``stop`` rule exists and there is more than one rank). ``fit`` waits for the
  evaluations still running before it returns.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_disttrain.evals.gate import RegressionGate
from lightning_disttrain.evals.results import checkpoint_complete, evals_record, print_results, write_evals
from lightning_disttrain.evals.suite import EvalResults, EvalSuite, run_tokenizer

MODES = ("inline", "subprocess")


class CheckpointEval(L.Callback):
    """Evaluate checkpoints during training.

    Args:
        tasks: eval tasks (``heldout``, ``lambada_openai``, ``piqa``, ``arc_easy``, ``arc_challenge``,
            ``winogrande``, ``copa``, ``openbook_qa``, ``hellaswag``, or ``NAME=FILE.jsonl``).
        data_dir: directory of local JSONL sets (llm-foundry's layout), ``"bundled"`` (the package's samples) or ``"hub"``; None: the
            ``LDT_EVAL_DATA`` environment variable, else the hub through ``datasets``.
        limit: the first N items of each task (evals stay fast; None: all).
        batch_size: sequences per forward (default 16).
        max_length: longest sequence fed to the model (None: the model's ``config.block_size``).
        heldout: the held-out corpus: ``"val"`` (default, the data module's validation set) or a
            ``.txt`` / ``.bin`` / ``.pt`` file.
        heldout_windows: windows of the held-out corpus to score (default 32; None: all).
        heldout_seq_len: window length for text and ``.bin`` held-out corpora (None: ``max_length``).
        on_checkpoint: evaluate after every checkpoint save.
        every_n_steps: also evaluate every N optimizer steps (None: only at checkpoints).
        gate: regression rules, e.g. ``[{"metric": "eval/heldout/loss", "max_increase_pct": 10,
            "action": "fail_checkpoint"}]`` (``evals.gate.GateRule``).
        mode: ``"inline"`` or ``"subprocess"`` (see the module docstring).
        subprocess_devices: with ``mode="subprocess"``: ``--devices`` of the eval process (default 1).
        subprocess_accelerator: with ``mode="subprocess"``: ``--accelerator`` of the eval process
            (default ``"cpu"``).
        subprocess_env: with ``mode="subprocess"``: environment variables set for the eval process,
            on top of this process's (launcher variables removed).
        tokenizer: the tokenizer's name when the data module has none (default: the data module's).
        print_table: print the results table on rank 0.
    """

    def __init__(self, tasks: list[str] | str = "heldout", data_dir: str | None = None, limit: int | None = 100,
                 batch_size: int = 16, max_length: int | None = None, heldout: str = "val",
                 heldout_windows: int | None = 32, heldout_seq_len: int | None = None, on_checkpoint: bool = True,
                 every_n_steps: int | None = None, gate: list[dict[str, Any]] | None = None, mode: str = "inline",
                 subprocess_devices: int = 1, subprocess_accelerator: str = "cpu",
                 subprocess_env: dict[str, str] | None = None, tokenizer: str | None = None,
                 print_table: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"CheckpointEval(mode={mode!r}); use one of {', '.join(MODES)}")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"CheckpointEval(every_n_steps={every_n_steps}) must be >= 1, or None")
        if mode == "subprocess" and every_n_steps is not None:
            raise ValueError("CheckpointEval(mode='subprocess') evaluates saved checkpoints only; drop every_n_steps "
                             "or use mode='inline'")
        if not on_checkpoint and every_n_steps is None:
            raise ValueError("CheckpointEval would never run: set on_checkpoint=True or every_n_steps")
        self.suite = EvalSuite(tasks=tasks, data_dir=data_dir, limit=limit, batch_size=batch_size,
                               max_length=max_length, heldout=heldout, heldout_windows=heldout_windows,
                               heldout_seq_len=heldout_seq_len)
        self.gate = RegressionGate(gate)
        self.on_checkpoint, self.every_n_steps, self.mode = on_checkpoint, every_n_steps, mode
        self.subprocess_devices, self.subprocess_accelerator = subprocess_devices, subprocess_accelerator
        self.subprocess_env = dict(subprocess_env or {})
        self.tokenizer_name, self.print_table = tokenizer, print_table
        self.history: list[dict[str, Any]] = []
        """Every evaluation: step, checkpoint, metrics, gate violations (what evals.json holds)."""
        self._last: tuple[int, EvalResults, dict[str, Any]] | None = None  # step, results, gate record
        self._pending: list[tuple[Path, dict[str, Any]]] = []  # evals.json waiting for its manifest (rank 0)
        self._handoff = None
        self._stop_requested = False
        self._observed: tuple[Any, Any] | None = None  # (strategy, its own save_checkpoint)

    # ---- Lightning hooks --------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not self.on_checkpoint or self._observed is not None:
            return
        if int(getattr(trainer.strategy, "context_parallel_size", 1)) > 1:
            raise ValueError("CheckpointEval scores whole sequences per rank, which context parallel (cp > 1) does "
                             "not run yet: evaluate the saved checkpoints with `lightning-disttrain eval` (one "
                             "process or cp=1), or remove the callback from this run")
        strategy, original = trainer.strategy, trainer.strategy.save_checkpoint

        @functools.wraps(original)
        def save_checkpoint(checkpoint, filepath, *args, **kwargs):
            out = original(checkpoint, filepath, *args, **kwargs)
            self._after_save(trainer, pl_module, Path(filepath), checkpoint)
            return out

        strategy.save_checkpoint = save_checkpoint
        self._observed = (strategy, original)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._observed is not None:
            strategy, _ = self._observed
            strategy.__dict__.pop("save_checkpoint", None)  # the class's method again
            self._observed = None
        if self._handoff is not None:
            self._handoff.close()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and not self._evaluated_at(step):
            self._evaluate(trainer, pl_module, None, trainer.current_epoch)
        self._flush(wait=False)
        if self.mode == "subprocess":
            self._collect(trainer, wait=False)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if not (self.on_checkpoint and self.mode == "inline" and self._observed is not None):
            return
        if not self._evaluated_at(trainer.global_step):
            self._evaluate(trainer, pl_module, None, trainer.current_epoch, checkpoint_pending=True)
        callbacks = checkpoint.get("callbacks")
        if isinstance(callbacks, dict) and self.state_key in callbacks:
            callbacks[self.state_key] = self.state_dict()  # with this evaluation in it

    def on_train_end(self, trainer, pl_module) -> None:
        wait = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if callable(wait):
            wait()  # the last async save's manifest, before evals.json joins it
        self._flush(wait=True)
        if self.mode == "subprocess":
            self._collect(trainer, wait=True)

    def state_dict(self) -> dict[str, Any]:
        return {"gate": self.gate.state_dict(), "history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.gate.load_state_dict(state_dict.get("gate", {}))
        self.history = list(state_dict.get("history", []))

    # ---- evaluation -------------------------------------------------------------------------

    def _evaluated_at(self, step: int) -> bool:
        return self._last is not None and self._last[0] == step

    def _after_save(self, trainer, pl_module, path: Path, checkpoint: dict[str, Any]) -> None:
        step, epoch = int(checkpoint.get("global_step", trainer.global_step)), checkpoint.get("epoch")
        if self.mode == "subprocess":
            if trainer.is_global_zero:
                self._handoff_for(trainer, pl_module).submit(path, step, epoch)
                self._collect(trainer, wait=False, agree=False)
            return
        if not self._evaluated_at(step):  # a weights-only save: on_save_checkpoint did not run
            self._evaluate(trainer, pl_module, path, epoch)
            return
        _, results, gate = self._last  # evaluated in on_save_checkpoint (or at this step already)
        if self.history and self.history[-1]["step"] == step and self.history[-1]["checkpoint"] is None:
            self.history[-1]["checkpoint"] = str(path)
        if gate.get("checkpoint_pending"):  # a fail_checkpoint rule fired for the checkpoint being saved
            gate = {**gate, "failed_checkpoint": True}
        gate.pop("checkpoint_pending", None)
        if trainer.is_global_zero:
            self._store(path, results, step, epoch, gate)

    def _evaluate(self, trainer, pl_module, path: Path | None, epoch: int | None,
                  checkpoint_pending: bool = False) -> None:
        tokenizer = self._tokenizer(trainer, pl_module)
        results = self.suite.run_module(pl_module, trainer, tokenizer=tokenizer)  # collective
        self._report(trainer, results, trainer.global_step, epoch, path, checkpoint_pending)

    def _report(self, trainer, results: EvalResults, step: int, epoch: int | None, path: Path | None,
                checkpoint_pending: bool = False) -> None:
        """Log, print, gate and store one evaluation (every rank inline; rank 0 in subprocess mode).
        ``checkpoint_pending``: evaluated for a checkpoint still being saved (its path comes later)."""
        metrics = results.flat()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        for name, value in metrics.items():
            trainer.callback_metrics[name] = torch.tensor(value)
        if self.print_table and trainer.is_global_zero:
            print_results(results, step, f" ({path.name})" if path is not None else "")
        violations = self.gate.check(metrics, step)
        fail = [v for v in violations if v.rule.action == "fail_checkpoint"]
        gate = {"passed": not violations, "failed_checkpoint": bool(fail) and path is not None,
                "violations": [v.to_dict() for v in violations]}
        if fail and checkpoint_pending:
            gate["checkpoint_pending"] = True
        for v in violations:
            what = {"warn": "", "stop": "; stopping training", "fail_checkpoint":
                    f"; checkpoint {path.name!r} marked failed" if path is not None else
                    "; the checkpoint being saved is marked failed" if checkpoint_pending else
                    " (no checkpoint at this step to mark failed)"}[v.rule.action]
            rank_zero_warn(f"eval gate at step {step}: {v.describe()}{what}")
        if any(v.rule.action == "stop" for v in violations):
            self._stop_requested = True
            if self.mode == "inline":  # every rank gated the same gathered numbers: no need to agree
                trainer.should_stop = True
        entry = {"step": step, "checkpoint": str(path) if path is not None else None, "metrics": metrics,
                 "violations": [v.describe() for v in violations]}
        self.history.append(entry)
        if violations:
            self.gate.failed.append(entry)
        self._last = (step, results, gate)
        if path is not None and trainer.is_global_zero:
            self._store(path, results, step, epoch, gate)

    def _store(self, path: Path, results: EvalResults, step: int, epoch: int | None, gate: dict[str, Any]) -> None:
        config = {"tasks": self.suite.tasks, "limit": self.suite.limit, "heldout": self.suite.heldout,
                  "heldout_windows": self.suite.heldout_windows, "mode": self.mode}
        record = evals_record(results, step=step, epoch=epoch, checkpoint=path.name, gate=gate, config=config)
        self._pending.append((path, record))
        self._flush(wait=False)

    def _flush(self, wait: bool) -> None:
        """Write each pending ``evals.json`` whose checkpoint is complete (rank 0 holds them)."""
        keep = []
        for path, record in self._pending:
            if checkpoint_complete(path):
                write_evals(path, record)
            elif not path.exists():
                pass  # deleted by retention before it completed: nothing to store it with
            elif wait:
                rank_zero_warn(f"CheckpointEval: {str(path)!r} never completed (no manifest); its eval results "
                               f"are in the loggers only")
            else:
                keep.append((path, record))
        self._pending = keep

    # ---- separate-process evaluation ----------------------------------------------------------

    def _handoff_for(self, trainer, pl_module):
        if self._handoff is None:
            from lightning_disttrain.evals.handoff import EvalHandoff
            from lightning_disttrain.evals.tasks import HELDOUT

            tokenizer = self._tokenizer(trainer, pl_module)
            self._handoff = EvalHandoff(self.suite, tokenizer.name, self.subprocess_devices,
                                        self.subprocess_accelerator, self.subprocess_env)
            if HELDOUT in self.suite.names and self.suite.heldout == "val":
                from lightning_disttrain.evals.suite import model_max_length

                self.suite.prepare(tokenizer, datamodule=trainer.datamodule, max_length=model_max_length(pl_module))
                self._handoff.heldout_file = str(self._handoff.workdir / "heldout.pt")
                torch.save(self.suite.windows, self._handoff.heldout_file)
        return self._handoff

    def _collect(self, trainer, wait: bool, agree: bool = True) -> None:
        if trainer.is_global_zero and self._handoff is not None:
            for job, results, error in self._handoff.poll(wait=wait):
                if results is None:
                    rank_zero_warn(f"CheckpointEval: {error}")
                    continue
                self._report(trainer, results, job.step, job.epoch, job.ckpt)
        stop = self._stop_requested
        if agree and not wait and trainer.world_size > 1 and any(r.action == "stop" for r in self.gate.rules):
            stop = trainer.strategy.broadcast(stop, src=0)  # only rank 0 saw the results
        if stop and not wait:
            trainer.should_stop = True

    def _tokenizer(self, trainer, pl_module):
        if self.tokenizer_name is not None:
            from lightning_disttrain.data import get_tokenizer

            return get_tokenizer(self.tokenizer_name)
        return run_tokenizer(pl_module, trainer)
