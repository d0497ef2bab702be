"""Checkpoint evals: time per checkpoint for the ``small`` GPT on CPU, per task and in total, and
the pause they cause in training, inline vs in a separate process.

    python benchmarks/bench_eval.py                        # both parts
    python benchmarks/bench_eval.py --part tasks --limit 50 --repeats 2
    python benchmarks/bench_eval.py --part pause --steps 8 --every 4 --pause-limit 10

``tasks``: ``EvalSuite`` on ``GPTModule("small")`` with GPT-2's vocabulary (~30M parameters), one
process, one thread: the first ``--limit`` items of every shipped set (``../shared/evals``) and
``--heldout-windows`` held-out windows of 256 tokens (README.md, GPT-2 BPE); ``--repeats`` rounds, min / median / max.

``pause``: three ``fit`` runs of the same model (1 process, 1 thread, FSDP2Strategy so that
checkpoints are DCP directories; batch 2 x 128 random tokens), a checkpoint every ``--every``
steps, with (a) no evals, (b) ``CheckpointEval(mode="inline")``, (c) ``CheckpointEval(mode=
"subprocess")`` (the eval command in a second process, 1 thread), the eval suite with
``--pause-limit`` items per task. Recorded: every step's wall time (a checkpoint step includes
the save and, inline, the evaluation), the fit's total, and for (c) how long ``fit`` waited at
the end for the last evaluation.

``--record FILE`` (with ``--part all``) writes both parts as ``cpu_figures.py`` reads them
(``record``); ``--plot DIR`` draws ``cpu-eval`` from that record.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_common import REPO, header, load1, parser, report, table
from record import add_record_options, provenance, record_path, wants_record, write_record

EVALS = REPO.parent / "shared" / "evals"
TASKS = ["heldout", "lambada_openai", "piqa", "arc_easy", "arc_challenge", "winogrande", "copa", "openbook_qa"]


HELDOUT_WINDOWS = 8


def _suite(limit: int):
    from lightning_disttrain.evals import EvalSuite

    return EvalSuite(tasks=TASKS, data_dir=str(EVALS), limit=limit, batch_size=16, heldout=str(REPO / "README.md"),
                     heldout_windows=HELDOUT_WINDOWS, heldout_seq_len=256)


def part_tasks(limit: int, repeats: int) -> list[dict]:
    from lightning_disttrain import GPTModule
    from lightning_disttrain.data import get_tokenizer

    torch.manual_seed(0)
    module = GPTModule("small")
    module.configure_model()
    tokenizer = get_tokenizer("gpt2")
    suite = _suite(limit)
    start = time.perf_counter()
    suite.prepare(tokenizer, max_length=module.config.block_size)
    print(f"read + tokenize once: {time.perf_counter() - start:.2f}s")
    rounds = [suite.run_module(module, None, tokenizer=tokenizer) for _ in range(repeats)]
    requests = {name: sum(len(r) for r in reqs) for name, reqs in suite._requests.items()}
    rows = []
    for name in [*suite.names, "total"]:
        times = [r.seconds[name] for r in rounds]
        n_req = requests.get(name, rounds[0].items.get(name)) if name != "total" else sum(
            [*requests.values(), rounds[0].items.get("heldout", 0)])
        items = rounds[0].items.get(name, sum(rounds[0].items.values()) if name == "total" else 0)
        rows.append({"task": name, "items": items, "requests": n_req, "seconds": times})
    print(table(["task", "items", "requests", ("s min", ".2f"), ("median", ".2f"), ("max", ".2f"),
                 ("ms/request", ".1f")],
                [(r["task"], r["items"], r["requests"], *task_numbers(r).values()) for r in rows]), flush=True)
    return rows


class StepTimer:
    def __new__(cls):
        import lightning as L

        class _StepTimer(L.Callback):
            def __init__(self):
                self.marks: list[float] = []
                self.train_end: float | None = None

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                self.marks.append(time.perf_counter())

            def on_train_end(self, trainer, pl_module):  # runs before CheckpointEval's (callback order)
                self.marks.append(time.perf_counter())

        return _StepTimer()


def _fit(mode: str, steps: int, every: int, limit: int, root: Path) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_disttrain import GPTModule
    from lightning_disttrain.callbacks import CheckpointEval
    from lightning_disttrain.strategies import FSDP2Strategy

    L.seed_everything(0)
    tokens = torch.randint(0, 50257, (steps * 2, 129))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    timer = StepTimer()
    callbacks = [timer, ModelCheckpoint(dirpath=root / mode, every_n_train_steps=every, save_top_k=-1)]
    if mode != "none":
        s = _suite(limit)
        callbacks.insert(1, CheckpointEval(tasks=s.tasks, data_dir=s.data_dir, limit=limit, heldout=s.heldout,
                                           heldout_windows=s.heldout_windows, heldout_seq_len=s.heldout_seq_len,
                                           tokenizer="gpt2", mode=mode, print_table=False,
                                           subprocess_env={"OMP_NUM_THREADS": "1"}))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=FSDP2Strategy(), max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        limit_val_batches=0)
    start = time.perf_counter()
    trainer.fit(GPTModule("small", lr=1e-4, warmup_steps=0), train_dataloaders=loader)
    total = time.perf_counter() - start
    marks = timer.marks
    step_times = [b - a for a, b in zip(marks[:-1], marks[1:])]  # step i: batch start i -> batch start i + 1
    ckpt_steps = {s - 1 for s in range(every, steps + 1, every)}  # 0-based index of steps ending in a save
    plain = [t for i, t in enumerate(step_times) if i not in ckpt_steps and i > 0]
    saved = [t for i, t in enumerate(step_times) if i in ckpt_steps]
    return {"mode": mode, "plain": statistics.median(plain), "saved": saved, "total": total,
            "end_wait": total - (marks[-1] - start)}


def part_pause(steps: int, every: int, limit: int) -> list[dict]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [_fit(mode, steps, every, limit, Path(tmp)) for mode in ("none", "inline", "subprocess")]
    base = statistics.median(rows[0]["saved"])
    for r in rows:
        pauses = [t - r["plain"] for t in r["saved"]]
        print(f"{r['mode']:10s} step {r['plain']:.2f}s  checkpoint steps " + " ".join(f"{t:.2f}" for t in r["saved"])
              + f"  pause over a step: median {statistics.median(pauses):.2f}s (save-only runs: "
              f"{base - rows[0]['plain']:.2f}s)  fit total {r['total']:.1f}s  waited at end {r['end_wait']:.1f}s",
              flush=True)
    return rows


def main() -> None:
    p = parser(__doc__, steps=8, repeats=2)
    p.add_argument("--part", choices=("tasks", "pause", "all"), default="all")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--pause-limit", type=int, default=10)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--heldout-windows", type=int, default=8)
    add_record_options(p, "cpu-eval")
    args = p.parse_args()
    if wants_record(args) and args.part != "all":
        p.error("--record and --plot need both parts (--part all)")
    global HELDOUT_WINDOWS
    HELDOUT_WINDOWS = args.heldout_windows
    torch.set_num_threads(1)
    header("bench_eval", "1 thread")
    result = {"args": vars(args)}
    if args.part in ("tasks", "all"):
        result["tasks"] = part_tasks(args.limit, args.repeats)
    if args.part in ("pause", "all"):
        result["pause"] = part_pause(args.steps, args.every, args.pause_limit)
    report("eval", result, f"# 1-min load average at end: {load1():.2f}")
    if wants_record(args):
        write_record(record(result["tasks"], result["pause"], args), record_path(args, "bench_eval.json"), args.plot,
                     args.format)


def task_numbers(r: dict) -> dict:
    """One row of ``part_tasks`` as its table prints it: s min / median / max over the rounds and
    1000 x s min / requests."""
    s = r["seconds"]
    return {"s_min": min(s), "s_median": statistics.median(s), "s_max": max(s),
            "ms_per_request": 1000 * min(s) / max(r["requests"], 1)}


def record(tasks: list[dict], pause: list[dict], args) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-eval`` from: ``part_tasks``'s rows (the last, ``total``,
    apart) with ``task_numbers``, and ``part_pause``'s runs: the ordinary step, the checkpoint
    steps, the median pause over a step, the save-only run's, the fit's total and the wait at its end."""
    rows = [{"task": r["task"], "items": r["items"], "requests": r["requests"]} | task_numbers(r) for r in tasks]
    none = statistics.median(t - pause[0]["plain"] for t in pause[0]["saved"])
    return provenance("bench_eval", "bench_eval.py", "1 thread per process") | {
        "setting": f"the small GPT with GPT-2's vocabulary, fp32; tasks: {args.limit} items of each shipped set and "
                   f"{args.heldout_windows} held-out windows of 256 tokens, {args.repeats} rounds; pause: three fit "
                   f"runs of {args.steps} steps, batch 2 x 128, a sync DCP checkpoint every {args.every} steps, "
                   f"{args.pause_limit} items per task",
        "steps": args.steps, "every": args.every, "tasks": rows[:-1], "total": rows[-1],
        "pause": [{"mode": r["mode"], "step_s": r["plain"], "checkpoint_steps_s": r["saved"],
                   "pause_median_s": statistics.median(t - r["plain"] for t in r["saved"]), "save_only_pause_s": none,
                   "fit_total_s": r["total"], "waited_at_end_s": r["end_wait"]} for r in pause]}


if __name__ == "__main__":
    main()
