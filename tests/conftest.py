import os
import sys
from pathlib import Path

import torch

# tests/dist_utils.py (shared multi-process helpers) importable as `dist_utils` from every folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

# One intra-op thread in the pytest process: the suite's models are tiny (two threads buy little)
# and multi-process tests run their ranks beside it; an idle OpenMP pool spinning against those
# ranks on a 2-core machine made single-process tests 10-20x slower. Spawned ranks get theirs
# from Lightning's launcher (cores // processes). LDT_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("LDT_TEST_THREADS", "1")))


# ---- one launch per world size for the multi-rank training runs ----------------------------
# A test module declares ``WORKER`` (the worker module's name) and ``LAUNCH = {devices: [run, ...]}``;
# its fixtures ask ``launched(WORKER, devices)`` for ``{run: [rank results]}``. ``multi_worker.py``
# starts per world size with the runs of every *selected* module that needs that size (running
# one test file launches only its own runs), in sets of ``_RUNS_PER_PROCESS`` runs per set of rank
# processes, so the suite pays Python's and Lightning's start-up once per set instead of once per
# run (and not the idle process groups of a whole launch's runs: see ``_RUNS_PER_PROCESS``).
#
# The launches start in the background when the first test runs (one at a time: 2, 4, then 8
# ranks), and the tests are ordered so that the tests that are not slow (one process, one thread)
# run first, beside them, then the tests that read the launches' results, then the other slow
# (multi-process) tests, alone: two multi-process runs at once on 2 cores took 1.7x as long each
# (measured: the 2-rank launch 226 s beside them against 129 s alone), more than they saved.
# Every test that starts more than one process is marked slow. Nothing asserts on wall time.

import threading  # noqa: E402

import pytest  # noqa: E402

from dist_utils import read_ranks, run_lightning_script  # noqa: E402

_NEEDED: dict[int, list[tuple[str, str]]] = {}


_LAUNCH_FIXTURES = {"launched", "two", "four"}


def _order(item) -> int:
    """0: tests that are not slow (in-process, or one subprocess); 1: tests reading the shared
    launches; 2: other slow (multi-process) tests, and readers that start processes of their own
    (marked ``own_processes``): beside a launch still running they would slow both."""
    if item.get_closest_marker("own_processes"):
        return 2
    if _LAUNCH_FIXTURES & set(getattr(item, "fixturenames", ())):
        return 1
    return 2 if item.get_closest_marker("slow") else 0


def pytest_collection_modifyitems(config, items):
    # Every test that waits on a multi-rank launch is ``slow``: ``-m "not slow"`` (README, the
    # development subset) then starts no launch at all.
    for item in items:
        if _LAUNCH_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_order)  # stable: file order within each group


def pytest_collection_finish(session):  # the selected items, after -k / -m deselection
    seen = set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is None or module in seen or not hasattr(module, "LAUNCH"):
            continue
        seen.add(module)
        for devices, runs in module.LAUNCH.items():
            _NEEDED.setdefault(devices, []).extend((module.WORKER, run) for run in runs)


# Runs per set of rank processes: a launch's runs go to fresh processes every this many runs.
# Each idle gloo group keeps about 3 threads polling, 0.0016 of a core per rank
# (benchmarks/bench_idle_groups.py, docs/benchmarks.md section 20). A run makes groups only for the
# rank sets its layout uses, and a later run of a layout already seen in the process reuses them
# (parallel/mesh.py's pool: section 21), so a set's groups grow with its distinct layouts, not its
# runs; fresh processes still cost a start-up (~5 s per rank).
_RUNS_PER_PROCESS = int(os.environ.get("LDT_RUNS_PER_PROCESS", "40"))


