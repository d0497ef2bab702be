"""The ``lightning-disttrain`` command.

``fit | validate | test | predict --config X.yaml`` go through ``LightningCLI``: the model, data,
strategy, loggers and callbacks are chosen by ``class_path`` (or a registered strategy name such
as ``fsdp2``) in the YAML. ``prepare`` tokenizes text into llm.c shards; ``export`` writes a
consolidated single-file state dict from a sharded checkpoint, or a Hugging Face model directory
(``--format hf``); ``eval`` scores a checkpoint on zero-shot tasks and held-out loss
(``lightning_disttrain/evals/command.py``).

Errors: a class that refuses its configuration is reported as one line naming the config key
(``error: trainer.strategy: NDParallelStrategy(pp=2) is not supported yet: ...``); an error during
a multi-process run is printed once, last, by rank 0 (see ``rank_errors.py``). ``LDT_TRACEBACK=1``
adds the tracebacks. A config the parser refuses (an unknown key, a ``class_path`` that does not
import, an ``init_args`` key its class does not take, an option misspelt on the command line) is
one ``error:`` line naming the key, with a "did you mean" where one is close, not the usage text; no
option is taken for a prefix of another (``--trainer.max_step``). An unknown strategy name suggests ours. ``prepare``/``export``/``plan``/``eval`` report an expected
failure (a missing or corrupt checkpoint, a bad path or value) as ``error: <command>: <message>``,
exit status 2; so does every command for a ``--ckpt_path`` / ``eval`` file that is not a checkpoint
(one line, the same for each: ``checkpoint.safe_load.check_checkpoint_file``).
``ft-lighthouse`` / ``ft-local`` start fault-tolerant replica groups (``fault_tolerance/command.py``).
``LDT_DEBUG=1`` (or ``LDT_TRACEBACK=1``) restores the full text and the tracebacks.

Output: Lightning's notes that read wrong for every run (its litlogger tip, ``v_num`` on the bar, a
FLOPs column of zeros, "Epoch 0/-2"; ``eval``'s own ``limit_val_batches`` note) are left out
(``_quiet_display``, ``_quiet_lightning``).
"""

from __future__ import annotations

import faulthandler
import importlib
import logging
import os
import pickle
import re
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import lightning as L
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_disttrain  # noqa: F401  (registers strategy names; callbacks importable by class_path)
from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain import cli_hints as hints
from lightning_disttrain import startup_signals
from lightning_disttrain.rank_errors import ENV_TRACEBACK, RunErrors

_TOOLS = {
    "prepare": ("lightning_disttrain.data.prepare", "prepare_main", "tokenize text into llm.c .bin shards"),
    "export": ("lightning_disttrain.checkpoint.command", "export_main",
               "export a sharded checkpoint as one state-dict file, or as Hugging Face (--format hf)"),
    "plan": ("lightning_disttrain.planning.command", "plan_main",
             "memory per GPU by layout, the recommended layout, speed, cost, checkpoint interval"),
    "eval": ("lightning_disttrain.evals.command", "eval_main",
             "evaluate a checkpoint (directory or exported file) on zero-shot tasks and held-out loss"),
    "ft-lighthouse": ("lightning_disttrain.fault_tolerance.command", "lighthouse_main",
                      "start a torchft lighthouse: where the replica groups of fault-tolerant runs meet"),
    "ft-local": ("lightning_disttrain.fault_tolerance.command", "local_main",
                 "try a fault-tolerant run on this machine: a lighthouse and one `fit` per replica group"),
}


ENV_DEBUG = "LDT_DEBUG"


def debug_enabled() -> bool:
    """``LDT_DEBUG=1`` or ``LDT_TRACEBACK=1``: full error texts and tracebacks."""
    return any(os.environ.get(var, "0") not in ("", "0") for var in (ENV_DEBUG, ENV_TRACEBACK))


_EXPECTED_TOOL_ERRORS = (ValueError, OSError, pickle.UnpicklingError, EOFError)
"""What ``prepare``/``export``/``plan``/``eval`` raise for a bad input (a missing or corrupt
checkpoint is a ``CheckpointVerificationError``, a ValueError): one line, no traceback."""


