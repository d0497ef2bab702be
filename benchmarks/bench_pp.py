"""Pipeline parallel on CPU ranks (gloo): the bubble per schedule, activation memory 1F1B vs GPipe,
and throughput through ``L.Trainer`` against a hand-written ``torch.distributed.pipelining`` loop.

    python benchmarks/bench_pp.py [--part all|bubble|memory|throughput|bubble+memory] [--record FILE] [--plot DIR]

1. Bubble. Each rank times the compute torch's stages run (``forward_one_chunk``,
   ``backward_one_chunk``, ``backward_weight_one_chunk``: wall clock around each call) and the
   whole schedule step; idle = 1 - compute / step, per rank, median over the timed steps, then
   the mean over ranks. Every micro-batch holds the same samples (``--mb-size``), so m micro-batches
   are m times the work. Theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for the
   interleaved schedule with v stages per rank (Megatron's bubble over the pipeline's total time);
   ZBVZeroBubble has none in theory when forward, input-gradient and weight-gradient cost the same,
   which they do not here (printed without a theory column). What counts as idle: waiting on a
   neighbour, the sends and receives themselves, the loss, the schedule's own Python. p=4 runs
   4 ranks on this machine's 2 cores: ranks share a core, so their compute timings stretch; read
   those rows as indicative only.
2. Activation memory per stage, GPipe vs 1F1B (p=2, m=8): the malloc peak over one schedule step
   minus the level before it (``memcount.so``, every thread; ``memory_meter.ProcessMeter``).
   GPipe runs every forward before any backward, so stage s holds m micro-batches of activations;
   1F1B holds at most p - s. The ratio GPipe/1F1B is expected near m/(p-s): 4 on stage 0, 8 on
   stage 1 (the logits of a micro-batch count there too).
3. Throughput: ``L.Trainer(strategy=NDParallelStrategy(pp=2, pp_schedule="1F1B"))`` vs a hand
   loop over the same model: each rank deletes the blocks it does not run, wraps its part in a
   ``PipelineStage``, steps ``Schedule1F1B``, clips by the norm over both stages (one all-reduce),
   AdamW, the same LR schedule; and that loop with FSDP2 on each rank's 1-rank data-parallel mesh,
   which is what ours runs at dp=1 (it separates FSDP's cost from the rest of ours). Interleaved
   repeats, order rotated each round; losses compared.

``--record FILE`` writes parts 1 and 2 as ``cpu_figures.py`` reads them (``record``); ``--plot DIR``
draws ``cpu-pp-bubble-memory`` from that record.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from functools import partial

from bench_common import OUT_ROOT, StepClock, header, memcount_env, parser, part, rounds_report
from bench_common import launch as _launch
from record import add_record_options, provenance, record_path, wants_record, write_record

OUT = OUT_ROOT / "pp"
OURS = "ours: L.Trainer + NDParallelStrategy(pp=2)"
HAND = "hand-written PipelineStage + Schedule1F1B loop"
HAND_FSDP = "the hand loop + FSDP2 on each rank's 1-rank mesh"
SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)]
launch = partial(_launch, __file__, OUT)


def model_kwargs(args) -> dict:
    return dict(n_layer=args.layers, n_embd=args.n_embd, n_head=args.n_head, n_kv_head=args.n_head,
                mlp_hidden=4 * args.n_embd, block_size=args.seq, tie_embeddings=False, vocab_size=args.vocab)


def gpt_module(args, total_steps: int):
    from lightning_disttrain.module import GPTModule

    kw = model_kwargs(args)
    vocab = kw.pop("vocab_size")
    return GPTModule("tiny", vocab_size=vocab, model_overrides=kw, lr=1e-3, weight_decay=0.1, warmup_steps=2,
                     max_steps=total_steps)


# ---------------------------------------------------------------------------------------------
# 1 + 2. the schedule alone: bubble and activation memory


class StageClock:
    """Wall time inside the stages' compute calls (class-level wrappers, this benchmark only)."""

    def __init__(self) -> None:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.busy = 0.0
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            original = getattr(_PipelineStageBase, name)

            def timed(stage, *a, __original=original, **kw):
                t0 = time.perf_counter()
                try:
                    return __original(stage, *a, **kw)
                finally:
                    self.busy += time.perf_counter() - t0

            setattr(_PipelineStageBase, name, timed)


