"""The pieces of the multi-process error report: which errors are secondary, and the report's text.

The whole path (2 ranks through the real command) is tested in test_cli_errors.py.
"""

import signal

import pytest
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
    died = errors._died_without_a_record(errors._launched(), [gone])
    # rank 3 exited 0 while rank 0 failed in communication: it had finished while rank 0 still waited
    # for it in a collective (the ranks ran different collectives), so it is named too.
    assert died == {1: -signal.SIGSEGV, 2: -signal.SIGKILL, 3: 0}
    text = format_report([gone], world=4, died=died)
    lines = text.strip().splitlines()
    assert lines[-3].startswith("lightning-disttrain: rank 1 crashed in native code (SIGSEGV)"), text
    assert lines[-2] == ("lightning-disttrain: rank 2 was killed by SIGKILL (the kernel's out-of-memory killer "
                         "sends it, as does `kill -9`)"), text
    assert lines[-1] == ("lightning-disttrain: rank 3 exited with code 0 (it had finished) while the others still "
                         "waited for it in a collective: the ranks did not run the same collectives"), text
    assert "every failing process failed in communication" not in text  # the cause is known
    assert "error on rank 0: RuntimeError: Connection closed by peer" in text
    # a rank recorded its own error: not named again; after a real (primary) error, one that
    # finished is not a cause
    primary = Record.of(_raised(ValueError("x")), 1)
    assert errors._died_without_a_record(errors._launched(), [gone, primary]) == {2: -signal.SIGKILL}


_SILENT_RANK = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("rank_errors", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["rank_errors"] = module
spec.loader.exec_module(module)
errors = module.RunErrors.for_this_process()
assert not errors.reporter, "launched as rank 1 of the test's run"

def waiting_in_another_collective():
    print("ready", flush=True)
    time.sleep(600)

waiting_in_another_collective()
"""


@pytest.mark.skipif(not hasattr(signal, "SIGRTMIN"), reason="no real-time signals on this platform (no stack dumps)")
def test_a_silent_rank_still_running_is_shown_where_it_was(tmp_path, monkeypatch):
    # Issue 42 (1): rank 0 failed in communication while rank 1 had no error of its own. Rank 1 is a
    # real process registered as a launched rank; rank 0 (this process) has it dump its stacks before
    # stopping it, and the report shows where its main thread was, the innermost frame last.
    import subprocess
    import sys
    from types import SimpleNamespace

    from lightning_disttrain import rank_errors
    from lightning_disttrain.rank_errors import ENV_DIR, ENV_REPORTER, RunErrors

    monkeypatch.delenv("LDT_TRACEBACK", raising=False)
    monkeypatch.setattr(rank_errors, "SECONDARY_GRACE_S", 0.5)
    env = dict(__import__("os").environ, **{ENV_DIR: str(tmp_path), ENV_REPORTER: str(__import__("os").getpid()),
                                            "LOCAL_RANK": "1"})
    proc = subprocess.Popen([sys.executable, "-S", "-c", _SILENT_RANK, rank_errors.__file__], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        errors = RunErrors(tmp_path, reporter=True)
        errors.trainer = SimpleNamespace(global_rank=0, strategy=SimpleNamespace(launcher=SimpleNamespace(procs=[proc])))
        own = Record.of(_raised(RuntimeError("Connection closed by peer")), 0)
        text = errors._report_text(errors._collect(own))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    lines = text.strip().splitlines()
    assert "rank 1 had no error of its own and was still running; its main thread was at" in text, text
    assert "in waiting_in_another_collective" in text, text
    assert lines[-2] == "lightning-disttrain: error on rank 0: RuntimeError: Connection closed by peer", text
    assert lines[-1].startswith("lightning-disttrain: rank 1 was still running, without an error, at File "), text
    assert lines[-1].endswith("in waiting_in_another_collective (its stack is above)"), text
    assert "every failing process failed in communication" not in text


def test_main_thread_stack_reads_faulthandlers_dump():
    from lightning_disttrain.rank_errors import STACK_FRAMES, main_thread_stack

    frames = "".join(f'  File "f.py", line {i} in f{i}\n' for i in range(STACK_FRAMES + 3))
    dump = ("main thread 0x00007f00000000aa\n"
            "Thread 0x00007f00000000bb (most recent call first):\n  File \"t.py\", line 1 in watcher\n\n"
            f"Current thread 0x00007f00000000aa (most recent call first):\n{frames}")
    stack = main_thread_stack(dump).splitlines()
    assert stack[0] == '  File "f.py", line 0 in f0' and "watcher" not in "".join(stack)
    assert len(stack) == STACK_FRAMES + 1 and stack[-1] == "  ... 3 more"
    assert main_thread_stack("no dump") == ""
