"""Context parallel: activation memory per rank against sequence length, and tokens/s of cp=2
against cp=1 on 2 ranks, with the share of the step spent gathering keys and values.

Memory: each rank of a cp group (cp = 1, 2, 4 processes) runs one forward of a GPT (RoPE, GQA) on
its shard of one sequence and counts the bytes the forward allocated that are still alive for
backward (``parallel.activation.activation_bytes``: saved activations, the gathered K/V, the
logits). The longest sequence that fits a budget is computed from the measured points (linear in
the sequence length between them; marked as computed).

Throughput (2 ranks, forward + backward, no optimizer or gradient sync, the same for both):
``cp2`` shards each sequence over the 2 ranks; ``cp1`` gives each rank a whole sequence (data
parallel). Rounds alternate the two; tokens/s counts the tokens both ranks processed. The K/V
gathers alone (the same shapes, as many per step as the model issues) give their share of the
cp2 step (computed: their time over the step's).

    python benchmarks/bench_cp.py                      # seq 1024..8192, throughput at 8192
    python benchmarks/bench_cp.py --seqs 256 512 --throughput-seq 512 --repeats 2
"""

from __future__ import annotations

import json
import statistics
import time

from bench_common import HERE, MIB, header, launch, part, parser, report, spread, table

OUT = HERE / "out" / "cp"
MODEL = dict(n_layer=2, n_embd=128, n_head=8, n_kv_head=2, mlp="swiglu", mlp_hidden=256, norm="rmsnorm",
             pos_emb="rope", vocab_size=256)


def _setup(seq: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_disttrain.models.gpt import GPT, GPTConfig
    from lightning_disttrain.parallel.context import apply_context_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL, block_size=seq))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if world > 1 else None
    return model, mesh, apply_context_parallel


def _tokens(seq: int, rank: int, size: int):
    import torch

    from lightning_disttrain.models.context_parallel import shard_sequence

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, MODEL["vocab_size"], (1, seq + 1), generator=g)
    inp, tgt = x[:, :-1], x[:, 1:]
    return (shard_sequence(inp, 1, rank, size), shard_sequence(tgt, 1, rank, size)) if size > 1 else (inp, tgt)


def memory_worker(args) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_disttrain.parallel.activation import activation_bytes

    rows = []
    for seq in args.seqs:
        model, mesh, apply_cp = _setup(max(args.seqs))
        if mesh is not None:
            apply_cp(model, mesh)
        rank, size = dist.get_rank(), dist.get_world_size()
        x, y = _tokens(seq, rank, size)

        def forward():
            logits = model(x)
            return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

        loss, alive = activation_bytes(forward)
        loss.backward()
        rows.append({"seq": seq, "cp": size, "rank": rank, "activation_bytes": alive})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        (OUT / f"memory_cp{dist.get_world_size()}.json").write_text(json.dumps([r for part in gathered for r in part]))
    dist.destroy_process_group()


