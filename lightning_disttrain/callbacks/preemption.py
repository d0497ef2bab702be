"""PreemptionCheckpoint: a preemption signal on any rank becomes one agreed save, then a clean exit.

What happens, in order:

1. Signal handlers (SIGTERM and SIGUSR1 by default) and the optional polled ``notice`` only set a
   flag. They replace Lightning's own SIGTERM handling, which runs a ``dist.broadcast`` inside the
   handler: the signalled rank then waits in that broadcast while the others wait in the step's
   reduce-scatter, and both hang until the 30-minute collective timeout. Lightning's SLURM
   SIGUSR1 handler (a save inside the handler) is replaced for the same reason.
2. At a boundary (``on_train_batch_end`` after an optimizer step; during a validation inside
   ``fit`` with ``stop_validation=True``, the end of each validation batch) the ranks may agree:
   one ``all_reduce(MAX)`` of a three-element host tensor ``[flag, seconds per boundary, age of
   the oldest signal]`` over every rank (``comm.host_group``: the default group under gloo, a gloo
   group beside NCCL, so that reading the flag does not drain the GPU's queue;
   ``lightning_disttrain.comm``). The signal may have reached any subset of the ranks. That
   all-reduce is a host barrier across the whole world (about 2 x (ranks - 1) sequential hops
   under gloo), so it is not paid at every boundary: with ``check_every_n_steps="auto"`` (the
   default) the ranks agree at the first boundary, and each agreement sets the number of
   boundaries to the next one, ``agreement_interval``: as many as fit in ``AGREEMENT_SHARE`` of
   the grace period at the slowest rank's mean boundary time since the previous agreement, at
   most twice the previous interval (a measurement widens it gradually) and ``MAX_INTERVAL``. It
   is a pure function of all-reduced values, so every rank agrees at the same boundary (a rank
   that skipped one would deadlock the others). Without a process group there is no collective
   and every boundary is an agreement. ``check_every_n_steps=k`` agrees every k optimizer steps
   (and after every validation batch), as before. A signal during the last interval of ``fit``
   is agreed on at the end of training (``on_train_end``, "auto" only). Every rank must run the
   same number of validation batches (as a ``DistributedSampler`` and FSDP's all-gathers in the
   forward need anyway).
3. If any rank was told: wait for the async save in flight, save synchronously (manifest last) to
   ``<dirpath>/preempted-step=NNNNNN.ckpt``, point ``<dirpath>/last.ckpt`` at it (unless that name
   is a real checkpoint directory), log one line, requeue the job under SLURM (``scontrol requeue``,
   as Lightning's SLURM integration does) and exit with ``exit_code`` on every rank
   (``PreemptionExit``, a ``SystemExit``). A watchdog ends the process with ``exit_code`` if the
   save has not finished ``grace_period_s`` after the first signal (the agreement carries the
   oldest signal's age, so the time spent reaching it comes out of the save's): the partial checkpoint has no
   manifest, so resume discovery skips it and takes the previous complete one. Everything in this
   exit path runs inside its error handling: whatever fails in it (the async save in flight, the
   save, the link, the barrier) is logged, ``last.ckpt`` is pointed at the newest complete
   checkpoint and the rank still exits with ``exit_code``. A save in flight that failed
   (``CheckpointSaveError``, raised on every rank together) is logged and the preemption save is
   made anyway.

A save from a validation stores the step the validation followed (the same step as the last
training batch) and, with the DCP strategies, the random state the next training batch of this
process would have started from; the relaunch skips the rest of that validation (Lightning treats
it as finished) and trains on exactly as the uninterrupted run would.

Grace period: schedulers send SIGKILL a fixed time after the signal (Kubernetes
``terminationGracePeriodSeconds``, 30 s by default; GCP spot 30 s; SLURM ``--signal=USR1@N``: N s
before the time limit; AWS spot 120 s). ``grace_period_s="auto"`` (the default) takes that window
from the environment variable ``LDT_PREEMPTION_WINDOW_S`` minus ``SAFETY_MARGIN_S`` (10 s: the step
or validation batch before the agreement, and the teardown after the save), and without it
``DEFAULT_GRACE_PERIOD_S`` (20 s: the 30 s of Kubernetes and GCP less that margin).

The handlers are in place from ``on_train_start`` to the end of ``fit``; a signal before that
(model setup, checkpoint loading) ends the process as it would without the callback, with
nothing trained yet to lose.

Resume: ``trainer.fit(..., ckpt_path="last")`` finds ``last.ckpt`` and the DCP strategies
resolve it to the newest checkpoint in its directory that verifies. ``ckpt_path="auto"`` (with this
callback in the Trainer) takes the newest complete checkpoint in this callback's and every
``ModelCheckpoint``'s directory, or starts from scratch when there is none: the same command for
the first launch and every relaunch, with or without ``last.ckpt``. ``validate``/``test``/``predict``
with ``ckpt_path="auto"`` evaluate that checkpoint, or with none the model as built, and say which
(``auto_resume_path``). Outside the Trainer,
``PreemptionCheckpoint.resume_path(dirpath)`` gives the same answer for one directory.

A checkpoint that cannot be written (disk full) during the preemption save: the previous complete
checkpoints stay (``CheckpointSaveError`` in ``checkpoint.dcp_io``), the error is logged and every
rank still exits with ``exit_code``; the relaunch resumes from the newest complete one.

A rank that loses a peer (SIGKILL, a lost node) gets an error from its next collective (gloo:
"Connection closed by peer", at once) and Lightning ends the run; nothing can be saved without
the peer's shards. ``on_exception`` points ``last.ckpt`` at the newest complete checkpoint (a
link, no collective) and logs which one a relaunch with ``ckpt_path="last"`` will use.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from lightning_disttrain import comm, startup_signals
from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain.callbacks.preemption_notices import Notice, NoticePoller
from lightning_disttrain.checkpoint.storage import check_writable, is_url

log = logging.getLogger(__name__)

SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGUSR1": signal.SIGUSR1, "SIGUSR2": signal.SIGUSR2,
           "SIGINT": signal.SIGINT, "SIGHUP": signal.SIGHUP}

WINDOW_ENV = "LDT_PREEMPTION_WINDOW_S"
"""Seconds the scheduler gives between the preemption signal and SIGKILL (Kubernetes
``terminationGracePeriodSeconds``, SLURM ``--signal=USR1@N``'s N); read by ``grace_period_s="auto"``."""
SAFETY_MARGIN_S = 10.0
"""What ``"auto"`` keeps back from the scheduler's window: reaching the agreement (the rest of a
step or a validation batch) before the grace period starts, and the teardown after the save."""
DEFAULT_GRACE_PERIOD_S = 20.0
"""``"auto"`` without ``LDT_PREEMPTION_WINDOW_S``: Kubernetes' default 30 s window less the margin."""
AGREEMENT_SHARE = 0.25
"""``check_every_n_steps="auto"``: the share of ``grace_period_s`` that the boundaries between two
agreements may take at the measured pace; a signal right after an agreement waits at most about
that long (plus the boundary in progress), and the save keeps the rest of the grace period."""
MAX_INTERVAL = 1000
"""``"auto"``: the most boundaries between two agreements, however fast the steps."""


def agreement_interval(seconds_per_boundary: float, grace_period_s: float, previous: int) -> int:
    """The boundaries until the next agreement under ``check_every_n_steps="auto"``:
    ``floor(AGREEMENT_SHARE * grace_period_s / seconds_per_boundary)``, clamped to
    ``[1, min(2 * previous, MAX_INTERVAL)]``. ``seconds_per_boundary``: the slowest rank's mean
    time per boundary since the previous agreement (all-reduced), ``previous``: the interval that
    just ended. A pure function of values every rank shares, so every rank agrees at the same
    boundary; doubling at most keeps one fast measurement (after a warm-up, a resume) from jumping
    far. A time that is not a finite positive number (NaN, a clock that did not move) counts as
    slow: 1, or as instant: the cap."""
    if not seconds_per_boundary == seconds_per_boundary or seconds_per_boundary == float("inf"):
        return 1  # NaN or infinite: agree at the next boundary
    cap = max(1, min(2 * int(previous), MAX_INTERVAL))
    if seconds_per_boundary <= 0:
        return cap
    return max(1, min(int(AGREEMENT_SHARE * grace_period_s / seconds_per_boundary), cap))


def grace_period_for(window_s: float, margin_s: float = SAFETY_MARGIN_S) -> float:
    """The save deadline for a scheduler that sends SIGKILL ``window_s`` seconds after the signal:
    ``window_s - margin_s``. ``PreemptionCheckpoint(grace_period_s=grace_period_for(120))`` for a
    SLURM job submitted with ``--signal=USR1@120``; or set ``LDT_PREEMPTION_WINDOW_S=120``."""
    window, margin = _seconds("window_s", window_s), _seconds("margin_s", margin_s, allow_zero=True)
    if window <= margin:
        raise ValueError(f"window_s={window_s}: the scheduler's {window:g} s between the signal and SIGKILL leave "
                         f"nothing after the {margin:g} s safety margin; give the job a longer window (Kubernetes "
                         f"terminationGracePeriodSeconds, SLURM --signal=USR1@N) or pass grace_period_s=<seconds> "
                         f"explicitly")
    return window - margin


def _seconds(name: str, value: Any, allow_zero: bool = False) -> float:
    try:
        if isinstance(value, bool):
            raise TypeError
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: give a number of seconds, e.g. 20") from None
    if not (seconds > 0 or (allow_zero and seconds == 0)) or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"{name}={value!r}: give a positive, finite number of seconds, e.g. 20")
    return seconds


