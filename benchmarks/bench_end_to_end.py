"""End to end: process start to exit of a small single-process CPU run, a plain PyTorch script vs
``lightning-disttrain fit``, phase by phase.

The recipe (both sides): the ``tiny`` GPT (4 layers, 128 wide, 4 heads), the byte tokenizer on the
embedded corpus (prepared once into ``--work``/cache before anything is timed), batch 8 x 128
tokens, AdamW (lr 3e-3, weight decay 0.1 on 2-D weights, betas 0.9/0.95), 30 warmup steps then
cosine to 10%, gradient clipping 1.0, seed 1337, the loss logged every 10 steps to CSV,
validation every ``--val-every`` steps on the first ``--val-batches`` batches of the validation
split, one checkpoint at the end.

- plain: ``benchmarks/e2e_plain.py`` (``GPT`` from a ``GPTConfig``, its own loop, ``torch.save``;
  no Lightning is imported).
- lightning: ``benchmarks/e2e_lightning.py``, the same recipe as a Lightning user writes it by hand
  (a minimal ``LightningModule`` around the same ``GPT``, ``self.log`` of the loss every step, the
  same loaders, ``L.Trainer`` with the same CSVLogger / ModelCheckpoint / validation settings and
  Lightning's defaults; ``lightning_disttrain``'s Lightning layer not imported): what Lightning
  itself costs, so that ``fit / lightning`` is what this package adds (``--no-lightning`` leaves
  it out).
- fit: ``lightning-disttrain fit --config <the YAML this writes>``: ``GPTModule`` (config tiny),
  ``TokenDataModule``, CSVLogger, a ``ModelCheckpoint`` every ``--steps`` steps (one save, at the
  end), ``e2e_phases.PhaseTimestamps`` for the timestamps, ``devices: 1``, everything else
  Lightning's defaults (progress bar, model summary, 2 sanity-check validation batches). Run as
  the console script runs it (``from lightning_disttrain.cli import main; sys.exit(main())``),
  with two timestamps added. One variant per ``--strategies`` entry: ``fit`` is
  ``strategy: fsdp2`` (the quickstart config with ``--trainer.devices 1``, what a quickstart user
  runs on one process: the headline figure), ``fit-auto`` is ``strategy: auto`` (Lightning's
  single-device strategy: what the package's own layer costs apart from FSDP2).

Each run is its own process, spawned by this one, which takes the spawn and exit times; the
process prints ``time.monotonic()`` at each phase (the same clock), so each run is split into
phases that add up to its total: interpreter start, imports, CLI + Trainer setup, data
preparation, model build, before the first step, first step, steady steps, validation,
checkpoint save, teardown. Runs alternate (plain, fit, fit-auto / fit, fit-auto, plain / ...), after one untimed
warm-up round of short runs (fills the bytecode cache: the children run with
``PYTHONPYCACHEPREFIX=<work>/pycache``, since this machine sets ``PYTHONDONTWRITEBYTECODE``).
The imports part times ``python -c "import ..."`` spawn to exit for the packages each side loads,
split into interpreter start, the import and interpreter shutdown.

    flock /tmp/ldt_test.lock python benchmarks/bench_end_to_end.py --repeats 3
    flock /tmp/ldt_test.lock python benchmarks/bench_end_to_end.py --steps 6 --val-every 3 --repeats 1 --import-repeats 1

``--record FILE`` writes the phase medians and totals as ``cpu_figures.py`` reads them (``record``;
``--append`` adds this run to the record in FILE, as a second panel); ``--plot DIR`` draws
``cpu-end-to-end`` from that record.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import HERE, OUT_ROOT, REPO, child_env, header, load1, parser, part, report, spread, table, timed_rounds
from record import add_record_options, provenance, record_path, wants_record, write_record

EVENT = re.compile(r"@@e2e (\S+) ([0-9.]+)")
SUMMARY = "@@e2e-json "
FIT_MAIN = ("import sys, time; sys.stderr.write(f'@@e2e main {time.monotonic():.6f}\\n'); "
            "from lightning_disttrain.cli import main; sys.stderr.write(f'@@e2e imports {time.monotonic():.6f}\\n'); "
            "sys.exit(main())")
"""``lightning-disttrain``'s console script (``from lightning_disttrain.cli import main; sys.exit(main())``)
with a timestamp before and after its import."""

PHASES = [
    ("interpreter", "interpreter start (spawn -> first line)"),
    ("imports", "imports"),
    ("cli", "CLI + Trainer setup (YAML, classes, strategy env)"),
    ("data", "data preparation"),
    ("model", "model build (+ optimizer, strategy setup)"),
    ("pre_step", "before the first step (sanity val, loaders)"),
    ("first_step", "first step (warm-up)"),
    ("steady", "steady steps (2..N, incl. batch fetch)"),
    ("val", "validation (incl. switching, loop end)"),
    ("ckpt", "checkpoint save"),
    ("teardown", "teardown (last event -> exit)"),
]
DETAILS = [
    ("cli.parse", "  CLI: parse YAML, instantiate model/data/callbacks"),
    ("cli.trainer", "  CLI: Trainer(...)"),
    ("cli.env", "  Trainer.fit -> prepare_data (strategy env)"),
    ("model.hooks", "  setup hooks (config save, module.setup)"),
    ("model.configure", "  configure_model (GPT(...))"),
    ("model.strategy", "  strategy.setup (wrap, optimizer)"),
    ("pre_step.sanity", "  sanity-check validation"),
    ("val.loops", "  validation loops, hook to hook"),
    ("teardown.trainer", "  Trainer teardown -> teardown hook"),
    ("teardown.return", "  return to the interpreter (CLI/main)"),
    ("teardown.exit", "  interpreter shutdown (atexit -> exit)"),
]
IMPORTS = [
    ("python -c pass", "pass"),
    ("import torch", "import torch"),
    ("import lightning", "import lightning"),
    ("import lightning_disttrain", "import lightning_disttrain"),
    ("fit's: from lightning_disttrain.cli import main", "from lightning_disttrain.cli import main"),
    ("plain's (e2e_plain.py --imports-only)", None),
]


# -- the runs ---------------------------------------------------------------------------------


def prepare_data(work: Path, args) -> dict:
    """Prepare the embedded corpus with the byte tokenizer into ``work/cache`` (once; untimed) as
    ``TokenDataModule`` does, and return its shard lists."""
    code = ("import json, sys; from lightning_disttrain import TokenDataModule; "
            f"dm = TokenDataModule(source='embedded', tokenizer='bytes', seq_len={args.seq}, batch_size={args.batch}, "
            f"val_batches={args.val_batches}, cache_dir={str(work / 'cache')!r}); dm.prepare_data(); dm.setup('fit'); "
            "print(json.dumps({'train': [str(p) for p in dm.shards.train], 'val': [str(p) for p in dm.shards.val], "
            "'train_tokens': dm.train_windows.num_tokens, 'val_tokens': dm.val_windows.num_tokens}))")
    out = subprocess.run([sys.executable, "-c", code], env=env(work), capture_output=True, text=True, cwd=work)
    if out.returncode != 0:
        raise SystemExit(f"preparing the data failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def fit_yaml(work: Path, args, strategy: str, steps: int, val_every: int) -> str:
    return f"""# written by benchmarks/bench_end_to_end.py