def _launch_once(out: Path, devices: int, jobs: list[tuple[str, str]]) -> tuple[bool, str] | None:
    """Run the launch; None if it passed, else (whether a run raised an error of its own, what
    failed). Not "its own": a rank only vanished (killed, or its peers' collectives broke)."""
    from lightning_disttrain.rank_errors import _PEER_GONE

    try:
        for start in range(0, len(jobs), _RUNS_PER_PROCESS):
            chunk = jobs[start:start + _RUNS_PER_PROCESS]
            run_lightning_script(Path(__file__).parent / "multi_worker.py", out, devices,
                                 *(f"{w}:{r}" for w, r in chunk), timeout=300 + 60 * len(chunk))
        return None
    except AssertionError as e:
        records = {p.name: p.read_text() for p in sorted(out.glob("FAILED.*"))}
        finished = sorted(p.name for p in out.glob("*.rank0.json"))
        own_error = any(not _PEER_GONE.search(text.strip().splitlines()[-1]) for text in records.values())
        details = "".join(f"\n--- {name} ---\n{text[-4000:]}" for name, text in records.items())
        return own_error, (f"{e}\n\nruns finished on rank 0: {finished}\n"
                           f"failed runs:{details or ' none recorded (a rank died without a Python error)'}")


class _Launch:
    """One world size's launch, run by the background thread: its directory, or its failure."""

    def __init__(self) -> None:
        self.finished = threading.Event()
        self.out: Path | None = None
        self.error: str | None = None
        self.rerun: str | None = None
        """Why it ran twice (a rank vanished without an error of its own the first time)."""

    def run(self, tmp_path_factory, devices: int, jobs: list[tuple[str, str]]) -> None:
        try:
            out = tmp_path_factory.mktemp(f"ranks{devices}")
            failure = _launch_once(out, devices, jobs)
            if failure and not failure[0]:
                # A rank disappeared without an error of its own (seen once in CI, not reproduced
                # here): run the launch once more, and say so loudly; an error raised by a run
                # itself, or a second failure, fails the tests.
                self.rerun = failure[1][-6000:]
                out = tmp_path_factory.mktemp(f"ranks{devices}_again")
                failure = _launch_once(out, devices, jobs)
            self.out, self.error = out, failure[1] if failure else None
        except BaseException as e:  # noqa: BLE001  (reported by the tests that wait for it)
            self.error = f"the {devices}-rank launch did not run: {type(e).__name__}: {e}"
        finally:
            self.finished.set()


_LAUNCHES: dict[int, _Launch] = {}


@pytest.fixture(scope="session", autouse=True)
def _background_launches(tmp_path_factory):
    """Start every needed launch, one after another, in a thread beside the first tests."""
    for devices in sorted(_NEEDED):
        _LAUNCHES[devices] = _Launch()
    # Create pytest's base temporary directory here, once: created lazily by the thread and a test's
    # tmp_path at the same time, one of them got "... is not a normalized and relative path".
    tmp_path_factory.getbasetemp()

    def run_all() -> None:
        for devices in sorted(_NEEDED):
            _LAUNCHES[devices].run(tmp_path_factory, devices, _NEEDED[devices])

    thread = threading.Thread(target=run_all, name="ldt-launches", daemon=True)
    if _NEEDED:
        thread.start()
    yield
    if thread.is_alive():
        thread.join(timeout=1)  # an interrupted session: the launches' own timeouts end them


@pytest.fixture(scope="session")
def launched():
    def get(worker: str, devices: int) -> dict[str, list[dict]]:
        launch = _LAUNCHES.get(devices)
        if launch is None:
            raise AssertionError(f"no {devices}-rank launch was planned: does the module declare LAUNCH?")
        launch.finished.wait()
        if launch.rerun is not None:
            import warnings

            rerun, launch.rerun = launch.rerun, None  # said once
            warnings.warn(f"the {devices}-rank launch failed without an error of its own and was run "
                          f"again:\n{rerun}", stacklevel=1)
        if launch.error is not None:
            raise AssertionError(launch.error)
        jobs = _NEEDED[devices]
        return {run: read_ranks(launch.out, f"{w}.{run}", devices) for w, run in jobs if w == worker}

    return get


@pytest.fixture(scope="module")
def two(launched, request):
    """The 2-rank results of the requesting module's ``WORKER``: ``{run: [rank results]}``."""
    return launched(request.module.WORKER, 2)


@pytest.fixture(scope="module")
def four(launched, request):
    """The 4-rank results of the requesting module's ``WORKER``."""
    return launched(request.module.WORKER, 4)


# ---- a 1-rank process group in the pytest process ------------------------------------------------


@pytest.fixture
def one_rank_group():
    """A 1-rank gloo process group for the test (an in-memory store), destroyed after it."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "an earlier test left a process group initialised in this process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
