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
# its fixtures ask ``launched(WORKER, devices)`` for ``{run: [rank results]}``. The first request
# for a world size starts ``multi_worker.py`` once with the runs of every *selected* module that
# needs that size (running one test file launches only its own runs), so the suite pays Python's
# and Lightning's start-up once per world size instead of once per worker.

import pytest  # noqa: E402

from dist_utils import read_ranks, run_lightning_script  # noqa: E402

_NEEDED: dict[int, list[tuple[str, str]]] = {}


def pytest_collection_finish(session):  # the selected items, after -k / -m deselection
    seen = set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is None or module in seen or not hasattr(module, "LAUNCH"):
            continue
        seen.add(module)
        for devices, runs in module.LAUNCH.items():
            _NEEDED.setdefault(devices, []).extend((module.WORKER, run) for run in runs)


@pytest.fixture(scope="session")
def launched(tmp_path_factory):
    done: dict[int, Path] = {}

    def get(worker: str, devices: int) -> dict[str, list[dict]]:
        jobs = _NEEDED.get(devices, [])
        if devices not in done:
            out = tmp_path_factory.mktemp(f"ranks{devices}")
            try:
                run_lightning_script(Path(__file__).parent / "multi_worker.py", out, devices,
                                     *(f"{w}:{r}" for w, r in jobs), timeout=300 + 60 * len(jobs))
            except AssertionError as e:
                first = "".join(f"\n--- {p.name} ---\n{p.read_text()[-4000:]}" for p in sorted(out.glob("FAILED.*")))
                finished = sorted(p.name for p in out.glob("*.rank0.json"))
                raise AssertionError(f"{e}\n\nruns finished on rank 0: {finished}\n"
                                     f"failed runs:{first or ' none recorded'}") from None
            done[devices] = out
        return {run: read_ranks(done[devices], f"{w}.{run}", devices) for w, run in jobs if w == worker}

    return get

