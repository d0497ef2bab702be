"""One plan: every candidate layout's memory, the recommendation, its speed, cost and checkpoints.

``make_plan`` ties the pieces together; the arithmetic lives in ``memory.py`` (bytes),
``layouts.py`` (candidates and the choice) and ``throughput.py`` (time, money, failures).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_disttrain.peak_flops import CHIPS
from lightning_disttrain.planning import throughput as tp
from lightning_disttrain.planning.layouts import Candidate, evaluate, recommend
from lightning_disttrain.planning.memory import DEFAULT_MARGIN, STATE_BYTES
from lightning_disttrain.planning.model_shape import ModelShape
from lightning_disttrain.planning.pipeline import bubble
from lightning_disttrain.planning.spec import DEGREES, GB, Cluster, Workload


@dataclass(frozen=True)
class Money:
    """What the run costs: optional inputs, each used only when given."""

    token_budget: float | None = None
    price: float | None = None
    """$ per GPU-hour, on demand."""
    spot_price: float | None = None
    preemptions_per_node_hour: float = 0.0
    """Spot preemption rate (per node and hour); it sets the spot run's failure rate."""
    device_mtbf_hours: float = tp.DEVICE_MTBF_HOURS
    checkpoint_seconds: float | None = None
    """Blocking cost of one checkpoint; None: estimated from its size at ``CHECKPOINT_WRITE_GBPS`` per node."""


@dataclass
class Plan:
    shape: ModelShape
    workload: Workload
    cluster: Cluster
    candidates: list[Candidate]
    chosen: Candidate | None
    reason: str
    speed: tp.Throughput | None = None
    failures: tp.Failures | None = None
    spot_failures: tp.Failures | None = None
    cost: tp.Cost | None = None
    assumptions: list[str] = field(default_factory=list)
    fits_at: tuple[int, int, str] | None = None
    """When nothing fits: (nodes, micro batch, layout) of the smallest cluster of these GPUs that fits."""
    accumulate_unsharded_grads: bool = False
    """The gradient-accumulation mode planned for the FSDP layouts (``Layout.accumulate_unsharded_grads``)."""

    def to_dict(self) -> dict:
        """Plain numbers for ``--json`` (memory in GB)."""
        s, w, c = self.shape, self.workload, self.cluster
        out = {
            "model": {"name": s.name, "params": s.params, "active_params": s.active_params,
                      "flops_per_token": s.flops_per_token, "n_layer": s.n_layer, "n_embd": s.n_embd,
                      "n_head": s.n_head, "vocab": s.vocab, "experts": s.num_experts},
            "cluster": {"gpu": c.gpu, "gpus_per_node": c.gpus_per_node, "nodes": c.nodes,
                        "memory_gb": c.memory_bytes / GB},
            "workload": {"seq_len": w.seq_len, "global_batch": w.global_batch, "micro_batch": w.micro_batch,
                         "precision": w.precision, "flash": w.flash, "tokens_per_step": w.tokens_per_step,
                         "accumulate_unsharded_grads": self.accumulate_unsharded_grads},
            "layouts": [{"name": x.layout.name, "degrees": _degrees(x), "zero": x.layout.zero, "ac": x.layout.ac,
                         "pipeline": _pipeline(x), "accumulation": x.accumulation, "note": x.note,
                         "recommendable": x.recommendable, "safe": x.safe(),
                         "memory_gb": x.memory.as_gb(),
                         "step_seconds": None if x.speed is None else x.speed.step_seconds,
                         "terms_seconds": None if x.speed is None else dict(x.speed.terms)}
                        for x in self.candidates],
            "recommendation": None if self.chosen is None else self.chosen.layout.name,
            "reason": self.reason,
            "fits_at": None if self.fits_at is None else {"nodes": self.fits_at[0], "gpus": self.fits_at[0] * c.gpus_per_node,
                                                          "micro_batch": self.fits_at[1], "layout": self.fits_at[2]},
            "assumptions": self.assumptions,
        }
        if self.speed is not None:
            out["speed"] = {"step_seconds": self.speed.step_seconds, "tokens_per_second": self.speed.tokens_per_second,
                            "mfu": self.speed.mfu, "achieved_mfu": self.speed.achieved_mfu,
                            "peak_flops_per_gpu": self.speed.peak_flops, "flops_per_step": self.speed.flops_per_step,
                            "terms_seconds": dict(self.speed.terms)}
        for key, f in (("checkpointing", self.failures), ("spot_checkpointing", self.spot_failures)):
            if f is not None:
                out[key] = {"job_mtbf_hours": f.job_mtbf_hours, "checkpoint_seconds": f.checkpoint_seconds,
                            "interval_minutes": f.interval_seconds / 60, "overhead": f.overhead}
        if self.cost is not None:
            out["cost"] = {"hours": self.cost.hours, "gpu_hours": self.cost.gpu_hours, "on_demand": self.cost.on_demand,
                           "spot": self.cost.spot, "spot_hours": self.cost.spot_hours,
                           "spot_savings": self.cost.spot_savings, "overhead_factor": tp.OVERHEAD}
        return out