class _ShortErrorParser(LightningArgumentParser):
    """jsonargparse's errors as one line: no usage text first, a "did you mean" for a misspelt key or
    class. The full text with ``LDT_DEBUG=1``. No option is abbreviated (``allow_abbrev=False``, on this
    parser and every one jsonargparse builds from it: subcommands and class parsers are this class):
    ``--trainer.max_step 4`` is an error, not silently ``max_steps``."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.family: list[_ShortErrorParser] = [self]
        """The command's parsers (``DistTrainCLI.init_parser``): a key unknown to the root parser is
        looked up in the subcommand's."""

    def error(self, message: str, ex: Exception | None = None):
        if debug_enabled() or not self.exit_on_error:
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        unknown = re.search(r"does not accept option '([^']+)'", message)
        if unknown:
            keys = compat.parser_option_names(parser)
            short = message.splitlines()[0] + hints.did_you_mean(unknown.group(1), keys)
        else:
            keys = [k for p in parser.family for k in compat.parser_option_names(p)]
            short = (hints.unrecognized_hint(message, parser) or hints.class_option_hint(message)
                     or hints.class_path_hint(message) or hints.class_name_hint(message)
                     or hints.unknown_key_hint(message, keys))
            key = re.search(r'Parser key "([^"]+)"', message)
            if short is not None and key and short.startswith("class_path"):
                short = f"{key.group(1)}: {short}"  # which class_path: model, data, trainer.callbacks...
            if short is None:
                lines = [line for line in message.splitlines() if line.strip()]
                short = lines[0] if len(lines) <= 6 else f"{lines[0]} (... {len(lines) - 1} more lines with {ENV_DEBUG}=1)"
        sys.stderr.write(f"error: {short}\n(options: {prog} --help)\n")
        self.exit(2)


def _our_strategy_names() -> list[str]:
    from lightning.pytorch.strategies import StrategyRegistry

    return [name for name, entry in StrategyRegistry.items()
            if getattr(entry.get("strategy"), "__module__", "").startswith("lightning_disttrain")]


def _strategy_hint(message: str) -> str | None:
    """An unknown strategy name: ours, with the closest one, instead of Lightning's list."""
    found = re.search(r"invalid strategy name: `strategy='([^']*)'`", message)
    if not found:
        return None
    ours = _our_strategy_names()
    return (f"unknown strategy {found.group(1)!r}{hints.did_you_mean(found.group(1), ours)} "
            f"lightning-disttrain registers "
            f"{', '.join(ours)}; or give a class_path, e.g. lightning_disttrain.strategies.NDParallelStrategy "
            f"(Lightning's own names work too: ddp, fsdp, ...)")


@dataclass
class _ConstructorFailure:
    """An exception raised by a configured class's constructor, and where in the config it came from."""

    exc: Exception
    class_type: type | None = None
    kwargs: dict = field(default_factory=dict)
    key: str | None = None


class _RememberFailures:
    """A jsonargparse instantiator that records the exception a constructor raises, then re-raises it.

    jsonargparse folds that exception into a "Does not validate against any of the Union subtypes"
    text of 60-80 lines, where it is not even listed first; this keeps the exception itself.
    """

    def __init__(self, inner, failures: list[_ConstructorFailure]) -> None:
        self.inner, self.failures = inner, failures
        self.key = getattr(inner, "key", None)  # LightningCLI's model / data instantiators know theirs

    def __call__(self, class_type, *args, applied_instantiation_links: dict | None = None, **kwargs):
        try:
            if self.inner is None:
                return class_type(*args, **kwargs)
            return self.inner(class_type, *args, applied_instantiation_links=applied_instantiation_links or {},
                              **kwargs)
        except Exception as exc:
            self.failures.append(_ConstructorFailure(exc, class_type, kwargs, self.key))
            raise


