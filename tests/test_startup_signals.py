"""A preemption signal outside the training loop stops every rank at once and says so
(``lightning_disttrain/startup_signals.py``; issue 42, item 1).

The loop that found it: ``benchmarks/stress_resume.py --signal-resume`` (SIGTERM during a resume's
start-up: before, 10 of 10 runs ended with the signalled process killed silently, exit -15, and
with rank 0 alone signalled, rank 1 left running or printing "out of memory?" afterwards).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_disttrain import rank_errors, startup_signals
from lightning_disttrain.rank_errors import Record, exit_code, format_report, stop_record

TESTS = Path(__file__).resolve().parent


def test_a_stop_is_reported_as_a_stop_with_the_preemption_exit_code(monkeypatch):
    monkeypatch.delenv("LDT_TRACEBACK", raising=False)
    stop = stop_record(signal.SIGTERM, 1)
    text = format_report([stop], world=2)
    assert text.strip().splitlines() == [
        "lightning-disttrain: stopped on rank 1: received SIGTERM outside the training loop (starting up, evaluating, "
        "or after training ended): nothing to save, so every rank stops now (exit code 143); relaunching resumes "
        "from the newest complete checkpoint"]
    assert exit_code([stop]) == 143
    # the peers' failed collectives are consequences, not causes
    gone = Record(0, False, "RuntimeError", "Connection closed by peer", "Traceback ...")
    assert exit_code([gone, stop]) == 143 and "Connection closed" not in format_report([gone, stop], world=2)
    # a real error beside a stop is an error
    error = Record(0, True, "ValueError", "bad data", "Traceback ...", user_error=True)
    assert exit_code([error, stop]) == 1
    assert exit_code([gone]) == 1


def test_a_secondary_record_does_not_replace_a_ranks_stop(tmp_path):
    errors = rank_errors.RunErrors(tmp_path, reporter=False)
    errors._write(stop_record(signal.SIGUSR1, 1))
    errors._write(Record(1, False, "RuntimeError", "Connection closed by peer", ""))  # its main thread, later
    (kept,) = errors._records()
    assert kept.stopped and "SIGUSR1" in kept.message


_CHILD = """
import importlib.util, os, signal, sys, threading, time
spec = importlib.util.spec_from_file_location("startup_signals", sys.argv[3])  # the module alone: no torch
startup_signals = importlib.util.module_from_spec(spec)
sys.modules["startup_signals"] = startup_signals
spec.loader.exec_module(startup_signals)

def stop(signum):
    with open(sys.argv[1], "w") as f:
        f.write(f"{signal.Signals(signum).name} {threading.current_thread().name}")
    os._exit(startup_signals.EXIT_CODE)

handlers = startup_signals.install(stop)
assert handlers is not None
mode = sys.argv[2]
if mode == "training":
    startup_signals.training_started()  # PreemptionCheckpoint's: the signal is its, not ours
    signal.signal(signal.SIGTERM, lambda *_: None)  # its flag-only handler
pid = os.fork() if mode == "fork" else None
if pid == 0:  # a DataLoader worker: the default action, and nothing reaches the parent
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    os._exit(0)
if pid:
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    time.sleep(1)  # had the child's signal reached this process's thread, it would have stopped by now
    print("parent still running", flush=True)
print("ready", flush=True)
time.sleep(60)
print("not stopped", flush=True)
"""


@pytest.mark.parametrize("mode", ["startup", "training", pytest.param("fork", marks=pytest.mark.slow)])
def test_the_signal_stops_the_process_from_its_own_thread(tmp_path, mode):
    out = tmp_path / "stopped.txt"
    proc = subprocess.Popen([sys.executable, "-S", "-c", _CHILD, str(out), mode, startup_signals.__file__],
                            stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or lines[-1] != "ready":
            lines.append(proc.stdout.readline().strip())
        if mode == "fork":
            assert lines[:2] == [f"child {-signal.SIGTERM}", "parent still running"], lines
        proc.send_signal(signal.SIGTERM)
        if mode == "training":
            time.sleep(1)
            assert proc.poll() is None and not out.exists(), "during training the signal is PreemptionCheckpoint's"
            return
        assert proc.wait(timeout=30) == 143
        assert out.read_text() == "SIGTERM ldt-startup-signals"  # the thread the signal woke, not the main one
    finally:
        proc.kill()
        proc.wait()


def test_install_and_uninstall_give_back_what_was_there():
    before = {s: signal.getsignal(s) for s in startup_signals.STOP_SIGNALS}
    handlers = startup_signals.install(lambda signum: None)
    try:
        assert all(signal.getsignal(s) == handlers._on_signal for s in startup_signals.STOP_SIGNALS)
        assert handlers._thread is not None and handlers._thread.is_alive()
    finally:
        startup_signals.uninstall(handlers)
    assert {s: signal.getsignal(s) for s in startup_signals.STOP_SIGNALS} == before
    assert signal.set_wakeup_fd(-1) == -1, "the wakeup descriptor is given back"
    assert not handlers._thread.is_alive() and startup_signals._installed is None


@pytest.mark.slow
def test_sigterm_to_rank_0_alone_before_training_stops_every_rank(tmp_path):
    # Rank 0 gets SIGTERM in setup and then waits in a barrier (its main thread blocked in gloo)
    # while rank 1 sleeps for 300 s: formerly rank 0 died silently (-15) and rank 1 stayed behind.
    from test_cli_errors import _config, _lines, _run

    callbacks = [{"class_path": "rank_failure.SignalOnRank", "init_args": {"rank": 0}}]
    config = _config(tmp_path, devices=2, strategy="fsdp2", callbacks=callbacks)
    out = _run(tmp_path, "fit", "--config", str(config), timeout=120)  # rank 1's sleep would take 300 s
    everything = out.stdout + out.stderr
    assert out.returncode == 143, everything[-4000:]
    assert _lines(out)[-1].startswith("lightning-disttrain: stopped on rank 0: received SIGTERM outside the "
                                      "training loop"), everything[-4000:]
    assert "out of memory?" not in everything and "Traceback" not in everything, everything[-4000:]