seed_everything: 1337
trainer:
  accelerator: cpu
  devices: 1
  strategy: {strategy}
  precision: 32-true
  max_steps: {steps}
  val_check_interval: {val_every}
  check_val_every_n_epoch: null
  gradient_clip_val: 1.0
  log_every_n_steps: 10
  default_root_dir: .
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args:
      save_dir: .
      name: logs
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: checkpoints
        every_n_train_steps: {steps}
    - class_path: e2e_phases.PhaseTimestamps
model:
  class_path: lightning_disttrain.GPTModule
  init_args:
    config: tiny
    lr: 3.0e-3
    warmup_steps: 30
    weight_decay: 0.1
data:
  class_path: lightning_disttrain.TokenDataModule
  init_args:
    source: embedded
    tokenizer: bytes
    seq_len: {args.seq}
    batch_size: {args.batch}
    val_batches: {args.val_batches}
    cache_dir: {work / 'cache'}
"""


def env(work: Path, pycache: bool = True) -> dict[str, str]:
    """A child's environment: ``benchmarks/`` and the repository on ``PYTHONPATH``, bytecode cached
    under ``work/pycache`` (or, ``pycache=False``, this machine's setting as it is)."""
    e = child_env()
    if pycache:
        e.pop("PYTHONDONTWRITEBYTECODE", None)
        e["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    if "OMP_NUM_THREADS" in os.environ:
        e["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return e


def spawn(cmd: list[str], cwd: Path, environ: dict[str, str], log: Path, timeout: float) -> tuple[float, float, str]:
    """Run ``cmd``; (spawn time, exit time) on ``time.monotonic()``, and its stderr + stdout."""
    with open(log, "w") as f:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, env=environ, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SystemExit(f"{cmd[:3]} ran past {timeout:.0f} s; see {log}") from None
        t1 = time.monotonic()
    text = log.read_text(errors="replace")
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {rc}); see {log}:\n{text[-3000:]}")
    return t0, t1, text


def variants(strategies: list[str], lightning: bool) -> dict[str, str | None]:
    """Variant name -> fit's strategy (None: the plain script or, ``lightning``, the hand-written
    Lightning one)."""
    return {"plain": None, **({"lightning": None} if lightning else {}),
            **{("fit" if s == "fsdp2" else f"fit-{s}"): s for s in strategies}}


def run_once(name: str, strategy: str | None, work: Path, args, data: dict, tag: str, steps: int,
             val_every: int) -> dict:
    """One run of the plain or the hand-written Lightning script (``strategy`` None) or of fit, in a
    fresh directory: its phases in seconds."""
    side = name if strategy is None else "fit"
    rundir = work / "runs" / f"{tag}-{name}"
    shutil.rmtree(rundir, ignore_errors=True)
    rundir.mkdir(parents=True)
    if side in ("plain", "lightning"):
        cmd = [sys.executable, str(HERE / f"e2e_{side}.py"), "--train", *data["train"], "--val", *data["val"],
               "--out", str(rundir), "--steps", str(steps), "--batch", str(args.batch), "--seq", str(args.seq),
               "--val-every", str(val_every), "--val-batches", str(args.val_batches)]
    else:
        (rundir / "fit.yaml").write_text(fit_yaml(work, args, strategy, steps, val_every))
        cmd = [sys.executable, "-c", FIT_MAIN, "fit", "--config", "fit.yaml"]
    t0, t1, text = spawn(cmd, rundir, env(work), rundir / "log.txt", args.timeout)
    phases = split_phases(side, t0, t1, text)
    ckpt_bytes = sum(f.stat().st_size for f in rundir.rglob("*") if f.is_file()
                     and (f.suffix in (".pt", ".ckpt", ".distcp") or "checkpoints" in f.parts))
    phases["ckpt_bytes"] = ckpt_bytes
    shutil.rmtree(rundir / "checkpoints", ignore_errors=True)  # the logs stay, the weights go
    for f in rundir.glob("*.pt"):
        f.unlink()
    return phases


def split_phases(side: str, spawn_t: float, exit_t: float, text: str) -> dict:
    """A run's phases (seconds, adding up to exit - spawn) from its ``@@e2e`` lines."""
    ev: dict[str, float] = {}
    for name, t in EVENT.findall(text):
        ev.setdefault(name, float(t))
    summary = json.loads(text[text.rindex(SUMMARY) + len(SUMMARY):].split("\n", 1)[0])
    starts, ends = summary["step_starts"], summary["step_ends"]
    vals, ckpts = summary["val"], summary["checkpoints"]
    if side == "fit":
        data_start, data_end, model_end = ev["prepare_data_start"], ev["dm_setup_end"], ev["fit_start"]
        last_hook = ev["teardown"]
    elif side == "lightning":  # its loaders are built before the Trainer: the model phase runs to fit_start
        data_start, data_end, model_end = ev["data_start"], ev["data_end"], ev["fit_start"]
        last_hook = ev["teardown"]
    else:
        data_start, data_end, model_end = ev["data_start"], ev["data_end"], ev["model_end"]
        last_hook = ev["train_end"]
    p = {"interpreter": ev["main"] - spawn_t, "imports": ev["imports"] - ev["main"],
         "cli": data_start - ev["imports"], "data": data_end - data_start, "model": model_end - data_end,
         "pre_step": starts[0] - model_end, "first_step": ends[0] - starts[0]}
    # Steps 2..N: each step's own span, and the gap before it unless a validation or a save ran
    # in that gap (then the gap is validation, less the save). After the last step, to the end of
    # the training loop: validation (and the save), less the save.
    steady = sum(e - s for s, e in zip(starts[1:], ends[1:]))
    val = 0.0
    ckpt = sum(e - s for s, e in ckpts)

    def inside(lo, hi, spans):
        return [(s, e) for s, e in spans if lo <= s <= hi]

    for prev_end, start in zip(ends, starts[1:]):
        gap = start - prev_end
        if inside(prev_end, start, vals) or inside(prev_end, start, ckpts):
            val += gap - sum(e - s for s, e in inside(prev_end, start, ckpts))
        else:
            steady += gap
    val += ev["train_end"] - ends[-1] - sum(e - s for s, e in inside(ends[-1], ev["train_end"], ckpts))
    p.update(steady=steady, val=val, ckpt=ckpt, teardown=exit_t - ev["train_end"])
    p["total"] = exit_t - spawn_t
    p["steady_per_step"] = steady / max(1, len(starts) - 1)
    p["val_loops"] = sum(e - s for s, e in vals)
    p["teardown.exit"] = exit_t - ev["atexit"]
    p["teardown.return"] = ev["atexit"] - last_hook
    if side == "fit":
        p["cli.parse"] = ev["callback_init"] - ev["imports"]
        p["cli.trainer"] = ev["trainer_fit_start"] - ev["callback_init"]
        p["cli.env"] = data_start - ev["trainer_fit_start"]
        p["model.hooks"] = ev["configure_model_start"] - data_end
        p["model.configure"] = ev["configure_model_end"] - ev["configure_model_start"]
        p["model.strategy"] = model_end - ev["configure_model_end"]
        p["pre_step.sanity"] = ev.get("sanity_end", 0.0) - ev.get("sanity_start", 0.0)
        p["teardown.trainer"] = ev["teardown"] - ev["train_end"]
    elif side == "lightning":
        p["pre_step.sanity"] = ev.get("sanity_end", 0.0) - ev.get("sanity_start", 0.0)
        p["teardown.trainer"] = ev["teardown"] - ev["train_end"]
    else:
        p["model.configure"] = model_end - data_end
    p["val.loops"] = p.pop("val_loops")
    p["steps"] = summary["global_step"]
    p["val_losses"] = summary["val_losses"]
    p["train_losses"] = summary["train_losses"]
    p["threads"] = summary["threads"]
    p["strategy"] = summary["strategy"]
    p["saves"] = len(ckpts)
    assert abs(sum(p[k] for k, _ in PHASES) - p["total"]) < 1e-3, "the phases do not add up to the total"
    return p


# -- imports ----------------------------------------------------------------------------------

IMPORT_MARKS = ("import sys, time, atexit; t0 = time.monotonic(); {stmt}; t1 = time.monotonic(); "
                "atexit.register(lambda: sys.stderr.write(f'@@e2e main {{t0:.6f}}\\n@@e2e imports {{t1:.6f}}\\n"
                "@@e2e atexit {{time.monotonic():.6f}}\\n'))")
"""An import command with the marks a run prints: first line, after the import, shutdown begins."""


def time_import(cmd: list[str], environ: dict[str, str], cwd: Path) -> dict[str, float]:
    """Spawn to exit of ``cmd`` (an ``IMPORT_MARKS`` command or ``e2e_plain.py --imports-only``),
    split into interpreter start, the import and interpreter shutdown."""
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=environ, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    t1 = time.monotonic()
    ev = {name: float(t) for name, t in EVENT.findall(out.stderr)}
    return {"total": t1 - t0, "start": ev["main"] - t0, "import": ev["imports"] - ev["main"],
            "shutdown": t1 - ev["atexit"]}


def time_imports(work: Path, repeats: int) -> tuple[dict, list, dict]:
    """``time_import`` of each of ``IMPORTS`` (rounds, alternating), bytecode cached; then once
    each: ``import lightning_disttrain`` as this machine runs it (no bytecode written: the
    package's sources compiled in every process), and ``-X importtime`` of fit's imports."""
    e = env(work)
    cmds = {label: ([sys.executable, "-c", IMPORT_MARKS.format(stmt=code)] if code is not None
                    else [sys.executable, str(HERE / "e2e_plain.py"), "--imports-only"]) for label, code in IMPORTS}
    times, rounds = timed_rounds({k: (lambda c=c: time_import(c, e, work)) for k, c in cmds.items()}, repeats,
                                 warmup=1)
    bare = env(work, pycache=False)
    once = {"import lightning_disttrain, no bytecode cache (this machine's PYTHONDONTWRITEBYTECODE=1)":
            time_import([sys.executable, "-c", IMPORT_MARKS.format(stmt="import lightning_disttrain")], bare, work)}
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "from lightning_disttrain.cli import main"],
                         env=e, cwd=work, capture_output=True, text=True, check=True)
    return times, rounds, {"once": once, "importtime": importtime_top(out.stderr)}


