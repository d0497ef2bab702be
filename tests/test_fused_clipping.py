"""bf16-mixed with ``gradient_clip_val`` and the package's fused AdamW (CUDA's optimizer, and CPU's):
Lightning's mixed-precision plugin refuses to clip an optimizer that "performs unscaling of gradients
internally", which only matters with a GradScaler; under bf16-mixed there is none. Under any
strategy for ``GPTModule`` (here Lightning's own, one process), and under this package's strategies for
any module (their mesh-aware clipping installs it; ``fsdp2_bf16`` trains that way on 2 ranks)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_disttrain import GPTModule
from lightning_disttrain._lightning_compat import clip_fused_optimizers_under_bf16_mixed
from lightning_disttrain.parallel.fsdp import install_mesh_aware_clipping


def _fused_adamw_with_grads(scale: float = 100.0):
    layer = torch.nn.Linear(8, 8)
    for p in layer.parameters():
        p.grad = torch.full_like(p, scale)
    optimizer = torch.optim.AdamW(layer.parameters(), fused=True)
    return layer, optimizer


def test_bf16_mixed_clips_a_fused_optimizer_by_the_norm():
    plugin = MixedPrecision("bf16-mixed", "cpu")
    layer, optimizer = _fused_adamw_with_grads()
    with pytest.raises(RuntimeError, match="performs unscaling of gradients internally"):
        plugin.clip_gradients(optimizer, clip_val=1.0)  # Lightning's check, as installed
    clip_fused_optimizers_under_bf16_mixed(plugin)
    plugin.clip_gradients(optimizer, clip_val=1.0)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in layer.parameters()]))
    assert norm == pytest.approx(1.0, rel=1e-4)


def test_the_strategies_clipping_installs_it_for_any_module():
    # what NDParallelStrategy does to the Trainer's plugin, whatever the LightningModule
    plugin = MixedPrecision("bf16-mixed", "cpu")
    layer, optimizer = _fused_adamw_with_grads()
    install_mesh_aware_clipping(plugin)
    plugin.clip_gradients(optimizer, clip_val=1.0)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in layer.parameters()]))
    assert norm == pytest.approx(1.0, rel=1e-4)


def test_a_subclass_with_its_own_clipping_keeps_it():
    class Logged(MixedPrecision):
        calls = 0

        def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None):
            Logged.calls += 1

    plugin = Logged("bf16-mixed", "cpu")
    _, optimizer = _fused_adamw_with_grads()
    clip_fused_optimizers_under_bf16_mixed(plugin)
    plugin.clip_gradients(optimizer, clip_val=1.0)
    assert Logged.calls == 1


def test_a_plugin_with_a_grad_scaler_keeps_lightnings_refusal():
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    _, optimizer = _fused_adamw_with_grads()
    clip_fused_optimizers_under_bf16_mixed(plugin)
    with pytest.raises(RuntimeError, match="performs unscaling of gradients internally"):
        plugin.clip_gradients(optimizer, clip_val=1.0)


def test_gptmodule_trains_under_bf16_mixed_with_clipping_on_lightnings_own_strategy():
    model = GPTModule(config="tiny", vocab_size=64, model_overrides={"n_layer": 1, "block_size": 16}, max_steps=2)
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", gradient_clip_val=0.5, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    assert trainer.optimizers == []
    trainer.fit(model, loader)
    assert trainer.global_step == 2
    assert trainer.optimizers[0].defaults["fused"]
