"""Context parallel (ring attention): peak memory per rank against sequence length, the longest
sequence within a per-rank budget for cp = 1, 2, 4, and step time of cp=2 against cp=1 with the
share of the ring's transfers that the compute hides.

Memory: each rank of a cp group (cp = 1, 2, 4 processes) runs one forward and backward of a GPT
preset (``tiny``, ``small``; byte vocabulary, batch 1) on its shard of one sequence, under
``torch.profiler`` with memory events: every allocation and free of the CPU allocator replayed in
order gives the step's peak above what was allocated before it (activations, logits, the ring's
chunks in flight, the gradients; not the parameters), and what the forward kept for backward. The
rank that peaks highest is the row's figure. The longest sequence within ``--budget-mib`` per rank
is computed from the measured points (linear between them, beyond the last along the last two:
marked as computed).

Throughput (2 ranks, forward + backward of ``tiny``, no optimizer or gradient sync, the same for
all): ``cp2`` shards each sequence over the 2 ranks (ring attention as it runs: each transfer in
flight while a block computes); ``cp2_serial`` the same with every ring transfer
(``comm.ring_shift``) waited on as soon as it starts (no overlap); ``cp1`` gives each rank a whole
sequence (data parallel). Rounds rotate the three; tokens/s counts the tokens both ranks
processed. The transfers of one cp2 step are then replayed alone, each waited on at once (their
whole time). Hidden by the overlap, round by round (computed): (cp2_serial - cp2) / alone.

    python benchmarks/bench_cp.py                              # the recorded run (section 17)
    python benchmarks/bench_cp.py --presets tiny --seqs 256 512 --throughput-seq 512 --repeats 2
    python benchmarks/bench_cp.py --out benchmarks/results/cpu-2026-12-04/bench_cp.json --plot docs/img
"""

from __future__ import annotations

import json
import statistics
import time

from bench_common import HERE, MIB, header, launch, part, parser, report, spread, table
from cpu_figures import longest_within
from record import add_record_options, plot_record, provenance

OUT = HERE / "out" / "cp"
SEQS = {"tiny": [1024, 2048, 4096, 8192], "small": [512, 1024, 2048, 4096]}
BUDGET_MIB = {"tiny": 256.0, "small": 512.0}
VOCAB = 256


def _model(preset: str, seq: int):
    import torch

    from lightning_disttrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig.from_name(preset, vocab_size=VOCAB, block_size=seq))


def _init():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    return init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if world > 1 else None


def _tokens(seq: int, rank: int, size: int, seed: int = 1):
    import torch

    from lightning_disttrain.models.context_parallel import shard_sequence

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
    inp, tgt = x[:, :-1], x[:, 1:]
    return (shard_sequence(inp, 1, rank, size), shard_sequence(tgt, 1, rank, size)) if size > 1 else (inp, tgt)


def _loss(model, x, y):
    import torch.nn.functional as F

    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def step_memory(step) -> dict[str, int]:
    """Run ``step(mark)`` (it wraps its forward in ``mark("forward")`` and its backward in
    ``mark("backward")``) under the profiler; bytes above the level before the step: the peak over
    forward and backward, and the level the forward ended at (kept for backward)."""
    import itertools

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(lambda name: record_function("mark::" + name))
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    spans = {e.name()[6:]: (e.start_ns(), e.end_ns()) for e in events if e.name().startswith("mark::")}
    running = list(itertools.accumulate(n for _, n in mem))
    start, end = spans["forward"][0], spans["backward"][1]
    before = [r for (t, _), r in zip(mem, running) if t < start]
    base = before[-1] if before else 0
    inside = [r for (t, _), r in zip(mem, running) if start <= t <= end]
    forward = [r for (t, _), r in zip(mem, running) if t <= spans["forward"][1]]
    return {"peak": max(inside) - base, "kept": forward[-1] - base}


def memory_worker(args) -> None:
    import torch.distributed as dist

    from lightning_disttrain.parallel.context import apply_context_parallel

    mesh = _init()
    rank, size = dist.get_rank(), dist.get_world_size()
    rows = []
    for preset in args.presets:
        for seq in SEQS[preset] if args.seqs is None else args.seqs:
            model = _model(preset, seq)
            if mesh is not None:
                apply_context_parallel(model, mesh)
            x, y = _tokens(seq, rank, size)

            def step(mark, model=model, x=x, y=y):
                with mark("forward"):
                    loss = _loss(model, x, y)
                with mark("backward"):
                    loss.backward()

            step_memory(step)  # warm-up: first-call allocations (thread pools, caches) out of the figure
            model.zero_grad(set_to_none=True)
            rows.append({"preset": preset, "seq": seq, "cp": size, "rank": rank, **step_memory(step)})
    gathered = [None] * size
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        (OUT / f"memory_cp{size}.json").write_text(json.dumps([r for part in gathered for r in part]))
    dist.destroy_process_group()


