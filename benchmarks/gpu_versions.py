"""What this machine runs against what the project pins: the first thing ``gpu.sh`` does.

Pins, read from the repository (not copied here, so they cannot go stale):
- torch: the exact ``torch==X`` of ``.ci/run`` (the CI entry) and of the README's install commands;
- lightning, torchao (and torch's lower bound): the requirement specifiers in ``pyproject.toml``.
CUDA and NCCL are not pinned: their versions are recorded, and the CUDA runtime torch was built
with is checked against what the driver supports.

Prints one ``# version ...`` line per component and one ``# differs: ...`` line per difference.
Never fails on a difference (it is information to record); writes ``gpu_versions.json`` to
``--out`` / ``$OUT``.

    python benchmarks/gpu_versions.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
TRACKED = ("torch", "lightning", "torchao")


def pinned_versions(repo: Path = REPO) -> dict[str, Any]:
    """``{"torch": {"exact": "2.13.0", "spec": ">=2.13", "exact_sources": {...}}, "lightning": {"spec": ...}, ...}``."""
    pins: dict[str, Any] = {name: {"spec": None} for name in TRACKED}
    with open(repo / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    for line in project.get("dependencies", []):
        req = Requirement(line)
        if req.name in pins:
            pins[req.name]["spec"] = str(req.specifier) or None
    exact: dict[str, str] = {}
    for source in (".ci/run", "README.md"):
        path = repo / source
        if path.exists():
            found = sorted(set(re.findall(r"torch==([0-9][0-9A-Za-z.+]*)", path.read_text())))
            if found:
                exact[source] = ", ".join(found)
    pins["torch"]["exact_sources"] = exact
    values = set(exact.values())
    pins["torch"]["exact"] = values.pop() if len(values) == 1 else None
    if len(set(exact.values())) > 1:
        pins["torch"]["conflict"] = f"the pins disagree: {exact}"
    return pins


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_cuda() -> str | None:
    """The highest CUDA version the driver supports (``nvidia-smi``'s header), or None."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"CUDA Version:\s*([0-9.]+)", out)
    return m.group(1) if m else None


def installed_versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "lightning": _dist_version("lightning"),
                           "torchao": _dist_version("torchao"), "cuda_runtime": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(), "gpus": torch.cuda.device_count(),
                           "nccl": None, "driver_cuda": None, "gpu_name": None}
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001  (recorded, not fatal)
            out["nccl"] = f"unavailable: {type(e).__name__}: {e}"
        out["gpu_name"] = torch.cuda.get_device_name(0)
        out["driver_cuda"] = _driver_cuda()
    return out


def _release(v: str) -> Version | None:
    try:
        return Version(v.split("+")[0])
    except InvalidVersion:
        return None


def differences(installed: dict[str, Any], pins: dict[str, Any]) -> list[str]:
    """One sentence per difference between ``installed`` and ``pins``; empty when all agree."""
    out = []
    torch_v = installed.get("torch")
    exact = pins["torch"].get("exact")
    if pins["torch"].get("conflict"):
        out.append(f"torch: {pins['torch']['conflict']}")
    if torch_v is None:
        out.append("torch: not installed")
    elif exact is not None and _release(torch_v) != _release(exact):
        out.append(f"torch: {torch_v} installed, {exact} pinned (torch=={exact} in "
                   f"{', '.join(pins['torch']['exact_sources'])})")
    for name in TRACKED:
        have, spec = installed.get(name), pins[name].get("spec")
        if have is None:
            out.append(f"{name}: not installed (pyproject requires {name}{spec or ''})")
        elif spec and _release(have) is not None and not Requirement(f"{name}{spec}").specifier.contains(
                _release(have), prereleases=True):
            out.append(f"{name}: {have} installed, pyproject requires {name}{spec}")
    cuda, driver = installed.get("cuda_runtime"), installed.get("driver_cuda")
    if installed.get("cuda_available") and cuda is None:
        out.append("torch: a CUDA device is visible but this torch is a CPU build")
    if cuda and driver and _release(driver) is not None and _release(cuda) is not None \
            and _release(driver) < _release(cuda):
        out.append(f"cuda: torch was built for CUDA {cuda}, the driver supports up to {driver}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_versions.json (default $OUT)")
    args = p.parse_args(argv)
    pins, have = pinned_versions(), installed_versions()
    diff = differences(have, pins)
    for name in TRACKED:
        print(f"# version {name} {have[name]} (pinned: {pins[name].get('exact') or ''}"
              f"{' ' if pins[name].get('exact') else ''}{pins[name]['spec'] or 'no specifier'})")
    print(f"# version cuda runtime {have['cuda_runtime']}, driver supports {have['driver_cuda']}, "
          f"nccl {have['nccl']}, {have['gpus']} GPU(s) {have['gpu_name'] or ''} (not pinned: recorded)")
    for line in diff:
        print(f"# differs: {line}")
    if not diff:
        print("# versions: torch, lightning and torchao as pinned")
    result = {"installed": have, "pinned": pins, "differences": diff}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_versions.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
