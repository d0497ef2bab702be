"""A real full disk during a checkpoint save: a small tmpfs as the checkpoint directory.

    sudo python benchmarks/bench_disk_full.py            # needs root (mount -t tmpfs); Linux only

The run of bench_preemption.py (the `tiny` GPT on 2 gloo ranks, FSDP2, async DCP saves every 3
steps, ``save_top_k=2``, 12 steps; benchmarks/preemption_worker.py) with its checkpoint directory
on a tmpfs sized for two checkpoints and a half: the saves of steps 3 and 6 fit, the one of step 9
runs out of space part-way (ENOSPC from the kernel, not injected). Once with the strategy's
``on_save_error="stop"``, once with ``"warn"``. For each: exit code, the error or warning line,
when training stopped, which checkpoints verify afterwards (sha256 of every file), that no
partial directory is left, and a relaunch with ``ckpt_path="last"`` on a disk with room again:
the step it resumes from and whether its losses equal an uninterrupted run's (float.hex).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests" / "checkpoint" / "scripts"), str(REPO)]
from bench_preemption import _finish, _ranks, _start  # noqa: E402

STEPS = 12


def _checkpoints(ckpt: Path) -> dict:
    from lightning_disttrain.checkpoint import CheckpointVerificationError, list_checkpoints, verify_checkpoint

    found = {}
    for cand in list_checkpoints(ckpt):
        try:
            found[cand.path.name] = f"verifies (step {verify_checkpoint(cand.resolved).global_step})"
        except CheckpointVerificationError as err:
            found[cand.path.name] = f"incomplete: {str(err)[:80]}"
    return found


def _errors(log: Path) -> list[str]:
    keep = ("CheckpointSaveError", "No space left", "Training goes on")
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if any(k in line for k in keep)]
    return list(dict.fromkeys(line[:400] for line in lines))[:3]


def main() -> None:
    from harness import write_indexed_shard

    root = Path(tempfile.mkdtemp(prefix="bench_disk_full_"))
    data = root / "data"
    write_indexed_shard(data)
    ref_dir = root / "reference"
    ref_dir.mkdir()
    if _finish(_start(data, ref_dir / "ckpt", ref_dir, "ref", STEPS)) != 0:
        raise SystemExit(f"reference run failed: {ref_dir / 'ref.log'}")
    ref = _ranks(ref_dir, "ref")
    size = sum(f.stat().st_size for f in (ref_dir / "ckpt" / "step=012.ckpt").rglob("*") if f.is_file())
    if not size:
        raise SystemExit("the reference left no step=012.ckpt to measure")
    tmpfs_bytes = int(size * 2.5)
    print(f"one checkpoint: {size / 1e6:.2f} MB on disk; tmpfs of {tmpfs_bytes / 1e6:.2f} MB", flush=True)
    for mode in ("stop", "warn"):
        out = root / mode
        mount = out / "disk"
        mount.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_bytes}", "tmpfs", str(mount)], check=True)
        try:
            os.environ["BENCH_ON_SAVE_ERROR"] = mode
            code = _finish(_start(data, mount / "ckpt", out, "full", STEPS))
            full = _ranks(out, "full")
            row = {"mode": mode, "exit_code": code, "steps_trained": [len(r["losses"]) for r in full],
                   "errors": [r.get("error", "")[:300] for r in full], "log": _errors(out / "full.log"),
                   "checkpoints": _checkpoints(mount / "ckpt")}
            # The relaunch, on a disk with room again (a copy of what the full one holds).
            shutil.copytree(mount / "ckpt", out / "ckpt", symlinks=True)
        finally:
            subprocess.run(["umount", str(mount)], check=False)
        os.environ["BENCH_ON_SAVE_ERROR"] = "stop"
        row["relaunch_exit_code"] = _finish(_start(data, out / "ckpt", out, "resume", STEPS, "last"))
        resumed = _ranks(out, "resume")
        start = resumed[0]["start_step"]
        row["resumed_from"] = start
        row["resumed_equal"] = start is not None and all(resumed[r]["losses"] == ref[r]["losses"][start:]
                                                         for r in range(2))
        print(json.dumps(row, indent=1), flush=True)
    print(f"runs kept in {root}")


if __name__ == "__main__":
    main()