def _runner(args, schedule: str, v: int, m: int, pp_group, rank: int, world: int):
    import torch

    from lightning_disttrain.parallel.pipeline import (
        PipelineOptions,
        PipelineRunner,
        split_blocks,
        split_model,
        stage_ids,
    )

    torch.manual_seed(0)
    module = gpt_module(args, 10)
    module.configure_model()
    plan = module.parallel_plan()
    options = PipelineOptions(schedule, microbatches=m, stages_per_rank=v if v > 1 else None)
    n_stages = options.num_stages(world)
    ranges = split_blocks(args.layers, n_stages)
    local = stage_ids(rank, world, options)
    modules = split_model(plan.pipeline, plan.blocks, ranges, local)
    runner = PipelineRunner(modules, local, n_stages, options, world, pp_group, torch.device("cpu"))
    return module, runner, [list(r) for r in ranges]


def _loss(module):
    import torch.nn.functional as F

    def loss(logits, target):
        return F.cross_entropy(logits[..., :module.config.vocab_size].float().flatten(0, 1), target.flatten())

    return loss


def schedule_worker(args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    clock = StageClock()
    g = torch.Generator().manual_seed(0)
    results = []
    meter = None
    if args.worker == "memory":
        from memory_meter import ProcessMeter

        meter = ProcessMeter()
        meter.start()
    cases = [(s, v, m) for s, v in SCHEDULES for m in args.ms] if args.worker == "bubble" else \
        [(s, 1, args.mem_m) for s in ("GPipe", "1F1B")]
    for schedule, v, m in cases:
        if m < v * world:
            results.append({"schedule": schedule, "v": v, "m": m, "skipped": f"m < {v * world} stages"})
            continue
        module, runner, ranges = _runner(args, schedule, v, m, None, rank, world)
        x = torch.randint(0, args.vocab, (m * args.mb_size, args.seq), generator=g)
        y = torch.randint(0, args.vocab, (m * args.mb_size, args.seq), generator=g)
        loss = _loss(module)
        idle, peaks = [], []
        for step in range(args.warmup + args.timed):
            for p in module.parameters():  # gradients stay allocated after the first step: the
                if p.grad is not None:       # peaks below are activations (and their temporaries)
                    p.grad.zero_()
            gc.collect()
            dist.barrier()
            clock.busy = 0.0
            if meter is not None:
                meter.begin_window(f"{schedule}.{step}")
            t0 = time.perf_counter()
            runner.run(x, y, loss, train=True)
            wall = time.perf_counter() - t0
            if meter is not None:
                meter.end_window(f"{schedule}.{step}")
                peaks.append(meter.peaks[f"{schedule}.{step}"] - meter.levels[f"{schedule}.{step}:begin"])
            if step >= args.warmup:
                idle.append({"wall": wall, "busy": clock.busy})
        results.append({"schedule": schedule, "v": v, "m": m, "steps": idle, "peaks": peaks, "ranges": ranges})
        del module, runner
    (OUT / f"{args.worker}_p{world}.rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def theory(schedule: str, v: int, m: int, p: int) -> float | None:
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if schedule == "Interleaved1F1B":
        return (p - 1) / (v * m + p - 1)
    return None


def bubble_rows(worlds: list[int]) -> list[dict]:
    """Per pipeline degree and case, from the ranks' JSON: the bubble (median over the timed steps per
    rank; mean, least and greatest over ranks), the theory, the median step of rank 0, or why the
    case was not run."""
    rows = []
    for p in worlds:
        per_rank = [json.loads((OUT / f"bubble_p{p}.rank{r}.json").read_text()) for r in range(p)]
        for i, case in enumerate(per_rank[0]):
            row = {"p": p, "schedule": case["schedule"], "v": case["v"], "m": case["m"]}
            if "skipped" in case:
                rows.append(row | {"measured": None, "ranks_min": None, "ranks_max": None, "theory": None,
                                   "step_s": None, "not_run": case["skipped"]})
                continue
            fr = [statistics.median(1 - s["busy"] / s["wall"] for s in rr[i]["steps"]) for rr in per_rank]
            rows.append(row | {"measured": statistics.mean(fr), "ranks_min": min(fr), "ranks_max": max(fr),
                               "theory": theory(case["schedule"], case["v"], case["m"], p),
                               "step_s": statistics.median(s["wall"] for s in per_rank[0][i]["steps"])})
    return rows


def report_bubble(rows: list[dict]) -> str:
    lines = ["Bubble: idle fraction of the schedule step = 1 - (time in the stages' forward/backward calls) / "
             "(step time); median over the timed steps per rank, then mean (min-max) over ranks",
             f"{'p':>2} {'schedule':16} {'v':>2} {'m':>3} {'measured':>9} {'ranks min-max':>14} {'theory':>7} "
             f"{'step s':>7}"]
    for r in rows:
        case = f"{r['p']:>2} {r['schedule']:16} {r['v']:>2} {r['m']:>3}"
        if r["measured"] is None:
            lines.append(f"{case}   ({r['not_run']})")
            continue
        t = r["theory"]
        lines.append(f"{case} {r['measured']:9.3f} {r['ranks_min']:6.3f}-{r['ranks_max']:.3f} "
                     f"{'' if t is None else f'{t:.3f}':>7} {r['step_s']:7.3f}")
    return "\n".join(lines)


def memory_rows(p: int) -> tuple[int, list[dict]]:
    """m, and per stage from the ranks' JSON: GPipe's and 1F1B's activation memory (MiB; median,
    least and greatest over the timed steps), their ratio and the expected m / (p - stage)."""
    per_rank = [json.loads((OUT / f"memory_p{p}.rank{r}.json").read_text()) for r in range(p)]
    m = per_rank[0][0]["m"]
    rows = []
    for r in range(p):
        by = {c["schedule"]: [x / 2**20 for x in c["peaks"][-len(c["steps"]):]] for c in per_rank[r]}
        g, o = statistics.median(by["GPipe"]), statistics.median(by["1F1B"])
        rows.append({"stage": r, "gpipe": g, "gpipe_min": min(by["GPipe"]), "gpipe_max": max(by["GPipe"]),
                     "one_f_one_b": o, "one_f_one_b_min": min(by["1F1B"]), "one_f_one_b_max": max(by["1F1B"]),
                     "gpipe_over_1f1b": g / o, "expected": m / (p - r)})
    return m, rows


def report_memory(p: int, m: int, rows: list[dict]) -> str:
    lines = [f"Activation memory per stage, p={p}, m={m}: malloc peak during one schedule step minus the level "
             f"before it (MiB); median over the timed steps (min-max)",
             f"{'stage':>5} {'GPipe':>16} {'1F1B':>16} {'GPipe/1F1B':>10} {'expected m/(p-s)':>16}"]
    for r in rows:
        lines.append(f"{r['stage']:>5} {r['gpipe']:7.1f} ({r['gpipe_min']:.0f}-{r['gpipe_max']:.0f}) "
                     f"{r['one_f_one_b']:7.1f} ({r['one_f_one_b_min']:.0f}-{r['one_f_one_b_max']:.0f}) "
                     f"{r['gpipe_over_1f1b']:10.2f} {r['expected']:16.1f}")
    return "\n".join(lines)


def record(bubble: list[dict], p: int, m: int, memory: list[dict], args) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-pp-bubble-memory`` from: ``bubble_rows`` and, at pipeline
    degree ``p`` with ``m`` micro-batches, ``memory_rows``."""
    return provenance("bench_pp_bubble_memory", "bench_pp.py", "gloo, one thread per rank") | {
        "model": f"GPT with {args.layers} layers, n_embd {args.n_embd}, {args.n_head} heads, vocabulary {args.vocab}, "
                 f"seq {args.seq}, fp32; split_model + PipelineRunner (torch's schedules) without the Trainer, "
                 f"micro-batches of {args.mb_size} samples",
        "bubble_rows": bubble, "memory_p": p, "memory_m": m, "memory_rows": memory}


# ---------------------------------------------------------------------------------------------
# 3. throughput


def throughput_worker(args) -> None:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, DistributedSampler

    from bench_common import dataset, rotated_rounds, step_timer, trainer
    from lightning_disttrain.optim import build_optimizer, build_scheduler
    from lightning_disttrain.strategies import NDParallelStrategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the strategy finds it initialised and keeps it
    rank, world = dist.get_rank(), dist.get_world_size()
    total = args.warmup + args.steps
    ds = dataset(args, total * args.batch)  # one pipeline: both ranks read every batch

    def ours():
        L.seed_everything(0)
        timer = step_timer(args.warmup)
        strategy = NDParallelStrategy(pp=world, pp_schedule="1F1B", pp_microbatches=args.microbatches)
        trainer(strategy, total, [timer]).fit(gpt_module(args, total),
                                              DataLoader(ds, batch_size=args.batch, shuffle=False))
        return timer.step_times(), timer.losses

    def hand(fsdp: bool = False):
        torch.manual_seed(0)
        ref = gpt_module(args, total)  # its config and hyper-parameters; the same initial weights
        ref.configure_model()
        hp, model = ref.hparams, ref.model
        per = args.layers // world
        keep = set(range(rank * per, (rank + 1) * per))
        for key in [k for k in model.blocks.keys() if int(k) not in keep]:
            del model.blocks[key]
        if rank > 0:
            model.wte, model.wpe = None, None
        if rank < world - 1:
            model.ln_f, model.lm_head = None, None
        if fsdp:  # what ours does at dp=1 (every block and the stage root, no resharding after forward)
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            dp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp_shard"))["dp_shard"]
            for block in model.blocks.values():
                fully_shard(block, mesh=dp, reshard_after_forward=False)
            fully_shard(model, mesh=dp, reshard_after_forward=False)
        stage = PipelineStage(model, rank, world, torch.device("cpu"))

        def loss_fn(logits, target):  # over the real vocabulary (the head's padding rows cut off)
            logits = logits[..., :args.vocab].float()
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()) / args.microbatches

        schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=loss_fn, scale_grads=False)
        params = [p for p in model.parameters()]
        opt = build_optimizer(model, "adamw", lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas),
                              eps=hp.eps)
        sched = build_scheduler(opt, schedule=hp.schedule, warmup_steps=hp.warmup_steps, total_steps=total,
                                min_lr_ratio=hp.min_lr_ratio, decay_fraction=hp.decay_fraction)
        # the batches Lightning feeds ours: its DistributedSampler over the 1 data-parallel rank
        loader = DataLoader(ds, batch_size=args.batch,
                            sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0))
        clock, losses = StepClock(args.warmup), []
        for x, y in clock.steps(loader):
            out = []
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=out)
            loss = torch.stack(out).sum() if out else torch.zeros(())
            dist.broadcast(loss, src=world - 1)  # the loss to every rank, as ours logs it
            losses.append(float(loss))
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
            sq = torch.stack([g.pow(2).sum() for g in grads]).sum()
            dist.all_reduce(sq)  # the norm over both stages; then clip as clip_grads_with_norm_ does
            coef = (1.0 / (sq.sqrt() + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return clock.step_times(), losses

    variants = {OURS: ours, HAND: hand, HAND_FSDP: lambda: hand(fsdp=True)}
    rotated_rounds(variants, args.repeats, OUT / "throughput.json",
                   {"tokens_per_step": args.batch * args.seq, "args": vars(args)})


def report_throughput() -> str:
    data = json.loads((OUT / "throughput.json").read_text())
    a = data["args"]
    return rounds_report(
        data, (f"Throughput on 2 ranks, pp=2 1F1B, {a['microbatches']} micro-batches ({a['layers']} layers, n_embd "
               f"{a['n_embd']}, vocab {a['vocab']}, seq {a['seq']}, batch {a['batch']}; {a['steps']} timed steps after "
               f"{a['warmup']} warm-up, {a['repeats']} interleaved repeats, order rotated each round; rank 0)"),
        ratios=[(HAND, OURS), (HAND_FSDP, OURS)], short={OURS: "ours", HAND: "hand", HAND_FSDP: "hand+fsdp"})


def main() -> None:
    p = parser(__doc__, steps=(10, "throughput: timed steps per repeat"), warmup=(2, "untimed steps first"),
               repeats=(5, "throughput: interleaved rounds"), worker=["bubble", "memory", "throughput"])
    p.add_argument("--part", choices=["all", "bubble", "memory", "throughput", "bubble+memory"], default="all")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mb-size", type=int, default=2, help="bubble/memory: samples per micro-batch")
    p.add_argument("--ms", default="2,4,8", help="bubble: micro-batch counts")
    p.add_argument("--worlds", default="2,4", help="bubble: pipeline degrees (= ranks)")
    p.add_argument("--mem-m", type=int, default=8, help="memory: micro-batches")
    p.add_argument("--timed", type=int, default=5, help="bubble/memory: timed schedule steps per case")
    p.add_argument("--batch", type=int, default=8, help="throughput: samples per step")
    p.add_argument("--microbatches", type=int, default=4, help="throughput: micro-batches per step")
    add_record_options(p, "cpu-pp-bubble-memory (bubble and memory parts)")
    args = p.parse_args()
    if wants_record(args) and args.part not in ("all", "bubble+memory"):
        p.error("--record and --plot need the bubble and memory parts (--part all or bubble+memory)")
    args.ms = [int(m) for m in str(args.ms).split(",")]
    OUT.mkdir(parents=True, exist_ok=True)
    if args.worker in ("bubble", "memory"):
        return schedule_worker(args)
    if args.worker == "throughput":
        return throughput_worker(args)

    common = ["--layers", str(args.layers), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
              "--vocab", str(args.vocab), "--seq", str(args.seq), "--warmup", str(args.warmup)]
    header("bench_pp", "gloo", "one thread per rank")
    sched_args = [*common, "--mb-size", str(args.mb_size), "--timed", str(args.timed)]
    if args.part in ("all", "bubble", "bubble+memory"):
        with part("bubble"):
            worlds = [int(w) for w in args.worlds.split(",")]
            for world in worlds:
                launch(world, f"bubble_p{world}",
                       ["--worker", "bubble", *sched_args, "--ms", ",".join(map(str, args.ms))])
            bubble = bubble_rows(worlds)
            print(report_bubble(bubble))
    if args.part in ("all", "memory", "bubble+memory"):
        with part("memory"):
            launch(2, "memory_p2", ["--worker", "memory", *sched_args, "--mem-m", str(args.mem_m)],
                   extra_env=memcount_env(OUT))
            mem_m, memory = memory_rows(2)
            print(report_memory(2, mem_m, memory))
    if wants_record(args):
        write_record(record(bubble, 2, mem_m, memory, args), record_path(args, OUT / "bench_pp_bubble_memory.json"),
                     args.plot, args.format)
    if args.part in ("all", "throughput"):
        with part("throughput"):
            launch(2, "throughput", ["--worker", "throughput", *common, "--batch", str(args.batch), "--microbatches",
                                     str(args.microbatches), "--steps", str(args.steps), "--repeats",
                                     str(args.repeats)], timeout=1500)
            print(report_throughput())


if __name__ == "__main__":
    main()
