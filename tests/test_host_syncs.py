"""No host sync in a training step that Lightning does not log (issue 38, item 3).

A read of a device tensor on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``...) makes
the CPU wait for the accelerator's queue to drain: the host can no longer run ahead, and every
other rank then waits for this one at the next collective. These tests count such reads in the
steps whose metrics do not go to the loggers (and in the MoE dispatch functions) on the CPU.

What the count catches: every *Python-visible* call of the methods ``HostReads`` wraps, made by
this package, Lightning (its result collection and progress bars) or torch's Python code, whatever
the device (on the CPU they cost nothing, on an accelerator each one is a sync). What it cannot
catch: syncs made inside C++ kernels without a Python call, e.g. boolean-mask indexing or
``repeat_interleave`` without ``output_size`` (which need the result size), a blocking
host-to-device copy (``torch.tensor(x, device="cuda")``), a blocking collective (NCCL's barrier),
or ``tensor.to("cpu")`` (uncountable here: on the CPU every ``.to`` targets the CPU). Those need a
profiler on the accelerator.
"""

from __future__ import annotations

import copy
import traceback
from collections import Counter

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, TensorDataset

from lightning_disttrain import GPTModule
from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain.models.moe import MoE, MoEConfig, update_moe_biases
from lightning_disttrain.parallel.expert import shard_experts

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


class HostReads:
    """Counts calls of ``torch.Tensor``'s host-reading methods while ``active``, with where each
    came from (the innermost frames outside torch), for the failure message."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.active = False
        self.calls: list[str] = []
        self.on_host = lambda: ()  # the tensors kept on the host by design: their reads are not counted
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, original))

    def _counting(self, name, original):
        def wrapper(tensor, *args, **kwargs):
            if self.active and not any(tensor is t for t in self.on_host()):
                frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-5:]
                where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[::-1])
                self.calls.append(f"Tensor.{name} at {where}")
            return original(tensor, *args, **kwargs)

        return wrapper


class PerStep(L.Callback):
    """Opens a count at each batch's start (callbacks' hooks run before the module's) and closes
    it at the next batch's start or the end of the epoch: so a step's count also holds what
    Lightning does after the step's hooks (the result collection's ``on_batch_end``, the loggers),
    the progress bar's refresh and the loading of the next batch."""

    def __init__(self, reads: HostReads):
        self.reads = reads
        self.steps: dict[int, list[str]] = {}  # optimizer step (1-based) -> its host reads
        self._open: int | None = None

    def _close(self):
        if self._open is not None:
            self.steps[self._open] = list(self.reads.calls)
        self.reads.active, self._open = False, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._close()
        self.reads.calls.clear()
        self.reads.on_host = lambda: _optimizer_steps(trainer)
        self.reads.active, self._open = True, trainer.global_step + 1

    def on_train_epoch_end(self, trainer, pl_module):
        self._close()


def _optimizer_steps(trainer):
    """The optimizers' step counts: torch keeps them on the host (unless capturable or fused, as
    this package's AdamW is on CUDA) and its CPU AdamW reads them with .item() (bias correction)."""
    for optimizer in trainer.optimizers:
        for part in getattr(optimizer, "optimizers", [optimizer]):
            yield from (state["step"] for state in part.state.values() if torch.is_tensor(state.get("step")))


def _fit_counting(tmp_path, monkeypatch, name: str, steps: int, every: int, bar: L.Callback | None = None,
                  callbacks: tuple = (), **overrides) -> dict[int, list[str]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = (torch.randint(0, 64, (steps * 4, 1), generator=g) + torch.arange(17)) % 64
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    module = GPTModule(name, vocab_size=64, lr=1e-3, model_overrides=overrides or None)
    reads = HostReads(monkeypatch)
    per_step = PerStep(reads)
    # The default callbacks (a progress bar refreshed every batch, the model summary,
    # ModelCheckpoint) and a logger.
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=every,
                        limit_val_batches=0, logger=CSVLogger(tmp_path), default_root_dir=tmp_path,
                        callbacks=[per_step, *callbacks] + ([bar] if bar is not None else []))
    trainer.fit(module, loader)
    assert sorted(per_step.steps) == list(range(1, steps + 1))
    return per_step.steps


