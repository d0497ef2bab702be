"""FSDP2 benchmarks: measured memory per rank by ZeRO stage, and throughput vs. baselines.

1. Memory (``--part memory``; N = 1, 2, 4 ranks): ``GPTModule`` trained by ``L.Trainer`` with our
   ``FSDP2Strategy`` (ZeRO-3: ``reshard_after_forward=True``; ZeRO-2: ``False``), fp32, AdamW,
   gradient clipping, ``--mem-steps`` steps. Measured per rank by an allocator, not by summing the
   tensors we know about (``memory_meter.py``), at the Trainer's own hooks in the last step (the
   earlier ones warm up; AdamW's state exists from the first optimizer step on):

   - setup      ``on_train_start``: sharded parameters, optimizer without state
   - after fwd  ``on_before_backward``: activations, units still gathered for backward; Lightning's
                 ``zero_grad`` has just freed the previous step's gradients
   - after bwd  ``on_after_backward``: new (sharded) gradients
   - rest       ``on_train_batch_end``: after the optimizer step
   - peak       the most in use between ``on_train_batch_start`` and ``on_train_batch_end``
                 (forward, backward, clipping, AdamW, logging): activations, gathered parameters
                 and communication buffers (FSDP's and gloo's) included

   Meters (each N and stage runs once per meter, in fresh processes): ``process`` (primary on CPU:
   malloc bytes in use in every thread, counted by ``memcount.c`` loaded with ``LD_PRELOAD``, exact
   peaks; glibc's ``mallinfo2`` and the kernel's peak RSS as cross-checks), ``alloc`` (c10 CPU
   allocator events from ``torch.profiler``: tensors only, main thread; its drift with gloo is
   printed), ``cuda`` (``torch.cuda.memory_allocated`` / ``max_memory_allocated``: the GPU path,
   written but not run on the CPU machine). Each worker first measures a known 100 MiB allocation
   with its meter. Beside the measurements, labelled as such: the *computed* ZeRO accounting (fp32:
   4 B param + 4 B grad + 8 B Adam = 16 B/param, /N) and the *known-tensor* sum (local shards of
   parameters, gradients and optimizer state).

2. Throughput (``--part throughput``; 2 ranks): ``GPTModule`` itself (its ``training_step``
   with ``self.log`` of ``train/loss`` (``sync_dist=True``), ``train/tokens``, ``train/lr`` and
   ``tok/s``; CSV logger, ``log_every_n_steps=10`` as in ``configs/quickstart.yaml``) under our
   ``FSDP2Strategy`` and under Lightning's ``ModelParallelStrategy`` (a subclass whose only change
   is ``configure_model`` calling ``fully_shard``, which that strategy leaves to the user), vs a
   hand-written FSDP2 loop over the same GPT, data, AdamW, cosine schedule and clipping, without
   logging. All three shard alike (``fully_shard`` per block, the last block and the root kept
   gathered after forward, as ``parallel.fsdp.apply_fsdp`` does). Interleaved in the same
   processes, the order rotated every round, so machine noise hits all three; every repeat is a
   fresh model and (for the Lightning variants) a fresh ``Trainer``.

    python benchmarks/bench_fsdp.py --part memory
    python benchmarks/bench_fsdp.py --part throughput --repeats 7
    python benchmarks/bench_fsdp.py --part memory --device cuda --sizes 1   # GPU path: untested so far

Ranks are started here with env:// variables (no torchrun agent); Lightning sees LOCAL_RANK and
does not launch again. Results: printed, and JSON under benchmarks/out/. With one part, ``--record
FILE`` writes it as ``cpu_figures.py`` reads it (``memory_record``, ``throughput_record``; a second
throughput run with ``--append`` joins the first as run B), ``--plot DIR`` draws its figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from functools import partial

from bench_common import (
    MIB,
    OUT_ROOT,
    StepClock,
    dataset,
    header,
    load1,
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
from bench_common import level_at as _at
from bench_common import step_peak as _peak
from record import add_record_options, provenance, record_path, wants_record, write_record

OUT = OUT_ROOT
OURS = "ours: GPTModule + FSDP2Strategy"
HAND = "hand-written FSDP2 loop"
MPS = "GPTModule + Lightning ModelParallelStrategy"
launch = partial(_launch, __file__, OUT)


# ---------------------------------------------------------------------------------------------
# shared pieces (worker processes)


def _imports():
    global L, torch, dist, F, DTensor, DataLoader, DistributedSampler, TensorDataset, GPTModule, FSDP2Strategy
    import lightning as L
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_disttrain import GPTModule
    from lightning_disttrain.strategies import FSDP2Strategy


def gpt_module(args):
    """``GPTModule`` as a user builds it (defaults: AdamW lr 6e-4, wd 0.1, cosine schedule)."""
    return GPTModule(args.preset, vocab_size=args.vocab, model_overrides={"block_size": args.seq})


def shard_like_ours(model, mesh, fully_shard) -> None:
    """By hand, the layout ``apply_fsdp`` gives a GPT with tied embeddings: one unit per block, the
    last block kept gathered after forward (backward needs it first), then the root."""
    n = len(model.blocks)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=mesh)


# ---------------------------------------------------------------------------------------------
# 1. memory


def memory_worker(args) -> None:
    _imports()
    from memory_meter import METERS, self_check

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    check = self_check(METERS[args.meter](), device=args.device)
    # The process group exists before the baseline: its own connections are not the step's memory.
    dist.init_process_group("nccl" if cuda else "gloo")
    comm = collective_check(METERS[args.meter], args.device) if args.meter != "alloc" and _WORLD > 1 else None
    ds = dataset(args, args.mem_steps * args.batch * _WORLD)
    loader = DataLoader(ds, batch_size=args.batch, shuffle=False)  # Lightning adds the DistributedSampler
    meter = METERS[args.meter]()

    L.seed_everything(0)
    module = gpt_module(args)
    probe = phase_probe(meter)
    strategy = FSDP2Strategy(reshard_after_forward=args.stage == "zero3")
    fit = trainer(strategy, args.mem_steps, [probe], accelerator="gpu" if cuda else "cpu")
    meter.start()
    fit.fit(module, loader)
    meter.stop()

    params = list(module.model.parameters())
    opt = fit.optimizers[0]
    known = {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
             "optim": local_bytes(v for s in opt.state.values() for v in s.values())}
    numel = sum(p.numel() for p in params)  # DTensor.numel() is the global size
    block_numel = [sum(p.numel() for p in b.parameters()) for b in module.model.blocks]
    record = {"meter": args.meter, "meter_name": meter.name, "check_mib": check, "comm_mib": comm, "levels": meter.levels,
              "peaks": meter.peaks, "known": known, "numel": numel, "block_numel": block_numel,
              "step": args.mem_steps - 1}
    for extra in ("mallinfo", "rss", "rss_peaks", "reserved"):
        if hasattr(meter, extra):
            record[extra] = getattr(meter, extra)
    (OUT / f"memory_{args.meter}_{args.nprocs}_{args.stage}_rank{_RANK}.json").write_text(json.dumps(record))


def collective_check(meter_cls, device: str, mib: int = 8) -> dict[str, float]:
    """What one collective allocates beyond its own input and output (the backend's buffers): an
    all-gather into ``mib`` MiB and a reduce-scatter from ``mib`` MiB, async + wait as FSDP2 does."""
    out = {}
    full, shard = mib * MIB // 4, mib * MIB // 4 // _WORLD
    for name in ("all_gather", "reduce_scatter"):
        big, small = torch.ones(full, device=device), torch.ones(shard, device=device)
        meter = meter_cls()
        meter.start()
        meter.begin_window(name)
        if name == "all_gather":
            dist.all_gather_into_tensor(big, small, async_op=True).wait()
        else:
            dist.reduce_scatter_tensor(small, big, async_op=True).wait()
        meter.end_window(name)
        meter.stop()
        out[name] = meter.peaks[name] / MIB
        del big, small
    return out


def _mem(meter: str, n: int, stage: str, rank: int = 0) -> dict:
    return json.loads((OUT / f"memory_{meter}_{n}_{stage}_rank{rank}.json").read_text())


def memory_rows(sizes, stages, meter: str) -> list[dict]:
    """Per N and stage, rank 0's numbers of the main table in MiB, from ``meter``'s JSON (the last
    step): the computed state (16 B/param / N) and all-gathered parameters (4 B/param: ZeRO-2 every
    unit, ZeRO-3 the root and the last block), the known tensors, the levels at setup, after forward,
    after backward and at rest, the peak and its phase, rest / computed state and peak - rest."""
    rec = _mem(meter, sizes[0], stages[0])
    k, P, blocks = rec["step"], rec["numel"], rec["block_numel"]
    root = P - sum(blocks)
    rows = []
    for n in sizes:
        for s in stages:
            r = _mem(meter, n, s)
            state = 16 * P / n
            rest, (peak, phase) = _at(r, k, "opt"), _peak(r, k)
            rows.append({"n": n, "stage": s, "computed_state": state / MIB, "known_tensors": sum(r["known"].values()) / MIB,
                         "setup": r["levels"]["setup"] / MIB, "after_fwd": _at(r, k, "fwd") / MIB,
                         "after_bwd": _at(r, k, "bwd") / MIB, "rest": rest / MIB, "peak": peak / MIB, "peak_phase": phase,
                         "rest_over_computed": rest / state, "peak_minus_rest": (peak - rest) / MIB,
                         "computed_gathered": (4 * P if s == "zero2" else 4 * (root + blocks[-1])) / MIB})
    return rows


def memory_record(rows: list[dict], numel: int, step: int, meter_name: str, args) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-fsdp-memory`` from: ``memory_rows`` of the main meter
    (``meter_name``) for a GPT of ``numel`` parameters, at step ``step``."""
    return provenance("bench_fsdp_memory", "bench_fsdp.py", f"{'nccl' if args.device == 'cuda' else 'gloo'}, "
                      f"{omp_threads()}, meter: {meter_name}") | {
        "model": f"GPTModule({args.preset!r}, vocab_size={args.vocab}), {numel:,} parameters, under L.Trainer "
                 f"with FSDP2Strategy(reshard_after_forward=True) (zero3) or False (zero2); fp32, AdamW, clipping 1.0, "
                 f"batch {args.batch} x {args.seq} tokens per rank, {args.mem_steps} steps, step {step} reported, rank 0",
        "unit": "MiB, relative to the same meter just before fit", "rows": rows}


def report_memory(sizes, stages, meters) -> str:
    def f(b: float) -> str:
        return f"{b / MIB:8.2f}"

    lines = []
    for m in meters:
        cs = [_mem(m, n, s, r)["check_mib"] for n in sizes for s in stages for r in range(n)]
        lines.append(f"method check, meter {m!r} ({len(cs)} processes): a 100 MiB tensor (pages written) measured "
                     f"{min(c['alive'] for c in cs):.2f}-{max(c['alive'] for c in cs):.2f} MiB alive, peak "
                     f"{min(c['peak'] for c in cs):.2f}-{max(c['peak'] for c in cs):.2f} MiB, "
                     f"{max(abs(c['after_free']) for c in cs):.2f} MiB left after free")
        if m == "process":
            lines.append(f"  same processes: mallinfo2 {min(c['mallinfo_alive'] for c in cs):.2f}-"
                         f"{max(c['mallinfo_alive'] for c in cs):.2f} MiB alive, RSS peak "
                         f"{min(c['rss_peak'] for c in cs):.2f}-{max(c['rss_peak'] for c in cs):.2f} MiB")
    comm = [_mem(m, n, s, r)["comm_mib"] for m in meters for n in sizes if n > 1 for s in stages for r in range(n)]
    comm = [c for c in comm if c]
    if comm:
        lines.append(f"communication buffers ({len(comm)} processes, N > 1, measured before fit): beyond its own input and "
                     f"output, an all-gather into 8 MiB peaks at +{min(c['all_gather'] for c in comm):.2f}-"
                     f"{max(c['all_gather'] for c in comm):.2f} MiB, a reduce-scatter from 8 MiB at "
                     f"+{min(c['reduce_scatter'] for c in comm):.2f}-{max(c['reduce_scatter'] for c in comm):.2f} MiB")
    rec = _mem(meters[0], sizes[0], stages[0])
    k = rec["step"]
    P, blocks = rec["numel"], rec["block_numel"]
    root = P - sum(blocks)
    lines += ["", (f"GPT: {P:,} parameters ({len(blocks)} blocks of {blocks[0]:,}; root = embeddings, tied head, final "
                   f"norm: {root:,}). Step {k} (steps 0..{k} ran), rank 0, MiB, relative to the same meter just before fit."),
              "computed (not measured): state = 16 B/param / N (fp32 param 4 + grad 4 + AdamW 8); gathered = parameters",
              "  all-gathered after forward, 4 B/param: ZeRO-2 all units, ZeRO-3 the root + last block (kept for backward).",
              "known tensors (summed, not measured): local shards of parameters + gradients + AdamW state after fit.",
              "setup = on_train_start; after fwd / after bwd = on_before_backward / on_after_backward; rest = after the",
              "  optimizer step (on_train_batch_end); peak = the most in use during the step, and the phase it fell in",
              "  (fwd: forward + loss; bwd: backward incl. reduce-scatter; opt: clipping + AdamW + logging)."]
    main = next(m for m in ("process", "cuda", "alloc") if m in meters)
    if main is not None:
        lines += ["", f"measured: {_mem(main, sizes[0], stages[0])['meter_name']}",
                  (f"{'N':>2} {'stage':5} | {'computed':>8} {'known':>8} | {'setup':>8} {'after':>8} {'after':>8}"
                   f" {'rest':>8} {'peak':>8} {'in':>3} | {'rest /':>8} {'peak -':>8} | {'computed':>8}"),
                  (f"{'':>2} {'':5} | {'state':>8} {'tensors':>8} | {'':>8} {'fwd':>8} {'bwd':>8} {'':>8} {'':>8}"
                   f" {'':>3} | {'computed':>8} {'rest':>8} | {'gathered':>8}")]
        spread, drift = [], []
        for row in memory_rows(sizes, stages, main):
            n, s = row["n"], row["stage"]
            lines.append(f"{n:>2} {s:5} | {row['computed_state']:8.2f} {row['known_tensors']:8.2f} | "
                         f"{row['setup']:8.2f} {row['after_fwd']:8.2f} {row['after_bwd']:8.2f} {row['rest']:8.2f} "
                         f"{row['peak']:8.2f} {row['peak_phase']:>3} | {row['rest_over_computed']:8.3f} "
                         f"{row['peak_minus_rest']:8.2f} | {row['computed_gathered']:8.2f}")
            rs = [_mem(main, n, s, rank) for rank in range(n)]
            drift += [abs(_at(x, k, "opt") - _at(x, k - 1, "opt")) for x in rs]
            spread += [max(_at(x, k, "opt") for x in rs) - min(_at(x, k, "opt") for x in rs),
                       max(_peak(x, k)[0] for x in rs) - min(_peak(x, k)[0] for x in rs)]
        lines.append(f"ranks differ by at most {max(spread) / MIB:.2f} MiB in rest and peak (every N and stage); rest "
                     f"changed from step {k - 1} to step {k} by at most {max(drift) / MIB:.2f} MiB (any rank)")
    if "process" in meters:
        lines += ["", "cross-checks, same processes: mallinfo2 = glibc's bytes in use; RSS peak = kernel VmHWM over the step",
                  "(reset at each phase start); glibc's caching off (MALLOC_MMAP_THRESHOLD_=65536, MALLOC_TRIM_THRESHOLD_=0)."]
        if "alloc" in meters:
            lines += ["c10 = torch.profiler CPU-allocator events (tensors only; separate processes): rest, peak, and its drift",
                      f"  = rest at step {k} minus rest at step {k - 1}, max over ranks (frees on gloo threads go unreported)."]
        head = f"{'N':>2} {'stage':5} | {'mallinfo2':>9} {'RSS':>8}"
        head2 = f"{'':>2} {'':5} | {'rest':>9} {'peak':>8}"
        if "alloc" in meters:
            head += f" | {'c10':>8} {'c10':>8} {'c10':>8}"
            head2 += f" | {'rest':>8} {'peak':>8} {'drift':>8}"
        lines += [head, head2]
        for n in sizes:
            for s in stages:
                r = _mem("process", n, s)
                line = f"{n:>2} {s:5} | {_at(r, k, 'opt', 'mallinfo') / MIB:9.2f} {f(_peak(r, k, 'rss_peaks')[0])}"
                if "alloc" in meters:
                    c = _mem("alloc", n, s)
                    d = max(_at(x, k, "opt") - _at(x, k - 1, "opt") for x in (_mem("alloc", n, s, q) for q in range(n)))
                    line += f" | {f(_at(c, k, 'opt'))} {f(_peak(c, k)[0])} {f(d)}"
                lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 2. throughput


def throughput_worker(args) -> None:
    _imports()
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_disttrain.models.gpt import GPT
    from lightning_disttrain.optim import build_optimizer, build_scheduler

    world = _WORLD
    total = args.warmup + args.steps
    n_samples = total * args.batch * world
    ds = dataset(args, n_samples)
    dist.init_process_group("gloo")  # Lightning's strategies find it initialised and keep it

    class GPTModuleForModelParallel(GPTModule):
        """What a user of ModelParallelStrategy adds: the sharding, in configure_model. Nothing else."""

        def configure_model(self):
            if self.model is not None:
                return
            super().configure_model()
            shard_like_ours(self.model, self.device_mesh["data_parallel"], fully_shard)

    def lightning_run(strategy, module_cls, tag) -> list[float]:
        L.seed_everything(0)
        timer = step_timer(args.warmup, losses=False)
        logger = CSVLogger(OUT / "throughput_logs", name=tag)
        trainer(strategy, total, [timer], logger=logger).fit(
            module_cls(args.preset, vocab_size=args.vocab, model_overrides={"block_size": args.seq}),
            DataLoader(ds, batch_size=args.batch, shuffle=False))
        return timer.step_times()

    def hand_loop() -> list[float]:
        torch.manual_seed(0)
        ref = gpt_module(args)  # only for its config and hyper-parameters
        hp = ref.hparams
        model = GPT(ref.config)
        shard_like_ours(model, init_device_mesh("cpu", (world,)), fully_shard)
        opt = build_optimizer(model, "adamw", lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas),
                              eps=hp.eps)
        sched = build_scheduler(opt, schedule=hp.schedule, warmup_steps=hp.warmup_steps, total_steps=total,
                                min_lr_ratio=hp.min_lr_ratio, decay_fraction=hp.decay_fraction)
        loader = DataLoader(ds, batch_size=args.batch,
                            sampler=DistributedSampler(ds, num_replicas=world, rank=dist.get_rank(), shuffle=False))
        vocab = ref.config.vocab_size
        clock = StepClock(args.warmup)
        for x, y in clock.steps(loader):
            logits = model(x)[..., :vocab].float()  # the loss GPTModule computes (padding columns cut)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return clock.step_times()

    variants = {
        OURS: lambda: lightning_run(FSDP2Strategy(), GPTModule, "ours"),
        HAND: hand_loop,
        MPS: lambda: lightning_run(ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                                   GPTModuleForModelParallel, "mps"),
    }
    rotated_rounds(variants, args.repeats, OUT / "throughput.json",
                   {"tokens_per_step": args.batch * args.seq * world, "args": vars(args)}, losses=False)


