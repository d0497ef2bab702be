"""One report of a failed multi-process run: the error that caused it, once, printed last.

Why this exists. `lightning-disttrain fit` with ``devices=N`` on one machine runs under Lightning's
subprocess launcher: the process the user started is rank 0 and re-runs the command for ranks
1..N-1. When one rank raises, the others fail a moment later in their next collective ("Connection
closed by peer"), so the last lines on the screen were a secondary gloo error; an error raised on
every rank (bad data) was printed once per rank; and Lightning's child-process observer SIGKILLs
rank 0 as soon as it sees a child exit non-zero, so rank 0 could not report anything after that.

How it works (`RunErrors`):
- rank 0 creates a per-run directory and exports it, with its pid, in ``LDT_ERRORS_DIR`` /
  ``LDT_ERRORS_REPORTER_PID`` before Lightning launches the other ranks, which inherit both;
- every rank catches its exception in `cli.main`, classifies it (`is_secondary`: a collective
  failing because a peer is gone, or being terminated, versus the *primary* error that started it)
  and writes it to that directory;
- a launched rank then prints nothing and stays alive until rank 0 stops it: exiting non-zero at
  once would make Lightning's observer kill rank 0 before it reports. Should rank 0 be gone, the
  rank reports its own error;
- rank 0 reports, from its main thread when it fails itself, or from a watcher thread when another
  rank's record appears while rank 0 is still computing or blocked in a collective (a NCCL
  collective waiting for a dead peer may never return). It waits briefly for the other ranks'
  records, prints the primary errors merged by message ("error on ranks 0, 1: ValueError: ..."),
  or the secondary ones when no rank had a primary error, stops the launched ranks and exits 1.

A rank without a record of its own is named too (issue 42, item 1: rank 1 vanished while rank 0
waited for it in DCP's load): one that ended by a signal (SIGKILL, a crash in native code) or with
an exit code, one that exited 0 while the others failed in communication (it finished: the ranks
did not run the same collectives), and one still running: before stopping it, rank 0 has it dump
its Python stacks (``faulthandler`` on ``STACK_SIGNAL``, registered by every launched rank) and
prints where its main thread was.

A rank told to stop outside the training loop (a SIGTERM / SIGUSR1 before training starts, see
``startup_signals.py``) records a stop instead of an error: the report says "stopped on rank N:
received SIGTERM ..." and the run exits with 143, as a preemption does; rank 0, left without a
report by a kill it could not catch, is named by the rank it launched.

Tracebacks are printed once, above the summary, for errors other than ValueError (our user
errors, whose message says what to change) and for every error with ``LDT_TRACEBACK=1``.
Processes not launched by a rank-0 `cli.main` (torchrun, SLURM: each rank its own process) each
report their own error.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ENV_DIR = "LDT_ERRORS_DIR"
ENV_REPORTER = "LDT_ERRORS_REPORTER_PID"
ENV_TRACEBACK = "LDT_TRACEBACK"
POLL_S = 0.2
PRIMARY_GRACE_S = 1.5  # after a primary error: how long the others get to record theirs
SECONDARY_GRACE_S = 10.0  # with only secondary errors: how long to wait for the primary one
ORPHAN_TIMEOUT_S = 600.0  # a launched rank reports itself after this long without being stopped
STACK_WAIT_S = 2.0  # how long rank 0 waits for a silent rank's stack dump
STACK_FRAMES = 12  # innermost frames of a silent rank's main thread shown in the report
STACK_SIGNAL: int | None = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None
"""The signal on which a launched rank writes its Python stacks (every thread) to its file in the
run's error directory. A real-time signal nothing else uses (not SIGUSR1/SIGUSR2, which
``PreemptionCheckpoint`` may be told to take); None where the platform has none (no dumps)."""

# Messages of errors that a collective raises because a peer died (gloo, NCCL, the TCP store).
_PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|remote worker|NCCL communicator.*abort|"
    r"ProcessGroup\w*.*(abort|shut ?down)|Socket Timeout|Connection refused", re.IGNORECASE)


USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
"""Errors that name what to change (ours are ValueErrors, a corrupt checkpoint's included): the
summary line without the traceback, unless ``LDT_TRACEBACK=1`` / ``LDT_DEBUG=1``."""


def is_secondary(exc: BaseException) -> bool:
    """True for a failure caused by another process failing: a broken collective, or termination."""
    import torch.distributed as dist
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (dist.DistError, SIGTERMException)):
            return True
        if isinstance(exc, RuntimeError) and _PEER_GONE.search(str(exc)):
            return True
        exc = exc.__cause__
    return False


@dataclass
class Record:
    rank: int
    primary: bool
    type: str
    message: str
    traceback: str
    user_error: bool = False
    """An expected failure whose message says what to change (``USER_ERRORS``): no traceback."""
    stopped: bool = False
    """Not an error: the rank was told to stop (a preemption signal outside the training loop,
    ``startup_signals``); the report says "stopped" and the run exits with ``STOP_EXIT_CODE``."""

    @classmethod
    def of(cls, exc: BaseException, rank: int) -> Record:
        return cls(rank, not is_secondary(exc), type(exc).__name__, str(exc),
                   "".join(traceback.format_exception(exc)), isinstance(exc, USER_ERRORS))


STOP_EXIT_CODE = 143
"""The exit code of a run stopped by a preemption signal (``startup_signals.EXIT_CODE``)."""


def stop_record(signum: int, rank: int) -> Record:
    name = signal.Signals(signum).name
    return Record(rank, True, "Stopped", f"received {name} outside the training loop (starting up, evaluating, or "
                  f"after training ended): nothing to save, so every rank stops now (exit code {STOP_EXIT_CODE}); "
                  f"relaunching resumes from the newest complete checkpoint", "", user_error=True, stopped=True)


def _current_rank() -> int:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    # The strategy sets the global rank there; before that it comes from the environment.
    rank = getattr(rank_zero_only, "rank", None)
    return int(rank) if rank is not None else int(os.environ.get("LOCAL_RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


class RunErrors:
    """The error reporting of one `lightning-disttrain` process; see the module docstring."""

    def __init__(self, directory: Path, reporter: bool, owns_env: bool = False) -> None:
        self.directory = directory
        self.reporter = reporter
        self.trainer = None  # set by DistTrainCLI: the launched processes are its launcher's
        self._owns_env = owns_env
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failing = False
        self._watcher: threading.Thread | None = None
        self._stack_file = None  # a launched rank's stack-dump file (_register_stack_dump)

    @classmethod
    def for_this_process(cls) -> RunErrors:
        directory, reporter_pid = os.environ.get(ENV_DIR), os.environ.get(ENV_REPORTER)
        launched = (directory and reporter_pid == str(os.getppid()) and os.path.isdir(directory)
                    and os.environ.get("LOCAL_RANK", "0") != "0")
        if launched:
            errors = cls(Path(directory), reporter=False)
            errors._register_stack_dump()
            return errors
        errors = cls(Path(tempfile.mkdtemp(prefix="ldt-errors-")), reporter=True, owns_env=True)
        os.environ[ENV_DIR], os.environ[ENV_REPORTER] = str(errors.directory), str(os.getpid())
        errors._watcher = threading.Thread(target=errors._watch, name="ldt-error-watcher", daemon=True)
        errors._watcher.start()
        return errors

    def close(self) -> None:
        """Stops watching and removes the directory (rank 0), leaving the environment as it was."""
        self._stop.set()
        if self._owns_env:
            for var in (ENV_DIR, ENV_REPORTER):
                if os.environ.get(var) in (str(self.directory), str(os.getpid())):
                    del os.environ[var]
            shutil.rmtree(self.directory, ignore_errors=True)

    # ---- what the ranks do ------------------------------------------------------------

    def fail(self, exc: BaseException):
        """Record `exc`; rank 0 reports and exits, a launched rank waits to be stopped. Never returns."""
        self._failing = True
        record = Record.of(exc, _current_rank())
        self._write(record)
        if self.reporter:
            with self._lock:
                self._report_and_exit(own=record)
        self._wait_to_be_stopped(record)

    def stopped(self, signum: int):
        """A preemption signal outside the training loop (``startup_signals``; any thread): record it
        as a stop; rank 0 reports and stops every rank, a launched rank waits for that. Never returns."""
        self._failing = True
        record = stop_record(signum, _current_rank())
        self._write(record)
        if self.reporter:
            with self._lock:
                self._report_and_exit(own=record)
        self._wait_to_be_stopped(record)

    def finish(self, timeout_s: float = 120.0) -> None:
        """After rank 0's own success: wait for the launched ranks, reporting an error of theirs."""
        deadline = time.monotonic() + timeout_s
        while self._children() and any(p.poll() is None for p in self._children()):
            if time.monotonic() > deadline:
                return
            time.sleep(POLL_S)  # the watcher reports a record that appears meanwhile
        with self._lock:
            if self._records():
                self._report_and_exit(own=None)

    # ---- rank 0 ------------------------------------------------------------------------

    def _report_text(self, records: list[Record]) -> str:
        launched = self._launched()
        return format_report(records, world=len(launched) + 1 if launched else _world_size(),
                             died=self._died_without_a_record(launched, records),
                             # only when no rank says what went wrong: after an error or a stop the
                             # other ranks just wait where they were
                             stacks={} if any(r.primary for r in records) else
                             self._stacks_of_silent_ranks(launched, records))

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if self._failing or not self._records():
                continue
            with self._lock:
                if not self._failing:
                    self._report_and_exit(own=None)

    def _report_and_exit(self, own: Record | None):
        records = self._collect(own)
        text = self._report_text(records)
        code = exit_code(records)
        children = self._children()
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
        for proc in children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)  # they only wait for this; they print nothing
        shutil.rmtree(self.directory, ignore_errors=True)
        if children or threading.current_thread() is not threading.main_thread():
            # Exiting the interpreter normally would run on into a collective of the main
            # thread, or print shutdown noise from the killed peers' process groups after the report.
            os._exit(code)
        raise SystemExit(code)

    def _collect(self, own: Record | None) -> list[Record]:
        """The records, once every rank has one (or none can come soon); see the grace periods above."""
        my_rank = own.rank if own is not None else _current_rank()
        start = time.monotonic()
        first_primary = None
        while True:
            records = self._records()
            if own is not None and not any(r.rank == own.rank for r in records):  # the directory is gone
                records = sorted([*records, own], key=lambda r: r.rank)
            now = time.monotonic()
            if first_primary is None and any(r.primary for r in records):
                first_primary = now
            running = [p for p in self._children() if p.poll() is None]
            # Launched ranks that failed stay alive until stopped, so each running one owes a record.
            children_done = len({r.rank for r in records} - {my_rank}) >= len(running)
            mine_done = any(r.rank == my_rank for r in records)
            # Rank 0's own record too: from the watcher thread, rank 0's main thread may be about
            # to fail the same way (every rank raising in one hook, rank 0 a little later because
            # it prepared the data): it gets the primary grace period to say so.
            if (children_done and mine_done) or \
                    (first_primary is not None and now - first_primary > PRIMARY_GRACE_S) or \
                    now - start > SECONDARY_GRACE_S:
                return records or ([own] if own is not None else [])
            time.sleep(POLL_S)

    def _children(self) -> list:
        launcher = getattr(getattr(self.trainer, "strategy", None), "launcher", None)
        return list(getattr(launcher, "procs", None) or [])

    def _launched(self) -> dict[int, Any]:
        """{global rank: process} of the ranks this process launched: Lightning's launcher starts
        local ranks 1..N-1 in order, after this process's rank."""
        first = getattr(self.trainer, "global_rank", 0) + 1
        return {first + i: proc for i, proc in enumerate(self._children())}

    def _died_without_a_record(self, launched: dict[int, Any], records: list[Record]) -> dict[int, int]:
        """{rank: exit status} of the launched ranks that ended without writing a record: killed by a
        signal (negative status, as ``Popen.returncode`` has it) or exited non-zero outside
        ``cli.main``; and, when every recorded error is a failed collective, those that exited 0:
        a rank that finished while the others still waited for it in a collective is the cause
        (after a real error elsewhere it is not)."""
        recorded = {r.rank for r in records}
        in_communication = not any(r.primary for r in records)
        return {rank: proc.returncode for rank, proc in launched.items()
                if proc.poll() is not None and (proc.returncode != 0 or in_communication) and rank not in recorded}

    def _stacks_of_silent_ranks(self, launched: dict[int, Any], records: list[Record]) -> dict[int, str]:
        """{rank: its main thread's stack} of the launched ranks still running without a record of
        their own, each asked for a dump (``STACK_SIGNAL``) before rank 0 stops them: where a rank
        was that neither failed nor ended (a hang, another collective than the others')."""
        recorded = {r.rank for r in records}
        silent = {rank: proc for rank, proc in launched.items() if proc.poll() is None and rank not in recorded}
        if STACK_SIGNAL is None or not silent:
            return {}
        asked = {}
        for rank, proc in silent.items():
            try:
                proc.send_signal(STACK_SIGNAL)
                asked[rank] = self.directory / f"stack-{proc.pid}.txt"
            except OSError:
                continue
        deadline, texts = time.monotonic() + STACK_WAIT_S, {}
        while asked and time.monotonic() < deadline:
            time.sleep(POLL_S / 2)
            for rank, path in list(asked.items()):
                text = _read(path)
                if "(most recent call first)" in text:
                    time.sleep(0.05)
                    if _read(path) == text:  # written out
                        texts[rank] = text
                        del asked[rank]
        return {rank: stack for rank, text in texts.items() if (stack := main_thread_stack(text))}

    # ---- the other ranks ---------------------------------------------------------------

    def _register_stack_dump(self) -> None:
        """Write this process's Python stacks to ``stack-<pid>.txt`` in the run's error directory
        on ``STACK_SIGNAL`` (rank 0 asks before it stops a rank that has no error of its own)."""
        if STACK_SIGNAL is None:
            return
        try:
            self._stack_file = open(self.directory / f"stack-{os.getpid()}.txt", "a")  # noqa: SIM115 (kept open: faulthandler writes to it)
            self._stack_file.write(f"main thread {threading.main_thread().ident:#x}\n")
            self._stack_file.flush()
            faulthandler.register(STACK_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        except (OSError, ValueError, RuntimeError):
            pass  # no dump: the report says less, the run is the same

    def _wait_to_be_stopped(self, record: Record):
        reporter_pid = os.environ.get(ENV_REPORTER)
        deadline = time.monotonic() + ORPHAN_TIMEOUT_S
        while time.monotonic() < deadline and str(os.getppid()) == reporter_pid and self.directory.is_dir():
            time.sleep(POLL_S)
        # Nobody is left to report this rank's error: report it here, with what became of rank 0.
        gone = str(os.getppid()) != reporter_pid and self.directory.is_dir()
        text = format_report([record], world=max(_world_size(), record.rank + 1, 2))
        if gone:
            text += (f"lightning-disttrain: rank 0, the process that launched rank {record.rank}, ended without a "
                     f"report (killed: a signal sent to it alone, SIGKILL, the out-of-memory killer); rank "
                     f"{record.rank}'s error above followed from it\n")
        sys.stderr.write(text)
        sys.stderr.flush()
        os._exit(exit_code([record]))

    # ---- records -----------------------------------------------------------------------

    def _write(self, record: Record) -> None:
        path = self.directory / f"rank-{record.rank}.json"
        if not record.primary and any(r.rank == record.rank and r.primary for r in self._records()):
            return  # a failed collective after this rank's own stop or error: the first one is the cause
        try:
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(asdict(record)))
            os.replace(tmp, path)  # whole records only: rank 0 may read at any moment
        except OSError:
            pass  # the directory is gone: rank 0 has already reported and exited

    def _records(self) -> list[Record]:
        records = []
        for path in sorted(self.directory.glob("rank-*.json")):
            try:
                records.append(Record(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue
        return sorted(records, key=lambda r: r.rank)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)[^\n]*\(most recent call first\):\n((?:[ \t]+.*(?:\n|$))*)",
                     re.MULTILINE)


