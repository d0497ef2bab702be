"""SampleGeneration: print a generated sample during and at the end of training."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities import rank_zero_info


class SampleGeneration(L.Callback):
    """Samples text from a LightningModule that has ``generate(prompt, ...)`` (e.g. ``GPTModule``).

    Every rank generates (under sharded strategies each forward is a collective) with one shared
    seed, so all ranks draw the same tokens; rank 0 prints and logs the text.

    Args:
        prompt: text to continue.
        max_new_tokens: tokens to generate after the prompt (passed to ``generate``).
        temperature: sampling temperature passed to ``generate`` (``GPTModule``: divides the
            logits; lower is more deterministic, 0 is greedy).
        top_k: passed to ``generate`` (``GPTModule``: sample only among the k most likely
            tokens; None: all).
        every_n_steps: also sample every n optimizer steps (None: only at the end of training).
        seed: sampling seed shared by all ranks.
    """

    def __init__(self, prompt: str = "\n", max_new_tokens: int = 128, temperature: float = 0.8,
                 top_k: int | None = 40, every_n_steps: int | None = None, seed: int = 0) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1 or None")
        self.prompt, self.max_new_tokens = prompt, max_new_tokens
        self.temperature, self.top_k = temperature, top_k
        self.every_n_steps, self.seed = every_n_steps, seed
        self.samples: list[tuple[int, str]] = []

    def _sample(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not callable(getattr(pl_module, "generate", None)):
            raise ValueError(f"SampleGeneration needs {type(pl_module).__name__}.generate(prompt, ...)")
        text = pl_module.generate(self.prompt, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                  top_k=self.top_k, seed=self.seed)
        self.samples.append((trainer.global_step, text))
        rank_zero_info(f"\n----- sample at step {trainer.global_step} -----\n{text}\n" + "-" * 40)

    def _sampled_at(self, step: int) -> bool:
        return bool(self.samples) and self.samples[-1][0] == step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # global_step stays put across the micro-batches of gradient accumulation: one sample per step.
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and not self._sampled_at(step):
            self._sample(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        # When the last step was also an every_n_steps step the model has not changed since: the
        # same seed would print the same text again.
        if not self._sampled_at(trainer.global_step):
            self._sample(trainer, pl_module)
