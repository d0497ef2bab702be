"""A plan for people: one table of layouts (rich when installed, plain text otherwise) and a summary."""

from __future__ import annotations

import sys

from lightning_disttrain.planning.planner import Plan
from lightning_disttrain.planning.spec import GB

COLUMNS = ("layout", "params", "grads", "optim", "activ.", "logits", "buffers", "total", "headroom", "fits")


def rows(plan: Plan) -> list[tuple[str, ...]]:
    out = []
    for c in plan.candidates:
        m = c.memory
        # "thin": fits with less headroom than the planner's error; "-": fits, but cannot run or is not offered
        fits = ("yes" if c.safe() else "thin") if c.usable else ("no" if not m.fits else "-")
        name = ("> " if c is plan.chosen else "  ") + c.layout.name
        out.append((name, *(f"{v / GB:.1f}" for v in (m.params, m.grads, m.optimizer, m.activations, m.logits,
                                                        m.buffers, m.total, m.headroom)), fits))
    return out


def summary(plan: Plan) -> list[str]:
    s, w, c = plan.shape, plan.workload, plan.cluster
    lines = [f"model {s.name}: {s.params / 1e9:.3g}B parameters"
             + (f" ({s.active_params / 1e9:.3g}B active, {s.num_experts} experts)" if s.is_moe else "")
             + f", {s.flops_per_token / 1e9:.3g} GFLOP/token at seq {w.seq_len}",
             f"cluster: {c.nodes} x {c.gpus_per_node} {c.gpu} ({c.memory_bytes / GB:.0f} GB each); "
             f"batch {w.global_batch} x {w.seq_len} = {w.tokens_per_step:,} tokens/step, micro batch {w.micro_batch}, "
             f"{w.precision}" + (f", optimizer {w.optimizer}" if w.optimizer != "adamw" else ""),
             f"recommendation: {plan.reason}"]
    if plan.chosen is not None:
        layout = plan.chosen.layout
        text = f"  gradient accumulation {plan.chosen.accumulation}"
        if layout.zero >= 2 and (plan.chosen.accumulation or 1) > 1:
            text += (" (one reduce-scatter per step, unsharded gradients held: accumulate_unsharded_grads)"
                     if layout.accumulate_unsharded_grads else " (reduce-scatter every micro-batch, gradients sharded)")
        if layout.pp > 1:
            o = layout.pipeline
            text += (f"; pipeline {o.schedule}, {o.num_microbatches(layout.pp)} micro-batches of {w.micro_batch} "
                     f"per batch, {o.local_stages} stage(s) per rank; most loaded: pipeline rank "
                     f"{plan.chosen.memory.rank}")
        lines.append(text)
    if plan.speed is not None:
        sp = plan.speed
        terms = ", ".join(f"{k} {v:.2f}" for k, v in sp.terms.items() if v > 0)
        lines.append(f"speed: {sp.step_seconds:.2f} s/step, {sp.tokens_per_second:,.0f} tokens/s "
                     f"({sp.tokens_per_second / c.world:,.0f} per GPU), MFU {sp.achieved_mfu:.0%} "
                     f"(compute at {sp.mfu:.0%}); seconds: {terms}")
    if plan.failures is not None:
        f = plan.failures
        lines.append(f"checkpoints (Young/Daly): every {f.interval_seconds / 60:.0f} min (checkpoint "
                     f"{f.checkpoint_seconds:.0f} s, job MTBF {f.job_mtbf_hours:.1f} h); overhead {f.overhead:.1%}")
    if plan.spot_failures is not None:
        f = plan.spot_failures
        lines.append(f"  on spot: every {f.interval_seconds / 60:.0f} min (job MTBF {f.job_mtbf_hours:.1f} h); "
                     f"overhead {f.overhead:.1%}")
    if plan.cost is not None:
        k = plan.cost
        text = f"training: {k.hours:,.1f} h ({k.hours / 24:,.1f} days), {k.gpu_hours:,.0f} GPU-hours"
        if k.on_demand is not None:
            text += f"; cost ${k.on_demand:,.0f} (incl. +20%)"
        if k.spot is not None:
            text += f"; spot ${k.spot:,.0f} over {k.spot_hours:,.1f} h"
        if k.spot_savings is not None:
            text += f", saving ${k.spot_savings:,.0f}"
        lines.append(text)
    lines += [f"assumed: {a}" for a in plan.assumptions]
    return lines


def print_plan(plan: Plan, file=None) -> None:
    file = file or sys.stdout
    title = "memory per GPU, GB (> recommended)"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [COLUMNS, *rows(plan)]) for i in range(len(COLUMNS))]
        print(title, file=file)
        for r in [COLUMNS, *rows(plan)]:
            print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))), file=file)
    else:
        table = Table(title=title)
        for i, col in enumerate(COLUMNS):
            table.add_column(col, justify="left" if i == 0 else "right")
        for r in rows(plan):
            table.add_row(*r, style="bold green" if r[0].startswith(">") else ("dim" if r[-1] != "yes" else None))
        Console(file=file, width=140).print(table)
    for line in summary(plan):
        print(line, file=file)