def throughput_worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_disttrain import comm

    seq = args.throughput_seq
    model, mesh, apply_cp = _setup(seq)
    rank = dist.get_rank()

    def step(size: int, x, y) -> float:
        for m in model.modules():  # cp on for cp2, off for cp1
            if hasattr(m, "context_parallel"):
                m.context_parallel = None
        if size > 1:
            apply_cp(model, mesh)
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        dist.barrier()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    cp2 = _tokens(seq, rank, 2)
    g = torch.Generator().manual_seed(2 + rank)  # data parallel: each rank its own whole sequence
    whole = torch.randint(0, MODEL["vocab_size"], (1, seq + 1), generator=g)
    cp1 = (whole[:, :-1], whole[:, 1:])
    times = {"cp2": [], "cp1": []}
    for r in range(args.warmup + args.repeats):
        for name in (("cp2", "cp1") if r % 2 == 0 else ("cp1", "cp2")):
            t = step(2 if name == "cp2" else 1, *(cp2 if name == "cp2" else cp1))
            if r >= args.warmup:
                times[name].append(t)
    # The K/V gathers of one cp2 step alone: per layer K and V (B, kv_heads, seq/2, head_dim) in
    # forward, and as many reduce-scatters of their gradients in backward (timed as gathers).
    head_dim = MODEL["n_embd"] // MODEL["n_head"]
    kv = torch.randn(1, MODEL["n_kv_head"], seq // 2, head_dim)
    gathers = 2 * 2 * MODEL["n_layer"]
    comm_times = []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(gathers):
            comm.all_gather_autograd(kv, 2, mesh)
        comm_times.append(time.perf_counter() - t0)
    if rank == 0:
        (OUT / "throughput.json").write_text(json.dumps({"seq": seq, "times": times, "comm": comm_times,
                                                         "gathers": gathers}))
    dist.destroy_process_group()


def main() -> None:
    p = parser(__doc__, repeats=(5, "timed rounds"), warmup=(1, "untimed rounds"), out=(None, "JSON here"),
               worker=["memory", "throughput"])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--throughput-seq", type=int, default=8192)
    p.add_argument("--budget-mib", type=float, default=64.0, help="memory budget per rank for the computed column")
    args = p.parse_args()
    if args.worker == "memory":
        return memory_worker(args)
    if args.worker == "throughput":
        return throughput_worker(args)
    OUT.mkdir(parents=True, exist_ok=True)
    header("bench_cp", f"GPT {MODEL['n_layer']} layers x {MODEL['n_embd']}, {MODEL['n_head']} heads / "
                       f"{MODEL['n_kv_head']} KV heads, RoPE")
    seqs = [str(s) for s in args.seqs]
    with part("memory"):
        peaks: dict[int, dict[int, float]] = {}
        for cp in (1, 2, 4):
            launch(__file__, OUT, cp, f"memory_cp{cp}", ["--worker", "memory", "--seqs", *seqs])
            rows = json.loads((OUT / f"memory_cp{cp}.json").read_text())
            for seq in args.seqs:
                peaks.setdefault(seq, {})[cp] = max(r["activation_bytes"] for r in rows if r["seq"] == seq) / MIB

        def longest(cp: int) -> float:  # computed: linear between measured points, beyond the last too
            pts = sorted((s, peaks[s][cp]) for s in args.seqs)
            (s0, m0), (s1, m1) = pts[-2], pts[-1]
            slope = (m1 - m0) / (s1 - s0)
            for (a, ma), (b, mb) in zip(pts, pts[1:]):
                if ma <= args.budget_mib <= mb:
                    return a + (args.budget_mib - ma) * (b - a) / (mb - ma)
            return s1 + (args.budget_mib - m1) / slope if m1 < args.budget_mib else pts[0][0] * args.budget_mib / pts[0][1]

        text = table(["seq", ("cp=1 MiB/rank", ".1f"), ("cp=2", ".1f"), ("cp=4", ".1f"), ("cp1/cp2", ".2f"),
                      ("cp1/cp4", ".2f")],
                     [(s, peaks[s][1], peaks[s][2], peaks[s][4], peaks[s][1] / peaks[s][2], peaks[s][1] / peaks[s][4])
                      for s in args.seqs])
        text += (f"\nlongest sequence within {args.budget_mib:.0f} MiB of activations per rank (computed from the "
                 f"points above): " + ", ".join(f"cp={cp}: {longest(cp):.0f}" for cp in (1, 2, 4)))
        print(text + "\n")
    with part("throughput"):
        launch(__file__, OUT, 2, "throughput", ["--worker", "throughput", "--throughput-seq", str(args.throughput_seq),
                                                "--repeats", str(args.repeats), "--warmup", str(args.warmup)])
        t = json.loads((OUT / "throughput.json").read_text())
        seq = t["seq"]
        tok = {"cp2": seq, "cp1": 2 * seq}  # per step, both ranks together
        rates = {k: [tok[k] / s for s in v] for k, v in t["times"].items()}
        ratio = [a / b for a, b in zip(rates["cp2"], rates["cp1"])]
        share = [c / s for c, s in zip(t["comm"], t["times"]["cp2"])]
        text2 = table(["variant", ("step s median", ".3f"), ("tokens/s median", ".0f")],
                      [(k, statistics.median(t["times"][k]), statistics.median(rates[k])) for k in ("cp1", "cp2")])
        text2 += (f"\ncp2 / cp1 tokens/s, round by round: {spread(ratio)}"
                  f"\nK/V gathers ({t['gathers']} per step, timed alone) / cp2 step (computed): {spread(share)}")
        print(text2)
    report("cp", {"memory_mib": {str(s): peaks[s] for s in args.seqs}, "throughput": t, "args": vars(args)},
           out=args.out)


if __name__ == "__main__":
    main()
