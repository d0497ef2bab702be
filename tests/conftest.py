import os
import sys
from pathlib import Path

import torch

# tests/dist_utils.py (shared multi-process helpers) importable as `dist_utils` from every folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Every process the suite starts skips torchmetrics' optional transformers/matplotlib imports
# (~1.5 s of each process's start-up; why and what exactly: tests/startup/sitecustomize.py), and so
# does this one, before anything imports lightning.
_STARTUP = str(Path(__file__).resolve().parent / "startup")
# Last on PYTHONPATH (still before site-packages): a sitecustomize earlier on it wins (and may load
# this one, as benchmarks/bench_suite_time.py's process logger does).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [os.environ.get("PYTHONPATH", ""), _STARTUP] if p)


def _install_startup() -> None:  # by path: a sitecustomize of the interpreter's own may be imported already
    import importlib.util

    spec = importlib.util.spec_from_file_location("ldt_test_startup", Path(_STARTUP) / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


_install_startup()

# One intra-op thread in the pytest process: the suite's models are tiny (two threads buy little)
# and multi-process tests run their ranks beside it; an idle OpenMP pool spinning against those
# ranks on a 2-core machine made single-process tests 10-20x slower. Spawned ranks get theirs
# from Lightning's launcher (cores // processes). LDT_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("LDT_TEST_THREADS", "1")))


# ---- one launch per world size for the multi-rank training runs ----------------------------
# A test module declares ``WORKER`` (the worker module's name) and ``LAUNCH = {devices: [run, ...]}``;
# its fixtures ask ``launched(WORKER, devices)`` for ``{run: [rank results]}``. ``multi_worker.py``
# starts per world size with the runs of every module whose launch a *selected* test reads (running
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
import time  # noqa: E402

import pytest  # noqa: E402

import dist_utils  # noqa: E402
from dist_utils import read_ranks, run_lightning_script  # noqa: E402

_NEEDED: dict[int, list[tuple[str, str]]] = {}

# LDT_SUITE_TIMELINE=FILE: one line per event (seconds since the session started, what): each
# launch's and background job's start and end, the first test of each order, the session's end.
# Off by default; docs/benchmarks.md section 25 shows what it recorded.
_T0 = time.monotonic()
_TIMELINE = os.environ.get("LDT_SUITE_TIMELINE")
_TIMELINE_LOCK = threading.Lock()


def _mark(event: str) -> None:
    if _TIMELINE:
        with _TIMELINE_LOCK, open(_TIMELINE, "a") as f:
            f.write(f"{time.monotonic() - _T0:8.1f} {event}\n")


_LAUNCH_FIXTURES = {"launched", "two", "four"}


def _background_fixtures(item) -> set[str]:
    """The fixtures of the item's module computed in the background (``BACKGROUND``) it uses."""
    return set(getattr(getattr(item, "module", None), "BACKGROUND", {})) & set(getattr(item, "fixturenames", ()))


def _order(item) -> int:
    """0: tests that are not slow (in-process, or one subprocess); 1: tests reading the shared
    launches; 2: other slow (multi-process) tests, and readers that start processes of their own
    (marked ``own_processes``): beside a launch still running they would slow both; 3: tests that
    read a fixture computed in the background (``BACKGROUND``), which runs beside the tests of 2."""
    if _background_fixtures(item):
        return 3
    if item.get_closest_marker("own_processes"):
        return 2
    if _LAUNCH_FIXTURES & set(getattr(item, "fixturenames", ())):
        return 1
    return 2 if item.get_closest_marker("slow") else 0


def pytest_collection_modifyitems(config, items):
    # Every test that waits on a multi-rank launch is ``slow``: ``-m "not slow"`` (README, the
    # development subset) then starts no launch at all.
    for item in items:
        if (_LAUNCH_FIXTURES | {"background"}) & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_order)  # stable: file order within each group


