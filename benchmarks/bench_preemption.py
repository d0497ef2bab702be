"""Fault injection: SIGTERM to a random rank at a random moment, relaunch, compare with an uninterrupted run.

    python benchmarks/bench_preemption.py                 # 20 trials, 12 steps, 2 CPU ranks
    python benchmarks/bench_preemption.py --trials 30 --seed 1

One uninterrupted run first (the reference losses, and the agreement collective's time per
step). Then each trial: launch the same run in a fresh directory (async DCP saves every 3 steps,
``PreemptionCheckpoint`` with its defaults), wait until both ranks are training, sleep a random
time within the training span, SIGTERM one random rank (the moment lands anywhere: data loading,
forward, backward, optimizer, an async save in flight, its finalisation), wait for the exit; then
relaunch with ``ckpt_path="last"`` to the end and compare the losses after the resume with the
reference's, bitwise (float.hex). Per trial:

- exit code (143 expected) and the time from the signal to the exit of the whole launch;
- with ``--validate``, whether the signal landed in a validation (after every third step), and how
  many validation batches ended after it on the signalled rank (the batch in progress: 1, or 0 when
  the signal came after the last batch's end);
- the step the signal interrupted (the last batch start before it, on the signalled rank) and the
  step saved: steps lost beyond the boundary = max(0, interrupted - 1 - saved) (goal 0);
- every checkpoint with a manifest re-verified (sha256 of every file): a checkpoint that reads as
  complete but fails verification is a corrupted checkpoint accepted (must be 0);
- resumed losses equal to the reference's from the saved step on.

``--record FILE`` writes the run's outcome counts, signal-to-exit times and the agreement's cost as
``cpu_figures.py`` reads them (``record``; ``--append`` adds this run to the record in FILE);
``--plot DIR`` draws ``cpu-preemption`` from that record.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import REPO, child_env, parser, write_json
from record import add_record_options, provenance, record_path, wants_record, write_record

WORKER = Path(__file__).with_name("preemption_worker.py")


def _start(data: Path, ckpt: Path, out: Path, run: str, steps: int, *extra: str, probe: bool = False) -> subprocess.Popen:
    log = open(out / f"{run}.log", "w")
    env = child_env(threads="1", **({"BENCH_PROBE": "1"} if probe else {}))
    return subprocess.Popen([sys.executable, str(WORKER), str(data), str(ckpt), str(out), run, str(steps), *extra],
                            env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def _ranks(out: Path, run: str) -> list[dict]:
    return [json.loads((out / f"{run}.rank{r}.json").read_text()) for r in range(2)]


def _wait_training(out: Path, run: str, proc: subprocess.Popen, timeout: float = 300) -> list[int] | None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        pids = [out / f"{run}.pid{r}" for r in range(2)]
        if all(p.exists() and p.read_text() for p in pids):
            return [int(p.read_text()) for p in pids]
        time.sleep(0.05)
    return None


def _step_at(out: Path, run: str, rank: int, when: float) -> tuple[int | None, bool, int]:
    """The step the signal interrupted on ``rank`` (the last batch start before it), whether it
    landed in a validation, and how many validation batches ended after it."""
    step, in_validation, val_after = None, False, 0
    for line in (out / f"{run}.steps{rank}").read_text().splitlines():
        t, *rest = line.split()
        if float(t) > when:
            val_after += rest[0] == "B"
            continue
        if rest[0] in ("V", "v"):
            in_validation = rest[0] == "V"
        elif rest[0] != "B":
            step, in_validation = int(rest[0]), False
    return step, in_validation, val_after


def _corrupted_accepted(ckpt: Path) -> tuple[int, int]:
    from lightning_disttrain.checkpoint import (
        CheckpointVerificationError,
        list_checkpoints,
        verify_checkpoint,
    )

    complete = [c for c in list_checkpoints(ckpt) if c.complete]
    bad = 0
    for cand in complete:
        try:
            verify_checkpoint(cand.resolved)
        except CheckpointVerificationError:
            bad += 1
    return bad, len(complete)


def trial(index: int, rng: random.Random, data: Path, root: Path, steps: int, span_s: float, ref: list[dict]) -> dict:
    out = root / f"trial{index:02d}"
    out.mkdir()
    ckpt = out / "ckpt"
    proc = _start(data, ckpt, out, "pre", steps)
    pids = _wait_training(out, "pre", proc)
    rank, delay = rng.randrange(2), rng.uniform(0.0, span_s)
    row: dict = {"trial": index, "rank": rank, "delay_s": round(delay, 2)}
    if pids is None:
        row["error"] = "did not start"
        _finish(proc)
        return row
    time.sleep(delay)
    sent = time.time()
    try:
        os.kill(pids[rank], signal.SIGTERM)
    except ProcessLookupError:
        pass
    code = _finish(proc)
    row.update(exit_code=code, exit_s=round(time.time() - sent, 2))
    pre = _ranks(out, "pre")
    interrupted, row["in_validation"], val_after = _step_at(out, "pre", rank, sent)
    if row["in_validation"]:
        row["val_batches_after_signal"] = val_after
    row["interrupted_step"] = interrupted
    if code == 0:  # the signal came after the last step's boundary: the run had finished
        row.update(saved_step=None, lost_steps=0, resumed_equal=pre[0]["losses"] == ref[0]["losses"])
        row["corrupted_accepted"], row["complete_ckpts"] = _corrupted_accepted(ckpt)
        return row
    saved = pre[0].get("saved_step")
    row["saved_step"] = saved
    row["lost_steps"] = None if saved is None or interrupted is None else max(0, interrupted - 1 - saved)
    row["corrupted_accepted"], row["complete_ckpts"] = _corrupted_accepted(ckpt)
    resume = _start(data, ckpt, out, "resume", steps, "last")
    row["resume_exit_code"] = _finish(resume)
    if row["resume_exit_code"] == 0:
        resumed = _ranks(out, "resume")
        start = resumed[0]["start_step"]
        row["resumed_from"] = start
        if start is None and not any(r["losses"] for r in resumed):
            # The signal came in the shutdown after the last step (Lightning had restored the default
            # handler); the relaunch found the final checkpoint and had no step left to train.
            row["nothing_left"] = True
            return row
        row["resumed_equal"] = all(resumed[r]["losses"] == ref[r]["losses"][start:] for r in range(2))
        row["losses_before_equal"] = all(pre[r]["losses"] == ref[r]["losses"][:len(pre[r]["losses"])]
                                         for r in range(2))
    return row


def outcomes(rows: list[dict]) -> dict:
    """The trials' outcomes (``trial``'s rows) as the summary counts them: the trials saved (every rank
    saved the agreed step and exited with the code), ended before the signal took effect (exit 0),
    signalled in the shutdown after the last step (nothing saved, nothing left), preempted and resumed;
    steps lost, corrupted checkpoints accepted and complete ones re-verified; resumed losses compared
    with the reference and bitwise equal; and the signal-to-exit seconds of the saved trials."""
    preempted = [r for r in rows if r.get("exit_code") not in (0, None) and not r.get("nothing_left")]
    saved = [r for r in rows if r.get("saved_step") is not None]  # every rank saved and exited with the code
    return {"saved": saved, "preempted": preempted, "ended_exit_0": sum(r.get("exit_code") == 0 for r in rows),
            "nothing_left_saved": sum(bool(r.get("nothing_left")) and r.get("saved_step") is not None for r in rows),
            "shutdown": sum(bool(r.get("nothing_left")) and r.get("saved_step") is None for r in rows),
            "steps_lost": sum(r.get("lost_steps") or 0 for r in rows),
            "corrupted_accepted": sum(r.get("corrupted_accepted", 0) for r in rows),
            "reverified": sum(r.get("complete_ckpts", 0) for r in rows),
            "resumed_bitwise": sum(bool(r.get("resumed_equal")) for r in preempted),
            "exit_s": [r["exit_s"] for r in saved]}


def summarize(rows: list[dict]) -> None:
    o = outcomes(rows)
    preempted, saved = o["preempted"], o["saved"]
    print("\nsummary:")
    print(f"  trials {len(rows)}; preempted and resumed {len(preempted)} (exit codes "
          f"{sorted({r.get('exit_code') for r in rows})}); finished before the signal took effect "
          f"{o['ended_exit_0']}; relaunch had nothing left: {o['nothing_left_saved']} saved the last step "
          f"(signal in the last validation), {o['shutdown']} signal in the shutdown after the last step")
    print(f"  steps lost beyond the boundary: total {o['steps_lost']}; signals that "
          f"landed in a validation: {sum(bool(r.get('in_validation')) for r in rows)}")
    print(f"  corrupted checkpoints accepted: {o['corrupted_accepted']} "
          f"(of {o['reverified']} complete checkpoints re-verified)")
    print(f"  resumed losses bitwise equal to the reference: {o['resumed_bitwise']}/{len(preempted)}")
    in_val = [r for r in saved if r.get("in_validation")]
    if in_val:
        print(f"  signals in a validation that were saved: {len(in_val)}; saved the step the validation followed: "
              f"{sum(r.get('saved_step') == r.get('interrupted_step') for r in in_val)}; validation batches "
              f"ended after the signal: {sorted(r.get('val_batches_after_signal') for r in in_val)}")
    if saved:
        exits = o["exit_s"]
        print(f"  signal to exit (every rank saved and exited with the code, {len(saved)} trials): median "
              f"{statistics.median(exits):.1f} s, min {min(exits):.1f} s, max {max(exits):.1f} s")
        for label, group in (("in a validation", [r["exit_s"] for r in in_val]),
                             ("in training", [r["exit_s"] for r in saved if not r.get("in_validation")])):
            if group:
                print(f"    {label}: median {statistics.median(group):.1f} s, min {min(group):.1f} s, "
                      f"max {max(group):.1f} s ({len(group)})")


def record(results: dict, run: str, steps: int) -> dict:
    """What ``cpu_figures.py`` draws ``cpu-preemption`` from: this run (``results``: what ``main``
    writes to results.json) as one row of ``runs``, labelled ``run``: ``outcomes``, the signal to
    exit of the saved trials (median, min, max), the reference's median step and the agreement's
    all_reduce at the step boundary and on aligned ranks (median ms; the latter's max, and its median
    over the median step in percent), each to the precision ``main`` prints it (0.1 ms, 1 us,
    0.001%); and the grace period ``"auto"`` resolves to here."""
    from lightning_disttrain.callbacks.preemption import resolve_grace_period

    rows, o = results["rows"], outcomes(results["rows"])
    compared = [r for r in o["preempted"] if "resumed_equal" in r]
    exits = o["exit_s"]
    aligned_ms = statistics.median(results["aligned_s"]) * 1e3
    return provenance("bench_preemption", "bench_preemption.py", "gloo, one thread per rank") | {
        "setting": f"each trial: the tiny GPT on 2 ranks, FSDP2, async DCP saves every 3 steps, PreemptionCheckpoint "
                   f"with its defaults, {steps} steps; SIGTERM to a random rank at a uniformly random moment of the "
                   "training span, relaunch with ckpt_path='last', resumed losses compared bitwise with an "
                   "uninterrupted run's",
        "runs": [{"run": run, "trials": len(rows), "preempted": len(o["saved"]),
                  "resumed_bitwise": sum(bool(r["resumed_equal"]) for r in compared), "resumed_compared": len(compared),
                  "steps_lost": o["steps_lost"], "corrupted_accepted": o["corrupted_accepted"],
                  "reverified": o["reverified"], "ended_exit_0": o["ended_exit_0"], "shutdown_exit_15": o["shutdown"],
                  "exit_s": {"median": statistics.median(exits), "min": min(exits), "max": max(exits)} if exits
                  else {"median": None, "min": None, "max": None},
                  "median_step_ms": round(results["step_s"] * 1e3, 1),
                  "agreement_boundary_ms": round(statistics.median(results["agreement_s"]) * 1e6) / 1e3,
                  "agreement_aligned_ms": round(aligned_ms * 1e3) / 1e3,
                  "agreement_aligned_max_ms": round(max(results["aligned_s"]) * 1e6) / 1e3,
                  "agreement_share": round(100 * aligned_ms / (results["step_s"] * 1e3), 3)}],
        "grace_period_s": resolve_grace_period("auto")}


def main() -> None:
    p = parser(__doc__, steps=12, out=(None, "keep the runs here (default: a temporary directory)"))
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--validate", action="store_true", help="validate (2 batches) after every third step, so "
                   "that signals also land in validation")
    p.add_argument("--summary-of", default=None, metavar="RESULTS_JSON",
                   help="print the summary of an earlier run's results.json and exit")
    add_record_options(p, "cpu-preemption", append="run")
    args = p.parse_args()
    if args.summary_of:
        summarize(json.loads(Path(args.summary_of).read_text())["rows"])
        return
    if args.validate:
        os.environ["BENCH_VALIDATE"] = "1"  # inherited by every launch
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_preemption_"))
    root.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO / "tests" / "checkpoint" / "scripts"))
    sys.path.insert(0, str(REPO))
    from harness import write_indexed_shard

    data = root / "data"
    write_indexed_shard(data)
    ref_dir = root / "reference"
    ref_dir.mkdir()
    t0 = time.time()
    proc = _start(data, ref_dir / "ckpt", ref_dir, "ref", args.steps, probe=True)
    _wait_training(ref_dir, "ref", proc)
    started = time.time()
    if _finish(proc) != 0:
        raise SystemExit(f"reference run failed: see {ref_dir / 'ref.log'}")
    ref = _ranks(ref_dir, "ref")
    agreement = [s for r in ref for s in r["agreement_s"]]
    aligned = [s for r in ref for s in r["aligned_all_reduce_s"]]
    steps_log = [float(line.split()[0]) for line in (ref_dir / "ref.steps0").read_text().splitlines()]
    step_s = statistics.median(b - a for a, b in zip(steps_log, steps_log[1:]))
    # Signals land from the moment both ranks train until the last step's end.
    span_s = steps_log[-1] - started + step_s
    print(f"reference: {args.steps} steps, training span {span_s:.1f} s (launch {started - t0:.1f} s), median step "
          f"{step_s * 1e3:.1f} ms; agreement all_reduce (incl. waiting for the slower rank): median "
          f"{statistics.median(agreement) * 1e6:.0f} us, max {max(agreement) * 1e6:.0f} us; the same all_reduce "
          f"on aligned ranks: median {statistics.median(aligned) * 1e6:.0f} us, max {max(aligned) * 1e6:.0f} us "
          f"({statistics.median(aligned) / step_s:.3%} of the median step; {len(aligned)} rank-steps)", flush=True)
    rng = random.Random(args.seed)
    rows = []
    for i in range(args.trials):
        row = trial(i, rng, data, root, args.steps, span_s, ref)
        rows.append(row)
        print(json.dumps(row), flush=True)
    summarize(rows)
    results = {"rows": rows, "agreement_s": agreement, "aligned_s": aligned, "step_s": step_s}
    write_json(root / "results.json", results)
    print(f"  rows: {root / 'results.json'}")
    if wants_record(args):
        run = f"seed {args.seed}" + (", --validate" if args.validate else "")
        write_record(record(results, run, args.steps), record_path(args, root / "bench_preemption.json"), args.plot,
                     args.format, append="runs" if args.append else None)


if __name__ == "__main__":
    main()