def resolve_grace_period(grace_period_s: float | str) -> float:
    """``grace_period_s`` as seconds: a number as it is; ``"auto"``: ``LDT_PREEMPTION_WINDOW_S`` less
    ``SAFETY_MARGIN_S`` when that is set, else ``DEFAULT_GRACE_PERIOD_S``."""
    if isinstance(grace_period_s, str):
        if grace_period_s != "auto":
            raise ValueError(f"grace_period_s={grace_period_s!r}: pass seconds (e.g. 20) or 'auto' (from "
                             f"${WINDOW_ENV}, the scheduler's seconds between the signal and SIGKILL)")
        window = os.environ.get(WINDOW_ENV, "").strip()
        if not window:
            return DEFAULT_GRACE_PERIOD_S
        try:
            return grace_period_for(window)
        except ValueError as err:
            raise ValueError(f"{WINDOW_ENV}={window!r} (grace_period_s='auto'): {err}") from None
    try:
        return _seconds("grace_period_s", grace_period_s)
    except ValueError:
        raise ValueError(f"grace_period_s={grace_period_s!r}: give the save a positive deadline in seconds, well "
                         f"inside the scheduler's window (Kubernetes and GCP give 30 s between SIGTERM and "
                         f"SIGKILL: e.g. 20), or 'auto' with ${WINDOW_ENV}") from None


