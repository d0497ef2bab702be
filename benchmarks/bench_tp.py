"""Tensor-parallel benchmarks: measured memory per rank for tp = 1, 2, 4 (state and activations per
layer, against Megatron's formula), and throughput on 2 ranks against a hand-written TP loop.

1. Memory (``--part memory``): ``GPTModule`` trained by ``L.Trainer`` with
   ``NDParallelStrategy(tp=t, dp_shard=1, sequence_parallel=sp, loss_parallel=True)`` on t ranks
   (t = 1: no TP, FSDP2 over 1 rank), fp32, AdamW, clipping, dropout 0, ``--mem-steps`` steps; each
   (t, sp) in fresh processes. Every process runs with ``memcount.so`` preloaded
   (``memory_meter.ProcessMeter``: malloc bytes in use, every thread) and reports:

   - the step's levels at Lightning's hooks in the last step, as ``bench_fsdp.py`` does (setup,
     after forward, after backward, rest, peak), next to the *computed* state: 16 B per local
     parameter element (fp32 param 4 + grad 4 + AdamW 8), the local shapes derived from the full
     parameter shapes and the plan's style types (``ColwiseParallel``: rows / t; ``RowwiseParallel``:
     a Linear's columns / t and its bias replicated, an Embedding's rows / t; anything not in the
     plan, i.e. the norms, replicated), and the *known-tensor* sum (the local shards actually held).
   - activations per transformer layer: after ``fit``, one forward of the whole model (no grad)
     captures the input block 1 really gets (plain local tensor: (b, s/t, h) with sequence
     parallel, (b, s, h) without); then block 1 alone runs forward with grad on it (a detached
     copy that requires grad, as in training) and is measured four ways, each in its own forward:
       malloc     memcount: bytes in use after the forward minus before (everything the forward
                  left alive: what backward reads, the block's output, autograd's own objects)
       saved      ``saved_tensors_hooks``: the storages of every tensor autograd saves, DTensors
                  unwrapped to their local shard, each storage once, parameters excluded
                  (FSDP's gathered weights are freed after forward: 0 bytes left)
       new alive  storages allocated in the forward and alive after it, DTensor outputs unwrapped
                  to their local tensor (``activation_bytes`` made DTensor-aware)
       stock      ``lightning_disttrain.parallel.activation.activation_bytes`` as it is: it counts
                  plain tensors only, so it misses what DTensor ops return (printed to show that)
     Block 1 is resharded after forward by FSDP (the last block is not), so its gathered weights
     are not left in the figures.

2. Throughput (``--part throughput``; 2 ranks, tp = 2, dp = 1): ``GPTModule`` itself (its
   ``training_step`` with ``self.log`` of ``train/loss`` (``sync_dist=True``), ``train/tokens``,
   ``train/lr``, ``tok/s``; CSV logger, ``log_every_n_steps=10``) under
   ``NDParallelStrategy(tp=2)`` vs a hand-written loop: the same GPT, ``parallelize_module`` with
   the same styles (``parallel.gpt_tp``), the tied head tied again, ``fully_shard`` per block (last
   block kept gathered) and on the root over the 1-rank data-parallel mesh of the same 2-D mesh
   (as ``parallel.recipe`` does), the same batches on both TP ranks, AdamW, cosine schedule,
   clipping 1.0 (``torch.nn.utils.clip_grad_norm_``), the vocabulary-sharded cross-entropy under
   ``loss_parallel()`` with the padding columns masked; no logging. Interleaved in the same
   processes, the order rotated every round; each repeat a fresh model (and Trainer).

    python benchmarks/bench_tp.py --part memory
    python benchmarks/bench_tp.py --part throughput --repeats 7

Ranks are started here with env:// variables (no torchrun agent). Results: printed, and JSON under
benchmarks/out/tp/. ``--record FILE`` writes the memory part as ``cpu_figures.py`` reads it
(``record``); ``--plot DIR`` draws ``cpu-tp-memory`` from that record.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from functools import partial

from bench_common import (
    MIB,
    OUT_ROOT,
    StepClock,
    dataset,
    header,
    local_bytes,
    memcount_env,
    omp_threads,
    parser,
    part,
    phase_probe,
    rotated_rounds,
    rounds_report,
    step_timer,
    trainer,
)
from bench_common import RANK as _RANK
from bench_common import WORLD as _WORLD
from bench_common import launch as _launch
from record import add_record_options, provenance, record_path, wants_record, write_record
from bench_common import level_at as _at
from bench_common import step_peak as _peak

OUT = OUT_ROOT / "tp"
OURS = "ours: GPTModule + NDParallelStrategy(tp=2)"
HAND = "hand-written parallelize_module + FSDP2 loop"
launch = partial(_launch, __file__, OUT, timeout=900)


# ---------------------------------------------------------------------------------------------
# shared pieces (worker processes)


def _imports():
    global L, torch, nn, dist, F, DTensor, DataLoader, TensorDataset, GPTModule, NDParallelStrategy
    import lightning as L
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_disttrain import GPTModule
    from lightning_disttrain.strategies import NDParallelStrategy


def overrides(args) -> dict:
    return {"block_size": args.seq, "n_head": args.n_head, "dropout": 0.0}


def gpt_module(args):
    """``GPTModule`` as a user builds it (defaults: AdamW lr 6e-4, wd 0.1, cosine schedule)."""
    return GPTModule(args.preset, vocab_size=args.vocab, model_overrides=overrides(args))


def _local(t):
    """The tensor that owns the memory: a DTensor's local shard, a wrapper's (funcol's
    AsyncCollectiveTensor) inner tensor, or the tensor itself."""
    while type(t) not in (torch.Tensor, nn.Parameter):
        if isinstance(t, DTensor):
            t = t._local_tensor
        elif hasattr(t, "elem"):
            t = t.elem
        else:
            break
    return t


def computed_local_numel(config, t: int, sp: bool) -> dict[str, int]:
    """Each parameter's local element count on a TP rank, from the full shapes (a GPT built on the
    meta device) and the type of the plan's style for its module. Not a measurement."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_disttrain.parallel import gpt_tp
    from lightning_disttrain.models.gpt import GPT
    from lightning_disttrain.parallel.tensor import TensorParallelOptions

    with torch.device("meta"):
        ref = GPT(config)
    plan = {}
    if t > 1:
        options = TensorParallelOptions(sequence_parallel=sp, loss_parallel=True)
        for i in range(config.n_layer):
            plan |= {f"blocks.{i}.{k}": v for k, v in gpt_tp.block_plan(config, options).items()}
        plan |= gpt_tp.root_plan(config, options)
    out = {}
    for name, p in ref.named_parameters():  # a tied weight once (as wte.weight)
        owner, _, kind = name.rpartition(".")
        module, style = ref.get_submodule(owner), plan.get(owner)
        dim = None
        if isinstance(style, ColwiseParallel):
            dim = 0 if isinstance(module, nn.Linear) else 1
        elif isinstance(style, RowwiseParallel):
            dim = (1 if kind == "weight" else None) if isinstance(module, nn.Linear) else 0
        shape = list(p.shape)
        if dim is not None:
            assert shape[dim] % t == 0, (name, shape, t)
            shape[dim] //= t
        out[name] = (int(torch.Size(shape).numel()), dim is not None)
    return out


