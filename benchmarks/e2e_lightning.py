"""The recipe of ``bench_end_to_end.py`` as a Lightning user writes it by hand: Lightning's floor.

The same work as ``e2e_plain.py`` (the ``tiny`` GPT from a ``GPTConfig``, the token shards in
``TokenDataModule``'s sample order, AdamW with weight decay on 2-D weights, warmup then cosine to
10% stepped every optimizer step, clipping 1.0, validation every ``--val-every`` steps on the first
``--val-batches`` batches, one checkpoint at the end) in a minimal ``LightningModule`` under
``L.Trainer`` with Lightning's defaults: ``self.log("train/loss", loss, prog_bar=True)`` every step
(what nearly every Lightning project does), ``self.log("val/loss", ...)`` in ``validation_step``,
a ``CSVLogger`` at ``log_every_n_steps=10``, a ``ModelCheckpoint`` every ``--steps`` steps (one
save, at the end), the default progress bar (rich when installed), model summary and 2-batch
sanity check. ``lightning_disttrain``'s Lightning layer (``GPTModule``, ``TokenDataModule``, the
CLI, the strategies, the callbacks) is not imported: the two packages on the way to the model and
the sampler are entered without running their ``__init__``, as in ``e2e_plain.py``.

So ``fit - lightning`` is what ``lightning-disttrain fit`` adds to Lightning, and ``lightning -
plain`` what Lightning itself costs. Prints the ``@@e2e`` marks (``e2e_phases.PhaseTimestamps``,
``e2e_plain.py``'s ``data_start`` / ``data_end`` around the loaders) and the ``@@e2e-json`` line.
"""

import sys
import time

T_MAIN = time.monotonic()
sys.stderr.write(f"@@e2e main {T_MAIN:.6f}\n")


import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from e2e_phases import PhaseTimestamps, mark  # noqa: E402
from e2e_recipe import bare_imports, loaders, optimizer_and_schedule, recipe_args  # noqa: E402

GPT, GPTConfig, _, _ = bare_imports()
mark("imports")


class Recipe(L.LightningModule):
    def __init__(self, steps: int, lr: float, warmup: int, weight_decay: float, vocab: int, seed: int) -> None:
        super().__init__()
        self.steps, self.lr, self.warmup, self.weight_decay = steps, lr, warmup, weight_decay
        torch.manual_seed(seed)  # the weights a seeded one-process build draws, as e2e_plain.py
        self.config = GPTConfig.from_name("tiny", vocab_size=vocab)
        self.model = GPT(self.config)

    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)[..., : self.config.vocab_size].float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self.loss_of(*batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val/loss", self.loss_of(*batch))

    def configure_optimizers(self):
        opt, sched = optimizer_and_schedule(self.parameters(), self.lr, self.weight_decay, self.warmup, self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    args = recipe_args(__doc__)

    mark("data_start")
    train_loader, val_loader = loaders(args)
    mark("data_end")

    L.seed_everything(args.seed, verbose=False)
    module = Recipe(args.steps, args.lr, args.warmup, args.weight_decay, args.vocab, args.seed)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=args.steps,
                        val_check_interval=args.val_every, check_val_every_n_epoch=None, gradient_clip_val=1.0,
                        log_every_n_steps=10, default_root_dir=args.out,
                        logger=L.pytorch.loggers.CSVLogger(args.out, name="logs"),
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{args.out}/checkpoints",
                                                                       every_n_train_steps=args.steps),
                                   PhaseTimestamps()])
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)


if __name__ == "__main__":
    main()