class Agreement(NamedTuple):
    """One agreement collective, as every rank saw it after the all-reduce."""

    boundary: int
    """Boundaries (optimizer steps and validation batches) since the start of training in this fit."""
    step: int
    """``trainer.global_step`` at it."""
    seconds_per_boundary: float
    """The slowest rank's mean time per boundary since the previous agreement."""
    interval: int
    """Boundaries to the next agreement (``"auto"``: ``agreement_interval``; an int: unused)."""
    stop: bool
    """Whether any rank had been told to stop."""


class PreemptionExit(SystemExit):
    """Raised on every rank after the agreed preemption checkpoint is complete; ``code`` is the exit code.

    Args:
        code: the process exit status (``PreemptionCheckpoint``'s ``exit_code``).
        path: the preemption checkpoint that was saved; None when nothing was saved (``save=False``,
            a replica group that does not write checkpoints, or a failed save).
        step: the global step at which the run stopped.
    """

    def __init__(self, code: int, path: str | None, step: int) -> None:
        super().__init__(code)
        self.path, self.step = path, step


class PreemptionCheckpoint(Callback):
    """Save once, on every rank together, when any rank is told it will be preempted; then exit.

    Args:
        dirpath: where the preemption checkpoint goes; default: the ``ModelCheckpoint``'s
            directory, else ``<default_root_dir>/checkpoints``. A local path or an fsspec URL.
            Checked writable on every rank at the start of ``fit``.
        signals: names of the signals that mean "preempted" (``"SIGTERM"``: cloud spot,
            Kubernetes; ``"SIGUSR1"``: SLURM ``--signal=USR1@120``).
        notice: a callable polled from a background thread (``AWSSpotNotice()``,
            ``GCPPreemptionNotice()``, or your own) returning a reason when preemption is announced.
        poll_interval_s: how often ``notice`` is called.
        check_every_n_steps: ``"auto"`` (default): agree at the first boundary, then every
            ``agreement_interval`` boundaries (steps and validation batches), so that the
            boundaries between two agreements take at most ``AGREEMENT_SHARE`` of
            ``grace_period_s`` at the measured pace; one all-reduce of 24 bytes each time, none
            between. An int k: agree every k optimizer steps and after every validation batch
            (1: every step, a world-wide all-reduce each time).
        grace_period_s: the deadline for the save, from the first signal (on any rank); past it
            the process exits without a complete checkpoint (the previous one is used on resume). ``"auto"``
            (default): the scheduler's window from ``$LDT_PREEMPTION_WINDOW_S`` (seconds between
            the signal and SIGKILL) less 10 s, else 20 s (Kubernetes' and GCP's 30 s less 10 s).
            Seconds: as given (``grace_period_for(window_s)`` computes them from a window).
        stop_validation: agree after every validation batch during ``fit`` too, so that a signal
            in a validation stops it at the end of the batch in progress and saves (every rank
            must run the same number of validation batches). False: agree only at step
            boundaries (the validation and the next step run first).
        exit_code: the exit status of every rank after the save (143 = 128 + SIGTERM; a non-zero
            status makes torchrun's ``--max-restarts`` and Kubernetes restart the job).
        requeue: under SLURM, ``scontrol requeue`` the job after the save (global rank 0).
        save: False: agree and exit with ``exit_code`` on every rank, saving nothing (what the
            lightning-disttrain strategies add when a run has no ``PreemptionCheckpoint``, so
            that a signal never leaves ranks hanging; see ``ensure_signal_safety``).
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1"),
                 notice: Notice | None = None, poll_interval_s: float = 5.0, check_every_n_steps: int | str = "auto",
                 grace_period_s: float | str = "auto", exit_code: int = 143, requeue: bool = True,
                 stop_validation: bool = True, save: bool = True) -> None:
        unknown = [s for s in signals if s not in SIGNALS]
        if unknown:
            raise ValueError(f"signals={list(signals)}: unknown {unknown}; choose from {sorted(SIGNALS)}")
        if check_every_n_steps != "auto" and (isinstance(check_every_n_steps, bool) or not isinstance(
                check_every_n_steps, int) or check_every_n_steps < 1):
            raise ValueError(f"check_every_n_steps={check_every_n_steps!r}: pass 'auto' (agree as often as the grace "
                             f"period needs) or a whole number of optimizer steps k >= 1 (1: every step)")
        grace_period_s = resolve_grace_period(grace_period_s)
        if not 0 <= exit_code <= 255:
            raise ValueError(f"exit_code={exit_code}: an exit status is 0..255")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s={poll_interval_s}: poll at a positive interval, e.g. 5")
        self.dirpath = None if dirpath is None else str(dirpath)
        self.signals = tuple(signals)
        self.notice, self.poll_interval_s = notice, poll_interval_s
        self.check_every_n_steps, self.grace_period_s = check_every_n_steps, grace_period_s
        self.exit_code, self.requeue, self.stop_validation = exit_code, requeue, stop_validation
        self.save = save
        self.reason: str | None = None
        """Why this rank wants to stop (set by a signal handler or the notice thread), else None."""
        self.agreement_seconds: list[float] = []
        """Wall time of each agreement collective on this rank (for measuring its cost)."""
        self.agreements: list[Agreement] = []
        """Every agreement collective this rank ran, in order (one ``comm.all_reduce`` each); none
        without a process group. Identical on every rank (its values are all-reduced)."""
        self._previous: dict[int, Any] = {}
        self._checked_step = -1
        self._signalled_at: float | None = None  # time.monotonic() of this rank's first request
        self._signal_age = 0.0  # the oldest signal's age at the agreement (all ranks), for the watchdog
        self._boundary = 0  # boundaries since on_train_start
        self._interval = 1  # "auto": boundaries from one agreement to the next
        self._agreed_boundary = 0  # the boundary of the last agreement
        self._agreed_at = 0.0  # time.monotonic() at its end
        self._poller: NoticePoller | None = None
        self._flag_group: Any = None  # comm.host_group(), from setup

    grace_period_for = staticmethod(grace_period_for)

    # ---- the flag ---------------------------------------------------------------------------

    def request(self, reason: str) -> None:
        """Ask for a preemption checkpoint at the next agreement (what the handlers call; thread-safe)."""
        if self.reason is None:
            if self._signalled_at is None:
                self._signalled_at = time.monotonic()  # before the reason: an agreement that sees it sees this
            self.reason = reason

    def _on_signal(self, signum: int, frame: Any = None) -> None:
        self.request(f"received {signal.Signals(signum).name}")  # only a flag: no I/O, no collective

    def _take_over_lightnings_handlers(self, trainer: pl.Trainer) -> None:
        # Lightning registers its handlers (a broadcast inside) just before training starts, after
        # on_fit_start; make its parts ours, so that a signal that arrives between then and
        # on_train_start is only a flag too. Its teardown restores the handlers it found.
        compat.route_lightning_signal_handlers(trainer, self._on_signal)

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python installs handlers from the main thread only
        for name in self.signals:
            signum = SIGNALS[name]
            current = signal.getsignal(signum)
            if current is not self._on_signal:
                self._previous.setdefault(signum, current)
                signal.signal(signum, self._on_signal)

    def _restore_handlers(self) -> None:
        # Lightning's teardown has restored the handlers it found before fit by now (it runs before
        # the teardown hooks); put back what we replaced only where that did not happen.
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) is self._on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    # ---- Lightning hooks --------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.reason, self._signalled_at = None, None
            self._checked_step = -1
            if comm.is_distributed() and trainer.world_size > 1:
                self._flag_group = comm.host_group()  # collective: every rank's setup runs here
            self._take_over_lightnings_handlers(trainer)
        if self.save:  # every stage: `validate/test/predict --config X.yaml` with X's ckpt_path: auto
            self._resolve_auto_on_restore(trainer)

    def _resolve_auto_on_restore(self, trainer: pl.Trainer) -> None:
        # Lightning passes ckpt_path="auto" through unchanged (not one of its names) to the restore,
        # which runs after every setup hook (before or after the strategy's setup): translate it there.
        def translate(checkpoint_path):
            if checkpoint_path is not None and str(checkpoint_path) == "auto":
                return self.auto_resume_path(trainer)
            return checkpoint_path

        compat.translate_resume_path_once(trainer, translate)

    def auto_resume_path(self, trainer: pl.Trainer) -> str | None:
        """What ``ckpt_path="auto"`` loads: the newest complete checkpoint in this callback's and every
        ModelCheckpoint's directory (files for Lightning's own strategies), or None.

        In ``fit`` that resumes training, or starts it from scratch. In ``validate``/``test``/``predict``
        the checkpoint's weights are evaluated; with none, the model as built (its initial weights),
        as Lightning does for ``ckpt_path=None`` or a ``"last"`` that does not exist yet, with one line
        saying so: a shipped config (``ckpt_path: auto``) runs as written under every subcommand."""
        dirs = list(dict.fromkeys([self.dirpath or self._default_dirpath(trainer)] + [
            str(cb.dirpath) for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]))
        found = _newest_complete(dirs, files=not _saves_directories(trainer))
        if trainer.is_global_zero:
            log.warning("ckpt_path='auto': %s", _auto_message(trainer.state.fn, found, dirs))
        return found

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.save:
            return
        # Every ModelCheckpoint has resolved its directory by now (its setup runs after ours).
        self.dirpath = self.dirpath or self._default_dirpath(trainer)
        dirs = {self.dirpath} | {str(cb.dirpath) for cb in trainer.checkpoint_callbacks
                                 if isinstance(cb, ModelCheckpoint) and cb.dirpath}
        problems = [p for d in sorted(dirs) if (p := check_writable(d))]
        gathered = _all_gather_objects(problems)
        if any(gathered):
            ranks = [r for r, p in enumerate(gathered) if p]
            raise ValueError(f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
                             f"{next(p for p in gathered if p)[0]}")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The agreement schedule starts afresh in every fit (a resume too): it follows timing, not
        # the training state, so nothing of it is checkpointed. A boundary is a change of global_step.
        self._checked_step = trainer.global_step
        self._boundary, self._interval, self._agreed_boundary = 0, 1, 0
        self._agreed_at = time.monotonic()
        self._install_handlers()  # replaces what Lightning registered just before training
        startup_signals.training_started()  # a signal from here on is a checkpoint at a boundary
        if self.notice is not None and trainer.local_rank == 0 and self._poller is None:
            self._poller = NoticePoller(self.notice, self.poll_interval_s, self.request)
            self._poller.start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.is_global_zero and self.save:
            self._keep_last_link(trainer)
        step = trainer.global_step
        if step == self._checked_step:
            return  # not a step boundary (gradient accumulation)
        self._checked_step = step
        self._boundary += 1
        due = self._due(trainer) if self.check_every_n_steps == "auto" else step % self.check_every_n_steps == 0
        if due and self._agree(trainer):
            self._save_and_exit(trainer)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        # Only the validations inside fit (not the sanity check: the handlers are not in place yet,
        # nothing is trained); every rank is at the same batch index here.
        if not self.stop_validation or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self._boundary += 1
        if self.check_every_n_steps == "auto" and not self._due(trainer):
            return
        if self._agree(trainer):
            self._save_and_exit(trainer, in_validation=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.save:
            self._keep_last_link(trainer)
        # "auto": a signal in the boundaries since the last agreement would otherwise go unheard
        # (the run ends, nothing saved since the last checkpoint); every rank ends training here.
        if self.check_every_n_steps == "auto" and self._boundary > self._agreed_boundary and self._agree(trainer):
            self._save_and_exit(trainer)

    def _keep_last_link(self, trainer: pl.Trainer) -> None:
        # Without ModelCheckpoint(save_last=...), keep last.ckpt pointing at its newest save, so that
        # ckpt_path="last" finds the directory after any end (all processes killed, a signal in the
        # shutdown); the DCP strategies then take the newest checkpoint there that verifies.
        for cb in trainer.checkpoint_callbacks:
            if not isinstance(cb, ModelCheckpoint) or cb.save_last or not cb.dirpath or is_url(str(cb.dirpath)):
                continue
            newest = compat.last_checkpoint_saved(cb)
            link = Path(cb.dirpath) / "last.ckpt"
            if newest and os.path.exists(newest) and (not link.is_symlink() or os.readlink(link) != Path(newest).name):
                _point_last_at(Path(newest), cb.dirpath)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning runs no teardown hook after an exception: out of the training loop here too.
        startup_signals.training_ended()
        if isinstance(exception, PreemptionExit):
            return
        from lightning_disttrain.rank_errors import is_secondary

        if is_secondary(exception) and self.dirpath and not is_url(self.dirpath):
            from lightning_disttrain.checkpoint.discovery import list_checkpoints

            # No collective here (a peer is gone): only a link, so that ckpt_path="last" finds
            # this directory on the relaunch; resume verifies and falls back by itself.
            inside = Path(self.dirpath).resolve()
            complete = [c for c in list_checkpoints(self.dirpath)
                        if c.complete and c.path.name != "last.ckpt" and Path(c.resolved).parent == inside]
            if complete:
                _point_last_at(complete[0].resolved, self.dirpath)
            log.error("rank %d: a peer process is gone (%s); no checkpoint can be saved without it. A relaunch "
                      "with ckpt_path='last' resumes from %s", trainer.global_rank, type(exception).__name__,
                      complete[0].describe() if complete else "scratch (no complete checkpoint)")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._poller is not None:
            self._poller.stop()
            self._poller = None
        self._restore_handlers()
        startup_signals.training_ended()  # outside the training loop: a signal stops the run at once

    # ---- agreement, save, exit --------------------------------------------------------------

    def _due(self, trainer: pl.Trainer) -> bool:
        """``"auto"``: whether the ranks agree at this boundary. Without a process group every
        boundary is an agreement (it costs no collective)."""
        if not comm.is_distributed() or trainer.world_size == 1:
            return True
        return self._boundary - self._agreed_boundary >= self._interval

    def _age(self, now: float) -> float:
        signalled = self._signalled_at if self.reason is not None else None
        return 0.0 if signalled is None else max(now - signalled, 0.0)

    def _agree(self, trainer: pl.Trainer) -> bool:
        start = time.monotonic()
        if not comm.is_distributed() or trainer.world_size == 1:
            self._agreed_boundary, self._agreed_at, self._signal_age = self._boundary, start, self._age(start)
            return self.reason is not None
        # One collective carries all three (MAX): whether any rank was told, the slowest rank's
        # pace (the next interval, the same on every rank) and the oldest signal's age (the
        # watchdog's deadline). On the host, over a gloo group (comm.host_group, made in setup):
        # reading the result then waits for the exchange only, not for the accelerator's queue.
        told = self.reason is not None
        per_boundary = (start - self._agreed_at) / max(self._boundary - self._agreed_boundary, 1)
        values = torch.tensor([float(told), per_boundary, self._age(start)], dtype=torch.float64)
        comm.all_reduce(values, op="max", group=self._flag_group)
        agreed, per_boundary, self._signal_age = bool(values[0].item()), values[1].item(), values[2].item()
        end = time.monotonic()
        self.agreement_seconds.append(end - start)
        if self.check_every_n_steps == "auto":
            self._interval = agreement_interval(per_boundary, self.grace_period_s, self._interval)
        self.agreements.append(Agreement(self._boundary, trainer.global_step, per_boundary, self._interval, agreed))
        self._agreed_boundary, self._agreed_at = self._boundary, end
        return agreed

    def _save_and_exit(self, trainer: pl.Trainer, in_validation: bool = False) -> None:
        start, step = time.monotonic(), trainer.global_step
        why = f"rank {trainer.global_rank}: {self.reason}" if self.reason else "signalled on another rank"
        where = " in a validation" if in_validation else ""
        if not self.save:
            if trainer.is_global_zero or self.reason is not None:
                log.warning("Stopped at step %d%s (%s): this run has no PreemptionCheckpoint, so nothing was saved; "
                            "every rank exits with code %d. To save on preemption and resume: "
                            "--trainer.callbacks+=lightning_disttrain.callbacks.PreemptionCheckpoint --ckpt_path auto "
                            "(Python: callbacks=[PreemptionCheckpoint()], trainer.fit(..., ckpt_path='auto'))",
                            step, where, why, self.exit_code)
            _stop_child_observer()
            raise PreemptionExit(self.exit_code, None, step)
        writes = getattr(trainer.strategy, "writes_checkpoints", None)
        if writes is not None and not writes():
            # Fault tolerance: another replica group writes the run's checkpoints (this group's
            # save would be skipped); this one heals from the live groups when it is relaunched.
            if trainer.is_global_zero:
                log.warning("Stopped at step %d%s (%s): this replica group does not write the run's checkpoints "
                            "(fault tolerance); it exits with code %d and heals from the live groups when relaunched",
                            step, where, why, self.exit_code)
            _stop_child_observer()
            raise PreemptionExit(self.exit_code, None, step)
        path = _join(self.dirpath, f"preempted-step={step:06d}.ckpt")
        # grace_period_s runs from the oldest signal: reaching the agreement took part of it.
        watchdog = _Deadline(max(self.grace_period_s - self._signal_age, 0.0), self.grace_period_s, self.exit_code,
                             path)
        failure: BaseException | None = None
        try:
            try:
                self._save(trainer, path)
                if trainer.is_global_zero and not is_url(path):
                    _point_last_at(Path(path), self.dirpath)
                comm.barrier()
            except Exception as err:  # whatever fails, every rank still exits with the code
                failure = err
                log.error("rank %d: preempted%s (%s) but the checkpoint could not be saved: %s: %s; exiting with "
                          "code %d, the relaunch resumes from %s", trainer.global_rank, where, why,
                          type(err).__name__, err, self.exit_code, self._link_newest_complete(trainer))
            else:
                seconds = time.monotonic() - start
                if trainer.is_global_zero:
                    log.warning("Preempted%s (%s): saved step %d to %s in %.1f s (complete, manifest written); "
                                "exiting with code %d. Resume: the same command with --ckpt_path last (or auto), or "
                                "trainer.fit(..., ckpt_path='last') from Python.",
                                where, why, step, path, seconds, self.exit_code)
                    if self.requeue:
                        _slurm_requeue()
                elif self.reason is not None:
                    log.warning("rank %d: %s; saved with the other ranks, exiting with code %d",
                                trainer.global_rank, self.reason, self.exit_code)
        except Exception as err:  # the logging or the requeue: the checkpoint is complete, exit anyway
            log.error("rank %d: after the preemption save: %s: %s", trainer.global_rank, type(err).__name__, err)
        finally:
            watchdog.cancel()
            _stop_child_observer()
        if failure is not None:
            raise PreemptionExit(self.exit_code, None, step) from failure
        raise PreemptionExit(self.exit_code, path, step)

    def _save(self, trainer: pl.Trainer, path: str) -> None:
        from lightning_disttrain.checkpoint.dcp_io import CheckpointSaveError

        strategy = trainer.strategy
        wait = getattr(strategy, "wait_for_checkpoint", None)
        if wait is not None:
            try:
                wait()  # the async save in flight gets its manifest first (or is reported as failed)
            except CheckpointSaveError as err:  # raised on every rank together (dcp_io): they go on together
                log.error("rank %d: the checkpoint save in flight failed (%s); saving the preemption checkpoint "
                          "anyway", trainer.global_rank, err)
        was_async, on_error = getattr(strategy, "async_save", None), getattr(strategy, "on_save_error", None)
        if was_async:
            strategy.async_save = False  # this one must be complete before we exit
        if on_error is not None:
            strategy.on_save_error = "stop"  # and a failure must not read as a success
        try:
            # a full checkpoint, said explicitly: without it Lightning logs "`weights_only` was not
            # set, defaulting to `False`" on every rank at every preemption save
            trainer.save_checkpoint(path, weights_only=False)
            if wait is not None:
                wait()
        finally:
            if was_async:
                strategy.async_save = was_async
            if on_error is not None:
                strategy.on_save_error = on_error

    def _link_newest_complete(self, trainer: pl.Trainer) -> str:
        """Point ``last.ckpt`` at the newest complete checkpoint (no collective: a link on this rank);
        returns what a relaunch resumes from, in words. Never raises."""
        try:
            dirs = list(dict.fromkeys([d for d in [self.dirpath] if d] + [
                str(cb.dirpath) for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath]))
            found = _newest_complete(dirs, files=not _saves_directories(trainer))
            if found is None:
                return "scratch (no complete checkpoint)"
            if not is_url(found):
                for d in dirs:  # the link goes into the directory that holds it, never beside a link's target
                    if _point_last_at(Path(found), d):
                        break
            return found
        except Exception as err:
            return f"the newest complete checkpoint (finding it failed: {type(err).__name__}: {err})"

    # ---- paths ------------------------------------------------------------------------------

    @staticmethod
    def _default_dirpath(trainer: pl.Trainer) -> str:
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and cb.dirpath:
                return str(cb.dirpath)
        return os.path.join(str(trainer.default_root_dir), "checkpoints")

    @staticmethod
    def resume_path(dirpath: str | os.PathLike) -> str | None:
        """The newest complete, verified checkpoint in ``dirpath``, or None: ``trainer.fit(...,
        ckpt_path=PreemptionCheckpoint.resume_path(dirpath))`` resumes when there is something to
        resume and starts from scratch on a first launch."""
        from lightning_disttrain.checkpoint.discovery import find_latest_checkpoint

        found = find_latest_checkpoint(dirpath)
        return None if found is None else str(found)


def _auto_message(fn: Any, found: str | None, dirs: list[str]) -> str:
    """The line ``ckpt_path="auto"`` logs, in the words of the trainer function that asked."""
    fn = getattr(fn, "value", fn)
    if fn in (None, TrainerFn.FITTING.value):
        return f"resuming from {found}" if found else f"no complete checkpoint in {', '.join(dirs)}; starting from scratch"
    verb = {TrainerFn.VALIDATING.value: "validating", TrainerFn.TESTING.value: "testing"}.get(fn, "predicting with")
    if found:
        return f"{verb} {found}, the newest complete checkpoint"
    return (f"no complete checkpoint in {', '.join(dirs)}; {verb} the model as built (its initial weights); "
            f"to {fn} a checkpoint, pass --ckpt_path PATH (Python: ckpt_path=PATH)")


def _newest_complete(dirs, files: bool) -> str | None:
    """The newest complete checkpoint in ``dirs``: DCP directories with a manifest (the eval gate's
    failures skipped), or with ``files`` Lightning's checkpoint files (newest by modification time)."""
    from lightning_disttrain.checkpoint.discovery import list_checkpoints

    best: tuple[float, str] | None = None
    for d in dirs:
        if files:
            if is_url(d) or not os.path.isdir(d):
                continue
            found = [(os.path.getmtime(p), str(p)) for p in Path(d).glob("*.ckpt")
                     if p.is_file() and not p.is_symlink()]
        else:
            found = [(c.timestamp, str(c.resolved)) for c in list_checkpoints(d) if c.complete and not c.failed]
        for entry in found:
            best = max(best, entry) if best else entry
    return None if best is None else best[1]


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}" if is_url(directory) else os.path.join(directory, name)


