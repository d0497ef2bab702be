"""Two "nodes" on this machine (examples/multinode_hsdp.py): HSDP replicating across nodes.

One launch as two torchrun agents (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous on
127.0.0.1: two machines' worth of commands), 5 steps and a checkpoint; then the same run resumed
under a SLURM-style environment (the SLURM_* variables srun sets, read by Lightning's
SLURMEnvironment) to step 6. Each rank prints its node, its mesh coordinate and its shard.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest
from dist_utils import REPO, _env, free_port, kill_tree, popen

EXAMPLE = REPO / "examples" / "multinode_hsdp.py"
LINE = re.compile(r"rank (\d) node (\d) env (\w+): mesh (\{[^}]*\}) coordinate (\([\d, ]*\)), (\S+): "
                  r"local shard \((\d+), (\d+)\) of \((\d+), (\d+)\), step (\d+)")

pytestmark = pytest.mark.slow


def _wait(procs: list[subprocess.Popen], timeout: float = 400) -> str:
    out = ""
    try:
        for p in procs:
            out += p.communicate(timeout=timeout)[0]
    finally:
        for p in procs:
            kill_tree(p)
    if not all(p.returncode == 0 for p in procs):
        # The workers' first error, not only the tail: after a worker fails, torchrun's agents print
        # pages of rendezvous-shutdown tracebacks that push it out of the last few thousand characters
        # (an intermittent failure at the end of one suite run showed only those).
        lines = out.splitlines()
        first = next((i for i, line in enumerate(lines) if "Traceback" in line and "rendezvous" not in
                      "".join(lines[i:i + 6])), None)
        head = "\n".join(lines[first:first + 40]) if first is not None else "(no worker traceback)"
        raise AssertionError(f"exit codes {[p.returncode for p in procs]}\n--- first traceback ---\n{head}\n"
                             f"--- tail ---\n{out[-3000:]}")
    return out


def _ranks(output: str) -> dict[int, tuple]:
    """rank -> (node, environment, (replicate, shard) coordinate, local rows, rows, local cols, cols, step)."""
    ranks = {}
    for m in LINE.finditer(output):
        rank, node, env, mesh, coord, _, rows, cols, full_rows, full_cols, step = m.groups()
        names, coord = list(ast.literal_eval(mesh)), ast.literal_eval(coord)
        assert {k: v for k, v in ast.literal_eval(mesh).items() if v > 1} == {"dp_replicate": 2, "dp_shard": 2}
        at = (coord[names.index("dp_replicate")], coord[names.index("dp_shard")])
        ranks[int(rank)] = (int(node), env, at, int(rows), int(full_rows), int(cols), int(full_cols), int(step))
    return ranks


def _launches(tmp_path_factory):
    def torchrun_launch():
        import torch.distributed as dist

        out = tmp_path_factory.mktemp("multinode")
        args = [str(EXAMPLE), "--nodes", "2", "--devices", "2", "--out", str(out)]
        # The rendezvous store lives here, beyond both agents (is_host=false): when the agent that
        # hosted it finished first, the other one waited in torchrun's exit barrier for its 300 s
        # timeout (2026-12-05: 280 s of one suite run's setup; py-spy: SimpleElasticAgent._exit_barrier).
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "is_host=false"]
        try:
            return _wait([popen([*torchrun, *args, "--max-steps", "5"]) for _ in range(2)]), args, out  # two "machines"
        finally:
            del store

    rerun = None
    try:
        first, args, out = torchrun_launch()
    except AssertionError as e:
        # Seen once at the end of a full suite run (1 of 2 runs; 4 of 4 passed alone, 2026-12-04):
        # the two torchrun agents' launch failed with only rendezvous-shutdown noise in the tail.
        # Once more, said loudly with the first traceback (by the fixture: this runs in a background
        # thread); a second failure fails the test.
        rerun = str(e)[:6000]
        first, args, out = torchrun_launch()
    second = _wait([popen([sys.executable, *args, "--fake-slurm", "--max-steps", "6", "--resume"], env=_env())])
    return first, second, out, rerun


BACKGROUND = {"launches": _launches}  # run beside the other slow tests (tests/conftest.py)


@pytest.fixture(scope="module")
def launches(background):
    first, second, out, rerun = background(__name__, "launches")
    if rerun is not None:
        import warnings

        warnings.warn(f"the two-node torchrun launch failed and was run again:\n{rerun}", stacklevel=1)
    return first, second, out


def test_torchrun_two_nodes_shard_inside_a_node_and_replicate_across(launches):
    ranks = _ranks(launches[0])
    assert sorted(ranks) == [0, 1, 2, 3], launches[0][-4000:]
    for rank, (node, env, at, rows, full_rows, cols, full_cols, step) in ranks.items():
        assert env == "TorchElasticEnvironment" and node == rank // 2
        assert at == (rank // 2, rank % 2)  # replicate = node, shard = local rank
        assert rows * 2 == full_rows and cols == full_cols  # half of the weight per rank
        assert step == 5
    saved = [p for p in (launches[2] / "checkpoints").iterdir() if p.name.endswith("step=5.ckpt")]
    assert saved and (saved[0] / "manifest.json").is_file()  # one DCP directory, written by all 4 ranks


def test_slurm_environment_resumes_the_torchrun_checkpoint(launches):
    ranks = _ranks(launches[1])
    assert sorted(ranks) == [0, 1, 2, 3], launches[1][-4000:]
    for rank, (node, env, at, *_, step) in ranks.items():
        assert env == "SLURMEnvironment" and node == rank // 2 and at == (rank // 2, rank % 2)
        assert step == 6
    # from the torchrun launch's step-5 checkpoint ("last"), not from scratch
    assert re.search(r"Restored all states from the checkpoint at \S*step=5\.ckpt", launches[1]), launches[1][-4000:]
