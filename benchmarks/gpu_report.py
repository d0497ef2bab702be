"""What the one-GPU scripts (``gpu_sac.py``, ``gpu_paths.py``) share: a JSON report rewritten after
every section, sections isolated from each other, and a time budget.

The budget: ``gpu.sh`` exports ``LDT_GPU_DEADLINE`` (Unix time by which everything must be done).
A section whose estimate does not fit in the time left is skipped and says so in the report,
instead of being killed half-way by the hard ``timeout`` (which would lose its figures).
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch


def deadline_from_env() -> float | None:
    value = os.environ.get("LDT_GPU_DEADLINE")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"LDT_GPU_DEADLINE={value!r} must be a Unix time in seconds (gpu.sh sets it)") from None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class SectionReport:
    """``report.run(name, estimate_s, fn, **kwargs)``: time ``fn``, keep its dict (or its error) under
    ``sections[name]`` and rewrite ``<out>/<filename>`` at once."""

    def __init__(self, filename: str, out: str | None, device: torch.device, smoke: bool,
                 deadline: float | None = None) -> None:
        self.path = os.path.join(out, filename) if out else None
        self.deadline = deadline
        self.data: dict[str, Any] = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device_name(device),
            "torch": torch.__version__, "smoke": smoke, "sections": {}, "errors": {}, "skipped": {}}

    def run(self, name: str, estimate_s: float, fn: Callable[..., dict[str, Any]], **kwargs) -> dict[str, Any] | None:
        left = None if self.deadline is None else self.deadline - time.time()
        if left is not None and left < estimate_s:
            self.data["skipped"][name] = f"time budget: {left:.0f} s left, section estimated at {estimate_s:.0f} s"
            print(f"# {name}: SKIPPED ({self.data['skipped'][name]})", flush=True)
            self.write()
            return None
        print(f"# {name}: running (estimate {estimate_s:.0f} s on one H200)", flush=True)
        t0 = time.perf_counter()
        try:
            result = fn(**kwargs)
        except Exception as e:  # noqa: BLE001  (report and go on: one broken section must not hide the others)
            self.data["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(f"# {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            result = None
        else:
            result["wall_s"] = time.perf_counter() - t0
            self.data["sections"][name] = result
            print(f"# {name}: done in {result['wall_s']:.1f} s", flush=True)
        self.write()
        return result

    def write(self) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)  # a hard stop mid-write leaves the previous complete file


PARTS = ("gpu_versions.json", "gpu_layouts.json", "gpu_bench.json", "gpu_paths.json")
"""The files the scripts of gpu.sh write, in the order gpu.sh runs them."""


def merge_reports(out: str) -> dict[str, Any]:
    """Every figure of one ``gpu.sh`` run in one file, ``<out>/gpu_report.json``: each script's JSON
    under its name, plus which ones are missing (not run, or killed before writing) and, per
    script, what errored, was skipped or failed a check."""
    merged: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "parts": {},
                              "missing": [], "summary": {}}
    for name in PARTS:
        path = os.path.join(out, name)
        if not os.path.exists(path):
            merged["missing"].append(name)
            continue
        with open(path) as f:
            data = json.load(f)
        key = name.removesuffix(".json")
        merged["parts"][key] = data
        merged["summary"][key] = {k: sorted(data[k]) for k in ("errors", "skipped") if data.get(k)} | (
            {"failed_checks": data["failed"]} if data.get("failed") else {}) | (
            {"differences": data["differences"]} if data.get("differences") else {})
    tmp = os.path.join(out, "gpu_report.json.tmp")
    with open(tmp, "w") as f:
        json.dump(merged, f, indent=1, default=str)
    os.replace(tmp, os.path.join(out, "gpu_report.json"))
    return merged


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="merge the gpu*.json of one gpu.sh run into gpu_report.json")
    p.add_argument("--merge", required=True, metavar="DIR", help="the directory the scripts wrote to ($OUT)")
    merged = merge_reports(p.parse_args().merge)
    print(f"# gpu_report.json: {', '.join(merged['parts']) or 'nothing'}"
          f"{'; missing ' + ', '.join(merged['missing']) if merged['missing'] else ''}")
    for part, s in merged["summary"].items():
        if s:
            print(f"#   {part}: {json.dumps(s)[:400]}")