def main_thread_stack(dump: str) -> str:
    """The main thread's frames (innermost first, at most ``STACK_FRAMES``) from a ``faulthandler``
    dump whose first line names the main thread (``_register_stack_dump``); "" if absent."""
    head = re.match(r"main thread (0x[0-9a-fA-F]+)", dump)
    for match in _THREAD.finditer(dump):
        if head is None or int(match.group(1), 16) == int(head.group(1), 16):
            frames = [line.strip() for line in match.group(2).splitlines() if line.strip()]
            more = len(frames) - STACK_FRAMES
            return "\n".join(["  " + f for f in frames[:STACK_FRAMES]] + ([f"  ... {more} more"] if more > 0 else []))
    return ""


def exit_code(records: list[Record]) -> int:
    """1 for an error; ``STOP_EXIT_CODE`` when the only causes are preemption signals (stops)."""
    causes = [r for r in records if r.primary] or records
    return STOP_EXIT_CODE if causes and all(r.stopped for r in causes) else 1


def describe_exit(status: int) -> str:
    """What a process's exit status (``Popen.returncode``: -N for signal N) says about its end."""
    if status == 0:
        return ("exited with code 0 (it had finished) while the others still waited for it in a collective: "
                "the ranks did not run the same collectives")
    if status > 0:
        return f"exited with code {status} without a Python error"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    if name == "SIGKILL":
        return "was killed by SIGKILL (the kernel's out-of-memory killer sends it, as does `kill -9`)"
    if name in ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE"):
        return f"crashed in native code ({name}); its Python stack, as faulthandler printed it, is in its output above"
    return f"was killed by {name}"


