"""Every use of a Lightning (and LightningCLI's jsonargparse) private, in one module.

Lightning has no public hook for a few things the strategies and callbacks must do: rename the
checkpoint a resume loaded, translate ``ckpt_path="auto"`` at the restore, make Lightning's signal
handlers only set a flag, change ``ModelCheckpoint(every_n_train_steps)`` after a measured save,
stop the launcher's child-process watchdog before a deliberate exit, swap the norm in the
precision plugin's clipping, and so on. Each such use is an accessor here, with one line on why,
so that a Lightning release that changes one breaks here, loudly, and nowhere else.

Checked against: ``lightning`` 2.6.x (2.6.6) and ``jsonargparse`` 4.53. ``check()`` verifies every
private below is present in the installed versions (``tests/test_lightning_compat.py`` runs it, and
asserts each accessor fails with :class:`LightningCompatError` rather than silently misbehaving
when its private is gone). ``tests/test_private_seams.py`` keeps such uses out of every other
module. Where Lightning has a public way, the package uses it instead (``strategy.optimizers = []``
for ``_reset_optimizers_and_schedulers``, the ``precision_plugin`` property, ``torch.distributed``
for ``_distributed_is_initialized``, ``LightningOptimizer.optimizer``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

CHECKED_VERSIONS = "lightning 2.6.x, jsonargparse 4.53"


class LightningCompatError(RuntimeError):
    """A Lightning private this package relies on is missing or changed in the installed version."""


def _fail(what: str, why: str) -> LightningCompatError:
    import lightning

    return LightningCompatError(
        f"lightning-disttrain relies on Lightning's private {what} ({why}), which the installed lightning "
        f"{lightning.__version__} does not have; it was checked against {CHECKED_VERSIONS}. Install a checked "
        f"version (pip install 'lightning>=2.6,<2.7') or report this to lightning-disttrain")


def _require(obj: Any, name: str, why: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _fail(f"{type(obj).__name__}.{name}", why) from None


# -- the trainer a module is attached to ------------------------------------------------------


def trainer_of(module: Any) -> Any | None:
    """The Trainer ``module`` is attached to, or None (``LightningModule.trainer`` raises instead
    of answering None when detached, and the strategy asks before and after attachment)."""
    if module is None:
        return None
    return _require(module, "_trainer", "LightningModule.trainer raises when detached")


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """Give ``module.device_mesh`` its mesh: the property is read-only, and Lightning's own
    ModelParallelStrategy sets the attribute behind it."""
    _require(module, "_device_mesh", "what LightningModule.device_mesh returns")
    module._device_mesh = mesh


# -- the checkpoint a resume loads ------------------------------------------------------------


def _checkpoint_connector(trainer: Any) -> Any:
    return _require(trainer, "_checkpoint_connector", "the restore of ckpt_path")


def resume_path(trainer: Any) -> Any:
    """The path the restore asked for (``trainer.ckpt_path`` reads the same)."""
    return _require(_checkpoint_connector(trainer), "_ckpt_path", "the path the restore loads")


def rename_resume_path(trainer: Any, path: Any) -> None:
    """Name the checkpoint really loaded in Lightning's "Restored all states from ..." message and
    in ``trainer.ckpt_path``, without the public setter's side effect (``_user_managed=True``
    would keep the path for a later validate/test)."""
    connector = _checkpoint_connector(trainer)
    _require(connector, "_ckpt_path", "the path the restore loads")
    connector._ckpt_path = path


def translate_resume_path_once(trainer: Any, translate: Callable[[Any], Any]) -> None:
    """Route the next ``resume_start(checkpoint_path)`` through ``translate``: Lightning passes a
    ckpt_path it does not know ("auto") unchanged to the restore, which runs after every setup hook,
    so no public hook sees it in time. Installed on the instance, removed after one call."""
    connector = _checkpoint_connector(trainer)
    if "resume_start" in vars(connector):
        return  # already installed for this fit
    original = _require(connector, "resume_start", "the restore's entry")

    def resume_start(checkpoint_path=None, weights_only=None):
        del connector.resume_start  # once per fit
        return original(translate(checkpoint_path), weights_only)

    connector.resume_start = resume_start


# -- signals, the launcher --------------------------------------------------------------------


def route_lightning_signal_handlers(trainer: Any, handler: Callable[..., None]) -> None:
    """Make the handlers Lightning registers before training (SIGTERM notifier, SLURM SIGUSR1
    requeue, each with a broadcast inside) call ``handler`` instead: a signal is then only a flag,
    and the preemption callback agrees on it at a step boundary. Lightning's teardown restores the
    handlers it found."""
    connector = _require(trainer, "_signal_connector", "the handlers Lightning registers")
    _require(connector, "_sigterm_notifier_fn", "Lightning's SIGTERM handler")
    _require(connector, "_slurm_sigusr_handler_fn", "Lightning's SLURM requeue handler")
    connector._sigterm_notifier_fn = handler
    connector._slurm_sigusr_handler_fn = handler
    # Lightning's training loop broadcasts rank 0's ``received_sigterm`` at every step
    # (``_TrainingEpochLoop._broadcast_sigterm_tensor``: a collective over the whole world and a
    # ``.item()`` host sync each step). Only the SIGTERM handler replaced above sets that flag, so
    # the broadcast can only ever carry 0: turned off for this loop (the preemption agreement
    # carries a signal, on its own cadence).
    loop = _require(_require(trainer, "fit_loop", "the fit loop"), "epoch_loop", "the training epoch loop")
    if hasattr(loop, "_broadcast_sigterm_tensor"):  # Lightning 2.6 (COSMETIC: gone, nothing to turn off)
        loop._broadcast_sigterm_tensor = _no_sigterm_broadcast


def _no_sigterm_broadcast() -> None:
    """What the training loop's per-step SIGTERM broadcast does once its flag cannot be set."""