def pytest_collection_finish(session):  # the selected items, after -k / -m deselection
    seen, background = set(), set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        for name in sorted(_background_fixtures(item)):  # the functions whose values a selected test reads
            if (module.__name__, name) not in background:
                background.add((module.__name__, name))
                _BACKGROUND_NEEDED.append((module.__name__, name, module.BACKGROUND[name]))
        # A module's runs launch only when a selected test reads them: under -m "not slow" a module's
        # in-process tests alone must not start its launch.
        if module in seen or not (_LAUNCH_FIXTURES & set(getattr(item, "fixturenames", ()))):
            continue
        seen.add(module)
        for devices, runs in getattr(module, "LAUNCH", {}).items():
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
        _mark(f"launch {devices} start")
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
            _mark(f"launch {devices} end")
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
    _TMP_PATH_FACTORY.append(tmp_path_factory)

    def run_all() -> None:
        dist_utils.background_env.base = _SESSION_ENV
        for devices in sorted(_NEEDED):
            if devices == max(_NEEDED) and len(_NEEDED) > 1 and _BACKGROUND_NEEDED:
                _start_background_jobs(tmp_path_factory)  # beside the last launch (see BACKGROUND below)
            _LAUNCHES[devices].run(tmp_path_factory, devices, _NEEDED[devices])

    thread = threading.Thread(target=run_all, name="ldt-launches", daemon=True)
    if _NEEDED:
        thread.start()
    yield
    if thread.is_alive():
        thread.join(timeout=1)  # an interrupted session: the launches' own timeouts end them


# ---- module fixtures computed in the background, beside the other slow tests ---------------------
# The slow tests that start their own processes (order 2) run one at a time and mostly keep one core
# of two busy (start-ups, waits on signals, peers and timeouts: measured 0.7-1.3 cores over the
# ~450 s they took, docs/benchmarks.md section 25). A module may declare
# ``BACKGROUND = {"fixture": function(tmp_path_factory) -> value}`` for its expensive module-scoped
# multi-process fixtures: they start, one after another in a thread, when the last shared launch (8
# ranks) starts, or else when the first test of order 2 runs. Beside the 8-rank launch they cost it
# 3-12 s and start ~50 s earlier (docs/benchmarks.md section 26); started any earlier, beside the 4-rank
# launch, they slowed it more than they gained, even at nice 10 (section 25). Their tests come last (order 3),
# reading the value with ``background(__name__, "fixture")``. A function runs in that thread: it must not touch
# ``os.environ`` (its processes start from the session's environment: ``dist_utils.background_env``)
# nor pytest's per-test state, and it reports warnings by returning them.

_BACKGROUND_NEEDED: list[tuple[str, str, object]] = []
_SESSION_ENV = dict(os.environ)


class _Job:
    def __init__(self) -> None:
        self.finished = threading.Event()
        self.value = None
        self.error: BaseException | None = None


_JOBS: dict[tuple[str, str], _Job] = {}
_TMP_PATH_FACTORY: list = []  # the session's, once its first test set up
_JOBS_STARTED = threading.Event()


def _start_background_jobs(tmp_path_factory) -> None:
    if _JOBS_STARTED.is_set():
        return
    _JOBS_STARTED.set()
    for module, name, _ in _BACKGROUND_NEEDED:
        _JOBS[module, name] = _Job()

    def run_all() -> None:
        dist_utils.background_env.base = _SESSION_ENV
        for module, name, function in _BACKGROUND_NEEDED:
            job = _JOBS[module, name]
            _mark(f"background {module}.{name} start")
            try:
                job.value = function(tmp_path_factory)
            except BaseException as e:  # noqa: BLE001  (raised again in the test that reads it)
                job.error = e
            finally:
                _mark(f"background {module}.{name} end")
                job.finished.set()

    if _BACKGROUND_NEEDED:
        threading.Thread(target=run_all, name="ldt-background", daemon=True).start()


_ORDERS_SEEN: set[int] = set()


def pytest_sessionfinish(session, exitstatus):
    _mark(f"session end (exit {int(exitstatus)})")


def pytest_runtest_setup(item):
    if _TIMELINE and _order(item) not in _ORDERS_SEEN:
        _ORDERS_SEEN.add(_order(item))
        _mark(f"order {_order(item)} first test {item.nodeid}")
    if _order(item) >= 2 and _TMP_PATH_FACTORY and not _JOBS_STARTED.is_set():
        _start_background_jobs(_TMP_PATH_FACTORY[0])


@pytest.fixture(scope="session")
def background(tmp_path_factory):
    """``background(module_name, fixture)``: the value its ``BACKGROUND`` function computed."""

    def get(module: str, name: str):
        _start_background_jobs(tmp_path_factory)  # a module run alone: no test of order 2 before it
        job = _JOBS.get((module, name))
        if job is None:
            raise AssertionError(f"{module}.BACKGROUND has no {name!r} (or no selected test reads it)")
        job.finished.wait()
        if job.error is not None:
            raise job.error
        return job.value

    return get


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