def throughput_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from lightning_disttrain import comm
    from lightning_disttrain.parallel.context import apply_context_parallel

    mesh = _init()
    seq, rank = args.throughput_seq, dist.get_rank()
    model = _model("tiny", seq)
    shift, transfers, serial = comm.ring_shift, [], [False]

    def recorded(tensors, group):
        transfers.append([(t.shape, t.dtype) for t in tensors])
        wait = shift(tensors, group)
        if not serial[0]:
            return wait
        received = wait()  # no overlap: the transfer completes before the block computes
        return lambda: received

    def step(variant: str, x, y) -> float:
        for m in model.modules():  # cp on for cp2, off for cp1
            if hasattr(m, "context_parallel"):
                m.context_parallel = None
        if variant != "cp1":
            apply_context_parallel(model, mesh)
        serial[0] = variant == "cp2_serial"
        dist.barrier()
        t0 = time.perf_counter()
        _loss(model, x, y).backward()
        dist.barrier()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    cp2 = _tokens(seq, rank, 2)
    cp1 = _tokens(seq, 0, 1, seed=2 + rank)  # data parallel: each rank its own whole sequence
    variants = ["cp2", "cp2_serial", "cp1"]
    times = {v: [] for v in variants}
    comm.ring_shift = recorded
    for r in range(args.warmup + args.repeats):
        for name in variants[r % 3:] + variants[:r % 3]:
            transfers.clear()
            t = step(name, *(cp1 if name == "cp1" else cp2))
            if r >= args.warmup:
                times[name].append(t)
            if name == "cp2":
                per_step = list(transfers)  # one cp2 step's transfers
    comm.ring_shift = shift
    group = mesh.get_group()
    alone = []
    for _ in range(args.repeats):
        buffers = [[torch.zeros(s, dtype=d) for s, d in shapes] for shapes in per_step]
        dist.barrier()
        t0 = time.perf_counter()
        for tensors in buffers:
            shift(tensors, group)()
        alone.append(time.perf_counter() - t0)
    if rank == 0:
        nbytes = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for shapes in per_step
                     for s, d in shapes)
        (OUT / "throughput.json").write_text(json.dumps({
            "seq": seq, "times": times, "alone": alone,
            "transfers_per_step": len(per_step), "bytes_sent_per_step": nbytes}))
    dist.destroy_process_group()


def memory_summary(rows: list[dict], budgets: dict[str, float]) -> dict[str, dict]:
    """Per preset: the highest rank's peak and kept MiB per (seq, cp), the longest sequence within
    the budget per cp (computed) and its ratio to cp=1's."""
    out = {}
    for preset in dict.fromkeys(r["preset"] for r in rows):
        mine = [r for r in rows if r["preset"] == preset]
        seqs, cps = sorted({r["seq"] for r in mine}), sorted({r["cp"] for r in mine})

        def top(seq, cp, key, mine=mine):
            return max(r[key] for r in mine if r["seq"] == seq and r["cp"] == cp) / MIB

        table_rows = [{"seq": s, "peak_mib": {str(c): top(s, c, "peak") for c in cps},
                       "kept_mib": {str(c): top(s, c, "kept") for c in cps}} for s in seqs]
        budget = budgets[preset]
        points = {str(c): [(row["seq"], row["peak_mib"][str(c)]) for row in table_rows] for c in cps}
        longest = {c: longest_within(p, budget) for c, p in points.items()}
        out[preset] = {"budget_mib": budget, "rows": table_rows, "longest": longest,
                       # beyond the measured points: computed along the last two (or the first)
                       "extrapolated": {c: not min(m for _, m in p) <= budget <= max(m for _, m in p)
                                        for c, p in points.items()},
                       "longest_over_cp1": {c: v / longest["1"] for c, v in longest.items()}}
    return out