def stop_child_process_watchdog() -> None:
    """Under Lightning's subprocess launcher, rank 0's "child-process-observer" thread SIGKILLs
    every rank when a child exits non-zero; before a deliberate exit with a non-zero code (after a
    complete checkpoint), stop it from watching."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "child-process-observer":
            _require(thread, "_child_processes", "the launcher's watched children")
            thread._child_processes = []


def subprocess_script_launcher(cluster_environment: Any, num_processes: int, num_nodes: int) -> Any:
    """Lightning's launcher that re-runs the script once per local rank (what ``ddp`` and
    ``ModelParallelStrategy`` use; the class is private, the behaviour is Lightning's default)."""
    try:
        from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
    except ImportError:
        raise _fail("_SubprocessScriptLauncher", "the launcher of local ranks") from None
    return _SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes)


class SubprocessLauncherStrategy:
    """Mixin for a ParallelStrategy: the launcher Lightning's DDP/ModelParallel strategies use
    (``Strategy._configure_launcher`` is the private hook the connector calls)."""

    def _configure_launcher(self) -> None:
        environment = self.cluster_environment  # type: ignore[attr-defined]
        assert environment is not None
        if not environment.creates_processes_externally:
            self._launcher = subprocess_script_launcher(environment, self.num_processes,  # type: ignore[attr-defined]
                                                        self.num_nodes)  # type: ignore[attr-defined]