def throughput_record(data: dict, start: str, load_start: float, load_end: float, seconds: float,
                      run: str = "A") -> dict:
    """What ``cpu_figures.py`` draws ``cpu-fsdp-throughput`` from: this run (``data``: the workers'
    ``throughput.json``; started at ``start`` UTC, the load average at its start and end, its wall
    seconds; labelled ``run``) with each variant's s/step per repeat (the mean over the repeat's timed steps), their
    min / median / max and tok/s, and against the hand-written loop best-of, ratio of the medians
    and per round."""
    a, tok = data["args"], data["tokens_per_step"]
    per_rep = {k: [sum(v) / len(v) for v in reps] for k, reps in data["steps"].items()}
    variants = []
    for k, v in per_rep.items():
        row = {"variant": k, "s_per_step": v, "min": min(v), "median": statistics.median(v), "max": max(v),
               "tok_s_best": tok / min(v), "tok_s_median": tok / statistics.median(v)}
        if k != HAND:
            rounds = [h / x for h, x in zip(per_rep[HAND], v)]
            row |= {"vs_hand_best_of": min(per_rep[HAND]) / min(v),
                    "vs_hand_median": statistics.median(per_rep[HAND]) / statistics.median(v),
                    "per_round_min": min(rounds), "per_round_median": statistics.median(rounds),
                    "per_round_max": max(rounds)}
        variants.append(row)
    return provenance("bench_fsdp_throughput", "bench_fsdp.py", f"gloo, {omp_threads()}") | {
        "setting": f"preset {a['preset']}, vocab {a['vocab']}, seq {a['seq']}, batch {a['batch']}/rank on 2 ranks, "
                   f"{a['steps']} timed steps after {a['warmup']} warm-up, {a['repeats']} interleaved repeats, order "
                   f"rotated each round; rank 0",
        "tokens_per_step": tok, "target_vs_hand": 0.95,
        "runs": [{"run": run, "date": start, "load_start": load_start, "load_end": load_end,
                  "load_before_round": [r["load1_before"] for r in data["rounds"]], "seconds": seconds,
                  "variants": variants}]}


