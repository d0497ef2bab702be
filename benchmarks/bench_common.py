"""The harness every ``bench_*.py`` shares: the command line, launching ranks (env:// variables, no
torchrun agent) and child runs, timing steps and interleaved rounds, the Trainer they time, the
per-step memory windows, and the report (a header, parts, aligned tables, JSON under
``benchmarks/out/``). A benchmark file then says what it measures, not how ranks start or how a
table is printed.

Worker-side helpers import torch and Lightning when called, so the launcher stays light.

Writing a new benchmark
-----------------------
``python benchmarks/bench_x.py`` puts ``benchmarks/`` on ``sys.path``; ranks started by
``launch`` get it and the repository on ``PYTHONPATH``. Variants are timed in rounds, each round
visiting every variant in turn, so that machine noise lands on all of them and their ratio can be
read round by round (``spread``)::

    '''Matmul vs einsum: seconds per call, side by side.'''
    import statistics, timeit
    from bench_common import header, parser, report, spread, table, timed_rounds

    def main() -> None:
        args = parser(__doc__, steps=(20, "calls per round"), repeats=(5, "rounds"), out=(None, "the JSON"))
        args = args.parse_args()
        import torch
        x = torch.randn(256, 256)
        calls = {"matmul": lambda: x @ x, "einsum": lambda: torch.einsum("ij,jk->ik", x, x)}
        header("bench_x", "1 process")
        times, rounds = timed_rounds({k: lambda f=f: timeit.timeit(f, number=args.steps) / args.steps
                                      for k, f in calls.items()}, args.repeats, warmup=1)
        ratio = [e / m for e, m in zip(times["einsum"], times["matmul"])]
        report("x", {"times": times, "rounds": rounds, "args": vars(args)},
               table(["variant", ("s/call min", ".2e"), ("median", ".2e")],
                     [(k, min(v), statistics.median(v)) for k, v in times.items()])
               + f"\\neinsum / matmul, round by round: {spread(ratio)}", out=args.out)

    if __name__ == "__main__":
        main()

Multi-rank: add ``worker=[...]`` to ``parser``, start the ranks with ``launch(__file__, out_dir,
nprocs, tag, ["--worker", name, ...])``, and in the worker call ``rotated_rounds`` (a barrier
before every variant; rank 0 writes the JSON), ``trainer`` / ``step_timer`` / ``StepClock`` for
step times, ``phase_probe`` with ``memory_meter`` (and ``memcount_env`` for ``launch``) for memory;
the parent prints ``rounds_report`` of that JSON inside ``with part("throughput"):``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT_ROOT = HERE / "out"
"""Where results go: ``benchmarks/out/`` (ignored by git)."""
MIB = 2**20
PHASES = ("fwd", "bwd", "opt")
"""The three windows of a step (see ``phase_probe``)."""

WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # read at import: Lightning's teardown deletes it
RANK = int(os.environ.get("RANK", "0"))
RANK_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT", "PL_GLOBAL_SEED")
"""What a launch leaves in a rank's environment; a child run that Lightning launches must not see it."""


# -- command line and report frame (parent process) ------------------------------------------


def parser(doc: str | None, *, full_doc: bool = False, steps=None, warmup=None, repeats=None, out=None,
           worker: Sequence[str] | None = None, nprocs: int = 1) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with the flags benchmarks share, each added only when asked for (a
    default, or a (default, help) pair): ``--steps``, ``--warmup``, ``--repeats`` (ints), ``--out``
    (a path). ``worker``: the hidden ``--worker`` (its choices) and ``--nprocs`` that ``launch``
    passes every rank. The description is ``doc``'s first paragraph, or all of it (``full_doc``)."""
    if full_doc:
        p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        p = argparse.ArgumentParser(description=" ".join((doc or "").split("\n\n")[0].split()))
    for flag, spec, type_ in (("--steps", steps, int), ("--warmup", warmup, int), ("--repeats", repeats, int),
                              ("--out", out, Path)):
        if spec is not None:
            default, help_ = spec if isinstance(spec, tuple) else (spec, None)
            p.add_argument(flag, type=type_, default=default, help=help_)
    if worker is not None:
        p.add_argument("--worker", choices=list(worker), help=argparse.SUPPRESS)
        p.add_argument("--nprocs", type=int, default=nprocs, help=argparse.SUPPRESS)
    return p


def omp_threads() -> str:
    """The thread setting ``launch`` gives each rank, for a header."""
    return f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}"