def init_process_group(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Lightning's process-group start (exports MASTER_ADDR/PORT from the cluster environment,
    then ``torch.distributed.init_process_group``), as its own strategies do it."""
    try:
        from lightning.fabric.utilities.distributed import _init_dist_connection
    except ImportError:
        raise _fail("_init_dist_connection", "the process-group start") from None
    _init_dist_connection(cluster_environment, backend, **kwargs)


def default_process_group_backend(device: Any) -> str:
    """Lightning's backend for a device type ("nccl" for cuda, "gloo" for cpu, ...)."""
    try:
        from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
    except ImportError:
        raise _fail("_get_default_process_group_backend_for_device", "the backend for a device") from None
    return _get_default_process_group_backend_for_device(device)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Move optimizer state to ``device`` (Lightning's helper for the same after a restore)."""
    try:
        from lightning.fabric.utilities.optimizer import _optimizers_to_device
    except ImportError:
        raise _fail("_optimizers_to_device", "optimizer state to the device") from None
    _optimizers_to_device(optimizers, device)


# -- strategy internals -----------------------------------------------------------------------


def forward_redirection(strategy: Any, wrapper: Any, original: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``original.<method>`` through ``wrapper.forward`` (FSDP2's root hooks fire in
    ``__call__``): Lightning's own strategies do it with the private ``_forward_redirection``."""
    return _require(strategy, "_forward_redirection", "*_step through the module's forward")(
        wrapper, original, method, *args, **kwargs)


def install_clip_grad_by_norm(precision_plugin: Any, clip: Callable[[Any, float], None]) -> None:
    """Replace the norm clipping of one precision plugin instance: Lightning clips through
    ``precision_plugin.clip_grad_by_norm`` and picks the plugin's class from the precision string,
    so overriding the method on the instance keeps autocast/scaler and swaps only the norm."""
    _require(precision_plugin, "clip_grad_by_norm", "Lightning's norm clipping")
    precision_plugin.clip_grad_by_norm = clip


def clip_fused_optimizers_under_bf16_mixed(precision_plugin: Any) -> None:
    """Let bf16-mixed clip the gradients of a fused optimizer (this package's AdamW, on CUDA and CPU).

    Lightning's ``MixedPrecision.clip_gradients`` refuses any optimizer that "performs unscaling of
    gradients internally" (fused AdamW declares it can), since with a ``GradScaler`` the gradients
    would still be scaled when clipped. Under bf16-mixed there is no scaler (``scaler is None``):
    the gradients are never scaled, and the refusal only stopped ``gradient_clip_val`` with the
    fused AdamW (on CUDA since the package existed: every bf16-mixed config with clipping would
    have failed at its first step on a GPU). The instance's ``clip_gradients`` becomes the base
    ``Precision.clip_gradients`` (the same ``clip_val <= 0`` return and value/norm dispatch, minus
    that check). Only Lightning's own ``MixedPrecision.clip_gradients`` is replaced (a subclass's
    own method is left alone), and only without a scaler: with one (16-mixed, which this package's
    strategies refuse anyway) Lightning's check stays. Public Lightning API, but an instance
    override like ``install_clip_grad_by_norm``: kept here with the other seams."""
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    if (isinstance(precision_plugin, MixedPrecision) and precision_plugin.scaler is None
            and type(precision_plugin).clip_gradients is MixedPrecision.clip_gradients):
        precision_plugin.clip_gradients = functools.partial(Precision.clip_gradients, precision_plugin)


# -- ModelCheckpoint --------------------------------------------------------------------------


def every_n_train_steps(callback: Any) -> int:
    """``ModelCheckpoint(every_n_train_steps=...)`` as configured (no public getter)."""
    return _require(callback, "_every_n_train_steps", "ModelCheckpoint's step cadence")


def set_every_n_train_steps(callback: Any, steps: int) -> None:
    """Change a ModelCheckpoint's step cadence after the run measured its save cost."""
    _require(callback, "_every_n_train_steps", "ModelCheckpoint's step cadence")
    callback._every_n_train_steps = int(steps)


def last_checkpoint_saved(callback: Any) -> str:
    """The newest path a ModelCheckpoint saved (any kind: top-k, last, every-n), "" if none."""
    return _require(callback, "_last_checkpoint_saved", "the newest save of a ModelCheckpoint")


# -- the loggers' cadence ----------------------------------------------------------------------


def loggers_write_step(trainer: Any, steps_done: int) -> bool:
    """Whether Lightning hands the training metrics of the optimizer step that brings the step
    count to ``steps_done`` to the loggers, as ``_LoggerConnector.update_train_step_metrics``
    decides after the step's hooks (from its ``_batches_that_stepped + 1``, which is
    ``steps_done``): every ``log_every_n_steps`` steps (never with 0), a step after which the run
    stops, and every step under ``fast_dev_run``. Call it at the end of the step (``should_stop``
    can still be set during it)."""
    every = trainer.log_every_n_steps
    return bool(trainer.fast_dev_run) or (every > 0 and (steps_done % every == 0 or bool(trainer.should_stop)))


def drop_logged_values(trainer: Any, hook: str, names: list[str]) -> None:
    """Take the values ``self.log(name, ...)`` recorded in ``hook`` out of the running loop's
    result collection (``trainer._results``, keyed ``"{hook}.{name}"``), as Lightning's own reset
    at an epoch's start does (``_ResultMetric.reset``). Lightning keeps a logged value there until
    the epoch ends and, at every batch's end and every progress-bar refresh, turns each
    ``prog_bar`` one into a number with ``.item()``: one host sync per step for a value logged
    once in a while. The bar keeps showing the number it last read."""
    results = _require(trainer, "_results", "the running loop's logged values")
    for name in names if results is not None else ():
        value = results.get(f"{hook}.{name}")
        if value is not None and not _require(value, "has_reset", "whether a logged value was reset"):
            value.reset()


# -- the fit loop's position (fault tolerance) ---------------------------------------------------


def _position_trackers(trainer: Any) -> dict[str, Any]:
    fit = _require(trainer, "fit_loop", "the fit loop")
    epoch = _require(fit, "epoch_loop", "the training epoch loop")
    return {"epoch": fit.epoch_progress, "batch": epoch.batch_progress, "scheduler": epoch.scheduler_progress,
            "optimizer": epoch.automatic_optimization.optim_progress,
            "manual_step": epoch.manual_optimization.optim_step_progress}


def training_position(trainer: Any) -> dict[str, Any]:
    """Every counter of the fit loop's position (epochs, batches, optimizer and scheduler steps,
    the logging step) as nested dicts of ints: what a replica group that joins a fault-tolerant
    run takes from its peers (Lightning restores them only from a checkpoint file)."""
    position = {name: tracker.state_dict() for name, tracker in _position_trackers(trainer).items()}
    position["batches_that_stepped"] = _require(trainer.fit_loop.epoch_loop, "_batches_that_stepped",
                                                "the step the loggers are called with")
    return position


def move_training_position(trainer: Any, peer: dict[str, Any], then: dict[str, Any]) -> None:
    """Set every counter to ``peer + (now - then)``: ``peer`` and ``then`` were read at the same
    point of a step (the peer's and this process's), so the increments this step has made since
    are kept and the loop carries on from the peer's position, mid-step."""
    target = _moved(peer, training_position(trainer), then)
    for name, tracker in _position_trackers(trainer).items():
        tracker.load_state_dict(target[name])
    trainer.fit_loop.epoch_loop._batches_that_stepped = target["batches_that_stepped"]


def _moved(peer: Any, now: Any, then: Any) -> Any:
    if isinstance(now, dict):
        return {k: _moved(peer.get(k, v), v, then.get(k, v)) for k, v in now.items()}
    if isinstance(now, int) and not isinstance(now, bool):
        return int(peer) + now - int(then)
    return now


# -- progress bar -----------------------------------------------------------------------------


def fix_epoch_description(trainer: Any) -> None:
    """With ``max_steps`` (and no ``max_epochs``) Lightning sets ``max_epochs=-1`` and its rich
    progress bar prints "Epoch 0/-2": show "Epoch 0" there, as the tqdm bar does. Only Lightning's
    own RichProgressBar (not a user's subclass) and only when the epoch count is unbounded."""
    from lightning.pytorch.callbacks import RichProgressBar

    bar = getattr(trainer, "progress_bar_callback", None)
    if type(bar) is not RichProgressBar or (trainer.max_epochs is not None and trainer.max_epochs >= 0):
        return
    if not hasattr(bar, "_get_train_description"):
        return  # cosmetic: a Lightning without the method prints its own label (COSMETIC, below)

    def describe(current_epoch: int) -> str:
        label = f"Epoch {current_epoch}"
        width = len(getattr(bar, "validation_description", ""))
        return f"{label:{width}}" if width > len(label) else label

    bar._get_train_description = describe


# -- LightningCLI's parser (jsonargparse) -----------------------------------------------------


def parser_option_names(parser: Any) -> list[str]:
    """The option names a (jsonargparse/argparse) parser accepts, for a "did you mean"."""
    actions = _require(parser, "_actions", "the parser's options")
    return [a.dest for a in actions if a.dest and a.dest != "help"]


def parser_instantiators(parser: Any) -> dict:
    """The class instantiators LightningCLI registered on its parser (wrapped to remember which
    constructor refused its config)."""
    return dict(_require(parser, "_instantiators", "LightningCLI's instantiators") or {})


# -- the check ----------------------------------------------------------------------------------

PRIVATES: tuple[tuple[str, str | None], ...] = (
    ("lightning.pytorch.core.module.LightningModule", "_trainer"),
    ("lightning.pytorch.core.module.LightningModule", "_device_mesh"),
    ("lightning.pytorch.trainer.trainer.Trainer", "_checkpoint_connector"),
    ("lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector", "_ckpt_path"),
    ("lightning.pytorch.trainer.connectors.checkpoint_connector._CheckpointConnector", "resume_start"),
    ("lightning.pytorch.trainer.trainer.Trainer", "_signal_connector"),
    ("lightning.pytorch.trainer.connectors.signal_connector._SignalConnector", "_sigterm_notifier_fn"),
    ("lightning.pytorch.trainer.connectors.signal_connector._SignalConnector", "_slurm_sigusr_handler_fn"),
    ("lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver", "_child_processes"),
    ("lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher", None),
    ("lightning.pytorch.strategies.strategy.Strategy", "_configure_launcher"),
    ("lightning.pytorch.strategies.strategy.Strategy", "_forward_redirection"),
    ("lightning.fabric.utilities.distributed._init_dist_connection", None),
    ("lightning.fabric.utilities.distributed._get_default_process_group_backend_for_device", None),
    ("lightning.fabric.utilities.optimizer._optimizers_to_device", None),
    ("lightning.pytorch.plugins.precision.Precision", "clip_grad_by_norm"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_every_n_train_steps"),
    ("lightning.pytorch.callbacks.ModelCheckpoint", "_last_checkpoint_saved"),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_batches_that_stepped"),
    ("lightning.pytorch.trainer.trainer.Trainer", "_results"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result._ResultMetric", "has_reset"),
    ("jsonargparse.ArgumentParser", "_actions"),
    ("jsonargparse.ArgumentParser", "_instantiators"),
)
"""(object, attribute): each private a run relies on (attribute None: the object itself). An
attribute set in ``__init__`` is found in the class's source (see ``check``)."""

COSMETIC: tuple[tuple[str, str | None], ...] = (
    ("lightning.pytorch.callbacks.RichProgressBar", "_get_train_description"),
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_broadcast_sigterm_tensor"),
)
"""Privates whose absence changes only what is printed, or removes a cost we would turn off:
``check(cosmetic=True)`` (the test) covers them, the run's own check does not stop a run for them
(``fix_epoch_description`` and ``route_lightning_signal_handlers`` skip instead)."""


def _resolve(dotted: str) -> Any:
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


_CHECKED: set[bool] = set()


def _assigned_in_source(cls: Any, attr: str) -> bool:
    """Whether a class of ``cls``'s MRO assigns ``self.<attr>`` (an instance attribute set in
    ``__init__``), read from the source files (no source available: assume it does)."""
    import re
    import sys

    pattern = re.compile(rf"self\.{re.escape(attr)}\s*(:[^=]*)?=[^=]")
    readable = False
    for klass in getattr(cls, "__mro__", (cls,)):
        path = getattr(sys.modules.get(klass.__module__), "__file__", None)
        try:
            text = open(path, encoding="utf-8").read() if path else None
        except OSError:
            text = None
        if text is None:
            continue
        readable = True
        if pattern.search(text):
            return True
    return not readable


def check(cosmetic: bool = False) -> None:
    """Raise :class:`LightningCompatError` naming the first private of ``PRIVATES`` (and
    ``COSMETIC`` if asked) the installed Lightning lacks: a class attribute, or ``self.<name>`` in
    the class's source. The strategies run it once per process, before the process group."""
    if cosmetic in _CHECKED:
        return
    for dotted, attr in PRIVATES + (COSMETIC if cosmetic else ()):
        try:
            obj = _resolve(dotted)
        except (ImportError, AttributeError):
            raise _fail(dotted, "see lightning_disttrain/_lightning_compat.py") from None
        if attr is None or hasattr(obj, attr):
            continue
        if not _assigned_in_source(obj, attr):
            raise _fail(f"{dotted}.{attr}", "see lightning_disttrain/_lightning_compat.py")
    _CHECKED.add(cosmetic)