def _check(steps: dict[int, list[str]], every: int) -> None:
    logged = {s: calls for s, calls in steps.items() if s % every == 0}
    quiet = {s: calls for s, calls in steps.items() if s % every}
    # The counter sees the reads it should: the loggers turn each logged tensor into a number.
    assert all(logged.values()), {s: len(c) for s, c in logged.items()}
    where = Counter(call for calls in quiet.values() for call in calls)
    listing = "\n".join(f"{n}x {call}" for call, n in where.most_common())
    assert not where, f"host reads in steps that do not log:\n{listing}"


@pytest.mark.parametrize("bar", [TQDMProgressBar, RichProgressBar])
def test_a_step_that_does_not_log_reads_nothing_on_the_host(tmp_path, monkeypatch, bar):
    every = 3
    _check(_fit_counting(tmp_path, monkeypatch, "tiny", steps=2 * every, every=every, bar=bar(), n_layer=2), every)


def test_qk_clip_reads_nothing_on_the_host_in_a_step_that_does_not_log(tmp_path, monkeypatch):
    # the largest logits' all-reduce and the clip stay on the device; the loggers' steps read them
    import csv

    from lightning_disttrain.callbacks import QKClip

    every, clip = 3, QKClip(tau=0.05)
    _check(_fit_counting(tmp_path, monkeypatch, "tiny", steps=2 * every, every=every, callbacks=(clip,), n_layer=2),
           every)
    assert clip.clipped_heads > 0 and clip.max_logit > 0.05
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("attn/max_logit")]
    assert [int(r["step"]) for r in rows] == [every - 1, 2 * every - 1]  # the rows of those steps' train/loss
    assert float(rows[-1]["attn/max_logit"]) == pytest.approx(clip.max_logit)
    assert int(float(rows[-1]["attn/clipped_heads"])) == clip.clipped_heads


def test_a_moe_step_that_does_not_log_reads_nothing_on_the_host(tmp_path, monkeypatch):
    # Dropless routing with the grouped GEMM (float32 on the CPU): the routing, the balancing
    # bias's update after the optimizer step and the logging need no host value.
    every = 3
    _check(_fit_counting(tmp_path, monkeypatch, "tiny-moe", steps=2 * every, every=every, n_layer=2,
                         moe_aux_loss_coef=0.01), every)


# ---- one MoE layer: at most one host read, whatever the dispatch ----------------------------------

def _moe_layer() -> MoE:
    torch.manual_seed(0)
    layer = MoE(MoEConfig(dim=16, hidden=16, num_experts=4, top_k=2, shared_experts=1))
    layer.init_weights(0.2, 0.2)
    torch.nn.init.normal_(layer.router.weight, std=1.0)
    return layer


def _reads_of_one_step(monkeypatch, layer: MoE) -> tuple[list[str], torch.Tensor]:
    """The host reads of a forward, backward and bias update of ``layer``, and its output."""
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    reads = HostReads(monkeypatch)
    reads.active = True
    out = layer(x)
    out.square().sum().backward()
    update_moe_biases([layer])
    reads.active = False
    return reads.calls, out.detach()


@pytest.mark.parametrize("grouped", [True, False])
def test_a_local_moe_layer_reads_its_counts_at_most_once(monkeypatch, grouped):
    layer = _moe_layer()
    layer.experts.use_grouped_mm = grouped
    # The grouped GEMM takes the counts on the device; the loop over experts splits the rows by
    # them: one copy for the layer's three projections.
    calls, _ = _reads_of_one_step(monkeypatch, layer)
    assert len(calls) == (0 if grouped else 1), calls


@pytest.mark.parametrize("grouped", [True, False])
def test_an_expert_parallel_moe_layer_reads_its_sizes_once(monkeypatch, one_rank_group, grouped):
    # The all-to-all's split sizes must be on the host: the send and receive splits and the local
    # experts' row counts come over in one copy, for both expert computations.
    layer = _moe_layer()
    layer.experts.use_grouped_mm = grouped
    _, expected = _reads_of_one_step(monkeypatch, copy.deepcopy(layer))
    shard_experts([layer], init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
    calls, out = _reads_of_one_step(monkeypatch, layer)
    assert len(calls) == 1 and "tolist" in calls[0], calls
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_dropping_logged_values_fails_loudly_without_lightnings_result_collection(tmp_path, monkeypatch):
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    compat.drop_logged_values(trainer, "on_train_batch_end", ["tok/s"])  # no loop running: nothing to drop
    monkeypatch.delattr(L.Trainer, "_results")
    with pytest.raises(compat.LightningCompatError, match=r"_results.*checked against"):
        compat.drop_logged_values(trainer, "on_train_batch_end", ["tok/s"])
