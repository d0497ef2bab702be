"""Resume through the strategy (``ckpt_path``) from checkpoints a hostile writer touched, on every rank.

    python multi_worker.py OUT_DIR DEVICES untrusted_ckpt_worker:RUN

``malformed``: the newest checkpoint's manifest is malformed (each kind of ``MALFORMED``: ``[]``,
deep nesting, a string step, a huge or NaN time); resuming from ``last.ckpt`` skips it on every rank
and starts from the one before. ``planted``: a checkpoint whose DCP ``.metadata``
creates a marker file when unpickled is refused on every rank by ``ckpt_path``, and loads with
``strategy.trust_checkpoint = True``.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "checkpoint")]
from lightning_disttrain import GPTModule  # noqa: E402  (registers fsdp2)
from untrusted_helpers import MALFORMED, malformed_text, plant_metadata  # noqa: E402

VOCAB, SEQ = 64, 16


class StartStep(L.Callback):
    def __init__(self):
        self.step = None

    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def _fit(devices: int, ckpt_dir: Path | None, steps: int, ckpt_path=None, trust: bool = False) -> int:
    L.seed_everything(0)
    tokens = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    module = GPTModule("tiny", vocab_size=VOCAB, lr=1e-3,
                       model_overrides=dict(n_layer=1, n_embd=32, n_head=2, block_size=SEQ))
    start = StartStep()
    callbacks = [start]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1,
                                         save_last="link"))
    trainer = L.Trainer(strategy="fsdp2", devices=devices, accelerator="cpu", max_steps=steps, callbacks=callbacks,
                        logger=False, enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.strategy.trust_checkpoint = trust
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return start.step


def fit_run(run: str, devices: int) -> dict:
    root = Path(os.environ.get("LDT_LAUNCH_OUT", "/tmp")) / f"untrusted_{run}"
    ckpts = root / "ckpts"
    _fit(devices, ckpts, steps=2)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if run == "malformed":
        # Each kind in a copy of the two checkpoints: the newest one's manifest malformed, then a resume
        # from last.ckpt there, which must skip it on every rank and start from step=1.ckpt.
        resumed = {}
        for kind in MALFORMED:
            copy = root / f"ckpts_{kind}"
            if rank == 0:
                shutil.copytree(ckpts, copy, symlinks=True)
                manifest = copy / "step=2.ckpt" / "manifest.json"
                manifest.write_text(malformed_text(kind, json.loads(manifest.read_text())))
            dist.barrier()
            resumed[kind] = _fit(devices, None, steps=2, ckpt_path=str(copy / "last.ckpt"))
        return {"resumed_at": resumed}
    marker = root / "PWNED"
    if rank == 0:
        plant_metadata(ckpts / "step=1.ckpt", marker)
    dist.barrier()
    refused = None
    try:
        _fit(devices, None, steps=2, ckpt_path=str(ckpts / "step=1.ckpt"))
    except ValueError as err:
        refused = str(err)
    marker_after_refusal = marker.exists()
    dist.barrier()
    resumed_at = _fit(devices, None, steps=2, ckpt_path=str(ckpts / "step=1.ckpt"), trust=True)
    return {"refused": refused, "marker_after_refusal": marker_after_refusal, "marker_after_trust": marker.exists(),
            "resumed_at": resumed_at}