IMPORTTIME_NAMES = ("lightning_disttrain.cli", "lightning", "torch", "lightning.fabric.utilities.imports",
                    "torchmetrics.functional", "transformers", "scipy.signal", "torch._dynamo", "jsonargparse")
"""Where fit's imports go: ``lightning.fabric.utilities.imports`` is where Lightning first imports
torchmetrics (whose text metrics import transformers, and its functional part scipy.signal);
``torch._dynamo`` comes in with ``lightning.fabric.wrappers``."""


def importtime_top(text: str) -> dict:
    """Cumulative import seconds (``-X importtime``; nested ones included in their parents') of
    the modules in ``IMPORTTIME_NAMES``, where first imported."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| *(\S+)$", line)
        if m and m.group(3) in IMPORTTIME_NAMES:
            found[m.group(3)] = max(found.get(m.group(3), 0.0), int(m.group(2)) / 1e6)
    return {k: found[k] for k in IMPORTTIME_NAMES if k in found}


# -- report -----------------------------------------------------------------------------------


def med(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def phase_table(results: dict[str, list[dict]]) -> str:
    """Per-phase medians of every variant, and each fit variant's difference to plain's."""
    names = list(results)
    fits = [n for n in names if n != "plain"]
    rows = []
    for key, label in [*PHASES, ("total", "TOTAL (spawn -> exit)")]:
        m = {n: med(results[n], key) for n in names}
        rows.append((label, *(m[n] for n in names), *(m[f] - m["plain"] for f in fits)))
        for dkey, dlabel in DETAILS if key != "total" else []:
            if dkey.split(".")[0] == key:
                rows.append((dlabel, *(med(results[n], dkey) for n in names), *([None] * len(fits))))
    return table(["phase (median over runs, s)", *[(n, ".2f") for n in names],
                  *[(f"{f} - plain", "+.2f") for f in fits]], rows)


def per_run_table(results: dict[str, list[dict]]) -> str:
    rows = []
    for name, runs in results.items():
        for i, r in enumerate(runs):
            rows.append((f"{name} {i}", *(r[k] for k, _ in PHASES), r["total"], r["steady_per_step"] * 1e3,
                         r["val_losses"][-1] if r["val_losses"] else None))
    cols = ["run", *[(k, ".2f") for k, _ in PHASES], ("total", ".2f"), ("ms/step", ".1f"), ("val loss", ".4f")]
    return table(cols, rows)


def imports_text(imports: dict) -> str:
    times = imports["times"]
    rows = [(k, *(statistics.median(r[f] for r in v) for f in ("total", "start", "import", "shutdown")),
             min(r["total"] for r in v), max(r["total"] for r in v)) for k, v in times.items()]
    rows += [(f"{k} (once)", v["total"], v["start"], v["import"], v["shutdown"], None, None)
             for k, v in imports["once"].items()]
    return "\n".join([
        "imports: spawn to exit (= interpreter start + import + shutdown), bytecode cached; medians over the rounds",
        table(["command", ("total", ".2f"), ("start", ".2f"), ("import", ".2f"), ("shutdown", ".2f"),
               ("total min", ".2f"), ("max", ".2f")], rows),
        "-X importtime of `from lightning_disttrain.cli import main` (once; cumulative s, a module's own imports "
        "included, where first imported): " + ", ".join(f"{k} {v:.2f}" for k, v in imports["importtime"].items()),
        "  order in each round: " + " | ".join(", ".join(str(IMPORTS.index(next(i for i in IMPORTS if i[0] == n)))
                                                         for n in r["order"]) for r in imports["rounds"])
        + " (by the rows above)", ""])


def record(results: dict[str, list[dict]], args) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-end-to-end`` from: this run (``results``: variant -> its runs,
    as ``run_once`` returns them) as one row of ``runs``: each phase's median per variant (the phase by
    the first words of its label) and its difference to plain, the median totals, the totals per round
    and the median steady step."""
    data = provenance("bench_end_to_end", "bench_end_to_end.py", "1 process per run, OMP_NUM_THREADS "
                      + os.environ.get("OMP_NUM_THREADS", "unset (torch's default)"))
    names = list(results)
    phases = []
    for key, label in PHASES:
        m = {n: med(results[n], key) for n in names}
        phases.append({"phase": label.split(" (")[0], "s": m}
                      | {f"{n.replace('-', '_')}_minus_plain": m[n] - m["plain"] for n in names if n != "plain"})
    return data | {
        "setting": f"the tiny GPT, byte tokenizer on the embedded corpus, {args.steps} optimizer steps of {args.batch} x "
                   f"{args.seq} tokens, AdamW, validation every {args.val_every} steps ({args.val_batches} batches), one "
                   f"checkpoint at the end; one process per variant, alternating, {args.repeats} rounds",
        "runs": [{"run": data["date"].split(" ", 1)[1], "date": data["date"], "command": data["command"],
                  "variants": names, "phases": phases, "total_s": {n: med(results[n], "total") for n in names},
                  "totals_per_round": {n: [r["total"] for r in results[n]] for n in names},
                  "steady_step_ms": {n: 1e3 * med(results[n], "steady_per_step") for n in names}}]}