class DistTrainCLI(LightningCLI):
    """LightningCLI with any LightningModule / LightningDataModule selectable by ``class_path``.

    A configured class whose constructor raises ends the command with ``error: <config key>:
    <its message>`` (exit status 2) instead of jsonargparse's union text and traceback.

    Args:
        *args: passed on to ``LightningCLI`` after its model and data module classes (both
            ``LightningModule`` / ``LightningDataModule``, in subclass mode).
        run_errors: the process's ``rank_errors.RunErrors`` (``main`` passes it): it is given the
            Trainer once it is built (``RunErrors.trainer``), for the run's error reporting
            across ranks; None: none.
        subcommand: the only LightningCLI subcommand to build a parser for (``fit``, ``validate``,
            ...); None: the first element of ``args`` when it is a string, else every subcommand.
        **kwargs: ``LightningCLI`` keyword arguments (``args``, ``parser_kwargs``, ...).
    """

    def __init__(self, *args, run_errors: RunErrors | None = None, subcommand: str | None = None, **kwargs):
        self._failures: list[_ConstructorFailure] = []
        self._run_errors = run_errors
        given = kwargs.get("args")
        if subcommand is None and isinstance(given, (list, tuple)) and given and isinstance(given[0], str):
            subcommand = given[0]  # DistTrainCLI(args=["fit", ...]) from Python
        self._only_subcommand = subcommand
        every = LightningCLI.subcommands()
        if subcommand in every and isinstance(kwargs.get("parser_kwargs"), dict):
            # LightningCLI sorts parser_kwargs by subcommands(): the other subcommands' entries
            # would reach the main parser as unknown arguments.
            kwargs["parser_kwargs"] = {k: v for k, v in kwargs["parser_kwargs"].items()
                                       if k not in every or k == subcommand}
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_class", _ShortErrorParser)
        self._parsers: list[LightningArgumentParser] = []
        super().__init__(L.LightningModule, L.LightningDataModule, *args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """LightningCLI's parser (the root's, then each subcommand's), each knowing the others: an
        error the root reports names the closest key of the subcommand."""
        parser = super().init_parser(**kwargs)
        self._parsers.append(parser)
        if isinstance(parser, _ShortErrorParser):
            parser.family = self._parsers
        return parser

    def subcommands(self) -> dict[str, set[str]]:  # an instance method: LightningCLI calls it through self
        """LightningCLI's subcommands, or only the one the command line names (``subcommand``):
        LightningCLI builds a parser of every Trainer argument and class signature for each
        subcommand it offers, in every process of a run (docs/benchmarks.md, section 18)."""
        every = LightningCLI.subcommands()
        only = self._only_subcommand
        return {only: every[only]} if only in every else every

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """LightningCLI's parsing, then a ``--ckpt_path FILE`` checked before LightningCLI reads its
        hyper-parameters with ``torch.load``: a file that is not a checkpoint is one line, exit status
        2 (``check_checkpoint_file``: the same line as ``eval``'s), not torch's traceback advising
        ``weights_only=False``. A directory (DCP) or a name (``last``, ``auto``) is the restore's."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand") if hasattr(self.config, "get") else None
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and os.path.isfile(ckpt_path):
            from lightning_disttrain.checkpoint.safe_load import NotACheckpointError, check_checkpoint_file

            try:
                check_checkpoint_file(ckpt_path)
            except NotACheckpointError as err:
                if debug_enabled():
                    raise
                sys.stderr.write(f"error: {subcommand}: {err}\n")
                raise SystemExit(2) from None

    def before_test(self) -> None:
        self._require_dataloader("test")

    def before_predict(self) -> None:
        self._require_dataloader("predict")

    def _require_dataloader(self, stage: str) -> None:
        """``test``/``predict`` with a data module that has no such split (``TokenDataModule`` has
        train and validation only): one line naming what does evaluate it, before any process starts,
        instead of Lightning's traceback from inside the run."""
        from lightning.pytorch.utilities.model_helpers import is_overridden

        data = self.datamodule
        if isinstance(data, L.LightningDataModule) and not is_overridden(f"{stage}_dataloader", data,
                                                                         L.LightningDataModule):
            sys.stderr.write(f"error: {stage}: {type(data).__name__} has no {stage} split (no {stage}_dataloader); "
                             f"`lightning-disttrain validate` with this config evaluates its validation set, "
                             f"`lightning-disttrain eval CKPT` zero-shot tasks and held-out loss; or set data.class_path "
                             f"to a data module with a {stage}_dataloader\n")
            raise SystemExit(2)

    def before_instantiate_classes(self) -> None:
        # Wrap LightningCLI's model/data instantiators (they record hyper-parameters, so they must
        # still run) and add one for every other class (strategy, callbacks, loggers).
        registered = compat.parser_instantiators(self.parser)
        for (class_type, subclasses), instantiator in registered.items():
            self.parser.add_instantiator(_RememberFailures(instantiator, self._failures), class_type, subclasses)
        self.parser.add_instantiator(_RememberFailures(None, self._failures), object, subclasses=True)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as exc:  # noqa: BLE001  (re-raised unless a constructor refused its config)
            self._exit_with_config_error(exc)
        if self._run_errors is not None:
            self._run_errors.trainer = self.trainer

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except Exception as exc:
            self._failures.append(_ConstructorFailure(exc, L.Trainer, key="trainer"))
            raise
        _quiet_display(trainer)
        return trainer

    def _exit_with_config_error(self, exc: Exception):
        failure = self._root_failure(exc)
        if failure is None:
            raise exc  # not a constructor refusing its arguments: keep the whole story
        root = failure.exc
        if debug_enabled():
            traceback.print_exception(root, file=sys.stderr)
        key = failure.key or self._config_key(failure) or getattr(failure.class_type, "__name__", "config")
        message = str(root) if isinstance(root, ValueError) else f"{type(root).__name__}: {root}"
        if (hint := _strategy_hint(message)) is not None:
            key, message = "trainer.strategy", hint
        sys.stderr.write(f"error: {key}: {message}\n")
        raise SystemExit(2)

    def _root_failure(self, exc: Exception) -> _ConstructorFailure | None:
        # The failure that ended instantiation: its exception is `exc` itself or in its chain, or
        # its message is folded into jsonargparse's text. Earlier ones may have been tolerated
        # (a union member that did not fit while another did).
        chain, cause = [], exc
        while cause is not None and len(chain) < 50:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        for failure in reversed(self._failures):
            if any(failure.exc is c for c in chain) or (str(failure.exc) and str(failure.exc) in str(exc)):
                return failure
        return None

    def _config_key(self, failure: _ConstructorFailure) -> str | None:
        """The dotted config key (``trainer.strategy``, ``trainer.callbacks[1]``) of the failed class."""
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        config = config.as_dict() if hasattr(config, "as_dict") else config
        candidates = list(_class_nodes(config, ""))
        matches = [(key, node) for key, node in candidates if hints.resolve(node["class_path"]) is failure.class_type]
        if not matches:
            return None

        def agreement(node: dict) -> int:
            init_args = node.get("init_args") or {}
            return sum(1 for k, v in failure.kwargs.items() if init_args.get(k, object()) == v)

        return max(matches, key=lambda m: agreement(m[1]))[0]


def _quiet_display(trainer: L.Trainer) -> None:
    """What Lightning's default bar and summary show that reads wrong for every run of ours (issue 42):
    "Epoch 0/-2" under ``max_steps`` with any strategy (ours fix it only for themselves), ``v_num``
    (the logger's version, 0 in a fresh directory: a number that reads like a metric), the model
    summary's FLOPs column of zeros (``callbacks/model_summary.py``). Only Lightning's own classes:
    a user's subclass is left as it is."""
    from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar, TQDMProgressBar

    from lightning_disttrain.callbacks.model_summary import summarize_without_zero_flops

    compat.fix_epoch_description(trainer)
    bar = trainer.progress_bar_callback
    if type(bar) in (RichProgressBar, TQDMProgressBar):
        metrics = bar.get_metrics  # Lightning's documented override point to drop v_num

        def get_metrics(*args: Any, **kwargs: Any) -> dict:
            return {k: v for k, v in metrics(*args, **kwargs).items() if k != "v_num"}

        bar.get_metrics = get_metrics
    for callback in trainer.callbacks:
        if type(callback) is RichModelSummary:
            callback.summarize = summarize_without_zero_flops


class _DropMessages(logging.Filter):
    """Drops Lightning's info messages that start with one of ``prefixes`` (matched on the format
    string, before its arguments are filled in)."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


_LITLOGGER_TIP = "💡 Tip: For seamless cloud logging"
"""Lightning's advertisement for its cloud logger, printed by every Trainer, ``eval``'s included."""
_EVAL_LIMIT = "`Trainer(limit_val_batches=1)` was configured"
"""``eval`` scores held-out loss through a Trainer it configures itself: a note on a setting the user
never made."""


def _quiet_lightning(command: str | None) -> None:
    """Lightning's notes that say nothing about this run, filtered where Lightning logs them
    (``rank_zero_info``'s logger, set by both of its packages)."""
    prefixes = (_LITLOGGER_TIP,) + ((_EVAL_LIMIT,) if command == "eval" else ())
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _DropMessages)]:  # an earlier main() in this process
            logger.removeFilter(old)
        logger.addFilter(_DropMessages(prefixes))


