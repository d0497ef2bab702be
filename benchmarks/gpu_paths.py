"""The strategy paths only CUDA runs, each checked on one GPU (world size 1, NCCL) through
``L.Trainer(devices=1, strategy=NDParallelStrategy(...))``, plus the SAC kernel count
(``gpu_sac.py``). Writes ``$OUT/gpu_paths.json`` after every section.

Sections, most important first, with estimates on one H200 (gpu.sh gives this script what is left
of its 440 s; a section that no longer fits is skipped and named in the JSON):

1. ``sac`` (~30 s): ``gpu_sac.measure``: attention forwards per block, memory, time for
   none / selective / full under the flash, cuDNN and memory-efficient SDPA kernels, eager.
   ``sac_compiled`` (~60 s): the same, flash only, each block compiled.
2. ``meta_init`` (~20 s): ``empty_init=True`` builds on the meta device; the strategy shards
   first, then each rank draws each full parameter from a generator of its own
   (``models/param_init.py``) and keeps its shard. Compared, tensor by tensor (bitwise equal, max
   difference, std per tensor), with (i) the same seed's meta build initialised whole by
   ``init_weights`` without a strategy and (ii) the eager build (``empty_init=False``): both must
   be bitwise equal.
3. ``cpu_offload`` (~35 s): ``cpu_offload=True`` vs False, same seed and batches: per-step losses,
   step time, peak GPU memory.
4. ``async_save`` (~35 s): three saves during training with ``async_save=True`` (pinned-memory
   staging, ``checkpoint.dcp_io.CheckpointWriter``) vs synchronous: how long each save blocks the
   training loop, and how long the background write then takes to finish.
5. ``init_broadcast`` (~15 s): a module that builds real weights in ``__init__``, under
   ``strategy="fsdp2"``: its weights after setup equal the ones it built (rank 0's). At world size 1
   the strategy has nothing to agree on and skips the broadcast, so the section then runs
   ``broadcast_module_`` itself on the 1-rank NCCL group (``comm.broadcast`` stages each host tensor
   on the GPU): the host -> GPU staging and copy back (a broadcast between two ranks needs two GPUs).
6. ``plan_memory`` (~25 s): peak GPU memory of ``gpt2-124m`` (seq 1024, micro-batch 8, bf16-mixed,
   eager) under ``fsdp2`` against ``lightning-disttrain plan --json``'s figure for that layout, and
   the memory of each phase of a step (``MemoryPhases``) against the plan's terms.
   ``plan_memory_llama`` (~30 s): the same for 4 blocks of Llama-3-8B (128k vocabulary, untied head,
   SwiGLU, GQA, RoPE), micro-batch 2.
   ``plan_memory_llama_compiled`` (~45 s): the same with the strategy's ``compile`` option (the
   blocks and the loss compiled).
   ``memory_attribution`` / ``memory_attribution_llama`` (~30 s each): the caching allocator's live
   blocks when the second step's backward starts, summed by the source line that allocated them
   (``torch.cuda.memory._record_memory_history`` with Python stacks): what the forward keeps.
7. ``ring_attention`` (~40 s): ``gpu_ring.measure``: context parallel's ring on one GPU (every
   rank a thread): the CUDA block kernels with their log-sum-exp (flash in bf16 at 32k tokens with
   GQA and at head_dim 256, memory-efficient in fp32) against one causal SDPA, forward and backward.

On CPU (``--smoke``: gloo, the ``tiny`` model, seq 64) every section runs the same code except:
``meta_init`` takes the materialise-then-shard path (DTensor's RNG needs a CUDA-like mesh),
``async_save`` uses DCP's own (unpinned) stager, ``init_broadcast`` broadcasts over gloo without
staging, and ``plan_memory`` has no allocator to measure (plan figure only).

    python benchmarks/gpu_paths.py            # on a GPU (see gpu.sh)
    python benchmarks/gpu_paths.py --smoke    # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import os
import shutil
import tempfile
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_disttrain.module import GPTModule
from lightning_disttrain import comm
from lightning_disttrain.parallel.materialize import (
    broadcast_module_,
    dtensor_rng_supported,
    materialize_,
)
from lightning_disttrain.strategies import NDParallelStrategy

try:  # run as a script (benchmarks/ on sys.path) or as benchmarks.gpu_paths
    import gpu_ring
    import gpu_sac
    from gpu_report import SectionReport, deadline_from_env
except ImportError:
    from benchmarks import gpu_ring, gpu_sac
    from benchmarks.gpu_report import SectionReport, deadline_from_env


class Shape:
    def __init__(self, smoke: bool) -> None:
        self.preset, self.vocab, self.seq, self.batch = ("tiny", 257, 64, 2) if smoke else ("gpt2-124m", None, 1024, 8)
        self.smoke, self.overrides = smoke, {}

    @classmethod
    def llama(cls, smoke: bool) -> "Shape":
        """Llama-3-8B's blocks, 4 of them (2 in --smoke, at the tiny width), its 128k vocabulary (so the
        logits weigh), untied head, SwiGLU, GQA, RoPE: the planner's terms on a second kind of model."""
        shape = cls(smoke)
        shape.preset, shape.vocab, shape.batch = "llama3-8b", None, 2
        shape.overrides = {"n_layer": 4}
        if smoke:
            shape.overrides = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2, "mlp_hidden": 128,
                               "vocab_size": 1000}
        return shape

    def module(self, cls=GPTModule) -> GPTModule:
        if self.overrides:
            from lightning_disttrain.planning.model_shape import config_for

            config = config_for(self.preset, {**self.overrides, "block_size": self.seq})
            return cls(config, warmup_steps=0)
        return cls(self.preset, vocab_size=self.vocab, model_overrides={"block_size": self.seq}, warmup_steps=0)

    def loader(self, vocab_size: int, steps: int, device: torch.device) -> DataLoader:
        g = torch.Generator().manual_seed(1234)  # the same batches for every run
        tokens = torch.randint(0, vocab_size, (self.batch * steps, self.seq + 1), generator=g)
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=self.batch,
                          pin_memory=device.type == "cuda")


