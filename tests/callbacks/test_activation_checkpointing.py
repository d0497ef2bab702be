"""SelectiveActivationCheckpointing in a Trainer: hook order, exactness, registry, CLI, fsdp2."""

from __future__ import annotations


import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_disttrain.callbacks import SelectiveActivationCheckpointing
from lightning_disttrain.module import GPTModule
from lightning_disttrain.parallel.activation import checkpoint_config_of
from lightning_disttrain.parallel.recipe import parallelize
from lightning_disttrain.parallel.transforms import TransformContext, TransformRegistry

from cli_fit import fit_from_yaml

VOCAB = 101
N_LAYER = 4  # the "tiny" preset


class RandomTokenData(pl.LightningDataModule):
    """Fixed random (x, y) next-token pairs; enough to take a few optimizer steps."""

    def __init__(self, seq_len: int = 32, batch_size: int = 2, n: int = 8, vocab_size: int = VOCAB):
        super().__init__()
        self.seq_len, self.batch_size, self.n, self.vocab_size = seq_len, batch_size, n, vocab_size

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab_size, (self.n, self.seq_len + 1), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=self.batch_size)


class BackwardOpCounter(pl.Callback):
    """Counts, per training step, forward ops that run again inside backward (= recomputation)."""

    class _Mode(TorchDispatchMode):
        def __init__(self, counts: dict[str, int]):
            super().__init__()
            self.counts = counts

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name.startswith("aten._scaled_dot_product") and "backward" not in name:
                self.counts["attention"] += 1
            elif name == "aten.native_layer_norm.default":
                self.counts["layer_norm"] += 1
            return func(*args, **(kwargs or {}))

    def __init__(self):
        self.steps: list[dict[str, int]] = []
        self._mode = None

    def on_before_backward(self, trainer, pl_module, loss):
        self.steps.append({"attention": 0, "layer_norm": 0})
        self._mode = self._Mode(self.steps[-1])
        self._mode.__enter__()

    def on_after_backward(self, trainer, pl_module):
        self._mode.__exit__(None, None, None)


def _fit(callbacks, strategy="auto", steps=2, module=None):
    torch.manual_seed(0)
    module = module or GPTModule("tiny", vocab_size=VOCAB, lr=1e-3, warmup_steps=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, datamodule=RandomTokenData())
    return trainer, module


@pytest.mark.parametrize("policy,attention_recomputed", [("selective", 0), ("full", N_LAYER)])
def test_applies_after_configure_model_and_trains_exactly_like_no_checkpointing(
        policy, attention_recomputed):
    _, ref = _fit([])
    counter = BackwardOpCounter()
    cb = SelectiveActivationCheckpointing(policy=policy)
    _, module = _fit([cb, counter])
    # The model was built in configure_model, after callbacks' setup: applied in on_fit_start.
    assert cb.checkpointed == list(range(N_LAYER))
    assert all(checkpoint_config_of(b).policy == policy for b in module.model.blocks)
    # It was active in every step: the block recomputation ran inside backward ...
    assert len(counter.steps) == 2
    for step in counter.steps:
        assert step["layer_norm"] == 2 * N_LAYER  # both norms of every block recomputed
        assert step["attention"] == attention_recomputed
    # ... and the optimizer built before on_fit_start updated the same parameters, bit for bit.
    assert list(module.state_dict()) == list(ref.state_dict())
    for (n, p), (_, q) in zip(module.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_second_fit_does_not_wrap_twice():
    cb = SelectiveActivationCheckpointing(policy="block", every_k=2)
    _, module = _fit([cb], steps=1)
    _fit([cb], steps=1, module=module)  # a new Trainer, the same (already wrapped) module
    assert cb.checkpointed == [0, 2]
    assert [checkpoint_config_of(b) is not None for b in module.model.blocks] == [True, False, True, False]


class RegistryStrategy(SingleDeviceStrategy):
    """The contract a lightning-disttrain strategy offers: a ``transforms`` registry that it runs
    in STAGES order after configure_model. (NDParallelStrategy does this with the mesh.)"""

    def __init__(self):
        super().__init__(device=torch.device("cpu"))
        self.transforms = TransformRegistry()
        self.applied_before_fit_start = None

    def setup(self, trainer):
        # The recipe, without FSDP: the strategy runs registered transforms at their stages.
        parallelize(self.lightning_module, TransformContext(device=self.root_device), self.transforms)
        blocks = self.lightning_module.model.blocks
        self.applied_before_fit_start = [checkpoint_config_of(b) is not None for b in blocks]
        super().setup(trainer)


def test_registers_with_a_strategy_registry_instead_of_applying_itself(recwarn):
    strategy = RegistryStrategy()
    cb = SelectiveActivationCheckpointing()
    _fit([cb], strategy=strategy, steps=1)
    assert strategy.transforms.names() == [("activation_checkpointing", "SelectiveActivationCheckpointing")]
    assert strategy.applied_before_fit_start == [True] * N_LAYER  # by the strategy, at its stage
    assert not [w for w in recwarn if "did not run" in str(w.message)]


def test_invalid_options_fail_at_construction():
    with pytest.raises(ValueError, match="use one of"):
        SelectiveActivationCheckpointing(policy="selctive")
    with pytest.raises(ValueError, match="only applies to policy='selective'"):
        SelectiveActivationCheckpointing(policy="block", recompute_matmuls="every_other")


def test_cli_yaml_class_path(tmp_path):
    cli = fit_from_yaml(tmp_path, {"class_path": "lightning_disttrain.callbacks.SelectiveActivationCheckpointing",
                                   "init_args": {"policy": "selective", "recompute_matmuls": "every_other"}},
                        RandomTokenData, VOCAB)
    [cb] = [c for c in cli.trainer.callbacks if isinstance(c, SelectiveActivationCheckpointing)]
    assert cb.config.recompute_matmuls == "every_other"
    assert cli.trainer.global_step == 2
    assert all(checkpoint_config_of(b).policy == "selective" for b in cli.model.model.blocks)


WORKER, LAUNCH = "callbacks_worker", {2: ["activation_checkpointing"]}  # the suite's shared 2-rank launch


@pytest.mark.slow
def test_under_fsdp2_on_two_cpu_processes(launched):
    for r in launched(WORKER, 2)["activation_checkpointing"]:
        steps = r["steps"]
        assert [s.split(":")[0] for s in steps] == ["activation_checkpointing", "fsdp"], steps
        assert steps[0] == "activation_checkpointing: SelectiveActivationCheckpointing", steps
        assert r["checkpointed"] == [0, 1, 2, 3] and all(r["configured"])
        assert [s["attention"] for s in r["backward_ops"]] == [0, 0], r["backward_ops"]  # attention never recomputed
        assert all(s["layer_norm"] == 8 for s in r["backward_ops"]), r["backward_ops"]
