"""The pieces of the multi-process error report: which errors are secondary, and the report's text.

The whole path (2 ranks through the real command) is tested in test_cli_errors.py.
"""

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_disttrain.rank_errors import Record, format_report, is_secondary


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001  (any exception, with its traceback)
        return caught


def test_secondary_errors_are_those_caused_by_another_process():
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4002")
    assert is_secondary(gloo)
    assert is_secondary(RuntimeError("[pair.cc:534] Connection reset by peer"))
    assert is_secondary(dist.DistBackendError("NCCL error in: ..., remote process exited or there was a network error"))
    assert is_secondary(SIGTERMException())
    wrapped = ValueError("while saving")
    wrapped.__cause__ = gloo
    assert is_secondary(wrapped), "a collective failing inside our code is still secondary"
    assert not is_secondary(ValueError("unknown tokenizer 'gpt3'"))
    assert not is_secondary(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_secondary(ConnectionError("Couldn't reach 'org/x' on the Hub"))


def test_report_merges_ranks_and_prints_the_primary_error_last(monkeypatch):
    monkeypatch.delenv("LDT_TRACEBACK", raising=False)
    data = [Record.of(_raised(ValueError("bad data")), rank) for rank in (0, 1)]
    follow_up = Record.of(_raised(RuntimeError("Connection closed by peer")), 2)
    text = format_report([*data, follow_up], world=3)
    lines = text.strip().splitlines()
    assert lines[-1] == "lightning-disttrain: error on ranks 0, 1: ValueError: bad data"
    assert text.count("bad data") == 1 and "Connection closed" not in text and "Traceback" not in text
    assert "LDT_TRACEBACK=1" in text

    monkeypatch.setenv("LDT_TRACEBACK", "1")
    text = format_report(data, world=2)
    assert text.count("Traceback") == 1 and text.strip().splitlines()[-1].endswith("ValueError: bad data")


def test_report_of_secondary_errors_only_says_so(monkeypatch):
    monkeypatch.delenv("LDT_TRACEBACK", raising=False)
    text = format_report([Record.of(_raised(RuntimeError("Connection closed by peer")), 0)], world=2)
    assert "failed in communication" in text
    assert text.strip().splitlines()[-1] == "lightning-disttrain: error on rank 0: RuntimeError: Connection closed by peer"


def test_single_process_report_has_no_rank(monkeypatch):
    monkeypatch.delenv("LDT_TRACEBACK", raising=False)
    text = format_report([Record.of(_raised(KeyError("x")), 0)], world=1)
    assert text.count("Traceback") == 1, "not a ValueError: the traceback is shown"
    assert text.strip().splitlines()[-1] == "lightning-disttrain: error: KeyError: 'x'"


def test_a_rank_that_died_without_a_record_is_named_with_its_signal(monkeypatch):
    # Issue 42 (1): rank 1 vanished while rank 0 waited in a collective; rank 0's report said only that
    # every failing process failed in communication. Real processes, ended as such a rank ends.
    import signal
    import subprocess
    import sys
    from types import SimpleNamespace

    from lightning_disttrain.rank_errors import RunErrors

    monkeypatch.delenv("LDT_TRACEBACK", raising=False)
    script = "import os, signal, sys; os.kill(os.getpid(), getattr(signal, sys.argv[1])) if sys.argv[1] != 'ok' else 0"
    procs = [subprocess.Popen([sys.executable, "-S", "-c", script, how]) for how in ("SIGSEGV", "SIGKILL", "ok")]
    for p in procs:
        p.wait(timeout=30)
    errors = RunErrors.__new__(RunErrors)  # only the trainer is read; no directory, no watcher thread
    errors.trainer = SimpleNamespace(global_rank=0, strategy=SimpleNamespace(launcher=SimpleNamespace(procs=procs)))
    gone = Record.of(_raised(RuntimeError("Connection closed by peer")), 0)
    died = errors._died_without_a_record(errors._children(), [gone])
    assert died == {1: -signal.SIGSEGV, 2: -signal.SIGKILL}  # rank 3 finished (exit 0): not a cause
    text = format_report([gone], world=4, died=died)
    lines = text.strip().splitlines()
    assert lines[-2].startswith("lightning-disttrain: rank 1 crashed in native code (SIGSEGV)"), text
    assert lines[-1] == ("lightning-disttrain: rank 2 was killed by SIGKILL (the kernel's out-of-memory killer "
                         "sends it, as does `kill -9`)"), text
    assert "every failing process failed in communication" not in text  # the cause is known
    assert "error on rank 0: RuntimeError: Connection closed by peer" in text
    # a rank recorded its own error: not named again
    assert errors._died_without_a_record(procs, [gone, Record.of(_raised(ValueError("x")), 1)]) == {2: -signal.SIGKILL}