def header(name: str, *fields: str) -> None:
    """The lines every report starts with: the benchmark, the UTC time, torch, machine, CPUs,
    Python and ``fields``; the command line; the 1-min load average."""
    import platform
    from datetime import datetime, timezone

    import torch

    print(f"# {name} {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
          + "".join(f", {f}" for f in fields))
    print(f"# {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"# 1-min load average at start: {load1():.2f}\n", flush=True)


@contextmanager
def part(name: str):
    """A part of a report: on leaving, its wall time and the load average at its end."""
    t0 = time.perf_counter()
    yield
    print(f"# {name} part: {time.perf_counter() - t0:.0f} s, 1-min load average at end: {load1():.2f}\n", flush=True)


def load1() -> float:
    return os.getloadavg()[0]


# -- launching (parent process) ---------------------------------------------------------------


def _pythonpath() -> str:
    return os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])


def launch(script: str, out_dir: Path, nprocs: int, tag: str, worker_args: list[str],
           extra_env: dict[str, str] | None = None, timeout: float = 1200) -> None:
    """Run ``nprocs`` ranks of ``script`` (each gets ``--nprocs``); logs to ``out_dir``. A rank that
    fails or outlives ``timeout`` ends the benchmark (and every other rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), NODE_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=_pythonpath(), **(extra_env or {}))
        log = open(out_dir / f"worker_{tag}_rank{rank}.log", "w")  # noqa: SIM115 (closed after the wait below)
        procs.append((subprocess.Popen([sys.executable, script, *worker_args, "--nprocs", str(nprocs)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = None
    for proc, log in procs:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            rc = "timeout"
        log.close()
        if rc != 0 and failed is None:
            failed = f"worker failed (exit {rc}); see {log.name}"
    if failed:
        raise SystemExit(failed)


def child_env(threads: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a child run that starts its own ranks (Lightning's launcher): this one
    without ``RANK_VARIABLES``, the repository and ``benchmarks/`` first on ``PYTHONPATH``,
    ``OMP_NUM_THREADS`` defaulting to ``threads`` when given, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["PYTHONPATH"] = _pythonpath()
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", threads)
    return env | extra


def memcount_env(out_dir: Path, needed_by: str = "the memory part", hint: str = "") -> dict[str, str]:
    """The environment of a rank metered by ``memory_meter.ProcessMeter``: ``memcount.so`` (built
    into ``out_dir``) preloaded, glibc's caching off so that freed memory leaves the process."""
    from memory_meter import build_memcount

    memcount = build_memcount(out_dir)
    if memcount is None:
        raise SystemExit(f"{needed_by} needs a C compiler (cc) to build benchmarks/memcount.c{hint}")
    return {"LD_PRELOAD": memcount, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


# -- timing -----------------------------------------------------------------------------------


class StepClock:
    """Step times after ``warmup`` untimed steps: a mark when step ``warmup`` starts and one as
    each later step ends; ``step_times()`` are the differences (so a step includes fetching its
    batch). Drive it with ``start(i)`` / ``end(i)``, or loop over ``steps(loader)``."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.marks = warmup, []

    def start(self, i: int) -> None:
        if i == self.warmup:
            self.marks.append(time.perf_counter())

    def end(self, i: int) -> None:
        if i >= self.warmup:
            self.marks.append(time.perf_counter())

    def steps(self, iterable: Iterable):
        """The items of ``iterable``, each one a step of this clock."""
        for i, item in enumerate(iterable):
            self.start(i)
            yield item
            self.end(i)

    def step_times(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.marks)]


def step_timer(warmup: int, losses: bool = True):
    """A callback timing each optimizer step after ``warmup`` untimed ones (``.step_times()``, a
    ``StepClock`` on Lightning's batch hooks) and recording every step's loss (``.losses``)."""
    import lightning as L

    class StepTimer(L.Callback):
        def __init__(self):
            self.clock, self.losses = StepClock(warmup), []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.clock.start(batch_idx)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.clock.end(batch_idx)
            if losses:
                self.losses.append(float(outputs["loss"]))

        def step_times(self) -> list[float]:
            return self.clock.step_times()

    return StepTimer()


def timed_rounds(variants: dict[str, Callable[[], object]], rounds: int, *, warmup: int = 0, rotate: bool = True,
                 before: Callable[[], None] | None = None,
                 after_round: Callable[[int, dict], None] | None = None) -> tuple[dict[str, list], list[dict]]:
    """Call every variant once per round, ``warmup`` untimed rounds first (their results dropped),
    so that machine noise lands on all of them and ratios can be taken round by round. ``rotate``:
    each round starts one variant later (A B C, B C A, ...); else the same order every round.
    ``before()`` runs before every call; ``after_round(r, {name: its result})`` after each timed
    round. Returns each variant's results (one per timed round) and each timed round's order and
    1-min load average before it."""
    names = list(variants)
    results: dict[str, list] = {name: [] for name in names}
    records = []
    for r in range(warmup + rounds):
        k = r % len(names) if rotate else 0
        order = names[k:] + names[:k]
        record = {"order": order, "load1_before": load1()}
        for name in order:
            if before is not None:
                before()
            out = variants[name]()
            if r >= warmup:
                results[name].append(out)
        if r >= warmup:
            records.append(record)
            if after_round is not None:
                after_round(r - warmup, {name: results[name][-1] for name in names})
    return results, records


def rotated_rounds(variants: dict, repeats: int, out_file: Path, extra: dict, losses: bool = True) -> None:
    """``timed_rounds`` on every rank of a process group: ``variants`` (name -> () -> (step times,
    losses), or step times alone when not ``losses``), the order rotated each round, a garbage
    collection and a barrier before each; rank 0 writes the step times, losses, each round's order
    and load average, and ``extra`` to ``out_file`` as JSON (read by ``rounds_report``)."""
    import gc

    import torch.distributed as dist

    rank0 = dist.get_rank() == 0

    def before() -> None:
        gc.collect()
        dist.barrier()

    def done(r: int, _) -> None:
        if rank0:
            print(f"round {r} done, load {load1():.2f}", flush=True)

    results, rounds = timed_rounds(variants, repeats, before=before, after_round=done)
    if losses:
        data = {"steps": {k: [ts for ts, _ in v] for k, v in results.items()},
                "losses": {k: [ls for _, ls in v] for k, v in results.items()}}
    else:
        data = {"steps": results}
    if rank0:
        out_file.write_text(json.dumps({**data, "rounds": rounds, **extra}))


# -- worker processes -------------------------------------------------------------------------


def random_tokens(n_samples: int, seq: int, vocab: int):
    """Random tokens (seed 0): ``n_samples`` (input, target) pairs of ``seq`` tokens."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n_samples, seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def dataset(args, n_samples: int):
    """``random_tokens`` of ``args.seq`` tokens from ``args.vocab``."""
    return random_tokens(n_samples, args.seq, args.vocab)


def trainer(strategy, max_steps, callbacks, accelerator="cpu", logger=False, gradient_clip_val=1.0):
    """The Trainer every benchmark times: clipping 1.0, no checkpoints, no validation, no progress bar."""
    import lightning as L

    return L.Trainer(strategy=strategy, devices=WORLD, accelerator=accelerator, max_steps=max_steps,
                     gradient_clip_val=gradient_clip_val, logger=logger, log_every_n_steps=10,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)


def local_bytes(tensors) -> int:
    """Known-tensor sum (for comparison only): bytes of the local shards of ``tensors``."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def phase_probe(meter):
    """A callback marking three windows per step on ``meter``, in Lightning's hook order: forward
    (batch start -> before backward; the previous step's gradients are held through it, Lightning's
    zero_grad frees them just before ``on_before_backward``), backward (-> after backward),
    optimizer (-> batch end: clipping, AdamW step, logging). The step's peak is the largest of the
    three; the marks between them are the levels after forward / backward / the step."""
    import lightning as L

    class Probe(L.Callback):
        def __init__(self):
            self.i = None

        def on_train_start(self, trainer, module):
            meter.mark("setup")

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.i = batch_idx
            meter.begin_window(f"step{batch_idx}.fwd")

        def on_before_backward(self, trainer, module, loss):
            meter.end_window(f"step{self.i}.fwd")
            meter.begin_window(f"step{self.i}.bwd")

        def on_after_backward(self, trainer, module):
            meter.end_window(f"step{self.i}.bwd")
            meter.begin_window(f"step{self.i}.opt")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            meter.end_window(f"step{batch_idx}.opt")

    return Probe()


# -- reports ----------------------------------------------------------------------------------


def level_at(r: dict, step: int, when: str, key: str = "levels") -> int:
    """A worker record's level at the end of ``when`` (a phase) of ``step``."""
    return r[key][f"step{step}.{when}:end"]


def step_peak(r: dict, step: int, key: str = "peaks") -> tuple[int, str]:
    """The largest window peak of ``step`` and the phase it fell in."""
    return max((r[key][f"step{step}.{ph}"], ph) for ph in PHASES)


def spread(xs) -> str:
    """min median max, 3 decimals."""
    return f"{min(xs):.3f} {statistics.median(xs):.3f} {max(xs):.3f}"


def table(columns: Sequence[str | tuple[str, str]], rows: Iterable[Sequence], *, markdown: bool = False,
          rule: bool = False, indent: str = "", sep: str = "  ") -> str:
    """An aligned text table. ``columns``: titles (a newline splits one over header lines), or
    (title, format spec) pairs, the spec as for ``format()`` without a width (``".3f"``, ``","``).
    Columns of numbers align right, others left; a ``None`` cell prints empty. ``markdown``: a
    GitHub table instead (cells unpadded); ``rule``: a line of dashes under the header; ``sep``:
    between columns."""
    cols = [(c, "") if isinstance(c, str) else c for c in columns]
    rows = [list(r) for r in rows]
    cells = [["" if v is None else format(v, spec) for v, (_, spec) in zip(r, cols)] for r in rows]
    right = [bool(rows) and all(r[i] is None or isinstance(r[i], (int, float)) for r in rows) for i in range(len(cols))]
    if markdown:
        return "\n".join(["| " + " | ".join(t.replace("\n", " ") for t, _ in cols) + " |",
                          "|" + "|".join("---:" if r else "---" for r in right) + "|",
                          *("| " + " | ".join(c) + " |" for c in cells)])
    titles = [t.split("\n") for t, _ in cols]
    depth = max(len(t) for t in titles)
    titles = [[""] * (depth - len(t)) + t for t in titles]
    widths = [max([len(x) for x in titles[i]] + [len(c[i]) for c in cells]) for i in range(len(cols))]

    def line(values) -> str:
        return (indent + sep.join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right))).rstrip()

    head = [h for h in (line([t[d] for t in titles]) for d in range(depth)) if h.strip()]  # untitled: none
    if rule:
        head.append("-" * max(len(x) for x in [*head, *(line(c) for c in cells)]))
    return "\n".join([*head, *(line(c) for c in cells)])