def _class_nodes(node: Any, key: str):
    """(key, node) for every ``{class_path: ..., init_args: ...}`` in a config, depth first."""
    if isinstance(node, dict):
        if isinstance(node.get("class_path"), str):
            yield key, node
        for name, value in node.items():
            if name != "class_path":
                yield from _class_nodes(value, f"{key}.{name}" if key else name)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _class_nodes(value, f"{key}[{i}]")


def main(argv: list[str] | None = None) -> None:
    # LightningCLI warns when given args while sys.argv has some too: pass ours only when they are
    # not sys.argv's (a call from Python).
    cli_args = None if argv is None else list(argv)
    whole_process = argv is None  # the console script / `python -m`: this call is the process
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_lightning(argv[0] if argv else None)
    if argv and argv[0] in _TOOLS:
        module, fn, _ = _TOOLS[argv[0]]
        try:
            getattr(importlib.import_module(module), fn)(argv[1:])
        except _EXPECTED_TOOL_ERRORS as exc:
            if debug_enabled():
                raise
            message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            sys.stderr.write(f"error: {argv[0]}: {message}\n({ENV_DEBUG}=1 shows the traceback)\n")
            raise SystemExit(2) from None
        return
    if argv and argv[0] in ("-h", "--help"):
        print("usage: lightning-disttrain {fit,validate,test,predict,prepare,export,plan,eval,ft-lighthouse,ft-local} "
              "...\n")
        for name, (_, _, doc) in _TOOLS.items():
            print(f"  {name:13s} {doc}")
        print("  fit, validate, test, predict: LightningCLI subcommands (lightning-disttrain fit --help)\n")
    # A rank that crashes in native code (a segfault in a kernel or a collective) prints its Python
    # stack before it dies; rank 0's report then names the signal (rank_errors.describe_exit). To
    # the process's own stderr: faulthandler writes to a file descriptor, and sys.stderr may be a
    # stream without one (a caller capturing output, main() called from Python).
    if not faulthandler.is_enabled() and sys.__stderr__ is not None:
        try:
            faulthandler.enable(file=sys.__stderr__)
        except (OSError, ValueError, AttributeError):  # no usable descriptor: run without it
            pass
    run_errors = RunErrors.for_this_process()
    # A preemption signal before training starts (or after it, or in validate/test/predict) stops
    # every rank at once with one line, instead of killing one process silently (startup_signals.py).
    # As the whole process, the handlers stay until it exits (its shutdown included); a call from
    # Python gives them back when it returns.
    signals = startup_signals.install(run_errors.stopped)
    try:
        DistTrainCLI(args=cli_args, run_errors=run_errors, subcommand=argv[0] if argv else None)
    except Exception as exc:  # noqa: BLE001  (every error is reported, see rank_errors.py)
        run_errors.fail(exc)  # does not return: rank 0 reports, the other ranks wait for it
    else:
        run_errors.finish()
    finally:
        if not whole_process:
            startup_signals.uninstall(signals)
        run_errors.close()


if __name__ == "__main__":
    main()