def _trainer(device: torch.device, strategy, max_steps: int, callbacks=()) -> L.Trainer:
    # Clipping as the shipped configs do: on CUDA that is bf16-mixed clipping the fused AdamW (which
    # Lightning's plugin refused until 2026-12-04, unseen by the first GPU run) and, in cpu_offload,
    # the fused AdamW and the norm on CPU-offloaded DTensors of a CUDA mesh.
    return L.Trainer(accelerator=device.type, devices=1, strategy=strategy, max_steps=max_steps,
                     gradient_clip_val=1.0,
                     precision="bf16-mixed" if device.type == "cuda" else "32-true", logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, callbacks=list(callbacks))


def _full(t: torch.Tensor) -> torch.Tensor:
    # A copy: on one rank (and on CPU) full_tensor() / .cpu() may return the parameter's own storage,
    # which the first optimizer step then overwrites.
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


class Record(L.Callback):
    """Weights when training starts (after setup: materialised, sharded), per-step losses and
    times, the peak GPU memory of the steps."""

    def __init__(self, keep_weights: bool = False) -> None:
        self.keep_weights, self.weights, self.losses, self.step_s = keep_weights, {}, [], []
        self.peak_alloc = self.peak_reserved = float("nan")

    def on_train_start(self, trainer, pl_module):
        if self.keep_weights:
            self.weights = {k: _full(v) for k, v in pl_module.state_dict().items()}
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync(pl_module.device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _sync(pl_module.device)
        self.step_s.append(time.perf_counter() - self._t0)
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        if pl_module.device.type == "cuda":
            self.peak_alloc = torch.cuda.max_memory_allocated(pl_module.device) / 1e9
            self.peak_reserved = torch.cuda.max_memory_reserved(pl_module.device) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fit(shape: Shape, device: torch.device, steps: int, module=None, callbacks=(), **strategy_kwargs) -> Record:
    gc.collect()  # earlier sections' trainers and models (reference cycles) off the GPU first
    leftover = 0.0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        leftover = torch.cuda.memory_allocated(device) / 1e9
    L.seed_everything(0, verbose=False)
    module = module or shape.module()
    record = Record(keep_weights=strategy_kwargs.pop("keep_weights", False))
    strategy = strategy_kwargs.pop("strategy", None) or NDParallelStrategy(**strategy_kwargs)
    trainer = _trainer(device, strategy, steps, [record, *callbacks])
    trainer.fit(module, train_dataloaders=shape.loader(module.config.vocab_size, steps, device))
    record.trainer, record.module, record.leftover_gb = trainer, module, leftover
    return record


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    if a.keys() != b.keys():
        raise RuntimeError(f"the two builds have different tensors: {sorted(a.keys() ^ b.keys())[:5]}")
    equal = [k for k in a if torch.equal(a[k], b[k])]
    differ = [k for k in a if k not in equal]
    diff = {k: float((a[k] - b[k]).abs().max()) for k in a}
    # Same distribution even where the draws differ: relative difference of the std per tensor.
    std_gap = {k: abs(float(a[k].std()) - float(b[k].std())) / float(a[k].std())
               for k in a if a[k].numel() >= 1024 and float(a[k].std()) > 0}
    return {"tensors": len(a), "bitwise_equal": len(equal), "all_equal": len(equal) == len(a),
            "max_abs_diff": max(diff.values()), "worst_tensor": max(diff, key=diff.get),
            "first_unequal": differ[0] if differ else None,
            "max_rel_std_gap": max(std_gap.values(), default=0.0)}


def _unsharded_init(shape: Shape, device: torch.device) -> dict[str, torch.Tensor]:
    """The same seed, meta build, materialised whole on ``device`` and initialised by ``init_weights``
    in this process without any strategy: what the sharded initialisation must reproduce."""
    L.seed_everything(0, verbose=False)
    module = shape.module()
    with torch.device("meta"):
        module.configure_model()
    materialize_(module, device=device)
    return {k: _full(v) for k, v in module.state_dict().items()}


def meta_init(shape: Shape, device: torch.device) -> dict[str, Any]:
    meta = _fit(shape, device, 1, empty_init=True, keep_weights=True)
    reference = _unsharded_init(shape, device)
    eager = _fit(shape, device, 1, empty_init=False, keep_weights=True)
    mesh = meta.trainer.strategy.device_mesh
    return {"model": shape.preset, "dtensor_rng_mesh": dtensor_rng_supported(mesh),
            "path": "shard, then each rank draws each full parameter from its own generator and keeps its shard",
            "steps": meta.trainer.strategy.parallelized_steps,
            # Expected bitwise equal: the same init_weights from the same RNG state.
            "vs_unsharded_init": _compare(reference, meta.weights),
            # Expected bitwise equal too: every weight is drawn from a generator of its own
            # (models/param_init.py), whatever the build and the layout.
            "vs_eager_build": _compare(eager.weights, meta.weights),
            "first_loss_eager": eager.losses[0], "first_loss_meta": meta.losses[0]}


def _loss_gap(a: list[float], b: list[float]) -> dict[str, float]:
    gaps = [abs(x - y) for x, y in zip(a, b)]
    return {"max_abs_loss_gap": max(gaps), "mean_abs_loss_gap": sum(gaps) / len(gaps)}


def cpu_offload(shape: Shape, device: torch.device, steps: int) -> dict[str, Any]:
    runs = {offload: _fit(shape, device, steps, cpu_offload=offload) for offload in (False, True)}
    params = runs[True].module.model.parameters()
    placed = sorted({(p.to_local() if isinstance(p, DTensor) else p).device.type for p in params})
    out = {"model": shape.preset, "steps": steps, "offloaded_param_devices": placed}
    for offload, r in runs.items():
        key = "offload" if offload else "no_offload"
        out[key] = {"losses": r.losses, "median_step_s": sorted(r.step_s)[len(r.step_s) // 2],
                    "peak_alloc_gb": r.peak_alloc, "peak_reserved_gb": r.peak_reserved}
    return out | _loss_gap(runs[False].losses, runs[True].losses)


def muon_clip(shape: Shape, device: torch.device, steps: int) -> dict[str, Any]:
    """MuonClip on the device: ``optimizer="muon"`` (ShardedMuon on the 2-D matrices) with
    ``QKClip`` at a tau the model's logits pass, with and without ``cpu_offload`` (the shards in host
    memory, the mesh on the device: the clip multiplies each local shard where it lives). Checks:
    the owner path ran, heads were clipped, the losses are finite, and offload trains as without."""
    from lightning_disttrain.callbacks import QKClip

    class Muon(GPTModule):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, optimizer="muon", **kwargs)

    out: dict[str, Any] = {"model": shape.preset, "steps": steps}
    losses = {}
    for offload in (False, True):
        clip = QKClip(tau=1e-3)  # every head passes it: every step clips every head (the code path)
        r = _fit(shape, device, steps, module=shape.module(Muon), callbacks=[clip], cpu_offload=offload)
        parts = [type(p).__name__ for p in r.trainer.optimizers[0].optimizers]
        key = "offload" if offload else "no_offload"
        max_logit, clipped = clip.last_step()  # the last step's (logged only every log_every_n_steps)
        out[key] = {"optimizers": parts, "losses": r.losses, "max_logit": max_logit, "clipped_heads": clipped,
                    "median_step_s": sorted(r.step_s)[len(r.step_s) // 2]}
        if parts[0] != "ShardedMuon" or not clipped or not all(map(math.isfinite, r.losses)):
            raise RuntimeError(f"muon_clip ({key}): optimizers {parts}, clipped {clipped}, losses {r.losses}")
        losses[offload] = r.losses
    return out | _loss_gap(losses[False], losses[True])


class SaveEvery(L.Callback):
    """Saves at the given steps; times how long ``save_checkpoint`` blocks the loop. Before each
    save it first waits, untimed (``previous_wait_s``), for the previous background write: saves a
    few steps apart would otherwise time the wait for the last write (a save waits for it before it
    stages), which real runs, saving minutes apart, never see."""

    def __init__(self, directory: str, at: tuple[int, ...]) -> None:
        self.directory, self.at, self.block_s, self.wait_s = directory, at, [], float("nan")
        self.previous_wait_s: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.at:
            t0 = time.perf_counter()
            trainer.strategy.wait_for_checkpoint()
            self.previous_wait_s.append(time.perf_counter() - t0)
            _sync(pl_module.device)
            t0 = time.perf_counter()
            trainer.save_checkpoint(os.path.join(self.directory, f"step{trainer.global_step}"))
            self.block_s.append(time.perf_counter() - t0)

    def on_train_end(self, trainer, pl_module):
        t0 = time.perf_counter()
        trainer.strategy.wait_for_checkpoint()  # the last background write still running
        self.wait_s = time.perf_counter() - t0


def async_save(shape: Shape, device: torch.device, steps: int) -> dict[str, Any]:
    from lightning_disttrain.checkpoint.manifest import read_manifest

    at = (2, 4, 6)
    out: dict[str, Any] = {"model": shape.preset, "save_at_steps": list(at)}
    for mode in ("sync", "async"):
        directory = tempfile.mkdtemp(prefix=f"ldt_gpu_{mode}_")
        try:
            saver = SaveEvery(directory, at)
            r = _fit(shape, device, steps, callbacks=[saver], async_save=mode == "async")
            manifests = [read_manifest(os.path.join(directory, f"step{s}")) for s in at]  # raises if absent
            size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in
                       os.walk(os.path.join(directory, f"step{at[-1]}")) for f in files)
            writer = getattr(r.trainer.strategy, "_dcp_writer", None)
            out[mode] = {"block_s": saver.block_s, "previous_write_wait_s": saver.previous_wait_s,
                         "final_wait_s": saver.wait_s, "checkpoint_gb": size / 1e9,
                         "manifests": len(manifests), "median_step_s": sorted(r.step_s)[len(r.step_s) // 2],
                         "stager": type(getattr(writer, "_stager", None)).__name__}
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    # The first async save allocates its pinned buffers; the later ones reuse them.
    out["stall_ratio_async_over_sync"] = (min(out["async"]["block_s"][1:] or out["async"]["block_s"])
                                          / min(out["sync"]["block_s"]))
    return out


class EagerGPTModule(GPTModule):
    """Builds its GPT with real weights in ``__init__`` (on the host), as many existing projects do."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.configure_model()


class CheckBroadcast(L.Callback):
    """On the initialised process group: ``broadcast_module_`` of a host module with the
    collective device the strategy would use (NCCL: the GPU, staged one tensor at a time)."""

    def __init__(self, shape: Shape) -> None:
        self.shape, self.result = shape, {}

    def on_train_start(self, trainer, pl_module):
        torch.manual_seed(7)
        host = self.shape.module(EagerGPTModule)
        before = {k: v.clone() for k, v in host.state_dict().items()}
        backend = dist.get_backend()
        device = comm.group_device()  # where comm stages each host tensor for this group's backend
        broadcast_module_(host, group_src=0)
        after = host.state_dict()
        self.result = {"backend": backend, "staging_device": str(device),
                       "unchanged_after_1_rank_broadcast": all(torch.equal(before[k], after[k]) for k in before),
                       "host_tensors_stay_on": sorted({v.device.type for v in after.values()})}


def init_broadcast(shape: Shape, device: torch.device) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = shape.module(EagerGPTModule)
    built = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    check = CheckBroadcast(shape)
    r = _fit(shape, device, 1, module=module, callbacks=[check], strategy="fsdp2", keep_weights=True)
    return {"model": shape.preset, "strategy": type(r.trainer.strategy).__name__, "built_on": "cpu (in __init__)",
            "world_size": r.trainer.world_size, **_compare(built, r.weights), "direct_broadcast": check.result}


def plan_figure(shape: Shape, device: torch.device) -> tuple[list[str], dict[str, Any]]:
    """``lightning-disttrain plan --json`` for this run's layout, run in this process."""
    from lightning_disttrain.planning.command import plan_main

    gpu = ["--gpu", "H200"] if device.type == "cuda" else ["--gpu", "cpu", "--gpu-memory", "16"]
    argv = ["--model", shape.preset, *gpu, "--gpus-per-node", "1", "--nodes", "1", "--seq-len", str(shape.seq),
            "--global-batch", str(shape.batch), "--micro-batch", str(shape.batch),
            "--precision", "bf16" if device.type == "cuda" else "fp32", "--json"]
    if shape.vocab:
        argv += ["--override", f"vocab_size={shape.vocab}"]
    for field, value in shape.overrides.items():
        argv += ["--override", f"{field}={value}"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        plan_main(argv)
    layouts = [x for x in json.loads(buf.getvalue())["layouts"] if x["zero"] == 3 and x["ac"] == "none"]
    if len(layouts) != 1:
        raise RuntimeError(f"plan gave {len(layouts)} FSDP2 layouts without AC for one GPU; expected one")
    return argv, layouts[0]


class MemoryPhases(L.Callback):
    """GPU memory per phase of each step after the first (when the optimizer state exists), so that
    the plan's terms can be checked one by one: ``state`` allocated when the batch starts
    (parameters, gradients and optimizer state: Lightning zeroes the gradients inside the next
    step's closure, so the last step's are still held), ``forward`` allocated when backward starts
    minus ``state`` (what the forward keeps for backward, the loss's included, less the gradients
    Lightning's ``zero_grad`` frees after the forward: ``before_zero_grad`` is the level before
    that), ``grads`` allocated
    after backward minus ``state`` (~0 once the gradients exist: backward refills them),
    ``peak_forward`` / ``peak_step`` the allocator's peak within the forward / the whole step minus
    ``state``. CUDA only (read from the caching allocator); GB."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        # The run's peaks before each reset, so that the whole run's peak (what Record reads at the
        # end, since its own reset) survives the per-step resets.
        self.peak_alloc = self.peak_reserved = 0.0

    @staticmethod
    def _now(device) -> tuple[float, float]:
        return torch.cuda.memory_allocated(device) / 1e9, torch.cuda.max_memory_allocated(device) / 1e9

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.device.type == "cuda" and trainer.global_step >= 1:
            torch.cuda.synchronize(pl_module.device)
            self.peak_alloc = max(self.peak_alloc, torch.cuda.max_memory_allocated(pl_module.device) / 1e9)
            self.peak_reserved = max(self.peak_reserved, torch.cuda.max_memory_reserved(pl_module.device) / 1e9)
            torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._row = {"state": self._now(pl_module.device)[0]}
        else:
            self._row = None

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        if self._row is not None:  # the forward is done, the last step's gradients still held
            self._row["before_zero_grad"] = self._now(pl_module.device)[0] - self._row["state"]

    def on_before_backward(self, trainer, pl_module, loss):
        if self._row is not None:
            alloc, peak = self._now(pl_module.device)
            self._row |= {"forward": alloc - self._row["state"], "peak_forward": peak - self._row["state"]}

    def on_after_backward(self, trainer, pl_module):
        if self._row is not None:
            self._row["grads"] = self._now(pl_module.device)[0] - self._row["state"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._row is not None:
            torch.cuda.synchronize(pl_module.device)
            self._row["peak_step"] = self._now(pl_module.device)[1] - self._row["state"]
            self.rows.append(self._row)


def plan_memory(shape: Shape, device: torch.device, steps: int, compiled: bool = False) -> dict[str, Any]:
    """``compiled``: the strategy's ``compile`` option on (the blocks and the loss, Inductor; on CPU
    the eager backend), whose loss keeps less than the plan's 12 B per logit."""
    from lightning_disttrain.planning.memory import GPU_RESERVED

    argv, layout = plan_figure(shape, device)
    phases = MemoryPhases()
    strategy = NDParallelStrategy(compile={"dynamic": False} if device.type == "cuda" else {"backend": "eager"}) \
        if compiled else "fsdp2"
    r = _fit(shape, device, steps, strategy=strategy, callbacks=[phases])
    if device.type == "cuda":  # the whole run's peaks: before the per-step resets, and after the last
        r.peak_alloc, r.peak_reserved = max(r.peak_alloc, phases.peak_alloc), max(r.peak_reserved, phases.peak_reserved)
    plan_gb = layout["memory_gb"]
    out = {"model": shape.preset, "overrides": shape.overrides, "compiled": compiled, "seq": shape.seq, "micro_batch": shape.batch, "steps": steps,
           "plan_command": "lightning-disttrain plan " + " ".join(argv), "plan_layout": layout["name"],
           "plan_gb": plan_gb, "measured_peak_alloc_gb": r.peak_alloc, "measured_peak_reserved_gb": r.peak_reserved,
           # held by earlier sections when the build started: ~0 expected. Not subtracted below: it
           # may be freed before the steps (run 5 had 0.069 GB and the same raw figures as run 6).
           "allocated_before_build_gb": r.leftover_gb}
    if device.type == "cuda":
        # The plan's total counts the CUDA context and library workspaces (GPU_RESERVED), which the
        # caching allocator never sees: compare the allocator's peak with the rest.
        allocator_part = plan_gb["total"] - GPU_RESERVED / 1e9
        out |= {"plan_allocator_part_gb": allocator_part,
                "measured_over_plan": r.peak_alloc / allocator_part,
                "reserved_over_plan": r.peak_reserved / allocator_part,
                "phases_gb": phases.rows}
        if phases.rows:
            last = phases.rows[-1]
            # Term by term (the last step): the plan's state (parameters + gradients + optimizer)
            # against what is held when a step starts; its activations + logits + buffers (without
            # the CUDA allowance, which the allocator never sees) against the step's peak above that.
            out["terms_gb"] = {
                "state": {"plan": plan_gb["state"], "measured": last["state"]},
                "step_peak_above_state": {
                    "plan": plan_gb["activations"] + plan_gb["logits"] + plan_gb["buffers"] - GPU_RESERVED / 1e9,
                    "measured": last["peak_step"]},
                "kept_by_forward": {"measured": last["forward"]}}
    else:
        out["measured"] = "not on CPU: no caching allocator to read (plan figure only)"
    return out


class KeptByForward(L.Callback):
    """When the second step's backward starts: the allocator's live blocks, with the Python stack
    that allocated each (``torch.cuda.memory._record_memory_history``), summed by where in this
    package (and in torch) they were made: what the forward keeps for backward, by source line."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.allocated = 0

    def on_before_backward(self, trainer, pl_module, loss):
        if pl_module.device.type == "cuda" and trainer.global_step == 1 and not self.blocks:
            torch.cuda.synchronize(pl_module.device)
            self.allocated = torch.cuda.memory_allocated(pl_module.device)
            snapshot = torch.cuda.memory._snapshot()
            self.blocks = [{"size": b["size"], "frames": b.get("frames", [])} for seg in snapshot["segments"]
                           for b in seg["blocks"] if b["state"] == "active_allocated"]


def _where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in this package and the innermost in torch's Python, as one key."""
    def first(part: str) -> str:
        for f in frames:
            if part in f.get("filename", ""):
                return f"{f['filename'].rsplit(part, 1)[1]}:{f.get('line')} {f.get('name')}"
        return "-"
    return f"{first('lightning_disttrain/')} | {first('/torch/')}"


def memory_attribution(shape: Shape, device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"model": shape.preset, "measured": "not on CPU: needs the CUDA caching allocator's history"}
    kept = KeptByForward()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        _fit(shape, device, 2, strategy="fsdp2", callbacks=[kept])
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    groups: dict[str, list] = {}
    for b in kept.blocks:
        g = groups.setdefault(_where(b["frames"]), [0, 0, b])
        g[0] += b["size"]
        g[1] += 1

    def stack(block) -> list[str]:  # a short stack of the group's first block, in the snapshot's order
        return [f"{f['filename'].rsplit('/', 2)[-2:][-1]}:{f.get('line')} {f.get('name')}" for f in block["frames"]
                if "lightning_disttrain/" in f.get("filename", "") or "/torch/" in f.get("filename", "")][:14]
    top = sorted(groups.items(), key=lambda kv: -kv[1][0])[:40]
    return {"model": shape.preset, "overrides": shape.overrides, "seq": shape.seq, "micro_batch": shape.batch,
            "allocated_gb": kept.allocated / 1e9, "live_blocks": len(kept.blocks),
            "live_gb": sum(b["size"] for b in kept.blocks) / 1e9,
            "by_source": [{"where": k, "gb": v[0] / 1e9, "blocks": v[1], "stack": stack(v[2])} for k, v in top]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes: checks the code paths")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_paths.json (default $OUT)")
    p.add_argument("--sections", nargs="+", default=list(SECTIONS))
    args = p.parse_args(argv)
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device; run with --smoke to check the code paths on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    shape, steps = Shape(args.smoke), 3 if args.smoke else 8
    report = SectionReport("gpu_paths.json", args.out, device, args.smoke, deadline_from_env())
    print(f"# gpu_paths {report.data['date']}  device {report.data['device']}  torch {torch.__version__}", flush=True)
    calls = {"sac": lambda: gpu_sac.measure(device, args.smoke),
             "sac_compiled": lambda: gpu_sac.measure(device, args.smoke, compiled=True),
             "meta_init": lambda: meta_init(shape, device),
             "cpu_offload": lambda: cpu_offload(shape, device, 5 if not args.smoke else 2),
             "async_save": lambda: async_save(shape, device, max(steps, 7)),
             "init_broadcast": lambda: init_broadcast(shape, device),
             "plan_memory": lambda: plan_memory(shape, device, 4 if not args.smoke else 2),
             "plan_memory_llama": lambda: plan_memory(Shape.llama(args.smoke), device, 4 if not args.smoke else 2),
             "plan_memory_llama_compiled": lambda: plan_memory(Shape.llama(args.smoke), device,
                                                               4 if not args.smoke else 2, compiled=True),
             "memory_attribution": lambda: memory_attribution(shape, device),
             "memory_attribution_llama": lambda: memory_attribution(Shape.llama(args.smoke), device),
             "ring_attention": lambda: gpu_ring.measure(device, args.smoke),
             "muon_clip": lambda: muon_clip(shape, device, 4 if not args.smoke else 3)}
    for name, estimate_s in SECTIONS.items():
        if name in args.sections:
            result = report.run(name, estimate_s, calls[name])
            if result is not None and not name.startswith("sac"):
                print("#   " + json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))},
                                          default=str)[:600], flush=True)
    if report.data["errors"]:
        print(f"# errors in: {', '.join(report.data['errors'])}")
    return report.data


SECTIONS = {"sac": 30, "sac_compiled": 60, "meta_init": 20, "cpu_offload": 35, "async_save": 35, "init_broadcast": 15, "plan_memory": 25,
            "plan_memory_llama": 30, "plan_memory_llama_compiled": 45, "memory_attribution": 30, "memory_attribution_llama": 30, "ring_attention": 40,
            "muon_clip": 40}
"""Section -> estimated seconds on one H200 (the time budget skips a section that would not fit)."""


if __name__ == "__main__":
    raise SystemExit(1 if main()["errors"] else 0)  # the sections' errors are in the report and printed