def _pipeline(c: Candidate) -> dict | None:
    """The strategy's pipeline arguments of a candidate (None without a pipeline)."""
    if c.layout.pp == 1:
        return None
    o = c.layout.pipeline
    return {"pp_schedule": o.schedule, "pp_microbatches": o.num_microbatches(c.layout.pp),
            "pp_stages_per_rank": o.local_stages, "bubble": bubble(o, c.layout.pp)}


def _degrees(c: Candidate) -> dict:
    layout = c.layout
    return {k: getattr(layout, k) for k in DEGREES}


def checkpoint_seconds_estimate(shape: ModelShape, workload: Workload, nodes: int) -> float:
    """Seconds to write one checkpoint (master weights and optimizer state) at the assumed bandwidth."""
    sb = STATE_BYTES[workload.precision]
    size = shape.params * (sb.master + sb.moments + (sb.weights if not sb.master else 0))
    if workload.optimizer == "muon":  # one momentum, not two moments, per element of the blocks' matrices
        size -= muon_params(shape) * sb.moments / 2
    return size / (tp.CHECKPOINT_WRITE_GBPS * GB * nodes)


def muon_params(shape: ModelShape) -> int:
    """Elements of every matrix Muon orthogonalises: the blocks' 2-D weights and the routed
    experts' stacks (``ExpertMuon``, each expert's matrix on its own)."""
    return sum(shape.muon_params_of_layer(i) for i in range(shape.n_layer)) + shape.expert_params


SEARCH_NODES = sorted({*range(1, 129), *(2 ** k for k in range(8, 14))})
"""Node counts tried for the smallest cluster that fits (up to 8192 nodes)."""


def smallest_fit(shape: ModelShape, workload: Workload, cluster: Cluster, margin: float = DEFAULT_MARGIN,
                 accumulate_unsharded_grads: bool = False) -> tuple[int, Candidate] | None:
    """The fewest nodes (of ``cluster``'s GPUs) on which some layout fits ``workload``, and that layout."""
    for nodes in SEARCH_NODES:
        if nodes <= cluster.nodes:
            continue
        bigger = Cluster(cluster.gpu, cluster.gpus_per_node, nodes, cluster.memory_gb)
        chosen, _ = recommend(evaluate(shape, workload, bigger, margin, accumulate_unsharded_grads))
        if chosen is not None:
            return nodes, chosen
    return None


def _nothing_fits(plan: Plan, margin: float) -> str:
    """The reason when no layout fits: how many GPUs would, or that none would at this GPU size."""
    shape, w, c = plan.shape, plan.workload, plan.cluster
    best = min(plan.candidates, key=lambda x: x.memory.total)
    usable = plan.candidates[0].memory.usable / GB
    head = (f"nothing fits on {c.world} x {c.gpu}: the smallest need is {best.memory.total / GB:.1f} GB per GPU "
            f"({best.layout.name}) against {usable:.1f} GB usable")
    for micro in dict.fromkeys((w.micro_batch, 1)):
        workload = w if micro == w.micro_batch else Workload(w.seq_len, w.global_batch, micro, w.precision, w.flash,
                                                                   w.optimizer)
        found = smallest_fit(shape, workload, c, margin, plan.accumulate_unsharded_grads)
        if found is not None:
            nodes, chosen = found
            plan.fits_at = (nodes, micro, chosen.layout.name)
            how = "" if micro == w.micro_batch else " with --micro-batch 1"
            return (f"{head}; the smallest cluster that fits{how}: {nodes} node(s) x {c.gpus_per_node} = "
                    f"{nodes * c.gpus_per_node} GPUs ({chosen.layout.name}, "
                    f"{chosen.memory.total / GB:.1f} GB per GPU): pass --nodes {nodes}")
    return (f"{head}; the model cannot fit on {c.gpu} ({c.memory_bytes / GB:.0f} GB) whatever the batch: even "
            f"micro batch 1 on up to {SEARCH_NODES[-1] * c.gpus_per_node:,} GPUs does not fit at global batch "
            f"{w.global_batch} (a pipeline needs as many micro-batches per step as stages: a larger --global-batch lets "
            f"deeper ones run); use GPUs with more memory, a shorter sequence, or a smaller model")