def memory_text(summary: dict[str, dict]) -> str:
    lines = []
    for preset, s in summary.items():
        cps = list(s["rows"][0]["peak_mib"])
        lines.append(f"{preset}: peak MiB per rank (forward + backward), and kept for backward at the forward's end")
        lines.append(table(["seq", *[(f"cp={c} peak", ".1f") for c in cps], *[(f"cp={c} kept", ".1f") for c in cps],
                            *[(f"cp1/cp{c} peak", ".2f") for c in cps[1:]]],
                           [(r["seq"], *[r["peak_mib"][c] for c in cps], *[r["kept_mib"][c] for c in cps],
                             *[r["peak_mib"]["1"] / r["peak_mib"][c] for c in cps[1:]]) for r in s["rows"]]))
        lines.append(f"longest sequence within {s['budget_mib']:.0f} MiB per rank (computed from the points): "
                     + ", ".join(f"cp={c}: {v:,.0f}{' (beyond the points)' if s['extrapolated'][c] else ''} "
                                 f"({s['longest_over_cp1'][c]:.2f}x cp=1)" for c, v in s["longest"].items()) + "\n")
    return "\n".join(lines)


def throughput_summary(t: dict) -> dict:
    seq = t["seq"]
    tok = {"cp2": seq, "cp2_serial": seq, "cp1": 2 * seq}  # per step, both ranks together
    rates = {k: [tok[k] / s for s in v] for k, v in t["times"].items()}
    alone = statistics.median(t["alone"])
    return {"seq": seq, "step_s": {k: statistics.median(v) for k, v in t["times"].items()},
            "tokens_per_s": {k: statistics.median(v) for k, v in rates.items()},
            "cp2_over_cp1": [a / b for a, b in zip(rates["cp2"], rates["cp1"])],
            "transfer_alone_s": alone,
            "hidden_share": [(s - o) / alone for s, o in zip(t["times"]["cp2_serial"], t["times"]["cp2"])],
            "transfers_per_step": t["transfers_per_step"], "bytes_sent_per_step": t["bytes_sent_per_step"]}


def throughput_text(s: dict) -> str:
    text = table(["variant", ("step s median", ".3f"), ("tokens/s median", ".0f")],
                 [(k, s["step_s"][k], s["tokens_per_s"][k]) for k in ("cp1", "cp2", "cp2_serial")])
    return (text + f"\ncp2 / cp1 tokens/s, round by round (min median max): {spread(s['cp2_over_cp1'])}"
            f"\nring transfers per cp2 step: {s['transfers_per_step']}, {s['bytes_sent_per_step'] / MIB:.2f} MiB sent "
            f"per rank, {s['transfer_alone_s'] * 1e3:.1f} ms alone (median); hidden by the overlap, "
            f"(cp2_serial - cp2) / alone, round by round (computed): {spread(s['hidden_share'])}")


def main() -> None:
    p = parser(__doc__, repeats=(5, "timed rounds"), warmup=(1, "untimed rounds"), out=(None, "JSON here"),
               worker=["memory", "throughput"])
    p.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(SEQS))
    p.add_argument("--seqs", type=int, nargs="+", default=None, help="for every preset (default: SEQS per preset)")
    p.add_argument("--throughput-seq", type=int, default=4096)
    p.add_argument("--budget-mib", type=float, default=None, help="for every preset (default: BUDGET_MIB per preset)")
    add_record_options(p, "cpu-cp-memory", record_flag="")  # the record is --out's JSON
    args = p.parse_args()
    if args.worker == "memory":
        return memory_worker(args)
    if args.worker == "throughput":
        return throughput_worker(args)
    OUT.mkdir(parents=True, exist_ok=True)
    header("bench_cp", "GPT presets " + ", ".join(args.presets) + f", vocabulary {VOCAB}, batch 1, ring attention")
    extra = ["--presets", *args.presets] + (["--seqs", *map(str, args.seqs)] if args.seqs else [])
    with part("memory"):
        rows = []
        for cp in (1, 2, 4):
            launch(__file__, OUT, cp, f"memory_cp{cp}", ["--worker", "memory", *extra])
            rows += json.loads((OUT / f"memory_cp{cp}.json").read_text())
        budgets = {pr: args.budget_mib or BUDGET_MIB[pr] for pr in args.presets}
        memory = memory_summary(rows, budgets)
        print(memory_text(memory))
    with part("throughput"):
        launch(__file__, OUT, 2, "throughput", ["--worker", "throughput", "--throughput-seq", str(args.throughput_seq),
                                                "--repeats", str(args.repeats), "--warmup", str(args.warmup)])
        throughput = throughput_summary(json.loads((OUT / "throughput.json").read_text()))
        print(throughput_text(throughput))
    data = provenance("bench_cp", "bench_cp.py", "gloo, one intra-op thread per rank") | {
        "memory": memory, "throughput": throughput, "memory_rows": rows, "args": vars(args)}
    written = report("cp", data, out=args.out, indent=1)
    if args.plot:
        plot_record(written, data["command"], args.plot, args.format)


if __name__ == "__main__":
    main()