def report_throughput() -> str:
    data = json.loads((OUT / "throughput.json").read_text())
    a = data["args"]
    return rounds_report(
        data, (f"Throughput on 2 ranks (preset {a['preset']}, vocab {a['vocab']}, seq {a['seq']}, batch "
               f"{a['batch']}/rank, {a['steps']} timed steps after {a['warmup']} warm-up, {a['repeats']} interleaved "
               f"repeats, order rotated each round; rank 0)"),
        ratios=[(HAND, OURS), (HAND, MPS)], short={OURS: "ours", HAND: "hand", MPS: "mps"})


# ---------------------------------------------------------------------------------------------


def main() -> None:
    p = parser(__doc__, steps=(15, "throughput: timed steps per repeat"),
               warmup=(3, "throughput: untimed steps before them"), repeats=(7, "throughput: interleaved rounds"),
               worker=["memory", "throughput"])
    p.add_argument("--part", choices=["all", "memory", "throughput"], default="all")
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab", type=int, default=257, help="257: the byte tokenizer")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--sizes", default="1,2,4", help="memory: world sizes")
    p.add_argument("--stages", default="zero3,zero2", help="memory: ZeRO stages")
    p.add_argument("--meters", default=None, help="memory: alloc,process on CPU (default); cuda on GPU")
    p.add_argument("--mem-steps", type=int, default=3, help="memory: steps; the last one is reported")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="memory: cuda = the GPU path (untested)")
    p.add_argument("--stage", choices=["zero3", "zero2"], help=argparse.SUPPRESS)
    p.add_argument("--meter", choices=["alloc", "process", "cuda"], help=argparse.SUPPRESS)
    add_record_options(p, "cpu-fsdp-memory (--part memory) or cpu-fsdp-throughput (--part throughput)",
                       append="throughput run (labelled with the next letter)")
    args = p.parse_args()
    if wants_record(args) and args.part == "all":
        p.error("--record and --plot: one part (--part memory or --part throughput), one record")
    if args.mem_steps < 2:
        p.error("--mem-steps must be >= 2: the last step is reported and compared with the one before")
    OUT.mkdir(parents=True, exist_ok=True)
    if args.worker == "memory":
        return memory_worker(args)
    if args.worker == "throughput":
        return throughput_worker(args)

    common = ["--preset", args.preset, "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch", str(args.batch)]
    header("bench_fsdp", "nccl" if args.device == "cuda" else "gloo", omp_threads())
    if args.part in ("all", "memory"):
        sizes = [int(s) for s in args.sizes.split(",")]
        stages = args.stages.split(",")
        meters = (args.meters or ("cuda" if args.device == "cuda" else "process,alloc")).split(",")
        with part("memory"):
            # process: malloc counted in every thread; glibc's caching off for RSS
            env = {}
            if "process" in meters:
                env = memcount_env(OUT, "--meters process", "; use --meters alloc without one")
            for n in sizes:
                for stage in stages:
                    for meter in meters:
                        launch(n, f"memory_{meter}_{n}_{stage}",
                               ["--worker", "memory", *common, "--mem-steps", str(args.mem_steps), "--device",
                                args.device, "--stage", stage, "--meter", meter],
                               extra_env=env if meter == "process" else {})
            print(report_memory(sizes, stages, meters))
        if wants_record(args):
            main = next(m for m in ("process", "cuda", "alloc") if m in meters)
            rec = _mem(main, sizes[0], stages[0])
            write_record(memory_record(memory_rows(sizes, stages, main), rec["numel"], rec["step"], rec["meter_name"],
                                       args), record_path(args, OUT / "bench_fsdp_memory.json"), args.plot, args.format)
    if args.part in ("all", "throughput"):
        start, load_start, t0 = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", load1(), time.perf_counter()
        with part("throughput"):
            launch(2, "throughput", ["--worker", "throughput", *common, "--steps", str(args.steps), "--warmup",
                                     str(args.warmup), "--repeats", str(args.repeats)])
            print(report_throughput())
        if wants_record(args):
            path = record_path(args, OUT / "bench_fsdp_throughput.json")
            run = chr(ord(json.loads(path.read_text())["runs"][-1]["run"]) + 1) if args.append else "A"
            data = throughput_record(json.loads((OUT / "throughput.json").read_text()), start, load_start, load1(),
                                     time.perf_counter() - t0, run)
            write_record(data, path, args.plot, args.format, append="runs" if args.append else None)


if __name__ == "__main__":
    main()
