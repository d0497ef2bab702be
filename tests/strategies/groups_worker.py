"""Process groups across fits in one process (issue 38); one process per rank, in the 2-rank launch.

Three fits of different layouts (FSDP2, TP, HSDP), each with a new Trainer and module, as a notebook
or a sweep would; then ``release_all_meshes()``: the process's groups must be back where they were
before the first fit, and its threads too (gloo's threads end with their group, once torch's DTensor
caches no longer hold its mesh). A fourth fit of a layout whose groups were destroyed must train
exactly as the same layout did before (torch caches specs by mesh equality: a stale mesh would
resolve a destroyed group). A fifth fit of that layout without a release reuses its meshes: no new
group.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp2_worker as base  # noqa: E402
from dist_utils import worker_main  # noqa: E402
from lightning_disttrain.parallel.mesh import release_all_meshes  # noqa: E402
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402

LAYOUTS = {"fsdp2": {}, "tp2": {"tp": 2}, "hsdp": {"dp_replicate": 2}}


def _groups() -> int:
    """Every process group this process holds (the default one included)."""
    return len(dist.distributed_c10d._world.pg_map)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fit(devices: int, degrees: dict) -> list[float]:
    L.seed_everything(0)
    model = base.RecordedGPT()
    model.micro_batch = base.GLOBAL_BATCH // (devices // degrees.get("tp", 1))
    trainer = L.Trainer(strategy=NDParallelStrategy(**degrees), devices=devices, accelerator="cpu", max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model)
    return [float(x) for x in model.micro_losses]


def fit_run(run: str, devices: int) -> dict:
    assert run == "three_fits"
    if dist.is_initialized():
        release_all_meshes()  # earlier runs of the launch: start from no mesh
    start: dict | None = None
    result: dict = {"groups_after": {}, "losses": {}}
    for name, degrees in LAYOUTS.items():
        losses = _fit(devices, degrees)
        if start is None:  # the default group exists from the first fit on
            release_all_meshes()
            gc.collect()  # earlier runs' modules (their meshes hold released groups' objects, and threads)
            start = {"groups": _groups(), "threads": _threads()}
            losses = _fit(devices, degrees)
        result["losses"][name] = losses
        result["groups_after"][name] = _groups()
    result["released"] = release_all_meshes()
    gc.collect()  # the finished fits' Trainers and modules (reference cycles) held the groups' objects
    result["end"] = {"groups": _groups(), "threads": _threads()}
    result["start"] = start
    result["losses"]["tp2_after_release"] = _fit(devices, LAYOUTS["tp2"])
    after = _groups()
    result["losses"]["tp2_again"] = _fit(devices, LAYOUTS["tp2"])
    result["new_groups_for_the_same_layout"] = _groups() - after
    result["threads_after_refits"] = _threads()
    release_all_meshes()
    gc.collect()
    # NDParallelStrategy(release_process_groups_at_teardown=True): each fit destroys what it made
    result["at_teardown"] = []
    for name, degrees in LAYOUTS.items():
        _fit(devices, {**degrees, "release_process_groups_at_teardown": True})
        gc.collect()  # the finished fit's module (its DTensors' meshes hold the groups' objects)
        result["at_teardown"].append({"layout": name, "groups": _groups(), "threads": _threads()})
    return result


if __name__ == "__main__":
    worker_main(fit_run)
