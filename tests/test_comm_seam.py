"""Every collective of the package goes through ``lightning_disttrain.comm``, which stages tensors
on the device of the group's backend (NCCL refuses host tensors; gloo takes anything, so CPU tests
cannot see such a mistake at the call site: this scan and comm's own tests are what can)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_disttrain import comm

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_disttrain"
SEAM = PACKAGE / "comm.py"

COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_reduce_multigpu", "broadcast", "broadcast_object_list",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_tensor", "all_gather_coalesced",
    "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "all_to_all_single_autograd", "barrier",
    "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
    "recv_object_list", "broadcast_object", "permute_tensor",
}
LIGHTNING_COLLECTIVES = {"_sync_ddp", "_sync_ddp_if_available", "_all_gather_ddp_if_available"}


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted module path, from every import in the file (functions' too)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    names[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """(line, resolved name) of each call of a torch.distributed collective (or Lightning's
    reduction helpers) in ``source``."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, rest = name.partition(".")
        resolved = aliases.get(head, head) + (f".{rest}" if rest else "")
        last = resolved.rsplit(".", 1)[-1]
        if (resolved.startswith("torch.distributed.") and last in COLLECTIVES) or last in LIGHTNING_COLLECTIVES:
            found.append((node.lineno, resolved))
    return found


def test_the_scan_finds_every_spelling_of_a_direct_collective():
    source = """
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import all_reduce as ar
from lightning.fabric.utilities.distributed import _sync_ddp_if_available

def f(t, g):
    dist.all_reduce(t)
    torch.distributed.broadcast(t, 0)
    ar(t)
    funcol.all_to_all_single(t, None, None, g)
    dist.all_gather_object([None], 1)
    _sync_ddp_if_available(t)
    dist.get_rank()               # not a collective
    comm.all_reduce(t)            # the seam
"""
    lines = [line for line, _ in direct_collectives(source)]
    assert lines == [9, 10, 11, 12, 13, 14]


def test_no_package_code_calls_a_collective_outside_the_seam():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == SEAM:
            continue
        for line, name in direct_collectives(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}")
    assert not offenders, ("call these through lightning_disttrain.comm (it stages tensors on the device the "
                           "group's backend carries):\n" + "\n".join(offenders))


def test_seam_itself_calls_torch_collectives():
    # The scan above is only meaningful if the seam is where the calls went.
    assert len(direct_collectives(SEAM.read_text())) >= 6


# ---- where tensors go -----------------------------------------------------------------------


def test_backend_device(monkeypatch):
    assert comm.backend_device("gloo") == torch.device("cpu")
    assert comm.backend_device("GLOO") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm.backend_device("nccl") == torch.device("cuda", 3)


def test_collectives_without_a_process_group_are_identities():
    t = torch.tensor([1.0, 2.0])
    assert comm.all_reduce(t, "max") is t and t.tolist() == [1.0, 2.0]
    assert comm.broadcast_object({"a": 1}) == {"a": 1}
    assert comm.all_gather_object(5) == [5]
    assert comm.world_size() == 1 and comm.rank() == 0
    with pytest.raises(ValueError, match="op='avg'"):
        comm.all_reduce(t, "avg")


def test_a_tensor_away_from_the_group_device_is_staged_and_lands_back(one_rank_group, monkeypatch):
    calls = []
    real = dist.all_reduce

    def recording(t, *a, **k):
        calls.append((t.device, t.is_contiguous(), t.data_ptr()))
        return real(t, *a, **k)

    monkeypatch.setattr(dist, "all_reduce", recording)
    base = torch.arange(6.0).view(2, 3)
    view = base.t()  # not contiguous: staged into a contiguous copy, as a host tensor would be for NCCL
    out = comm.all_reduce(view, "sum")
    assert out is view and torch.equal(base, torch.arange(6.0).view(2, 3))
    assert calls[0][1] and calls[0][2] != view.data_ptr()  # the collective saw the staged copy
    plain = torch.ones(3)
    comm.all_reduce(plain)
    assert calls[1][2] == plain.data_ptr()  # already in place: no copy


def test_broadcast_and_objects_on_a_group(one_rank_group):
    t = torch.tensor([7, 8])
    assert comm.broadcast(t, group_src=0) is t
    assert comm.broadcast_object("x") == "x" and comm.all_gather_object({"r": 0}) == [{"r": 0}]
    comm.barrier()
    assert comm.group_device() == torch.device("cpu")


def test_host_group_is_the_default_under_gloo_and_a_gloo_group_beside_an_accelerator_backend(one_rank_group,
                                                                                             monkeypatch):
    # Under gloo the control flags ride the default group; beside NCCL (simulated: the default
    # group reports "nccl") a gloo group over the same ranks is made once, and a host flag's
    # all-reduce goes there, on the host, without staging it onto an accelerator.
    assert comm.host_group() is None
    comm._SIDE_GROUPS.clear()
    real_get_backend = dist.get_backend
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl" if group is None else real_get_backend(group))
    group = comm.host_group()
    assert group is not None and real_get_backend(group) == "gloo" and comm.host_group() is group
    flag = torch.tensor([1], dtype=torch.int32)
    assert comm.all_reduce(flag, "max", group=group).item() == 1 and comm.group_device(group).type == "cpu"
    comm._SIDE_GROUPS.clear()


def test_checkpoint_group_is_one_gloo_group_per_process_shared_by_every_writer(one_rank_group):
    # Every fit's checkpoint writer used to make a new world-size gloo group (never destroyed): now
    # one per default group, the same for every writer, and not the host group (async saves run
    # its collectives from a background thread).
    from lightning_disttrain.checkpoint.dcp_io import CheckpointWriter

    comm._SIDE_GROUPS.clear()
    first = CheckpointWriter().comm().group
    assert first is not None and dist.get_backend(first) == "gloo" and first is not comm.host_group()
    assert CheckpointWriter().comm().group is first and comm.checkpoint_group() is first
    comm._SIDE_GROUPS.clear()