def main() -> None:
    p = parser(__doc__, full_doc=True, steps=(400, "optimizer steps per run"),
               repeats=(3, "alternating rounds (one run of each variant each)"),
               out=(None, "the JSON (default benchmarks/out/end_to_end.json)"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--val-every", type=int, default=100, help="validation every N steps (must divide --steps)")
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--strategies", nargs="+", default=["fsdp2", "auto"], choices=["fsdp2", "auto"],
                   help="fit variants by trainer.strategy (devices: 1 each): fsdp2 is `fit`, auto `fit-auto`")
    p.add_argument("--no-lightning", dest="lightning", action="store_false",
                   help="leave out the hand-written Lightning variant (e2e_lightning.py: Lightning's own floor)")
    p.add_argument("--import-repeats", type=int, default=3, help="rounds of the import timings (0: skip them)")
    p.add_argument("--warmup-steps", type=int, default=4,
                   help="steps of the untimed warm-up round's runs (0: no warm-up round)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--work", type=Path, default=OUT_ROOT / "end_to_end", help="run directories, data cache, bytecode")
    add_record_options(p, "cpu-end-to-end", append="run")
    args = p.parse_args()
    if args.steps % args.val_every:
        p.error(f"--val-every {args.val_every} must divide --steps {args.steps}")
    work = args.work.resolve()
    (work / "runs").mkdir(parents=True, exist_ok=True)
    threads = os.environ.get("OMP_NUM_THREADS", "unset (torch's default)")
    header("bench_end_to_end", "1 process per run", f"OMP_NUM_THREADS {threads}")
    print(f"recipe: tiny GPT, bytes tokenizer on the embedded corpus, {args.steps} steps x {args.batch} x {args.seq} "
          f"tokens, validation every {args.val_every} steps on {args.val_batches} batches, one checkpoint at the end",
          flush=True)
    kinds = variants(args.strategies, args.lightning)

    with part("prepare"):
        data = prepare_data(work, args)
        print(f"data: {data['train_tokens']:,} train / {data['val_tokens']:,} val tokens in {work / 'cache'}",
              flush=True)

    imports = None
    if args.import_repeats > 0:
        with part("imports"):
            times, rounds, once = time_imports(work, args.import_repeats)
            imports = {"times": times, "rounds": rounds, **once}
            print(imports_text(imports), flush=True)

    with part("runs"):
        if args.warmup_steps > 0:
            w = args.warmup_steps
            for name, strategy in kinds.items():
                r = run_once(name, strategy, work, args, data, "warmup", w, w)
                print(f"warm-up {name}: {r['total']:.1f} s ({w} steps)", flush=True)
        counter = dict.fromkeys(kinds, 0)

        def variant(name: str, strategy: str | None):
            def go() -> dict:
                i = counter[name]
                counter[name] += 1
                r = run_once(name, strategy, work, args, data, f"r{i}", args.steps, args.val_every)
                print(f"{name} {i}: {r['total']:.1f} s, steady {r['steady_per_step'] * 1e3:.1f} ms/step, "
                      f"val loss {r['val_losses'][-1]:.4f}, load {load1():.2f}", flush=True)
                return r
            return go

        results, rounds = timed_rounds({n: variant(n, s) for n, s in kinds.items()}, args.repeats)

    lines = [f"per-phase medians over {args.repeats} runs of each variant; the phases add up to the total; torch "
             "threads: " + ", ".join(f"{n} {rs[0]['threads']}" for n, rs in results.items())
             + "; strategies: " + ", ".join(f"{n} {rs[0]['strategy']}" for n, rs in results.items() if n != "plain"),
             phase_table(results), "", "per run (s):", per_run_table(results), ""]
    ratios = {}
    pairs = [(n, "plain") for n in results if n != "plain"]
    pairs += [(n, "lightning") for n in results if "lightning" in results and n.startswith("fit")]
    for name, base in pairs:
        runs, ref = results[name], results[base]
        ratio = [f["total"] / b["total"] for b, f in zip(ref, runs)]
        steady = [f["steady_per_step"] / b["steady_per_step"] for b, f in zip(ref, runs)]
        gap = {k: med(runs, k) - med(ref, k) for k, _ in PHASES}
        ratios[f"{name}/{base}"] = {"total": ratio, "steady": steady}
        lines += [f"{name} / {base}, total, round by round (min median max): {spread(ratio)}; ratio of the medians "
                  f"{med(runs, 'total') / med(ref, 'total'):.3f}",
                  f"{name} / {base}, steady s/step, round by round: {spread(steady)}",
                  f"{name} - {base}, gap of the medians: {med(runs, 'total') - med(ref, 'total'):+.2f} s; by phase: "
                  + ", ".join(f"{k} {v:+.2f}" for k, v in sorted(gap.items(), key=lambda kv: -abs(kv[1])))]
    lines += ["validation losses (every validation of run 0): " + " | ".join(
                  f"{n} " + " ".join(f"{x:.4f}" for x in rs[0]["val_losses"]) for n, rs in results.items()),
              "final validation loss, every run: " + " | ".join(
                  f"{n} " + " ".join(f"{r['val_losses'][-1]:.4f}" for r in rs) for n, rs in results.items()),
              "train loss at steps 10, 20, 30 (run 0): " + " | ".join(
                  f"{n} " + " ".join(f"{x:.4f}" for _, x in rs[0]["train_losses"][:3]) for n, rs in results.items()),
              "checkpoint (run 0): " + ", ".join(f"{n} {rs[0]['ckpt_bytes']:,} B in {rs[0]['saves']} save"
                                                  for n, rs in results.items()),
              "order in each round: " + " | ".join(", ".join(r["order"]) for r in rounds),
              "1-min load average before each round: " + " ".join(f"{r['load1_before']:.2f}" for r in rounds)]
    report("end_to_end", {"results": results, "rounds": rounds, "ratios": ratios, "imports": imports, "data": data,
                          "args": vars(args), "repo": str(REPO)}, "\n".join(lines), out=args.out)
    if wants_record(args):
        write_record(record(results, args), record_path(args, OUT_ROOT / "bench_end_to_end.json"), args.plot,
                     args.format, append="runs" if args.append else None)


if __name__ == "__main__":
    main()