def write_json(path: str | Path, data, indent: int | None = None) -> Path:
    """``data`` as JSON at ``path`` (its directory made; paths and other objects as strings)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str) + ("\n" if indent is not None else ""))
    return path


def report(name: str, data, text: str | None = None, out: str | Path | None = None, indent: int | None = None) -> Path:
    """Print ``text`` (the benchmark's table) and write ``data`` as JSON to ``out``, by default
    ``benchmarks/out/<name>.json``; returns the path written."""
    if text is not None:
        print(text, flush=True)
    return write_json(out if out is not None else OUT_ROOT / f"{name}.json", data, indent)


def rounds_report(data: dict, title: str, ratios: Sequence[tuple[str, str]], short: dict[str, str]) -> str:
    """The report of a ``rotated_rounds`` JSON (``tokens_per_step`` in its extras): each variant's
    s/step (the mean over one repeat's timed steps; min / median / max over the repeats) and tok/s;
    for each (reference, variant) of ``ratios``, the reference's s/step / the variant's, best-of,
    of the medians and round by round; every repeat's figure, each round's order (by ``short``
    names) and load; with losses, repeat 0's and the largest gap of each pair at any step."""
    per_rep = {k: [sum(v) / len(v) for v in reps] for k, reps in data["steps"].items()}
    tok = data["tokens_per_step"]
    med = {k: statistics.median(v) for k, v in per_rep.items()}
    lines = [title, "s/step = mean over one repeat's timed steps; min / median / max over the repeats",
             table(["variant", ("s/step min", ".3f"), ("median", ".3f"), ("max", ".3f"), ("tok/s best", ".0f"),
                    ("median", ".0f")],
                   [(k, min(v), med[k], max(v), tok / min(v), tok / med[k]) for k, v in per_rep.items()]),
             "", "ratio = the reference's s/step / the variant's (>= 1: the variant as fast or faster); per round: "
                 "the same round's ratio",
             table(["variant", "reference", ("best-of", ".3f"), ("median", ".3f"), "per round: min median max"],
                   [(v, short[ref], min(per_rep[ref]) / min(per_rep[v]), med[ref] / med[v],
                     spread([a / b for a, b in zip(per_rep[ref], per_rep[v])])) for ref, v in ratios]),
             "", "per repeat s/step (repeat 0 ... n-1):",
             table(["", ""], [(k, " ".join(f"{t:.3f}" for t in v)) for k, v in per_rep.items()], indent="  "),
             "  order in each round: " + " | ".join(", ".join(short[n] for n in r["order"]) for r in data["rounds"]),
             "  1-min load average before each round: " + " ".join(f"{r['load1_before']:.2f}" for r in data["rounds"])]
    fl = data.get("losses")
    if fl:
        lines.append(table(["", ""], [(f"losses, repeat 0: {short[k]}", " ".join(f"{x:.4f}" for x in v[0]))
                                      for k, v in fl.items()], indent="  "))
        for ref, v in ratios:
            gap = max(abs(a - b) for o, h in zip(fl[v], fl[ref]) for a, b in zip(o, h))
            lines.append(f"  {short[v]} vs {short[ref]}: losses differ by at most {gap:.2e} at any step of any repeat")
        same = all(x == fl[k][0] for k in fl for x in fl[k])
        lines.append(f"  every repeat {'gave the same losses as repeat 0' if same else 'did NOT give the same losses'}")
    return "\n".join(lines)
