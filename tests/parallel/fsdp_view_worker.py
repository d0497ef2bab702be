"""FSDP2's "returned a view tensor" warning on 1 gloo rank (no Lightning): which units warn.

    (RANK/WORLD_SIZE/MASTER_* set by tests/dist_utils.run_torch_script) python fsdp_view_worker.py OUT_DIR

A model whose root ends in a biased ``nn.Linear`` on (batch, seq, dim) input (a view: linear is
``addmm(...).view(...)`` there), and a second one whose blocks return such a view too. Writes the
warnings each forward raised to ``OUT_DIR/view.rank0.json``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import exit_without_teardown, write_rank_json  # noqa: E402
from lightning_disttrain.parallel.fsdp import apply_fsdp  # noqa: E402
from lightning_disttrain.parallel.plan import ParallelPlan  # noqa: E402


class Block(nn.Module):
    def __init__(self, residual: bool) -> None:
        super().__init__()
        self.lin, self.residual = nn.Linear(8, 8), residual

    def forward(self, x):
        return x + self.lin(x) if self.residual else self.lin(x)  # the second: a view


class Plain(nn.Module):
    def __init__(self, residual_blocks: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(residual_blocks) for _ in range(2))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def views_warned(residual_blocks: bool, mesh) -> list[str]:
    model = Plain(residual_blocks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # as `python -W always` would: set before the sharding
        apply_fsdp(model, ParallelPlan(blocks=model.blocks), mesh)
        model(torch.randn(2, 3, 8)).sum().backward()
    return [str(w.message)[:60] for w in caught if "returned a view tensor" in str(w.message)]


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        write_rank_json(out_dir, "view", dist.get_rank(),
                        {"plain": views_warned(True, mesh), "view_blocks": views_warned(False, mesh)})
    finally:
        dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main(sys.argv[1])
