"""FSDP2 benchmarks on CPU (gloo): memory per rank by ZeRO stage, and throughput vs. baselines.

1. Memory (N = 1, 2, 4 ranks): bytes of parameters, gradients and AdamW state each rank holds
   (local shards of DTensors summed), under our ``fsdp2`` (ZeRO-3) and ``fsdp2_zero2``, against
   the ZeRO accounting. fp32 on CPU: 4 B parameter + 4 B gradient + 8 B Adam moments = 16 B/param
   (the same total as the mixed-precision 2+2+12 baseline, split differently).
2. Throughput (2 ranks): our ``fsdp2`` through ``L.Trainer`` vs a hand-written FSDP2 loop (plain
   torch: ``fully_shard`` per block + root, same model, data, AdamW, clipping) vs Lightning's own
   ``ModelParallelStrategy`` with a ``configure_model`` that calls ``fully_shard``. Interleaved
   (A B C A B C ...) in the same processes so machine noise hits all three.

    python benchmarks/bench_fsdp.py                      # both parts
    python benchmarks/bench_fsdp.py --part throughput --preset small --batch 4 --seq 128

Ranks are started here with env:// variables (no torchrun agent); Lightning sees LOCAL_RANK and
does not launch again. Results: printed, and JSON under benchmarks/out/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


# ---------------------------------------------------------------------------------------------
# launcher (parent process)


def launch(nprocs: int, *worker_args: str, timeout: float = 1800) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), NODE_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        log = open(OUT / f"worker_{worker_args[0]}_{nprocs}_{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, "--worker", *worker_args, "--nprocs", str(nprocs)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for proc, log in procs:
        rc = proc.wait(timeout=timeout)
        log.close()
        if rc != 0:
            raise SystemExit(f"worker failed (exit {rc}); see {log.name}")


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


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def dataset(args, n_samples: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (n_samples, args.seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def make_module_cls():
    class Module(GPTModule):
        """GPTModule with a sampler we control (no shuffling) and quiet logging."""

        def __init__(self, args, n_samples):
            super().__init__(args.preset, vocab_size=args.vocab, lr=6e-4, weight_decay=0.1, schedule="constant",
                             model_overrides={"block_size": args.seq})
            self._args, self._n = args, n_samples

        def train_dataloader(self):
            ds = dataset(self._args, self._n)
            kw = self.trainer.strategy.distributed_sampler_kwargs
            return DataLoader(ds, batch_size=self._args.batch, sampler=DistributedSampler(ds, shuffle=False, **kw))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss_fn(self(x), y)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            pass

        def on_before_optimizer_step(self, optimizer):
            pass

    return Module


def trainer(strategy, max_steps, callbacks):
    return L.Trainer(strategy=strategy, devices=dist_world(), accelerator="cpu", max_steps=max_steps,
                     gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)


_WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read at import: Lightning's teardown deletes it


def dist_world() -> int:
    return _WORLD


# ---------------------------------------------------------------------------------------------
# 1. memory


def memory_worker(args) -> None:
    _imports()
    Module = make_module_cls()

    class Probe(L.Callback):
        """Measured on the second step, when the optimizer state exists."""

        def __init__(self):
            self.m = {}

        def _params(self, module):
            return list(module.model.parameters())

        def on_before_backward(self, trainer, module, loss):
            if trainer.global_step == 1:
                # After forward: units that did not reshard hold gathered (plain-tensor) parameters
                # in addition to their shards.
                self.m["gathered_after_forward"] = local_bytes(
                    p for p in self._params(module) if not isinstance(p, DTensor))

        def on_before_optimizer_step(self, trainer, module, optimizer):
            if trainer.global_step == 1:
                self.m["grads"] = local_bytes(p.grad for p in self._params(module))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                opt = trainer.optimizers[0]
                self.m["params"] = local_bytes(self._params(module))
                self.m["optim"] = local_bytes(v for s in opt.state.values() for v in s.values()
                                              if isinstance(v, torch.Tensor))
                self.m["numel"] = sum((p.full_tensor() if isinstance(p, DTensor) else p).numel()
                                      for p in self._params(module))

    results = {}
    for stage, strategy in (("zero3", "fsdp2"), ("zero2", "fsdp2_zero2")):
        L.seed_everything(0)
        probe = Probe()
        trainer(strategy, 2, [probe]).fit(Module(args, 64))
        results[stage] = probe.m
    if dist.get_rank() == 0:
        (OUT / f"memory_{args.nprocs}.json").write_text(json.dumps(results))


def report_memory(sizes) -> str:
    lines = ["Memory per rank (fp32 params + fp32 grads + AdamW exp_avg/exp_avg_sq; MiB, rank 0)",
             "expected (ZeRO accounting, fp32: 4 B param + 4 B grad + 8 B Adam = 16 B/param):",
             "  at rest (after the step)   ZeRO-3 and FSDP2's ZeRO-2: 16/N B/param (FSDP2 reshards after",
             "                             backward in both; ZeRO-2 differs only between forward and backward)",
             "  forward->backward peak     ZeRO-3: 16/N; ZeRO-2: params full = 4 + 12/N B/param",
             "  (mixed-precision reference, 2 B bf16 param + 2 B grad + 12 B fp32 master/Adam: ZeRO-1 4+12/N,",
             "   ZeRO-2 2+14/N, ZeRO-3 16/N)",
             f"{'N':>2} {'stage':6} {'params':>8} {'grads':>8} {'optim':>8} {'rest':>8} {'exp':>8} {'ratio':>6}"
             f" {'+gathered':>10} {'peak':>8} {'exp':>8} {'ratio':>6}"]
    for n in sizes:
        data = json.loads((OUT / f"memory_{n}.json").read_text())
        for stage, m in data.items():
            numel = m["numel"]
            rest = m["params"] + m["grads"] + m["optim"]
            exp_rest = 16 * numel / n
            peak = rest + m["gathered_after_forward"]
            exp_peak = 16 * numel / n if stage == "zero3" else (4 + 12 / n) * numel
            lines.append(
                f"{n:>2} {stage:6} {m['params'] / MIB:8.2f} {m['grads'] / MIB:8.2f} {m['optim'] / MIB:8.2f}"
                f" {rest / MIB:8.2f} {exp_rest / MIB:8.2f} {rest / exp_rest:6.3f}"
                f" {m['gathered_after_forward'] / MIB:10.2f} {peak / MIB:8.2f} {exp_peak / MIB:8.2f} {peak / exp_peak:6.3f}")
    lines += ["rest = params + grads + optim (local shards); peak = rest + parameters still gathered after",
              "forward. ZeRO-3 peak > 16/N: the root (embeddings, tied head) and the last block are kept",
              "gathered from forward to backward by design (backward needs them first); ZeRO-2 peak > 4+12/N",
              "by 4/N: FSDP2 keeps each parameter's shard next to its gathered copy. Shards are padded to a",
              "multiple of N rows, so ratios can exceed 1 slightly."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 2. throughput


def throughput_worker(args) -> None:
    _imports()
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from lightning_disttrain.models.gpt import GPT
    from lightning_disttrain.optim import build_optimizer

    Module = make_module_cls()
    world = dist_world()
    total = args.warmup + args.steps
    n_samples = total * args.batch * world

    class UserFSDP(Module):
        """What a user of ModelParallelStrategy writes: fully_shard in configure_model."""

        def configure_model(self):
            if self.model is not None:
                return
            super().configure_model()
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    class Timer(L.Callback):
        def __init__(self):
            self.t0 = None
            self.elapsed = None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == args.warmup:
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer, module):
            self.elapsed = time.perf_counter() - self.t0

    def lightning_run(strategy, module_cls) -> float:
        L.seed_everything(0)
        timer = Timer()
        trainer(strategy, total, [timer]).fit(module_cls(args, n_samples))
        return timer.elapsed

    def hand_loop() -> float:
        torch.manual_seed(0)
        ref = Module(args, n_samples)  # only for its config; the model is a plain GPT
        model = GPT(ref.config)
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = build_optimizer(model, "adamw", lr=6e-4, weight_decay=0.1)  # the optimizer GPTModule builds
        ds = dataset(args, n_samples)
        loader = DataLoader(ds, batch_size=args.batch,
                            sampler=DistributedSampler(ds, num_replicas=world, rank=dist.get_rank(), shuffle=False))
        t0 = None
        for i, (x, y) in enumerate(loader):
            if i == args.warmup:
                t0 = time.perf_counter()
            loss = ref.loss_fn(model(x), y)  # the same loss (padding columns cut) as GPTModule
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    variants = {
        "lightning-disttrain fsdp2": lambda: lightning_run(FSDP2Strategy(), Module),
        "hand-written FSDP2 loop": hand_loop,
        "Lightning ModelParallelStrategy": lambda: lightning_run(
            ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), UserFSDP),
    }
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(fn())
    if dist.get_rank() == 0:
        tokens = args.steps * args.batch * args.seq * world
        (OUT / "throughput.json").write_text(json.dumps({"times": times, "tokens": tokens, "args": vars(args)}))


def report_throughput() -> str:
    data = json.loads((OUT / "throughput.json").read_text())
    a = data["args"]
    lines = [f"Throughput on 2 ranks (preset {a['preset']}, vocab {a['vocab']}, seq {a['seq']}, batch {a['batch']}/rank,"
             f" {a['steps']} timed steps after {a['warmup']} warm-up, {a['repeats']} interleaved repeats; rank 0)",
             f"{'variant':34} {'median s/step':>13} {'tokens/s':>9} {'vs hand':>8} {'best s/step':>11} {'vs hand':>8}"
             "   per-repeat s/step"]
    per_step = {k: [t / a["steps"] for t in v] for k, v in data["times"].items()}
    hand = per_step["hand-written FSDP2 loop"]
    for name, ts in per_step.items():
        med, best = statistics.median(ts), min(ts)
        lines.append(f"{name:34} {med:13.4f} {data['tokens'] / a['steps'] / med:9.0f} "
                     f"{statistics.median(hand) / med:8.3f} {best:11.4f} {min(hand) / best:8.3f}   "
                     + " ".join(f"{t:.4f}" for t in ts))
    lines.append("vs hand: the hand-written loop's time divided by the variant's (>= 1: as fast or faster); "
                 "'best' is the fastest repeat, the least disturbed by other load on the machine.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["all", "memory", "throughput"], default="all")
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab", type=int, default=257, help="257: the byte tokenizer")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", default="1,2,4", help="world sizes for the memory part")
    p.add_argument("--worker", choices=["memory", "throughput"], help=argparse.SUPPRESS)
    p.add_argument("--nprocs", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.worker == "memory":
        return memory_worker(args)
    if args.worker == "throughput":
        return throughput_worker(args)

    passthrough = ["--preset", args.preset, "--vocab", str(args.vocab), "--seq", str(args.seq), "--batch",
                   str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats",
                   str(args.repeats)]
    import torch

    print(f"# bench_fsdp {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, gloo")
    print(f"# {' '.join([os.path.basename(sys.executable), *sys.argv])}\n")
    if args.part in ("all", "memory"):
        sizes = [int(s) for s in args.sizes.split(",")]
        for n in sizes:
            launch(n, "memory", *passthrough)
        print(report_memory(sizes) + "\n")
    if args.part in ("all", "throughput"):
        launch(2, "throughput", *passthrough)
        print(report_throughput())


if __name__ == "__main__":
    main()
