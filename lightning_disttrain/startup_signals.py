"""A preemption signal outside the training loop stops every rank at once, and says so.

Why this exists (issue 42, item 1). ``PreemptionCheckpoint`` turns SIGTERM / SIGUSR1 into a
checkpoint at the next step boundary, but only from the start of training (``on_train_start``) to
the end of ``fit``; Lightning's own handlers come in only after the checkpoint is restored. Before
that (imports, data preparation, building and sharding the model, loading a checkpoint, the
sanity check), after it, and in ``validate`` / ``test`` / ``predict``, a signal met the default
action: the process that got it died on the spot without a word, the others failed in their next
collective, and the report blamed communication ("out of memory?"); with the signal sent to rank 0
alone (``kill PID``, a scheduler signalling the launching process), rank 1 was left running and
printed that report after the shell had its prompt back. ``benchmarks/stress_resume.py
--signal-resume`` reproduces it. At scale the window is minutes (loading a 70B checkpoint), and a
spot preemption in it is ordinary.

What happens instead. Outside the training loop there is nothing a checkpoint would add (the weights
are those being loaded, or those the last checkpoint holds), so the run stops at once: the rank
that got the signal calls ``stop(signum)`` (``RunErrors.stopped``: it records the signal as a stop,
not an error; rank 0 prints one line, "stopped on rank N: received SIGTERM ...", stops the other
ranks and exits with code 143, ``PreemptionCheckpoint``'s, which schedulers and wrappers read as
"preempted: requeue"). It runs on a thread woken by the signal itself (``signal.set_wakeup_fd``),
so a rank whose main thread is blocked in a collective, waiting for a rank that is still loading,
stops at once too. Between ``training_started()`` and ``training_ended()`` (``PreemptionCheckpoint``'s
``on_train_start`` and ``teardown``) the signals are that callback's, and this module ignores them.

Installed by ``cli.main`` for the LightningCLI subcommands, on every rank (kept to the end of the
process when it is the process; a call from Python gives them back). A ``Trainer`` run from a
user's own script does not get them (not built: holding process-wide signals from a callback
inside someone else's process needs more care than this change took). Forked children (DataLoader workers) get the default actions back, and a signal they
receive never reaches their parent's thread.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""The signals that stop a run outside the training loop: ``PreemptionCheckpoint``'s defaults (what
Kubernetes, spot reclaims and SLURM's ``--signal=USR1@N`` send)."""
EXIT_CODE = 143
"""The exit code of a run stopped by one of them (``PreemptionCheckpoint``'s default ``exit_code``)."""

_installed: StartupSignals | None = None


class StartupSignals:
    """The handlers of one process; see the module docstring. ``stop(signum)`` must not return."""

    def __init__(self, stop: Callable[[int], None]) -> None:
        self._stop = stop
        self._pid = os.getpid()
        self._training = False
        self._stopping = threading.Lock()
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    def install(self) -> bool:
        """Take the signals (main thread only: Python's rule for handlers); False if not installed."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        read, write = os.pipe()
        os.set_blocking(write, False)  # the C handler never blocks on a full pipe
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if previous != -1:  # someone else's (an event loop): theirs stays, the handler does the work
            signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
        else:
            self._pipe = (read, write)
            self._thread = threading.Thread(target=self._wake, name="ldt-startup-signals", daemon=True)
            self._thread.start()
        return True

    def uninstall(self) -> None:
        """Give back the handlers and the wakeup descriptor found at ``install`` (main thread)."""
        if threading.current_thread() is not threading.main_thread() or os.getpid() != self._pid:
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:  # a bound method: equal, not identical
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._pipe is not None:
            _, write = self._pipe
            self._pipe = None
            if signal.set_wakeup_fd(-1) != write:  # not ours any more: put back whatever is there
                signal.set_wakeup_fd(signal.set_wakeup_fd(-1))
            os.close(write)  # the thread reads end-of-file, closes its end and returns
            if self._thread is not None:
                self._thread.join(timeout=5)

    # ---- the signal ---------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object = None) -> None:
        if os.getpid() != self._pid:  # a forked child that kept the handler: the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._pipe is None:  # no thread of ours is woken: act here, in the main thread
            self._maybe_stop(signum)

    def _wake(self) -> None:
        # The read end is this thread's: it closes it when the write end is gone, so its descriptor
        # number is never reused while this thread may still read it.
        read = self._pipe[0] if self._pipe else -1
        try:
            while True:
                data = os.read(read, 64)
                if not data:
                    return
                for signum in data:
                    if signum in STOP_SIGNALS:
                        self._maybe_stop(signum)
        except OSError:
            return
        finally:
            if read >= 0 and os.getpid() == self._pid:
                os.close(read)

    def _maybe_stop(self, signum: int) -> None:
        if self._training or os.getpid() != self._pid:
            return
        if self._stopping.acquire(blocking=False):  # once, whichever of two signals came first
            self._stop(signum)


def install(stop: Callable[[int], None]) -> StartupSignals | None:
    """Install this process's handlers (``cli.main``); None where they cannot be (not the main thread)."""
    global _installed
    handlers = StartupSignals(stop)
    if not handlers.install():
        return None
    _installed = handlers
    return handlers


def uninstall(handlers: StartupSignals | None) -> None:
    global _installed
    if handlers is not None:
        handlers.uninstall()
        if _installed is handlers:
            _installed = None


def training_started() -> None:
    """From here the preemption signals are ``PreemptionCheckpoint``'s (its ``on_train_start``)."""
    if _installed is not None:
        _installed._training = True


def training_ended() -> None:
    """Outside the training loop again (``PreemptionCheckpoint``'s ``teardown``)."""
    if _installed is not None:
        _installed._training = False


def _reset_in_child() -> None:
    # A forked child (a DataLoader worker) must neither stop its parent's run nor write into its
    # parent's wakeup pipe: the default actions and no wakeup descriptor.
    handlers = _installed
    if handlers is None or os.getpid() == handlers._pid:
        return
    if handlers._pipe is not None:
        read, write = handlers._pipe
        handlers._pipe = None
        # The child's copy of the write end now leads nowhere: whatever its wakeup descriptor is,
        # nothing it receives can reach the parent's thread.
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, write)
        os.close(null)
        os.close(read)
    try:
        signal.set_wakeup_fd(-1)
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) == handlers._on_signal:
                signal.signal(signum, signal.SIG_DFL)
    except ValueError:  # forked from a thread other than the main one: Python refuses; _on_signal's pid check holds
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