def format_report(records: list[Record], world: int, died: dict[int, int] | None = None,
                  stacks: dict[int, str] | None = None) -> str:
    """Tracebacks (when wanted) then one line per distinct error, merged by rank; the error last.
    ``died``: {rank: exit status} of ranks that ended without a record (killed, crashed, finished
    early): said last, since their end is what made the others' collectives fail. ``stacks``:
    {rank: main-thread frames} of ranks still running without a record, shown above the summary."""
    died, stacks = died or {}, stacks or {}
    shown = [r for r in records if r.primary] or records
    if not shown and not died and not stacks:
        return ""
    groups: dict[tuple[str, str], list[Record]] = {}
    for record in shown:
        groups.setdefault((record.type, record.message), []).append(record)
    want_tracebacks = any(os.environ.get(var, "0") not in ("", "0") for var in (ENV_TRACEBACK, "LDT_DEBUG"))
    lines: list[str] = []
    hidden = False
    for (kind, _), group in groups.items():
        if group[0].stopped:
            continue  # a signal, not an error: nothing to trace
        if want_tracebacks or not (kind == "ValueError" or group[0].user_error):
            lines.append(group[0].traceback.rstrip())
        else:
            hidden = True
    if hidden:
        lines.append(f"(the traceback is not shown for an error that says what to change; {ENV_TRACEBACK}=1 shows it)")
    for rank, stack in sorted(stacks.items()):
        lines.append(f"rank {rank} had no error of its own and was still running; its main thread was at "
                     f"(most recent call first):\n{stack}")
    if shown and not shown[0].primary and not died and not stacks:
        lines.append("every failing process failed in communication: the one that failed first may have "
                     "been killed without a Python error (out of memory?); its own output above may say why.")
    for (kind, message), group in groups.items():
        ranks = [r.rank for r in group]
        where = "" if world == 1 else f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        if group[0].stopped:
            lines.append(f"lightning-disttrain: stopped{where}: {message}")
        else:
            lines.append(f"lightning-disttrain: error{where}: {kind}: {message}")
    for rank, stack in sorted(stacks.items()):
        innermost = stack.splitlines()[0].strip() if stack else ""
        lines.append(f"lightning-disttrain: rank {rank} was still running, without an error, at {innermost} "
                     f"(its stack is above)")
    for rank, status in sorted(died.items()):
        lines.append(f"lightning-disttrain: rank {rank} {describe_exit(status)}")
    return "\n" + "\n".join(lines) + "\n"