def _point_last_at(path: Path, directory: str | os.PathLike) -> bool:
    """``directory/last.ckpt`` -> ``path`` (relative link), unless ``last.ckpt`` is a real checkpoint
    (save_last=True) or ``path`` does not lie in ``directory`` itself: a checkpoint reached through a
    link to elsewhere (``init.ckpt -> ../user_data``) never gets a ``last.ckpt`` beside its target,
    outside the run's directory. Returns whether the link points at ``path`` now."""
    directory = Path(directory)
    target = path.resolve()
    if target.parent != directory.resolve():
        log.warning("not pointing %s at %s: it lies outside that directory", directory / "last.ckpt", target)
        return False
    link = directory / "last.ckpt"
    if link.exists() and not link.is_symlink():
        return False
    tmp = directory / f".last.ckpt.tmp{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    os.replace(tmp, link)  # atomic: ckpt_path="last" never sees a missing link
    return True


def _saves_directories(trainer: pl.Trainer) -> bool:
    """Whether the strategy writes DCP checkpoint directories (``DCPCheckpointMixin``, read through its
    ``saves_checkpoint_directories`` marker: the strategies sit above the callbacks and install this
    one, so this module does not import them) rather than Lightning's single files."""
    return getattr(type(trainer.strategy), "saves_checkpoint_directories", False) is True