# ---------------------------------------------------------------------------------------------
# 1. memory


class _NewLocalStorages:
    """``activation.activation_bytes``' tracker, but DTensor-aware: outputs of DTensor ops count
    by their local tensor's storage."""

    def __init__(self):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        storages = self.storages = {}

        def real(t):
            return isinstance(t, torch.Tensor) and _local(t).device.type != "meta"

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {_local(t).untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if real(t)}
                for t in tree_leaves(out):
                    if real(t):
                        s = _local(t).untyped_storage()
                        if s._cdata not in inputs and s._cdata not in storages:
                            storages[s._cdata] = (StorageWeakRef(s), s.nbytes())
                return out

        self.mode = Mode()

    def alive(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())


def saved_for_backward(fn, param_ptrs: set[int]):
    """Run ``fn``; the bytes of the storages autograd saved (DTensors by their local shard, each
    storage once, parameter storages excluded), read after ``fn`` returned (so storages FSDP freed
    by resizing to 0 count 0). Also a list of (shape, dtype, MiB) of what was saved."""
    storages = {}

    def pack(t):
        s = _local(t).untyped_storage()
        storages.setdefault(s._cdata, (s, tuple(_local(t).shape), str(_local(t).dtype)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    kept = [(shape, dtype, s.nbytes()) for s, shape, dtype in storages.values()
            if s.nbytes() and s.data_ptr() not in param_ptrs]
    return out, sum(n for *_, n in kept), sorted(kept, key=lambda k: -k[2])


def memory_worker(args) -> None:
    _imports()
    from memory_meter import ProcessMeter, load_memcount, self_check

    from lightning_disttrain.parallel.activation import activation_bytes

    count = load_memcount()
    check = self_check(ProcessMeter())
    dist.init_process_group("gloo")
    ds = dataset(args, args.mem_steps * args.batch)  # dp = 1: every TP rank reads the same batches
    loader = DataLoader(ds, batch_size=args.batch, shuffle=False)
    meter = ProcessMeter()

    L.seed_everything(0)
    module = gpt_module(args)
    strategy = NDParallelStrategy(tp=args.tp, dp_shard=1, sequence_parallel=bool(args.sp), loss_parallel=True)
    fit = trainer(strategy, args.mem_steps, [phase_probe(meter)])
    meter.start()
    fit.fit(module, loader)
    meter.stop()

    gpt = module.model
    params = list(gpt.parameters())
    opt = fit.optimizers[0]
    known = {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
             "optim": local_bytes(v for s in opt.state.values() for v in s.values())}
    computed = computed_local_numel(module.config, args.tp, bool(args.sp))
    actual = {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in gpt.named_parameters()}
    mismatch = {n: (c, actual.get(n)) for n, (c, _) in computed.items() if actual.get(n) != c}

    # -- activations per layer: block 1 on the input it really gets ---------------------------
    captured = {}

    def grab(mod, a):
        captured["x"] = a[0].detach().clone()

    handle = gpt.blocks[1].register_forward_pre_hook(grab)
    with torch.no_grad():
        gpt(next(iter(loader))[0])
    handle.remove()
    x0 = captured.pop("x")
    block = gpt.blocks[1]
    param_ptrs = {_local(p).untyped_storage().data_ptr() for p in gpt.parameters()}

    def run():
        x = x0.detach().clone().requires_grad_(True)  # before the measured region: the input exists
        return x, (lambda: block(x))

    acts = {"input": {"type": type(x0).__name__, "shape": list(x0.shape)}}
    for rep in range(args.act_repeats):
        # malloc: everything the forward left alive
        x, f = run()
        gc.collect()
        dist.barrier()
        before = count.memcount_current()
        out = f()
        acts.setdefault("malloc", []).append(count.memcount_current() - before)
        acts["output"] = {"type": type(out).__name__, "shape": list(out.shape)}
        del out, x
        # saved tensors
        x, f = run()
        dist.barrier()
        out, n, kept = saved_for_backward(f, param_ptrs)
        acts.setdefault("saved", []).append(n)
        acts["saved_list"] = [[list(s), d, b] for s, d, b in kept]
        del out, x
        # new storages alive, DTensor-aware
        x, f = run()
        dist.barrier()
        tracker = _NewLocalStorages()
        with tracker.mode:
            out = f()
        acts.setdefault("new_alive", []).append(tracker.alive())
        del out, x, tracker
        # stock activation_bytes
        x, f = run()
        dist.barrier()
        out, n = activation_bytes(f)
        acts.setdefault("stock", []).append(n)
        del out, x
    cfg = module.config
    record = {"tp": args.tp, "sp": bool(args.sp), "preset": args.preset, "check_mib": check, "levels": meter.levels, "peaks": meter.peaks,
              "known": known, "numel": sum(p.numel() for p in params),
              "computed_local": sum(c for c, _ in computed.values()),
              "computed_sharded": sum(c for c, s in computed.values() if s),
              "computed_replicated": sum(c for c, s in computed.values() if not s),
              "computed_root_last": sum(c for n, (c, _) in computed.items()
                                        if not n.startswith("blocks.") or n.startswith(f"blocks.{len(gpt.blocks) - 1}.")),
              "replicated_names": sorted({n.split(".", 2)[-1] if n.startswith("blocks.") else n
                                          for n, (_, s) in computed.items() if not s}),
              "mismatch": mismatch, "step": args.mem_steps - 1, "acts": acts,
              "shape": {"s": args.seq, "b": args.batch, "h": cfg.n_embd, "a": cfg.n_head, "L": cfg.n_layer,
                        "V": cfg.vocab_size, "Vp": cfg.padded_vocab_size, "mlp": cfg.mlp_hidden},
              "steps_done": fit.strategy.parallelized_steps}
    (OUT / f"memory_{args.tp}_{'sp' if args.sp else 'nosp'}_rank{_RANK}.json").write_text(json.dumps(record))


def _mem(t: int, sp: bool, rank: int = 0) -> dict:
    return json.loads((OUT / f"memory_{t}_{'sp' if sp else 'nosp'}_rank{rank}.json").read_text())


def formulas(sh: dict, t: int, sp: bool) -> dict[str, float]:
    """Activation bytes per layer: Megatron's formula and the same count for this model.

    megatron: Korthikanti et al. 2022, section 4.1 (16-bit activations, 1-byte dropout masks,
      softmax and its mask stored): sbh(34 + 5as/h); TP: sbh(10 + 24/t + 5as/(ht)); TP + SP: sbh/t(34 + 5as/h).
    adapted: the same tensors in our model: fp32 (4 B), dropout 0 (no masks), CPU flash SDPA (no
      softmax; its logsumexp, a*s*b fp32, instead), plus LayerNorm's mean and rstd (2 x s*b fp32 per
      norm). 16 stored sbh-sized tensors per layer: 4 replicated under TP (2 norm inputs, the
      attention and MLP inputs), 12 sharded (q, k, v, attention output, GELU input, w2 input).
      With SP Megatron keeps the gathered attention / MLP inputs sharded (all-gathering them again
      in backward): "adapted, megatron SP" = 64 sbh / t + ...; torch's PrepareModuleInput keeps them
      gathered: "adapted, torch SP" = sbh(8 + 56/t) + ...
    """
    s, b, h, a = sh["s"], sh["b"], sh["h"], sh["a"]
    sbh, sb = s * b * h, s * b
    if t == 1:
        meg = sbh * (34 + 5 * a * s / h)
        ad = 64 * sbh + 16 * sb + 4 * a * sb
        return {"megatron": meg, "adapted": ad}
    if not sp:
        return {"megatron": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
                "adapted": sbh * (16 + 48 / t) + 16 * sb + 4 * a * sb / t}
    return {"megatron": sbh / t * (34 + 5 * a * s / h),
            "adapted": sbh * (8 + 56 / t) + 16 * sb / t + 4 * a * sb / t,
            "adapted_megatron_sp": 64 * sbh / t + 16 * sb / t + 4 * a * sb / t}


def _sp(t: int, sp: bool) -> str:
    return "-" if t == 1 else "on" if sp else "off"


def memory_rows(runs: list[tuple[int, bool]]) -> list[dict]:
    """Per (t, sequence parallel) run, rank 0's numbers of the memory table in MiB (the last step):
    the computed state (16 B x the local elements; its sharded and replicated parts), the known
    tensors, the levels at setup, after forward, after backward and at rest, the peak and its phase,
    rest / computed state and peak - rest."""
    k = _mem(*runs[0])["step"]
    rows = []
    for t, sp in runs:
        r = _mem(t, sp)
        state = 16 * r["computed_local"]
        rest, (peak, phase) = _at(r, k, "opt"), _peak(r, k)
        rows.append({"t": t, "sp": _sp(t, sp), "computed_state": state / MIB,
                     "sharded_part": 16 * r["computed_sharded"] / MIB,
                     "replicated_part": 16 * r["computed_replicated"] / MIB,
                     "known_tensors": sum(r["known"].values()) / MIB, "setup": r["levels"]["setup"] / MIB,
                     "after_fwd": _at(r, k, "fwd") / MIB, "after_bwd": _at(r, k, "bwd") / MIB, "rest": rest / MIB,
                     "peak": peak / MIB, "peak_phase": phase, "rest_over_computed": rest / state,
                     "peak_minus_rest": (peak - rest) / MIB})
    return rows


def activation_rows(runs: list[tuple[int, bool]]) -> list[dict]:
    """Per run, block 1's activations on rank 0 in MiB (medians over the repeats: malloc, saved, new
    alive, stock), the formulas (Megatron's, adapted, Megatron's SP adapted: None without SP) and
    the ratios of the activations table."""
    rows = []
    for t, sp in runs:
        r = _mem(t, sp)
        a = r["acts"]
        med = {key: statistics.median(a[key]) for key in ("malloc", "saved", "new_alive", "stock")}
        fm = formulas(r["shape"], t, sp)
        msp = fm.get("adapted_megatron_sp")
        rows.append({"t": t, "sp": _sp(t, sp), "block_input": "x".join(str(d) for d in a["input"]["shape"])}
                    | {key: v / MIB for key, v in med.items()}
                    | {"megatron": fm["megatron"] / MIB, "adapted": fm["adapted"] / MIB,
                       "megatron_sp_adapted": msp / MIB if msp else None,
                       "malloc_over_megatron": med["malloc"] / fm["megatron"],
                       "malloc_over_adapted": med["malloc"] / fm["adapted"],
                       "malloc_over_megatron_sp": med["malloc"] / msp if msp else None,
                       "saved_over_adapted": med["saved"] / fm["adapted"]})
    return rows


def record(memory: list[dict], activations: list[dict], r0: dict) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-tp-memory`` from: ``memory_rows`` and ``activation_rows``,
    and the model's shape from rank 0's JSON of the first run (``r0``)."""
    sh = r0["shape"]
    return provenance("bench_tp_memory", "bench_tp.py", f"gloo, {omp_threads()}") | {
        "model": f"GPTModule \"{r0['preset']}\" with n_head={sh['a']}: {sh['L']} layers, h={sh['h']}, a={sh['a']} heads, "
                 f"MLP {sh['mlp']}, vocab {sh['V']} (padded {sh['Vp']}), {r0['numel']:,} parameters; batch b={sh['b']} "
                 f"x s={sh['s']} tokens, the same on every TP rank (dp = 1); fp32, AdamW, clip 1.0; L.Trainer with "
                 "NDParallelStrategy(tp=t, dp_shard=1) on t ranks",
        "parameters": r0["numel"], "s": sh["s"], "b": sh["b"], "h": sh["h"], "a": sh["a"], "layers": sh["L"],
        "memory_unit": f"MiB, step {r0['step']} (steps 0..{r0['step']} ran), rank 0, relative to the meter just before fit",
        "memory_rows": memory,
        "activation_unit": f"MiB per transformer layer (block 1 of {sh['L']}), forward with grad on its real input, "
                           f"rank 0, the median of {len(r0['acts']['malloc'])} repeats",
        "activation_rows": activations}


def report_memory(runs: list[tuple[int, bool]]) -> str:
    def f(x: float) -> str:
        return f"{x / MIB:8.2f}"

    on = _sp
    lines = []
    cs = [_mem(t, sp, r)["check_mib"] for t, sp in runs for r in range(t)]
    lines.append(f"method check ({len(cs)} processes): a 100 MiB tensor measured {min(c['alive'] for c in cs):.2f}-"
                 f"{max(c['alive'] for c in cs):.2f} MiB alive, peak {min(c['peak'] for c in cs):.2f}-"
                 f"{max(c['peak'] for c in cs):.2f} MiB, {max(abs(c['after_free']) for c in cs):.2f} MiB left after free")
    r0 = _mem(*runs[0])
    sh, k = r0["shape"], r0["step"]
    lines += ["", (f"GPT: preset {r0['preset']!r} with n_head={sh['a']}: {sh['L']} layers, h={sh['h']}, a={sh['a']} heads, MLP {sh['mlp']}, vocab "
                   f"{sh['V']} (padded {sh['Vp']}), tied head, learned positions, dropout 0; {r0['numel']:,} parameters."),
              f"batch b={sh['b']} x s={sh['s']} tokens, the same on every TP rank (dp = 1). fp32, AdamW, clip 1.0.",
              f"Step {k} (steps 0..{k} ran), rank 0, MiB, relative to the meter just before fit (as in section 4).",
              "computed state = 16 B x the local elements derived from the full shapes and the plan's style types",
              "  (sharded part + replicated part: the norms' weights and biases and the row-parallel biases).",
              "known tensors = the local shards of parameters + gradients + AdamW state, summed (not measured).", "",
              "measured: malloc bytes in use, every thread (memcount.so)",
              (f"{'t':>2} {'SP':3} | {'computed':>8} {'sharded':>8} {'replic.':>8} {'known':>8} | {'setup':>8} "
               f"{'after':>8} {'after':>8} {'rest':>8} {'peak':>8} {'in':>3} | {'rest /':>8} {'peak -':>8}"),
              (f"{'':>2} {'':3} | {'state':>8} {'part':>8} {'part':>8} {'tensors':>8} | {'':>8} {'fwd':>8} {'bwd':>8} "
               f"{'':>8} {'':>8} {'':>3} | {'computed':>8} {'rest':>8}")]
    spread, drift, mism = [], [], []
    for (t, sp), row in zip(runs, memory_rows(runs)):
        lines.append(f"{t:>2} {on(t, sp):3} | " + " ".join(f"{row[c]:8.2f}" for c in (
            "computed_state", "sharded_part", "replicated_part", "known_tensors")) + " | " + " ".join(
            f"{row[c]:8.2f}" for c in ("setup", "after_fwd", "after_bwd", "rest", "peak"))
                     + f" {row['peak_phase']:>3} | {row['rest_over_computed']:8.3f} {row['peak_minus_rest']:8.2f}")
        rs = [_mem(t, sp, q) for q in range(t)]
        drift += [abs(_at(x, k, "opt") - _at(x, k - 1, "opt")) for x in rs]
        spread += [max(_at(x, k, "opt") for x in rs) - min(_at(x, k, "opt") for x in rs),
                   max(_peak(x, k)[0] for x in rs) - min(_peak(x, k)[0] for x in rs)]
        mism += [(t, sp, m) for x in rs for m in x["mismatch"].items()]
    lines.append(f"ranks differ by at most {max(spread) / MIB:.2f} MiB in rest and peak; rest changed from step {k - 1} "
                 f"to step {k} by at most {max(drift) / MIB:.2f} MiB (any rank)")
    lines.append("computed local shapes equal the actual local shards for every parameter on every rank" if not mism
                 else f"computed local shapes DIFFER from the actual shards: {mism}")
    lines.append(f"replicated under TP (per block, and root): {', '.join(_mem(*runs[-1])['replicated_names'])}")

    # -- activations -------------------------------------------------------------------------
    lines += ["", (f"Activations per transformer layer (block 1 of {sh['L']}), forward with grad on its real input; MiB,"
                   f" rank 0; each figure the median of {len(r0['acts']['malloc'])} repeats (spread printed below)."),
              "malloc = bytes in use after the forward minus before; saved = storages autograd saved (local shards,",
              "  once each, parameters excluded); new alive = storages the forward allocated and still alive (DTensor-",
              "  aware); stock = activation_bytes() as it is (plain tensors only).",
              "formulas: megatron = s*b*h*(34 + 5*a*s/h) [TP: 10 + 24/t + 5*a*s/(h*t); SP: all / t] bytes, 16-bit;",
              "  adapted = what this model stores (fp32, no dropout masks, CPU flash SDPA: logsumexp, not softmax),",
              "  see formulas() and the doc; with SP: 'torch SP' keeps the gathered attention/MLP inputs, 'meg. SP'",
              "  would keep them sharded.",
              (f"{'t':>2} {'SP':3} {'block input':>16} | {'malloc':>7} {'saved':>7} {'new':>7} {'stock':>7} |"
               f" {'megatron':>8} {'adapted':>8} {'meg. SP':>8} | {'malloc/':>8} {'malloc/':>8} {'malloc/':>8}"
               f" {'saved/':>8}"),
              (f"{'':>2} {'':3} {'(local shape)':>16} | {'':>7} {'':>7} {'alive':>7} {'':>7} |"
               f" {'formula':>8} {'formula':>8} {'adapted':>8} | {'megatron':>8} {'adapted':>8} {'meg. SP':>8}"
               f" {'adapted':>8}")]
    def opt(x: float | None) -> str:
        return f"{'-':>8}" if x is None else f"{x:8.3f}"

    for (t, sp), a in zip(runs, activation_rows(runs)):
        lines.append(f"{t:>2} {on(t, sp):3} {a['block_input']:>16} | " + " ".join(
            f"{a[c]:7.3f}" for c in ("malloc", "saved", "new_alive", "stock")) + f" | {a['megatron']:8.3f}"
                     f" {a['adapted']:8.3f} {opt(a['megatron_sp_adapted'])} | {a['malloc_over_megatron']:8.3f}"
                     f" {a['malloc_over_adapted']:8.3f} {opt(a['malloc_over_megatron_sp'])}"
                     f" {a['saved_over_adapted']:8.4f}")
    keys = ("malloc", "saved", "new_alive", "stock")
    lines.append("spread: each figure on every rank and in every repeat, against its rank-0 median above:")
    for key in keys:
        devs = []
        for t, sp in runs:
            med = statistics.median(_mem(t, sp)["acts"][key])
            devs += [(v - med, t, sp, q) for q in range(t) for v in _mem(t, sp, q)["acts"][key]]
        near = [abs(d) for d, *_ in devs if abs(d) < 64 * 1024]
        far = [f"{d / MIB:+.3f} MiB (t={t}, SP {on(t, sp)}, rank {q})" for d, t, sp, q in devs if abs(d) >= 64 * 1024]
        lines.append(f"  {key:9}: {len(near)} of {len(devs)} within {max(near) / 1024:.1f} KiB"
                     + (f"; the others {', '.join(far)}" if far else ""))
    lines += ["", "the whole forward, from the step's levels above (rank 0, MiB): activations = after fwd - (rest - known",
              "  gradients) - gathered (4 B x the local elements of the root and the last block, which FSDP keeps",
              "  unsharded after forward; computed); L x layer = the per-layer malloc figure x L; the rest is the root's",
              "  (embedding output, final norm, logits, loss-parallel cross-entropy).",
              f"{'t':>2} {'SP':3} | {'acts':>8} {'L x':>8} {'root':>8}",
              f"{'':>2} {'':3} | {'(step)':>8} {'layer':>8} {'part':>8}"]
    for t, sp in runs:
        r = _mem(t, sp)
        acts = _at(r, k, "fwd") - (_at(r, k, "opt") - r["known"]["grads"]) - 4 * r["computed_root_last"]
        layers = sh["L"] * statistics.median(r["acts"]["malloc"])
        lines.append(f"{t:>2} {on(t, sp):3} | {f(acts)} {f(layers)} {f(acts - layers)}")
    lines += ["", "what autograd saved in block 1 (local shapes, one storage each; rank 0):"]
    for t, sp in runs:
        kept = _mem(t, sp)["acts"]["saved_list"]
        big = [f"{'x'.join(map(str, s))}" for s, d, n in kept if n >= 4096]
        small = sum(n for s, d, n in kept if n < 4096)
        lines.append(f"  t={t} SP {on(t, sp):3}: " + ", ".join(big) + f" (+{small / 1024:.1f} KiB in "
                     f"{sum(1 for s, d, n in kept if n < 4096)} small ones)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 2. throughput


def throughput_worker(args) -> None:
    _imports()
    from lightning.pytorch.loggers import CSVLogger
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.utils.data import DistributedSampler

    from lightning_disttrain.parallel import gpt_tp
    from lightning_disttrain.models.gpt import GPT
    from lightning_disttrain.optim import build_optimizer, build_scheduler
    from lightning_disttrain.parallel.tensor import TensorParallelOptions

    total = args.warmup + args.steps
    ds = dataset(args, total * args.tp_batch)  # dp = 1: both TP ranks read every batch
    dist.init_process_group("gloo")  # the strategy finds it initialised and keeps it
    mesh = init_device_mesh("cpu", (1, _WORLD), mesh_dim_names=("dp_shard", "tp"))  # the hand loop's

    def ours():
        L.seed_everything(0)
        timer = step_timer(args.warmup)
        logger = CSVLogger(OUT / "throughput_logs", name="ours")
        trainer(NDParallelStrategy(tp=_WORLD, dp_shard=1), total, [timer], logger=logger).fit(
            gpt_module(args), DataLoader(ds, batch_size=args.tp_batch, shuffle=False))
        return timer.step_times(), timer.losses

    def hand():
        torch.manual_seed(0)
        ref = gpt_module(args)  # only for its config and hyper-parameters
        hp, cfg = ref.hparams, ref.config
        model = GPT(cfg)
        options = TensorParallelOptions(sequence_parallel=True, loss_parallel=True)
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], gpt_tp.block_plan(cfg, options))
        parallelize_module(model, mesh["tp"], gpt_tp.root_plan(cfg, options))
        model.lm_head.weight = model.wte.weight  # each style made its own copy; the head is tied again
        n = len(model.blocks)
        for i, block in enumerate(model.blocks):
            fully_shard(block, mesh=mesh["dp_shard"], reshard_after_forward=i < n - 1)
        fully_shard(model, mesh=mesh["dp_shard"])
        opt = build_optimizer(model, "adamw", lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas),
                              eps=hp.eps)
        sched = build_scheduler(opt, schedule=hp.schedule, warmup_steps=hp.warmup_steps, total_steps=total,
                                min_lr_ratio=hp.min_lr_ratio, decay_fraction=hp.decay_fraction)
        # -inf on the vocabulary padding columns, sharded like the logits' last dimension
        pad = torch.zeros(cfg.padded_vocab_size)
        pad[cfg.vocab_size:] = float("-inf")
        pad = distribute_tensor(pad, mesh["tp"], [Shard(0)], src_data_rank=None)
        # The batches Lightning feeds ours: it injects a DistributedSampler over the dp ranks (1 here),
        # which for training shuffles (seed = the global seed) even when the loader did not.
        loader = DataLoader(ds, batch_size=args.tp_batch,
                            sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))
        clock, losses = StepClock(args.warmup), []
        for x, y in clock.steps(loader):
            with loss_parallel():
                logits = model(x)  # vocabulary-sharded DTensor
                loss = F.cross_entropy((logits.float() + pad).flatten(0, 1), y.flatten())
                loss.backward()
            losses.append(float(loss.detach().full_tensor()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return clock.step_times(), losses

    variants = {OURS: ours, HAND: hand}
    rotated_rounds(variants, args.repeats, OUT / "throughput.json",
                   {"tokens_per_step": args.tp_batch * args.seq, "args": vars(args)})


def report_throughput() -> str:
    data = json.loads((OUT / "throughput.json").read_text())
    a = data["args"]
    return rounds_report(
        data, (f"Throughput on 2 ranks, tp=2 dp=1 (preset {a['preset']}, n_head {a['n_head']}, vocab {a['vocab']}, seq "
               f"{a['seq']}, batch {a['tp_batch']} (the same on both TP ranks), {a['steps']} timed steps after "
               f"{a['warmup']} warm-up, {a['repeats']} interleaved repeats, order rotated each round; rank 0)"),
        ratios=[(HAND, OURS)], short={OURS: "ours", HAND: "hand"})


# ---------------------------------------------------------------------------------------------


def main() -> None:
    p = parser(__doc__, steps=(15, "throughput: timed steps per repeat"),
               warmup=(3, "throughput: untimed steps before them"), repeats=(7, "throughput: interleaved rounds"),
               worker=["memory", "throughput"])
    p.add_argument("--part", choices=["all", "memory", "throughput"], default="all")
    p.add_argument("--preset", default="small")
    p.add_argument("--n-head", type=int, default=8, help="8 (head size 48): divisible by tp = 4")
    p.add_argument("--vocab", type=int, default=257, help="257: the byte tokenizer")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="memory: samples per step (every TP rank)")
    p.add_argument("--tp-batch", type=int, default=8, help="throughput: samples per step (both TP ranks)")
    p.add_argument("--tps", default="1,2,4", help="memory: TP degrees (= ranks)")
    p.add_argument("--mem-steps", type=int, default=3, help="memory: steps; the last one is reported")
    p.add_argument("--act-repeats", type=int, default=3, help="memory: repeats of each activation measurement")
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    add_record_options(p, "cpu-tp-memory (the memory part)")
    args = p.parse_args()
    if args.mem_steps < 2:
        p.error("--mem-steps must be >= 2: the last step is reported and compared with the one before")
    if wants_record(args) and args.part == "throughput":
        p.error("--record and --plot: the memory part's (--part memory or all)")
    OUT.mkdir(parents=True, exist_ok=True)
    if args.worker == "memory":
        return memory_worker(args)
    if args.worker == "throughput":
        return throughput_worker(args)

    common = ["--preset", args.preset, "--n-head", str(args.n_head), "--vocab", str(args.vocab), "--seq", str(args.seq)]
    header("bench_tp", "gloo", omp_threads())
    if args.part in ("all", "memory"):
        with part("memory"):
            env = memcount_env(OUT)
            runs = [(t, sp) for t in (int(x) for x in args.tps.split(","))
                    for sp in ((True,) if t == 1 else (True, False))]
            for t, sp in runs:
                launch(t, f"memory_{t}_{'sp' if sp else 'nosp'}",
                       ["--worker", "memory", *common, "--batch", str(args.batch), "--mem-steps", str(args.mem_steps),
                        "--act-repeats", str(args.act_repeats), "--tp", str(t), "--sp", str(int(sp))], extra_env=env)
            print(report_memory(runs))
        if wants_record(args):
            write_record(record(memory_rows(runs), activation_rows(runs), _mem(*runs[0])),
                         record_path(args, OUT / "bench_tp_memory.json"), args.plot, args.format)
    if args.part in ("all", "throughput"):
        with part("throughput"):
            launch(2, "throughput", ["--worker", "throughput", *common, "--tp-batch", str(args.tp_batch), "--steps",
                                     str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats)],
                   timeout=1500)
            print(report_throughput())


if __name__ == "__main__":
    main()
