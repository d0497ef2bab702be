"""Start-up of the 2-rank quickstart: process start to the first training step (issue 29).

The README's first command, ``lightning-disttrain fit --config configs/quickstart.yaml`` (FSDP2 over
2 CPU processes, the ``tiny`` GPT on the embedded corpus), run for 2 steps with
``e2e_phases.PhaseTimestamps`` added (timestamps only) and ``--ckpt_path null`` (a fresh start),
in a fresh directory each time, with the data module's token cache kept between runs (the first,
untimed run prepares it; a user pays that once). The parent takes the spawn time; the children
print ``time.monotonic()`` at their events. Per run:

- imports: spawn -> ``e2e_phases`` imported by rank 0 (the CLI's imports, Lightning's included);
- to ``fit_start``: + parsing the YAML, building the classes and the Trainer, launching rank 1
  (which imports everything again), the process group, data setup, the strategy's setup;
- to the first step: + the sanity-check validation (2 batches) and the loaders;
- the first step itself (both ranks: the latest start and end over the ranks).

    python benchmarks/bench_startup.py --repeats 3

Results: printed; JSON under benchmarks/out/startup/.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import sys
from pathlib import Path

from bench_common import OUT_ROOT, REPO, header, parser, part
from bench_end_to_end import env, spawn

OUT = OUT_ROOT / "startup"


def run_once(work: Path, tag: str, timeout: float) -> dict:
    rundir = work / "runs" / tag
    shutil.rmtree(rundir, ignore_errors=True)
    rundir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "lightning_disttrain.cli", "fit", "--config", str(REPO / "configs" / "quickstart.yaml"),
           "--trainer.max_steps", "2", "--ckpt_path", "null", "--trainer.enable_progress_bar", "false",
           "--trainer.callbacks+=e2e_phases.PhaseTimestamps",
           "--data.init_args.cache_dir", str(work / "cache")]
    t0, t1, text = spawn(cmd, rundir, env(work), rundir / "log.txt", timeout)
    first: dict[str, float] = {}
    for name, t in re.findall(r"^@@e2e (\S+) ([0-9.]+)$", text, re.M):
        first.setdefault(name, float(t))  # rank 0 prints before it launches rank 1
    summaries = [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("@@e2e-json ")]
    if len(summaries) != 2 or not all(s["step_starts"] for s in summaries):
        raise SystemExit(f"{tag}: expected both ranks' step timestamps; see {rundir / 'log.txt'}")
    start = max(s["step_starts"][0] for s in summaries)
    end = max(s["step_ends"][0] for s in summaries)
    return {"imports": first["phases_imported"] - t0, "to_fit_start": first["fit_start"] - t0,
            "to_first_step": start - t0, "first_step_done": end - t0, "total": t1 - t0}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    work = OUT / "work"
    header("bench_startup", "gloo", "2 ranks")
    with part("startup"):
        run_once(work, "warmup", args.timeout)  # prepares the token cache and the bytecode cache
        runs = [run_once(work, f"run{i}", args.timeout) for i in range(args.repeats)]
        keys = ("imports", "to_fit_start", "to_first_step", "first_step_done", "total")
        print(f"{'seconds from spawn':22s} " + " ".join(f"{k:>16s}" for k in keys))
        for i, r in enumerate(runs):
            print(f"{'run ' + str(i):22s} " + " ".join(f"{r[k]:16.2f}" for k in keys))
        med = {k: statistics.median(r[k] for r in runs) for k in keys}
        print(f"{'median':22s} " + " ".join(f"{med[k]:16.2f}" for k in keys))
        (OUT / "startup.json").write_text(json.dumps({"runs": runs, "median": med}, indent=1))


if __name__ == "__main__":
    main()
