"""SampleGeneration: one sample per optimizer step at most, including the one at the end of training."""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_disttrain import GPTModule
from lightning_disttrain.callbacks import SampleGeneration


def _fit(tmp_path, max_steps, every_n_steps, accumulate=1):
    data = torch.randint(0, 257, (32, 17))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    sampler = SampleGeneration(prompt="ab", max_new_tokens=4, every_n_steps=every_n_steps)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[sampler])
    trainer.fit(GPTModule("tiny", vocab_size=257, tokenizer_name="bytes"), loader)
    return [step for step, _ in sampler.samples]


@pytest.mark.parametrize("max_steps, every, accumulate, expected", [
    (4, 2, 1, [2, 4]),        # the last step is a sampling step: the end of training does not repeat it
    (5, 2, 1, [2, 4, 5]),     # it is not: the end of training samples the final model
    (4, 2, 2, [2, 4]),        # gradient accumulation: several batches end at one step
    (3, None, 1, [3]),
])
def test_one_sample_per_step(tmp_path, max_steps, every, accumulate, expected):
    assert _fit(tmp_path, max_steps, every, accumulate) == expected
