"""Every multi-rank layout on real GPUs (NCCL), each against a one-GPU run of the same model, seed
and data: what ``gpu.sh`` runs when the machine has 2 or more GPUs. Writes ``gpu_layouts.json``.

Layouts (``LAYOUTS``, most important first; GPUs needed in brackets):

- ``tp_setup`` [2]: ``tp=2`` with the model's real weights built on every rank (no ``empty_init``)
  and gradient clipping. This setup crashed on NCCL (the TP group's RNG state, a CPU tensor, was
  broadcast over NCCL): first of all a *no crash* check.
- ``offload_clip`` [2]: FSDP2 ``dp_shard=2`` with ``cpu_offload=True``, ``empty_init`` and gradient
  clipping. Crashed on NCCL too (gradient norms of offloaded, CPU-resident gradients all-reduced
  over NCCL): a no-crash check, plus every parameter's local shard must live on the CPU.
- ``tp`` [2]: ``tp=2`` with sequence parallel and loss parallel.
- ``pp`` [2]: ``pp=2``, schedule 1F1B, 4 micro-batches.
- ``ep`` [2]: a small MoE (4 experts, top-2, 1 shared expert), ``ep=2`` (over FSDP's 2 ranks).
- ``hsdp`` [4]: ``dp_replicate=2 x dp_shard=2``.
- ``float8_tp`` [2]: ``tp=2`` with the ``Float8Training`` callback (tensorwise), against the
  one-GPU run with the same callback.
- ``async_tp`` [2, CUDA only]: ``tp=2, async_tp=True, compile=True``; also counts the fused
  symmetric-memory collective-matmul ops that ran in one step (must be > 0, or async TP did nothing).
- ``cp`` [2]: context parallel ``cp=2``: on CUDA its attention takes SDPA's lower-right
  ``CausalBias`` path (the CPU materialises the mask; docs/benchmarks.md section 17).

Every layout except ``tp_setup`` builds under ``empty_init=True``. Checks per layout (each can fail;
``gpu_layouts.json`` holds every figure, pass or not):

1. no crash: the launch ran the layout to the end on every rank;
2. loss parity: the per-step losses (6 steps, global batch 8, each data-parallel rank's mean
   all-reduced) against the one-GPU run, max |dloss| <= ``FP32_TOL`` (fp32: TF32 off, so the only
   differences are reduction orders: split matmuls, all-reduces, micro-batch means) or
   ``FLOAT8_TOL`` (float8: a last-bit difference in an input can move a value to the next float8
   step). Not bitwise: the layouts change which kernels run and in which order they sum;
3. initial weights: every parameter gathered whole at ``on_train_start`` (before the first
   step), by name, against the one-GPU eager build (``empty_init=False``). Expected bitwise equal
   (issue 22: ``empty_init`` and the layout must not change the initialisation); reported as the
   number of bitwise-equal tensors and the max difference, so a mismatch shows by how much;
4. the layout really applied (a DTensor parameter over a ``tp`` / ``ep`` mesh, a 2x2 HSDP mesh,
   the blocks split between the stages, parameters offloaded, float8 linears, fused ops).

The one-GPU references run in a separate process (``--reference``) with ``strategy="auto"``
(plain Lightning, none of this package's strategy code); the dense one runs twice: the two runs
must be bitwise equal, which shows the settings make CUDA deterministic: TF32 off
(``torch.backends.cuda.matmul.allow_tf32 = False``, ``torch.backends.cudnn.allow_tf32 = False``,
float32 matmul precision "highest"), ``torch.use_deterministic_algorithms(True, warn_only=True)``
with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, and attention through the math SDPA backend (the
memory-efficient kernel's backward is not deterministic). Every layout runs with the same settings.

How it runs: one launch ``torchrun --standalone --nproc-per-node N gpu_layouts.py --worker L1 L2 ...``
per GPU count (the layouts of one size run one after another in the same processes, paying
Python's, Lightning's and NCCL's start-up once), on disjoint GPUs (``CUDA_VISIBLE_DEVICES``) at the
same time as the reference and the other size's launch when the machine has enough GPUs. A layout
that fails ends its launch (its ranks may be stuck in a collective); the layouts after it run in a
fresh launch. Layouts needing more GPUs than the machine has print ``skipped: <layout> needs N
GPUs (have M)``. With ``LDT_GPU_DEADLINE`` (gpu.sh) or ``--budget``, what no longer fits is skipped
and named; a launch still running at the deadline is killed.

    python benchmarks/gpu_layouts.py                    # on the GPU machine (gpu.sh does this)
    python benchmarks/gpu_layouts.py --dry-run          # the plan and commands, nothing trained
    python benchmarks/gpu_layouts.py --smoke            # CPU, gloo, 2 processes per launch
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic GEMMs

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from lightning_disttrain.module import GPTModule  # noqa: E402
from lightning_disttrain.strategies import NDParallelStrategy  # noqa: E402

try:  # run as a script (benchmarks/ on sys.path) or as benchmarks.gpu_layouts
    from gpu_report import SectionReport, deadline_from_env
except ImportError:
    from benchmarks.gpu_report import SectionReport, deadline_from_env

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
GLOBAL_BATCH = 8
SEQ = 32
VOCAB = 128
CLIP = 0.3
FP32_TOL = 1e-4
"""Max |dloss| over the steps, fp32 with TF32 off. On CPU the suite's layouts agree within 1e-6
(docs/benchmarks.md, issue 22); CUDA's split-K GEMMs and NCCL's sums reorder more: 100x margin."""
FLOAT8_TOL = 5e-3
"""float8 (tensorwise): the CPU suite measured 2.2e-4 (emulated) and allows 1e-3; real float8 GEMMs
accumulate in their own order, so a wider bound. Not measured on a GPU yet."""
DENSE = dict(n_layer=4, n_embd=64, n_head=4, n_kv_head=2, mlp_hidden=256, block_size=SEQ, tie_embeddings=False)
MOE = dict(DENSE, n_layer=2, mlp="swiglu", mlp_hidden=128, moe_num_experts=4, moe_top_k=2, moe_shared_experts=1,
           moe_hidden=64, moe_bias_update_speed=0.01)
MODELS = {"dense": (DENSE, ()), "moe": (MOE, ()), "float8": (DENSE, ("float8",))}
"""Reference key -> (GPTConfig overrides of the ``tiny`` preset, callbacks)."""
FUSED_OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter", "fused_all_gather_scaled_matmul",
             "fused_scaled_matmul_reduce_scatter")
"""Names of the symmetric-memory ops async TP puts in the compiled graph (``torch.ops.symm_mem``)."""
STARTUP_S = 30
"""Estimated start-up of one launch on the GPU machine: torchrun, imports on every rank, NCCL."""
SMOKE_FACTOR = 4
"""The estimates are for an H200; on CPU (--smoke) each takes about this many times longer."""
GRACE_S = 15


@dataclasses.dataclass(frozen=True)
class Layout:
    nproc: int
    strategy: dict[str, Any]
    what: str
    model: str = "dense"
    empty_init: bool = True
    cuda_only: bool = False
    estimate_s: float = 8.0
    loss_tol: float = FP32_TOL
    facts_check: str = ""
    """Name of the check in ``FACT_CHECKS`` that shows the layout was applied."""


LAYOUTS: dict[str, Layout] = {
    "tp_setup": Layout(2, dict(tp=2), "tp=2, real weights built on every rank, clipping: no crash on NCCL",
                       empty_init=False, facts_check="tp"),
    "offload_clip": Layout(2, dict(dp_shard=2, cpu_offload=True), "FSDP2 dp_shard=2 + cpu_offload + clipping: "
                           "no crash on NCCL", facts_check="offload"),
    "tp": Layout(2, dict(tp=2, sequence_parallel=True, loss_parallel=True), "tp=2, sequence + loss parallel",
                 facts_check="tp"),
    "pp": Layout(2, dict(pp=2, pp_schedule="1F1B", pp_microbatches=4), "pp=2, 1F1B, 4 micro-batches",
                 facts_check="pp"),
    "ep": Layout(2, dict(ep=2), "MoE (4 experts, top-2), ep=2", model="moe", facts_check="ep"),
    "hsdp": Layout(4, dict(dp_replicate=2, dp_shard=2), "HSDP dp_replicate=2 x dp_shard=2", facts_check="hsdp"),
    "float8_tp": Layout(2, dict(tp=2), "tp=2 + Float8Training (tensorwise)", model="float8", estimate_s=12,
                        loss_tol=FLOAT8_TOL, facts_check="float8"),
    "async_tp": Layout(2, dict(tp=2, async_tp=True, compile=True), "tp=2, async TP, per-block compile",
                       cuda_only=True, estimate_s=75, facts_check="async_tp"),
    "cp": Layout(2, dict(cp=2), "context parallel cp=2", facts_check="cp"),
}


# ---- the model, its data, what a run records ------------------------------------------------------


class ParityGPT(GPTModule):
    """GPTModule recording the loss of every step; reads the same global batch whatever the layout
    (micro-batch = global batch / data-parallel ranks, the strategy's sampler, no shuffling)."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        super().__init__("tiny", vocab_size=VOCAB, model_overrides=overrides, lr=3e-3, weight_decay=0.1,
                         schedule="constant", warmup_steps=0)
        self.recorded: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.recorded.append(loss.detach().float().reshape(()).clone())
        return loss

    def pipeline_training_step(self, batch, batch_idx, loss, **kwargs):
        # kwargs: ``aux_loss`` (MoE under PP) where the strategy passes it; recorded as
        # training_step's loss is: the whole objective.
        out = super().pipeline_training_step(batch, batch_idx, loss, **kwargs)
        total = loss + kwargs["aux_loss"] if kwargs.get("aux_loss") is not None else loss
        self.recorded.append(torch.as_tensor(total).detach().float().reshape(()).clone())
        return out

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1234)
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ + 1), generator=g)
        ds = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
        sampler = DistributedSampler(ds, shuffle=False, **kwargs) if kwargs else None
        replicas = kwargs["num_replicas"] if kwargs else 1
        return DataLoader(ds, batch_size=GLOBAL_BATCH // replicas, sampler=sampler, shuffle=False)


def _fqn(name: str) -> str:
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU. Collective for DTensors (every rank holding the parameter calls
    it in the same order). An offloaded shard lives on the CPU while its mesh is NCCL's: it goes to
    the mesh's device first (the gather here must not itself put CPU tensors into NCCL)."""
    p = p.detach()
    if isinstance(p, DTensor):
        local, mesh = p.to_local(), p.device_mesh
        if local.device.type != mesh.device_type:
            device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else mesh.device_type
            p = DTensor.from_local(local.to(device), mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride())
        p = p.full_tensor()
    return p.cpu().clone()


def _mesh_str(mesh) -> str:
    return ",".join(mesh.mesh_dim_names or ()) + "=" + "x".join(map(str, mesh.shape))


class Probe(L.Callback):
    """Initial weights gathered whole (``on_train_start``), layout facts, and optionally the ops
    whose names contain one of ``count_ops`` during training step 2 (CPU profiler: op names)."""

    def __init__(self, count_ops: tuple[str, ...] = ()) -> None:
        self.count_ops, self.init, self.facts, self._prof = count_ops, {}, {}, None

    def on_train_start(self, trainer, pl_module):
        net = pl_module.model
        self.init = {_fqn(n): _full(p) for n, p in net.named_parameters()}
        meshes, local_devices = set(), set()
        for p in net.parameters():
            if isinstance(p, DTensor):
                meshes.add(_mesh_str(p.device_mesh))
                local_devices.add(p.to_local().device.type)
            else:
                local_devices.add(p.device.type)
        dims = getattr(trainer.strategy, "parallel_dims", None)
        self.facts = {
            "param_meshes": sorted(meshes), "param_local_devices": sorted(local_devices),
            "blocks_here": len(net.blocks), "n_layer": pl_module.config.n_layer,
            "float8_linears": sum(type(m).__name__ == "Float8Linear" for m in net.modules()),
            "degrees": dict(dims.degrees) if dims is not None else None,
            "parallelized_steps": list(getattr(trainer.strategy, "parallelized_steps", []) or []),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "deterministic": torch.are_deterministic_algorithms_enabled(),
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.count_ops and batch_idx == 2:
            try:
                self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self._prof.__enter__()
            except Exception as e:  # noqa: BLE001  (the check below fails with this message)
                self.facts["op_count_error"] = f"{type(e).__name__}: {e}"
                self._prof = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        try:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            prof.__exit__(None, None, None)
            counts: dict[str, int] = {}
            for event in prof.events():
                for pattern in self.count_ops:
                    if pattern in event.name:
                        counts[event.name] = counts.get(event.name, 0) + 1
            self.facts["op_counts"] = counts
        except Exception as e:  # noqa: BLE001
            self.facts["op_count_error"] = f"{type(e).__name__}: {e}"


def deterministic_settings() -> None:
    """TF32 off and deterministic algorithms: the one-GPU reference repeats bitwise, and a layout
    differs from it only by what the layout changes."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)


def _callbacks(names: tuple[str, ...]) -> list[L.Callback]:
    from lightning_disttrain.callbacks import Float8Training

    return [Float8Training(recipe="tensorwise") for n in names if n == "float8"]


def fit(model_key: str, strategy, *, accelerator: str, devices: int, count_ops: tuple[str, ...] = ()
        ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One ``trainer.fit`` of ``STEPS`` steps; returns (per-step losses and facts, initial weights)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    os.environ.pop("PL_GLOBAL_SEED", None)  # an earlier run's seed must not re-seed this one's setup
    deterministic_settings()
    overrides, callback_names = MODELS[model_key]
    L.seed_everything(0, verbose=False)
    module = ParityGPT(overrides)
    probe = Probe(count_ops)
    trainer = L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=STEPS,
                        precision="32-true", gradient_clip_val=CLIP, callbacks=[probe, *_callbacks(callback_names)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    t0 = time.perf_counter()
    with sdpa_kernel(SDPBackend.MATH):
        trainer.fit(module)
    wall = time.perf_counter() - t0
    losses = torch.stack(module.recorded).to(trainer.strategy.root_device)
    if dist.is_initialized():  # each data-parallel replica's own batch: their mean, as one process sees it
        group = getattr(trainer.strategy, "dp_process_group", None)
        dist.all_reduce(losses, group=group)
        losses /= dist.get_world_size(group)
    result = {"losses": losses.tolist(), "fit_s": wall, "global_step": trainer.global_step,
              "rank": dist.get_rank() if dist.is_initialized() else 0, **probe.facts}
    return result, probe.init


# ---- the processes: reference (one device) and worker (one rank of a torchrun launch) -----------


def _paths(work: Path, name: str, rank: int) -> tuple[Path, Path]:
    return work / f"{name}.rank{rank}.json", work / f"{name}.init.rank{rank}.pt"


def _write(work: Path, name: str, rank: int, result: dict[str, Any], init: dict[str, torch.Tensor]) -> None:
    js, pt = _paths(work, name, rank)
    torch.save(init, pt)
    tmp = js.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    os.replace(tmp, js)  # the JSON last: its presence means the run is complete


def reference_main(keys: list[str], work: Path, smoke: bool) -> None:
    accelerator = "cpu" if smoke else "cuda"
    for key in keys:
        result, init = fit(key, "auto", accelerator=accelerator, devices=1)
        if key == "dense":  # the determinism control: the same run again
            again, init_again = fit(key, "auto", accelerator=accelerator, devices=1)
            result["repeat"] = {"losses": again["losses"], "bitwise": again["losses"] == result["losses"],
                                "max_abs_diff": max(abs(a - b) for a, b in zip(again["losses"], result["losses"])),
                                "init_bitwise": all(torch.equal(init[k], init_again[k]) for k in init)}
        _write(work, f"ref.{key}", 0, result, init)
        print(f"# reference {key}: losses {[round(x, 5) for x in result['losses']]}", flush=True)


def _agree(flag: bool, device: torch.device) -> bool:
    """True only if every rank says True (all ranks must take the same branch)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def worker_main(names: list[str], work: Path, smoke: bool, deadline: float | None) -> None:
    import faulthandler

    faulthandler.enable()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu") if smoke else torch.device("cuda", local_rank)
    for name in names:
        spec = LAYOUTS[name]
        if spec.nproc != world:
            raise SystemExit(f"{name} needs {spec.nproc} ranks; this launch has {world}")
        estimate = spec.estimate_s * (SMOKE_FACTOR if smoke else 1)
        fits = deadline is None or time.time() + estimate <= deadline
        if not _agree(fits, device):  # the first layout: the launcher checked it fits
            if rank == 0:
                (work / f"{name}.SKIPPED").write_text(
                    f"time budget: {deadline - time.time():.0f} s left, estimated {estimate:.0f} s")
            continue
        if rank == 0:
            (work / f"{name}.STARTED").write_text(str(time.time()))
        try:
            strategy = NDParallelStrategy(**spec.strategy, empty_init=spec.empty_init, timeout=timedelta(seconds=120))
            result, init = fit(spec.model, strategy, accelerator="cpu" if smoke else "cuda", devices=world,
                               count_ops=FUSED_OPS if name == "async_tp" else ())
        except BaseException:
            (work / f"{name}.FAILED.rank{rank}.txt").write_text(traceback.format_exc())
            raise  # ends this launch: another rank may be stuck in a collective; the launcher goes on
        _write(work, name, rank, result, init)
        if rank == 0:
            print(f"# {name}: ran on {world} ranks in {result['fit_s']:.1f} s", flush=True)


# ---- checks ---------------------------------------------------------------------------------------


def compare_losses(got: list[float], ref: list[float], tol: float) -> dict[str, Any]:
    if len(got) != len(ref) or not got:
        return {"expect": f"{len(ref)} steps, max |dloss| <= {tol:g}", "ok": False,
                "detail": f"{len(got)} losses against {len(ref)}"}
    diffs = [abs(a - b) for a, b in zip(got, ref)]
    return {"expect": f"max |dloss| <= {tol:g} (not bitwise: the layout reorders sums)", "ok": max(diffs) <= tol,
            "max_abs_diff": max(diffs), "bitwise": got == ref, "per_step": diffs}


def compare_init(inits: list[dict[str, torch.Tensor]], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Merge the ranks' gathered weights by name (ranks holding the same parameter must agree) and
    compare with the reference build."""
    merged: dict[str, torch.Tensor] = {}
    disagree = []
    for init in inits:
        for k, v in init.items():
            if k not in merged:
                merged[k] = v
            elif not torch.equal(merged[k], v):
                disagree.append(k)
    missing, extra = sorted(ref.keys() - merged.keys()), sorted(merged.keys() - ref.keys())
    diffs: dict[str, float] = {}
    for k in sorted(ref.keys() & merged.keys()):
        a, b = merged[k].float(), ref[k].float()
        diffs[k] = float((a - b).abs().max()) if a.shape == b.shape else float("inf")
    equal = [k for k in diffs if diffs[k] == 0.0 and torch.equal(merged[k], ref[k])]
    worst = max(diffs, key=diffs.get) if diffs else None
    return {"expect": "bitwise equal to the one-GPU eager build, tensor by tensor (issue 22)",
            "ok": len(equal) == len(ref) and not missing and not extra and not disagree,
            "tensors": len(ref), "bitwise_equal": len(equal), "max_abs_diff": diffs[worst] if worst else None,
            "worst_tensor": worst, "first_unequal": next((k for k in diffs if k not in equal), None),
            "missing": missing[:5], "extra": extra[:5], "ranks_disagree": sorted(set(disagree))[:5]}


def _has_mesh(facts: list[dict], name: str, size: int) -> bool:
    for f in facts:
        found = False
        for m in f.get("param_meshes", []):
            names, shape = m.split("=")
            for n, s in zip(names.split(","), shape.split("x")):
                found |= n == name and int(s) == size
        if not found:
            return False
    return bool(facts)


def _fact_check(kind: str, facts: list[dict]) -> tuple[bool, str]:
    if kind == "tp":
        return _has_mesh(facts, "tp", 2), "every rank holds DTensor parameters over a tp mesh of 2"
    if kind == "offload":
        ok = bool(facts) and all(f["param_local_devices"] == ["cpu"] for f in facts) and all(
            any(m.split("=")[1] == "2" for m in f["param_meshes"]) for f in facts)
        return ok, "every parameter's local shard on the CPU, sharded over a mesh of 2"
    if kind == "pp":
        n = facts[0]["n_layer"] if facts else 0
        ok = bool(facts) and all(0 < f["blocks_here"] < n for f in facts) and sum(f["blocks_here"] for f in facts) == n
        return ok, "each stage holds part of the blocks, together all of them"
    if kind == "ep":
        return _has_mesh(facts, "ep", 2), "every rank holds expert weights over an ep mesh of 2"
    if kind == "hsdp":
        ok = bool(facts) and all(any(m.split("=")[1] == "2x2" for m in f["param_meshes"]) for f in facts)
        return ok, "parameters over a 2x2 (replicate, shard) mesh"
    if kind == "float8":
        return bool(facts) and all(f["float8_linears"] > 0 for f in facts), "Float8Linear modules on every rank"
    if kind == "async_tp":
        ok = bool(facts) and all(sum(f.get("op_counts", {}).values()) > 0 for f in facts)
        errors = [f["op_count_error"] for f in facts if "op_count_error" in f]
        return ok, "fused symmetric-memory collective matmuls ran in step 2 on every rank" + (
            f" (profiler: {errors[0]})" if errors else "")
    if kind == "cp":
        ok = bool(facts) and all(any(s.startswith("context_parallel: cp=2") for s in f["parallelized_steps"])
                                 for f in facts) and (_has_mesh(facts, "dp_shard_cp", 2) or _has_mesh(facts, "cp", 2))
        # With dp_shard == 1 the shard mesh is the world's own 1-D "cp" dimension (ParallelDims builds
        # no flattened copy over the same ranks), so either name is the same sharding.
        return ok, "context parallel cp=2 applied on every rank, parameters sharded over dp_shard x cp (2)"
    raise ValueError(kind)


def evaluate(name: str, ranks: list[dict], inits: list[dict], ref: dict | None, ref_init: dict | None
             ) -> dict[str, Any]:
    spec = LAYOUTS[name]
    checks: dict[str, Any] = {"no_crash": {"expect": "the layout ran to the end on every rank", "ok": True}}
    ok, what = _fact_check(spec.facts_check, ranks)
    checks["layout_applied"] = {"expect": what, "ok": ok}
    settings_ok = all(f["float32_matmul_precision"] == "highest" and not f["cuda_matmul_allow_tf32"] for f in ranks)
    checks["fp32_no_tf32"] = {"expect": "TF32 off during the run (parity is fp32)", "ok": settings_ok}
    if ref is None or ref_init is None:
        checks["loss_parity"] = {"expect": "a one-GPU reference", "ok": False, "detail": "the reference did not run"}
    else:
        checks["loss_parity"] = compare_losses(ranks[0]["losses"], ref["losses"], spec.loss_tol)
        checks["init_equal_eager"] = compare_init(inits, ref_init)
    return {"what": spec.what, "nproc": spec.nproc, "strategy": spec.strategy, "empty_init": spec.empty_init,
            "checks": checks, "ok": all(c["ok"] for c in checks.values()), "losses": ranks[0]["losses"],
            "reference_losses": ref["losses"] if ref else None, "fit_s": max(r["fit_s"] for r in ranks),
            "facts_rank0": {k: v for k, v in ranks[0].items() if k not in ("losses", "rank")}}


# ---- the launcher ---------------------------------------------------------------------------------


def plan(gpus: int, smoke: bool, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """(layouts to run, {layout: why skipped}) for a machine with ``gpus`` GPUs (CPU ranks in smoke)."""
    run, skipped = [], {}
    for name in names:
        spec = LAYOUTS[name]
        try:  # also what the dry run checks: every layout's arguments against the strategy's signature
            NDParallelStrategy(**spec.strategy, empty_init=spec.empty_init)
        except ValueError as e:
            skipped[name] = f"not available in this package: {e}"
            continue
        if spec.cuda_only and smoke:
            skipped[name] = "needs CUDA GPUs (this is the CPU smoke run)"
        elif spec.nproc > gpus:
            skipped[name] = f"needs {spec.nproc} GPUs (have {gpus})"
        else:
            run.append(name)
    return run, skipped


@dataclasses.dataclass
class Job:
    kind: str  # "reference" or "layouts"
    names: list[str]
    nproc: int
    attempt: int = 0
    proc: subprocess.Popen | None = None
    gpus: list[str] = dataclasses.field(default_factory=list)
    log: Path | None = None
    started: float = 0.0

    def estimate(self, smoke: bool) -> float:
        first = 5.0 if self.kind == "reference" else LAYOUTS[self.names[0]].estimate_s
        return (STARTUP_S + first) * (SMOKE_FACTOR if smoke else 1)


def command(job: Job, work: Path, smoke: bool, deadline: float | None) -> list[str]:
    script = str(Path(__file__).resolve())
    tail = ["--work", str(work)] + (["--smoke"] if smoke else []) + (
        ["--deadline", f"{deadline:.0f}"] if deadline else [])
    if job.kind == "reference":
        return [sys.executable, script, "--reference", *job.names, *tail]
    # torchrun's own module, run with this interpreter: `torchrun --standalone --nproc-per-node N`
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(job.nproc),
            script, "--worker", *job.names, *tail]


def _shown(cmd: list[str]) -> str:
    return " ".join(["torchrun", *cmd[3:]] if cmd[1:3] == ["-m", "torch.distributed.run"] else ["python", *cmd[1:]])


def _tail(path: Path | None, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:] if path else ""
    except OSError:
        return ""


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the launch's own session: torchrun and its ranks
    proc.wait()


def run_all(names: list[str], gpus: int, smoke: bool, deadline: float | None, work: Path,
            report: SectionReport) -> None:
    """Launch the reference and one torchrun per GPU count on disjoint GPUs, collect, evaluate."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in visible.split(",") if x] if visible else [str(i) for i in range(gpus)]
    ids = ids[:gpus]
    refs = sorted({LAYOUTS[n].model for n in names} | {"dense"})
    pending = [Job("reference", refs, 1)]
    for size in sorted({LAYOUTS[n].nproc for n in names}):
        pending.append(Job("layouts", [n for n in names if LAYOUTS[n].nproc == size], size))
    free, running, outcome = list(ids), [], {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(REPO / "benchmarks"),
                                                                    os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    if smoke:
        env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED"):
        env.pop(key, None)
    n_launch = 0
    while pending or running:
        for job in list(pending):
            if job.nproc > len(free) and not smoke:
                continue
            if smoke and running:  # CPU: one launch at a time (few cores)
                break
            pending.remove(job)
            if deadline is not None and deadline - time.time() < job.estimate(smoke):
                for n in job.names:
                    outcome[n] = ("skipped", f"time budget: {deadline - time.time():.0f} s left, the launch is "
                                             f"estimated at {job.estimate(smoke):.0f} s")
                continue
            job.gpus, free = free[:job.nproc], free[job.nproc:]
            n_launch += 1
            job.log = work / f"launch{n_launch}.{job.kind}.log"
            cmd = command(job, work, smoke, deadline)
            job_env = dict(env) if smoke else dict(env, CUDA_VISIBLE_DEVICES=",".join(job.gpus))
            print(f"# launch {n_launch}: {_shown(cmd)}"
                  f"{'' if smoke else '  (GPUs ' + ','.join(job.gpus) + ')'}", flush=True)
            with open(job.log, "w") as log:
                job.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=job_env, cwd=REPO,
                                            start_new_session=True)
            job.started = time.time()
            running.append(job)
        time.sleep(0.5)
        for job in list(running):
            timed_out = deadline is not None and time.time() > deadline + GRACE_S
            if job.proc.poll() is None and not timed_out:
                continue
            if job.proc.poll() is None:
                _kill(job.proc)
            running.remove(job)
            free += job.gpus
            rc = job.proc.returncode
            print(f"# launch of {' '.join(job.names)}: exit {rc} after {time.time() - job.started:.0f} s"
                  + (" (killed at the deadline)" if timed_out else ""), flush=True)
            if job.kind == "reference":
                for key in job.names:
                    if not _paths(work, f"ref.{key}", 0)[0].exists():
                        outcome[f"ref.{key}"] = ("error", f"reference {key} did not finish (exit {rc}):\n"
                                                          f"{_tail(job.log)}")
                continue
            progressed, remaining = False, []
            for n in job.names:
                done = all(_paths(work, n, r)[0].exists() for r in range(job.nproc))
                failed = sorted(work.glob(f"{n}.FAILED.rank*.txt"))
                if done:
                    outcome[n], progressed = ("done", None), True
                elif (work / f"{n}.SKIPPED").exists():
                    outcome[n] = ("skipped", (work / f"{n}.SKIPPED").read_text())
                elif failed:
                    outcome[n], progressed = ("error", f"crashed on {failed[0].name.split('.')[-2]}:\n"
                                                       f"{failed[0].read_text()[-3000:]}"), True
                elif (work / f"{n}.STARTED").exists():
                    why = "killed at the deadline" if timed_out else f"the launch died (exit {rc})"
                    outcome[n], progressed = ("error", f"{why} during this layout:\n{_tail(job.log)}"), True
                else:
                    remaining.append(n)
            if remaining and progressed and not timed_out:
                pending.insert(0, Job("layouts", remaining, job.nproc, job.attempt + 1))
            elif remaining:
                for n in remaining:
                    outcome[n] = ("error" if not timed_out else "skipped",
                                  f"not run: the launch ended (exit {rc}) before it:\n{_tail(job.log)}"
                                  if not timed_out else "time budget: the launch was killed at the deadline")

    ref_data: dict[str, tuple[dict, dict] | None] = {}
    for key in refs:
        js, pt = _paths(work, f"ref.{key}", 0)
        ref_data[key] = (json.loads(js.read_text()), torch.load(pt)) if js.exists() else None
        if f"ref.{key}" in outcome:
            report.data["errors"][f"reference_{key}"] = outcome[f"ref.{key}"][1]
    dense = ref_data.get("dense")
    if dense is not None:
        rep = dense[0]["repeat"]
        report.data["sections"]["reference_repeat"] = {
            "what": "the one-GPU dense reference run twice in one process",
            "checks": {"repeat_bitwise": {"expect": "bitwise: deterministic kernels, TF32 off", "ok": rep["bitwise"]
                                          and rep["init_bitwise"], "max_abs_diff": rep["max_abs_diff"]}},
            "ok": rep["bitwise"] and rep["init_bitwise"], "losses": dense[0]["losses"]}
    for n in names:
        state, text = outcome.get(n, ("error", "no outcome recorded"))
        if state == "skipped":
            report.data["skipped"][n] = text
        elif state == "error":
            report.data["errors"][n] = text
            report.data["sections"][n] = {"what": LAYOUTS[n].what, "ok": False,
                                          "checks": {"no_crash": {"expect": "the layout ran to the end on every "
                                                                            "rank", "ok": False}}}
        else:
            ranks = [json.loads(_paths(work, n, r)[0].read_text()) for r in range(LAYOUTS[n].nproc)]
            inits = [torch.load(_paths(work, n, r)[1]) for r in range(LAYOUTS[n].nproc)]
            ref = ref_data.get(LAYOUTS[n].model)
            report.data["sections"][n] = evaluate(n, ranks, inits, ref[0] if ref else None, ref[1] if ref else None)
    report.write()


def summary(report: SectionReport) -> list[str]:
    """One line per layout; the failed checks named."""
    lines = []
    for name, sec in report.data["sections"].items():
        parts = []
        for check, c in sec.get("checks", {}).items():
            figure = ""
            if "max_abs_diff" in c and c["max_abs_diff"] is not None:
                figure = f" max|d| {c['max_abs_diff']:.2e}"
            if "bitwise_equal" in c:
                figure += f" bitwise {c['bitwise_equal']}/{c['tensors']}"
            parts.append(f"{check}{'' if c['ok'] else ' FAILED'}{figure}")
        lines.append(f"# {name}: {'PASS' if sec.get('ok') else 'FAIL'}  " + "; ".join(parts))
    for name, why in report.data["skipped"].items():
        lines.append(f"skipped: {name} {why}" if why.startswith("needs") else f"# {name}: SKIPPED ({why})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, gloo: --gpus CPU processes per launch (default 2)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_layouts.json (default $OUT)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; --smoke: 2)")
    p.add_argument("--budget", type=float, default=None, help="seconds from now (default: $LDT_GPU_DEADLINE)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands; train nothing")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new one in /tmp)")
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--reference", nargs="+", choices=list(MODELS), help=argparse.SUPPRESS)
    p.add_argument("--worker", nargs="+", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reference:
        reference_main(args.reference, args.work, args.smoke)
        return 0
    if args.worker:
        worker_main(args.worker, args.work, args.smoke, args.deadline)
        return 0
    deadline = time.time() + args.budget if args.budget is not None else deadline_from_env()
    if not args.smoke and not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit("no CUDA device; run with --smoke to check the code paths on CPU (or --dry-run)")
    gpus = args.gpus if args.gpus is not None else (2 if args.smoke else torch.cuda.device_count())
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    report = SectionReport("gpu_layouts.json", None if args.dry_run else args.out, device, args.smoke, deadline)
    to_run, skipped = plan(gpus, args.smoke, args.layouts)
    report.data.update(gpus=gpus, plan=to_run, settings={
        "steps": STEPS, "global_batch": GLOBAL_BATCH, "seq": SEQ, "vocab": VOCAB, "clip": CLIP, "dense": DENSE,
        "moe": MOE, "fp32_tol": FP32_TOL, "float8_tol": FLOAT8_TOL, "precision": "32-true, TF32 off",
        "determinism": "use_deterministic_algorithms(warn_only), CUBLAS_WORKSPACE_CONFIG=:4096:8, math SDPA"})
    report.data["skipped"].update(skipped)
    for name, why in skipped.items():
        print(f"skipped: {name} {why}", flush=True)
    if args.dry_run:
        work = args.work or Path(tempfile.gettempdir()) / "ldt_gpu_layouts"
        refs = sorted({LAYOUTS[n].model for n in to_run} | {"dense"})
        jobs = ([Job("reference", refs, 1)] if to_run else []) + [
            Job("layouts", [n for n in to_run if LAYOUTS[n].nproc == s], s)
            for s in sorted({LAYOUTS[n].nproc for n in to_run})]
        for job in jobs:
            cmd = command(job, work, args.smoke, deadline)
            print("# would run: " + _shown(cmd), flush=True)
        for name in to_run:
            print(f"# {name} [{LAYOUTS[name].nproc}]: {LAYOUTS[name].what}", flush=True)
        return 0
    if not to_run:
        print(f"# gpu_layouts: nothing to run with {gpus} GPU(s)", flush=True)
        report.write()
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="ldt_gpu_layouts_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"# gpu_layouts: {len(to_run)} layout(s) on {gpus} {'CPU process slots' if args.smoke else 'GPU(s)'}; "
          f"scratch {work}", flush=True)
    try:
        run_all(to_run, gpus, args.smoke, deadline, work, report)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    for line in summary(report):
        print(line, flush=True)
    failed = [n for n, s in report.data["sections"].items() if not s.get("ok")]
    report.data["failed"] = failed
    report.write()
    if report.data["errors"] or failed:
        print(f"# gpu_layouts: FAILED: {', '.join(sorted(set(failed) | set(report.data['errors'])))}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
