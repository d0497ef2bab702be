"""``lightning-disttrain plan``: will it fit, which layout, how long, what it costs.

    lightning-disttrain plan --model llama2-7b --gpu "H100 SXM" --nodes 2 --seq-len 4096 \\
        --global-batch 512 --micro-batch 1 --tokens 2e11 --price 2.5 --spot-price 1.0 --json

The model is a preset (``GPTConfig`` presets and the planner's shapes, ``--list-models``) with
``--override field=value``, or the ``model:`` section of a LightningCLI YAML (``--model-config``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import yaml

from lightning_disttrain.peak_flops import CHIPS
from lightning_disttrain.planning.config_yaml import find_candidate, write_config
from lightning_disttrain.planning.memory import DEFAULT_MARGIN
from lightning_disttrain.planning.model_shape import config_for, model_names, shape_of
from lightning_disttrain.planning.planner import Money, make_plan
from lightning_disttrain.planning.report import print_plan
from lightning_disttrain.planning.spec import OPTIMIZERS, PRECISIONS, Cluster, Workload


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-disttrain plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default="gpt2-124m", help="preset or shape name (--list-models)")
    m.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                   help="a GPTConfig field, e.g. --override n_layer=48 (repeatable; values parsed as YAML)")
    m.add_argument("--model-config", metavar="YAML", help="take model.init_args.config / model_overrides from this "
                   "LightningCLI YAML instead of --model")
    m.add_argument("--list-models", action="store_true", help="print the model names and exit")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpu", default="H100 SXM", help=f"one of {sorted(CHIPS)}, or cpu (with --gpu-memory)")
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpu-memory", type=float, help="GB per device (default: the datasheet's)")
    w = p.add_argument_group("workload")
    w.add_argument("--seq-len", type=int, default=2048)
    w.add_argument("--global-batch", type=int, default=256, help="sequences per optimizer step")
    w.add_argument("--micro-batch", type=int, default=1, help="sequences per forward per GPU")
    w.add_argument("--precision", default="bf16", choices=PRECISIONS)
    w.add_argument("--no-flash", action="store_true", help="attention stores its score matrix (no FlashAttention)")
    w.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                   help="GPTModule's optimizer: adamw, or muon (one momentum per element of the blocks' matrices "
                        "instead of two moments; its step adds Newton-Schulz and two all-to-alls)")
    w.add_argument("--accumulate-unsharded-grads", action="store_true",
                   help="plan gradient accumulation as NDParallelStrategy(accumulate_unsharded_grads=True): one "
                        "reduce-scatter per optimizer step, the whole unsharded fp32 gradient held between "
                        "micro-batches (default: reduce-scatter every micro-batch, gradients stay sharded)")
    w.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="fraction of memory kept free (default 0.1)")
    w.add_argument("--mfu", type=float, help="model FLOPs utilisation to assume (default 0.40, with its anchors)")
    k = p.add_argument_group("cost and failures")
    k.add_argument("--tokens", type=float, help="token budget, e.g. 2e11")
    k.add_argument("--price", type=float, help="$ per GPU-hour, on demand")
    k.add_argument("--spot-price", type=float, help="$ per GPU-hour on spot")
    k.add_argument("--preemptions-per-hour", type=float, default=0.0, help="spot preemptions per node-hour")
    k.add_argument("--mtbf-hours", type=float, default=None, help="mean time between failures of one device (h)")
    k.add_argument("--checkpoint-seconds", type=float, help="blocking cost of one checkpoint (s)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    o.add_argument("--write-config", metavar="YAML", help="write a LightningCLI YAML for the recommendation")
    o.add_argument("--plot", metavar="FILE", help="also draw each layout's memory per device as a chart (.png, "
                   ".svg or .pdf; needs matplotlib: pip install 'lightning-disttrain[plot]')")
    o.add_argument("--layout", metavar="NAME", help="with --write-config: write this layout of the table instead "
                   "of the recommendation (its name as printed, e.g. 'FSDP2 x8 + TP 2')")
    return p


def _overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--override {item!r}: write FIELD=VALUE, e.g. --override n_layer=48")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _model_from_yaml(path: str) -> tuple[str, dict]:
    if not Path(path).is_file():
        raise ValueError(f"--model-config {path!r} does not exist")
    data = yaml.safe_load(Path(path).read_text()) or {}
    model = data.get("model") or {}
    args = model.get("init_args", model) if isinstance(model, dict) else {}
    name = args.get("config", "tiny")
    if not isinstance(name, str):
        raise ValueError(f"--model-config {path!r}: model.init_args.config must be a preset name, got {name!r}")
    return name, dict(args.get("model_overrides") or {})


def plan_main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.list_models:
        print("\n".join(model_names()))
        return
    try:
        name, overrides = _model_from_yaml(args.model_config) if args.model_config else (args.model, {})
        overrides |= _overrides(args.override)
        shape = shape_of(config_for(name, overrides), args.seq_len, name)
        cluster = Cluster(args.gpu, args.gpus_per_node, args.nodes, args.gpu_memory)
        workload = Workload(args.seq_len, args.global_batch, args.micro_batch, args.precision, not args.no_flash,
                            args.optimizer)
        money = Money(args.tokens, args.price, args.spot_price, args.preemptions_per_hour,
                      **({} if args.mtbf_hours is None else {"device_mtbf_hours": args.mtbf_hours}),
                      checkpoint_seconds=args.checkpoint_seconds)
        if args.spot_price is not None and args.preemptions_per_hour == 0:
            raise ValueError("--spot-price needs --preemptions-per-hour (spot preemptions per node-hour, e.g. 0.05)")
        if not 0 <= args.margin < 1:
            raise ValueError(f"--margin {args.margin} must be in [0, 1)")
        if args.plot:
            from lightning_disttrain.planning.plot import check_path

            check_path(args.plot)  # before the planning, with the other bad input
        plan = make_plan(shape, workload, cluster, money, args.mfu, args.margin, args.accumulate_unsharded_grads)
        written = plotted = None
        if args.layout and not args.write_config:
            raise ValueError("--layout names the layout --write-config writes: add --write-config YAML")
        if args.write_config:
            command = "lightning-disttrain plan " + shlex.join(sys.argv[2:] if argv is None else argv)
            candidate = find_candidate(plan, args.layout) if args.layout else None
            written = write_config(args.write_config, plan, name, overrides, command, candidate)
        if args.plot:
            from lightning_disttrain.planning.plot import plot_memory

            command = "lightning-disttrain plan " + shlex.join(sys.argv[2:] if argv is None else argv)
            plotted = plot_memory(plan, args.plot, command)
    except ValueError as err:
        print(f"error: plan: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.json:
        out = plan.to_dict() | ({"config": str(written)} if written else {}) | ({"plot": str(plotted)} if plotted else {})
        print(json.dumps(out, indent=2))
    else:
        print_plan(plan)
        if written:
            print(f"wrote {written}")
        if plotted:
            print(f"wrote {plotted}")
    if plan.chosen is None and not written:
        print(f"error: plan: {plan.reason}", file=sys.stderr)
        raise SystemExit(1)