def make_plan(shape: ModelShape, workload: Workload, cluster: Cluster, money: Money = Money(),
              mfu: float | None = None, margin: float = DEFAULT_MARGIN,
              accumulate_unsharded_grads: bool = False) -> Plan:
    candidates = evaluate(shape, workload, cluster, margin, accumulate_unsharded_grads)
    chosen, reason = recommend(candidates)
    plan = Plan(shape, workload, cluster, candidates, chosen, reason,
                accumulate_unsharded_grads=accumulate_unsharded_grads)
    plan.assumptions.append(f"memory: GB = 1e9 bytes; fits within {1 - margin:.0%} of {cluster.memory_bytes / GB:.0f} GB "
                            f"(margin for allocator fragmentation)")
    sb = STATE_BYTES[workload.precision]
    plan.assumptions.append(f"model state: {sb.total:g} bytes/param at {workload.precision} (weights {sb.weights:g} + "
                            f"gradients {sb.grads:g} + fp32 master {sb.master:g} + AdamW moments {sb.moments:g}), "
                            f"divided over the sharding ranks by ZeRO stage (ZeRO-3: all of it)"
                            + (f"; with Muon the blocks' matrices and experts ({muon_params(shape) / shape.params:.0%} of the "
                               f"parameters) keep one momentum of {sb.moments / 2:g} bytes instead of the moments, "
                               f"and each step adds Newton-Schulz (5 iterations) on every whole matrix, split over the "
                               f"ranks that hold its pieces (tensor parallel's too), and two all-to-alls per "
                               f"dimension that splits it" if workload.optimizer == "muon" else ""))
    plan.assumptions.append(
        "gradient accumulation under FSDP: " + (
            "one reduce-scatter per optimizer step (--accumulate-unsharded-grads): every rank holds its part's "
            "whole unsharded fp32 gradient between micro-batches" if accumulate_unsharded_grads else
            "a reduce-scatter every micro-batch, gradients stay sharded (--accumulate-unsharded-grads trades "
            "memory for 1/k of that traffic)"))
    if chosen is None:
        plan.reason = _nothing_fits(plan, margin)
        return plan
    if cluster.gpu == "cpu":
        return plan
    peak = CHIPS[cluster.gpu].bf16
    fp8 = workload.precision == "fp8"
    for c in candidates:
        if c.usable:
            c.speed = tp.step_terms(shape, c.layout, workload, cluster, tp.DEFAULT_MFU if mfu is None else mfu,
                                    c.accumulation or 1)
    plan.speed = chosen.speed
    plan.assumptions.append(f"compute at MFU {plan.speed.mfu:.0%} against the {cluster.gpu} dense bf16 peak "
                            f"({peak / 1e12:.0f} TFLOP/s)" + ("" if mfu is not None else
                                                            "; anchors: " + "; ".join(tp.MFU_ANCHORS)))
    intra, inter = tp.LINKS[cluster.gpu]
    plan.assumptions.append(f"links: {intra:g} GB/s per GPU inside a node, {inter:g} GB/s across nodes, "
                            f"{tp.LINK_EFFICIENCY:.0%} of it reached; communication terms from message sizes "
                            f"(lightning_disttrain/planning/throughput.py)")
    if fp8:
        plan.assumptions.append(f"fp8: x{tp.FP8_SPEEDUP} over bf16; anchor: {tp.FP8_ANCHOR}")
    ckpt = money.checkpoint_seconds
    if ckpt is None:
        ckpt = checkpoint_seconds_estimate(shape, workload, cluster.nodes)
        plan.assumptions.append(f"checkpoint: {ckpt:.0f} s to write master weights and optimizer state at "
                                f"{tp.CHECKPOINT_WRITE_GBPS:g} GB/s per node (pass --checkpoint-seconds)")
    plan.failures = tp.failures(cluster.world, cluster.nodes, ckpt, money.device_mtbf_hours)
    if money.device_mtbf_hours == tp.DEVICE_MTBF_HOURS:
        plan.assumptions.append(f"device MTBF {tp.DEVICE_MTBF_HOURS:,.0f} h; anchor: {tp.MTBF_ANCHOR}")
    plan.assumptions.append(f"restart after a failure: {tp.RESTART_SECONDS / 60:.0f} min")
    if money.spot_price is not None:
        plan.spot_failures = tp.failures(cluster.world, cluster.nodes, ckpt, money.device_mtbf_hours,
                                         money.preemptions_per_node_hour)
    if money.token_budget is not None:
        plan.cost = tp.cost(money.token_budget, plan.speed.tokens_per_second, cluster.world, plan.failures.overhead,
                            money.price, money.spot_price,
                            None if plan.spot_failures is None else plan.spot_failures.overhead)
        plan.assumptions.append(f"cost: x{tp.OVERHEAD} for profiling, debugging and restarts")
    return plan