def ensure_signal_safety(trainer: pl.Trainer) -> None:
    """Give a run without a ``PreemptionCheckpoint`` one that saves nothing: a SIGTERM / SIGUSR1 on
    any rank (or on the launcher, which is rank 0) then makes every rank agree at the next
    agreement (``check_every_n_steps="auto"``) and exit with code 143 and one message, instead of Lightning's handler, which
    broadcasts inside the signal handler and leaves the ranks waiting on each other for good."""
    if not any(isinstance(cb, PreemptionCheckpoint) for cb in trainer.callbacks):
        trainer.callbacks.append(PreemptionCheckpoint(save=False))


def _all_gather_objects(obj: Any) -> list[Any]:
    return comm.all_gather_object(obj)


def _slurm_requeue() -> None:
    """``scontrol requeue JOB`` when running under SLURM (what Lightning's SLURM handler does)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        log.warning("not requeueing: SLURM job id %r is not a job id", job)
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job], check=False).returncode
    except FileNotFoundError:
        result = -1
    if result == 0:
        log.warning("Requeued SLURM job %s", job)
    else:
        log.warning("Requeueing SLURM job %s failed (scontrol exit status %s)", job, result)


def _stop_child_observer() -> None:
    # Under Lightning's subprocess launcher, rank 0 watches its child ranks and SIGKILLs itself and
    # them when a child exits non-zero. Here every rank exits with `exit_code` on purpose, after the
    # checkpoint is complete: stop watching, or rank 0 could be killed before it exits itself.
    compat.stop_child_process_watchdog()


class _Deadline:
    """Ends the process with ``exit_code`` unless cancelled within ``seconds``."""

    def __init__(self, seconds: float, grace_period_s: float, exit_code: int, path: str) -> None:
        self._timer = threading.Timer(seconds, self._expire, args=(grace_period_s, exit_code, path))
        self._timer.daemon = True
        self._timer.start()

    @staticmethod
    def _expire(grace_period_s: float, exit_code: int, path: str) -> None:
        log.error("preemption checkpoint %s not complete %.0f s after the first signal (grace_period_s); exiting "
                  "without it: it has no manifest, so resume takes the previous complete checkpoint", path,
                  grace_period_s)
        logging.shutdown()
        os._exit(exit_code)

    def cancel(self) -> None:
        self._timer.cancel()
