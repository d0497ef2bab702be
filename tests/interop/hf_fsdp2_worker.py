"""2-rank worker for test_hf_fsdp2.py: ``python hf_fsdp2_worker.py HF_DIR OUT_DIR``.

1. Fine-tunes ``GPTModule(init_from=HF_DIR, init_device="meta")`` under ``strategy="fsdp2"`` on two
   CPU ranks (materialised, then the HF weights loaded by ``init_weights``), records each rank's
   losses, saves a sharded checkpoint and the trained model's logits on fixed tokens.
2. Loads the HF weights into a GPT sharded on the meta device (FSDP2, ``Shard(0)``) and into
   ``Shard(1)`` DTensors (the tensor-parallel row-wise layout): every rank reads only its slices.
   Records whether every full tensor equals a one-process import.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dist_utils import write_rank_json  # noqa: E402
from hf_fixtures import VOCAB, tokens  # noqa: E402

from lightning_disttrain import GPTModule  # noqa: E402
from lightning_disttrain.models.gpt import GPT  # noqa: E402
from lightning_disttrain.models.hf import (  # noqa: E402
    _assign,
    _reader,
    gpt_from_hf,
    load_hf_weights_,
    weight_map,
)

STEPS, BATCH = 4, 4


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = tokens(batch=STEPS * BATCH, seq=17, seed=3)
    return [(data[i : i + BATCH, :-1], data[i : i + BATCH, 1:]) for i in range(0, STEPS * BATCH, BATCH)]


class Tokens(pl.LightningDataModule):
    """The fixed batches; rank r of W takes samples r, r+W, ...: together the one-process batch."""

    def train_dataloader(self):
        xs, ys = zip(*batches())
        data = TensorDataset(torch.cat(xs), torch.cat(ys))
        world, rank = self.trainer.world_size, self.trainer.global_rank
        return DataLoader(Subset(data, range(rank, len(data), world)), batch_size=BATCH // world)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach()))


def fine_tune(hf_dir: str, out: Path) -> dict:
    module = GPTModule(init_from=hf_dir, init_device="meta", model_overrides={"dropout": 0.0}, lr=3e-3,
                       warmup_steps=0, max_steps=STEPS, schedule="constant", weight_decay=0.0)
    losses = Losses()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", max_steps=STEPS, precision="32-true",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[losses])
    trainer.fit(module, datamodule=Tokens())
    trainer.save_checkpoint(out / "ckpt")
    module.eval()
    with torch.no_grad():  # every rank runs the sharded forward; all get the same logits
        logits = module.model.trim_padding(module(tokens())).tolist()
    return {"losses": losses.losses, "logits": logits,
            "sharded": type(module.model.blocks[0].attn.wq.weight).__name__}


def sharded_loads(hf_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_disttrain.parallel.materialize import materialize_

    one_process = gpt_from_hf(hf_dir)
    reference = one_process.state_dict()
    mesh = init_device_mesh("cpu", (2,))
    with torch.device("meta"):
        model = GPT(one_process.config)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialize_(model, "cpu", init=lambda m: load_hf_weights_(m, hf_dir))
    fsdp_equal = {n: bool(torch.equal(p.full_tensor(), reference[n])) for n, p in model.named_parameters()}
    local_rows = model.wte.weight.to_local().shape[0]
    # Shard(1): split along the input features, as tensor parallel's row-wise layers are.
    from lightning_disttrain.models.hf import HFWeights

    col_equal = {}
    with HFWeights(hf_dir, "transformer.") as weights:
        for e in weight_map(model.config):
            full = reference[e.ours]
            if full.ndim != 2:
                continue
            target = distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)])
            _assign(target, _reader(weights, e))
            col_equal[e.ours] = bool(torch.equal(target.full_tensor(), full))
    return {"fsdp_equal": fsdp_equal, "wte_local_rows": local_rows, "placements": str(model.wte.weight.placements),
            "col_equal": col_equal, "vocab": VOCAB}


if __name__ == "__main__":
    hf_dir, out = sys.argv[1], Path(sys.argv[2])
    result = fine_tune(hf_dir, out)
    result.update(sharded_loads(hf_dir))
    write_rank_json(out, "hf_fsdp2", dist.get_rank(), result)
