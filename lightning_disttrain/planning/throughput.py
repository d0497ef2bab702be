"""Step time, tokens/s, training hours and cost from FLOPs per token, an assumed MFU and the
layout's communication.

    step time = compute + recompute + pipeline bubble + exposed TP / CP / PP / EP / data-parallel communication

``step_terms`` names each term (seconds per optimizer step, on the most loaded rank):

- compute: FLOPs/token x tokens/step / (GPUs x peak x MFU): the model's FLOPs at the assumed MFU.
- recompute: what activation checkpointing runs again: a third of the compute per fully
  recomputed block (the forward of forward + backward); ``selective`` re-runs elementwise ops
  (counted as free) and, where the package's policy does not keep ``aten._grouped_mm`` outputs, the
  routed experts' forward (2 FLOPs per active expert parameter and token).
- bubble: the schedule's idle fraction (``planning/pipeline.py``: (p - 1) / m for 1F1B, (p - 1) /
  (v·m) interleaved, a third of that for zero bubble) times the time the pipeline's ranks are busy.
- tp: sequence-parallel tensor parallel moves, per block and micro-batch, two all-gathers and two
  reduce-scatters of the s·b·h activations in forward and again in backward (a third time when
  the block is recomputed), each (t - 1)/t of the tensor per rank, on the node's links; exposed
  (no async TP).
- pp: each micro-batch's s·b·h/t boundary activations, sent forward and its gradient back, on the
  inter-node links, on the critical path for the m + p - 1 slots of the schedule.
- cp: ring attention's transfers, per block and micro-batch, step by step against the attention
  compute of that step (``ring_exposed_seconds``): each key/value chunk pair (and in backward its
  fp32 gradient pair) is hidden by the step's blocks as far as they last; the last hop home of the
  gradients is exposed whole; a recomputed block's ring runs again.
- ep: the dispatch and the combine all-to-all of k'·s·b·h per MoE block and micro-batch, forward and
  backward, (ep - 1)/ep of it leaving each rank; exposed.
- muon (``Workload(optimizer="muon")``): the optimizer step's Newton-Schulz on the blocks' whole
  matrices, split over every rank that holds a piece of them (data and tensor parallel), and its
  all-to-alls (two per mesh dimension that splits the matrices, one more across replicas);
  exposed (``muon_step_seconds``).
- dp: FSDP's all-gathers (forward and backward of every micro-step; ZeRO-2: forward only) and
  the gradient reduce-scatter, DDP's all-reduce, HSDP's all-reduce across nodes; overlapped with
  the compute, so only what exceeds it is exposed. With gradient accumulation FSDP reduce-scatters
  every micro-step (the strategy's default: gradients stay sharded; HSDP still all-reduces across
  nodes once per step, except under a pipeline, whose stages reduce fully at every schedule step),
  or once per step with ``Layout.accumulate_unsharded_grads`` (the memory it costs:
  ``planning/memory.py``). DDP all-reduces once per step (Lightning's ``no_sync``).

Link bandwidths per GPU and direction (``LINKS``, datasheets) times ``LINK_EFFICIENCY`` (what
NCCL's bus bandwidth reaches on large messages); ring collectives move (n - 1)/n of the data per rank.

FLOPs per token are the model's (``GPT.flops_per_token``: 6·N_active + 12·L·H·Dh·T, PaLM
appendix B). The peak is the dense bf16 figure of the chip (``lightning_disttrain/peak_flops.py``). MFU is
assumed, not known before a run: ``DEFAULT_MFU`` with the public anchors below; pass ``--mfu``
with your own measurement (``MFUMonitor`` logs it) to replace it. Full activation recomputation
runs the forward twice (8 instead of 6 FLOPs per parameter and token: x4/3 time at the same
utilisation); selective recomputation re-runs only elementwise ops (counted as free). A 1F1B
pipeline with p stages and m micro-batches idles (p-1)/m of a step. fp8: the same MFU against the
bf16 peak, times ``FP8_SPEEDUP``.

Cost = $/GPU-hour x GPUs x hours x 1.2: 20% on top for profiling, debugging and restarts that a
FLOP count does not see. Failures (Young 1974 / Daly 2006): with a checkpoint costing C seconds
and a mean time between failures M of the whole job, checkpoint every sqrt(2·C·M); the expected
overhead is C/interval + (interval/2 + restart)/M of the run (half an interval of work lost per
failure, plus the restart). M = device MTBF / GPUs, with spot preemptions added as a rate per node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_disttrain.parallel.muon import owner_plan
from lightning_disttrain.peak_flops import CHIPS
from lightning_disttrain.planning.activations import (
    grouped_gemm_saved,
    routed_assignments,
)
from lightning_disttrain.planning.memory import local_params
from lightning_disttrain.planning.model_shape import ModelShape, newton_schulz_flops
from lightning_disttrain.planning.pipeline import bubble as pipeline_bubble
from lightning_disttrain.planning.pipeline import rank_stages
from lightning_disttrain.planning.spec import Cluster, Layout, Workload
from lightning_disttrain.young_daly import young_daly_interval

DEFAULT_MFU = 0.40
MFU_ANCHORS = (
    "Llama 3 405B on 16K H100: 38-43% bf16 MFU (Llama 3 paper, table 4)",
    "MegaScale, 175B on 12,288 GPUs: 55.2% MFU (Jiang et al. 2024)",
    "PaLM 540B on 6,144 TPU v4: 46.2% MFU (Chowdhery et al. 2022, table 3)",
)
"""Where ``DEFAULT_MFU`` comes from: well-tuned large runs reach 38-55%; 40% is the low end, for a
first run of a new setup."""
FP8_SPEEDUP = 1.3
FP8_ANCHOR = "torchao float8 rowwise: 1.34-1.43x end to end on Llama 3 at 2K-GPU scale (torchao README)"
OVERHEAD = 1.20
DEVICE_MTBF_HOURS = 50_000.0
MTBF_ANCHOR = ("Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. one per "
               "16,384 x 54 x 24 / 419 = 50,700 GPU-hours (Llama 3 paper, section 3.3.4)")
RESTART_SECONDS = 600.0
CHECKPOINT_WRITE_GBPS = 1.0
"""Assumed checkpoint write bandwidth per node (GB/s) when the checkpoint cost is not given."""


LINKS: dict[str, tuple[float, float]] = {
    "A100": (300, 25), "H100 SXM": (450, 50), "H100 PCIe": (64, 50), "H100 NVL": (300, 50), "GH200": (450, 50),
    "H200": (450, 50), "H200 NVL": (450, 50), "B200": (900, 50), "GB200": (900, 100), "L4": (32, 12.5),
    "L40S": (32, 25), "A10G": (32, 12.5),
}
"""GB/s per GPU and direction: (inside a node: NVLink, or PCIe where there is none; across nodes:
the GPU's share of the network, 400 Gb/s InfiniBand / RoCE per H100-class GPU, 200 Gb/s per A100,
100-200 Gb/s for the PCIe cards' instances)."""
LINK_EFFICIENCY = 0.7


@dataclass(frozen=True)
class Throughput:
    step_seconds: float
    tokens_per_second: float
    mfu: float
    """The MFU assumed for the compute term."""
    peak_flops: float
    flops_per_step: float
    terms: dict[str, float] = field(default_factory=dict)
    """Seconds per step by term (``step_terms``); their sum is ``step_seconds``."""

    @property
    def achieved_mfu(self) -> float:
        """Model FLOPs over the whole step's time: below ``mfu`` by the other terms."""
        compute = self.terms.get("compute", self.step_seconds)
        return self.mfu * compute / self.step_seconds


def throughput(flops_per_token: float, tokens_per_step: float, gpus: int, peak_flops: float, mfu: float = DEFAULT_MFU,
               *, full_recompute: bool = False, pp: int = 1, microbatches: int = 1, fp8: bool = False,
               bubble: float | None = None) -> Throughput:
    """Compute at the assumed MFU, x4/3 for full recomputation, x(1 + bubble) with a pipeline
    (``bubble`` None: 1F1B's (p - 1)/m)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu} must be in (0, 1]; e.g. 0.4 for 40%")
    if peak_flops <= 0:
        raise ValueError(f"peak_flops={peak_flops} must be > 0")
    flops = flops_per_token * tokens_per_step
    compute = flops / (gpus * peak_flops * mfu * (FP8_SPEEDUP if fp8 else 1.0))
    terms = {"compute": compute, "recompute": compute / 3 if full_recompute else 0.0}
    if pp > 1:
        frac = (pp - 1) / max(microbatches, 1) if bubble is None else bubble
        terms["bubble"] = frac * (terms["compute"] + terms["recompute"])
    seconds = sum(terms.values())
    return Throughput(seconds, tokens_per_step / seconds, mfu, peak_flops, flops, terms)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_terms(shape: ModelShape, layout: Layout, workload: Workload, cluster: Cluster, mfu: float = DEFAULT_MFU,
               accumulation: int = 1,
               links: tuple[float, float] | None = None) -> Throughput:
    """The named terms of one optimizer step of ``layout`` (see the module docstring)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu={mfu} must be in (0, 1]; e.g. 0.4 for 40%")
    peak = CHIPS[cluster.gpu].bf16
    fp8 = workload.precision == "fp8"
    intra, inter = [b * 1e9 * LINK_EFFICIENCY for b in (links or LINKS[cluster.gpu])]
    G, N = cluster.gpus_per_node, cluster.world
    t, p, ep = layout.tp, layout.pp, layout.ep
    e = 4 if workload.precision == "fp32" else 2
    tokens = workload.tokens_per_step
    flops = shape.flops_per_token * tokens
    compute = flops / (N * peak * mfu * (FP8_SPEEDUP if fp8 else 1.0))
    ranks = rank_stages(layout.pipeline, p, shape.n_layer)
    layers = max(len(r.all_layers) for r in ranks)  # blocks on the busiest pipeline rank
    full = sum(1 for i in range(shape.n_layer)
               if layout.ac == "full" or (layout.ac == "block" and i % layout.ac_every_k == 0))
    recompute = compute / 3 * full / shape.n_layer
    if layout.ac == "selective" and shape.is_moe and not grouped_gemm_saved():
        k = routed_assignments(shape)
        expert_fwd = 2 * k * (shape.expert_params / shape.num_experts) * tokens / (N * peak * mfu)
        recompute += expert_fwd
    # per data-parallel rank and step: micro-batches of s x b tokens, of which a cp rank holds 1/cp
    whole = workload.micro_batch * workload.seq_len  # tokens of one micro-batch
    micro = whole / layout.cp
    microsteps = accumulation * layout.microbatches
    passes = 2 + full / shape.n_layer  # forward, backward, and a recomputed block's forward again
    tp_comm = 0.0
    if t > 1:
        per_block = 4 * _ring(t) * micro * shape.n_embd * e  # 2 all-gathers + 2 reduce-scatters
        tp_comm = per_block * passes * layers * microsteps / (intra if t <= G else inter)
    cp_comm = 0.0
    if layout.cp > 1:
        cp_comm = (ring_exposed_seconds(shape, layout.cp, t, workload.micro_batch, workload.seq_len, e,
                                        intra if layout.cp * t <= G else inter, peak * mfu, recomputed=full / shape.n_layer)
                   * layers * microsteps)
    ep_comm = 0.0
    if ep > 1:
        moe_blocks = sum(1 for i in range(shape.n_layer) if shape.is_moe_layer(i)) * layers / shape.n_layer
        per_block = 2 * _ring(ep) * routed_assignments(shape) * micro * shape.n_embd * e  # dispatch + combine
        ep_comm = 2 * per_block * moe_blocks * microsteps / (intra if ep * t <= G else inter)
    pp_comm = 0.0
    if p > 1:
        msg = micro * shape.n_embd / t * e
        m = layout.microbatches
        pp_comm = 2 * (m + p - 1) * accumulation * msg / (inter if G < N else intra)
    dense, experts = local_params(shape, layout)
    n = layout.dp_shard * layout.cp  # FSDP shards over dp_shard x cp
    shard_bw = intra if n * t * p <= G or (layout.dp_replicate > 1 and n * t <= G) else inter
    dp_comm = 0.0
    if layout.zero == 0:
        dp_comm = 2 * _ring(layout.dp) * (dense + experts) * 4 / (intra if layout.dp <= G else inter)
    else:
        gathers = 2 if layout.zero == 3 and p == 1 else 1
        gathered = gathers * microsteps if p == 1 else gathers * accumulation
        weights = dense * _ring(n) + experts * _ring(n // ep)
        reductions = 1 if layout.accumulate_unsharded_grads else accumulation  # reduce-scatters per step
        dp_comm = (gathered * weights * e + reductions * weights * 4) / shard_bw
        if layout.dp_replicate > 1:
            all_reduces = reductions if p > 1 else 1  # torch's pipeline stage turns every sync on itself
            dp_comm += (all_reduces * 2 * _ring(layout.dp_replicate) * (dense / n + experts / max(1, n // ep)) * 4
                        / inter)
    dp_exposed = max(0.0, dp_comm - compute)
    muon = (muon_step_seconds(shape, layout, peak * mfu, shard_bw, inter, intra if t <= G else inter)
            if workload.optimizer == "muon" else 0.0)
    busy = compute + recompute + tp_comm + cp_comm + ep_comm
    bubble = pipeline_bubble(layout.pipeline, p) * busy if p > 1 else 0.0
    terms = {"compute": compute, "recompute": recompute, "bubble": bubble, "tp": tp_comm, "cp": cp_comm,
             "pp": pp_comm, "ep": ep_comm, "dp": dp_exposed, "muon": muon}
    seconds = sum(terms.values())
    return Throughput(seconds, tokens / seconds, mfu, peak, flops, terms)


def ring_exposed_seconds(shape: ModelShape, cp: int, t: int, micro_batch: int, seq_len: int, e: int,
                         bandwidth: float, flops_per_s: float, recomputed: float = 0.0) -> float:
    """Ring attention's transfer time per block and micro-batch that its attention compute does not
    hide, step by step. A key/value chunk pair (2·kv_dim·e per token of the shard) moves while a
    step's blocks compute (forward: a cp-th of the block's causal attention, 2·b·s²·h/cp/t FLOPs
    per rank; backward twice that): forward steps 0..cp-2 each send one; backward step 0 sends a
    pair, steps 1..cp-2 a pair and an fp32 gradient pair (2·kv_dim·4), step cp-1 a gradient pair,
    and the last hop home is exposed whole. ``recomputed``: the share of blocks whose forward
    (its ring) runs again in backward."""
    tokens = micro_batch * seq_len / cp
    kv = tokens * 2 * shape.kv_dim / t * e / bandwidth
    acc = tokens * 2 * shape.kv_dim / t * 4 / bandwidth
    forward_step = 2 * micro_batch * seq_len ** 2 * shape.n_embd / cp / t / cp / flops_per_s
    backward_step = 2 * forward_step
    forward = (cp - 1) * max(0.0, kv - forward_step)
    backward = (max(0.0, kv - backward_step) + (cp - 2) * max(0.0, kv + acc - backward_step)
                + max(0.0, acc - backward_step) + acc)
    return forward * (1 + recomputed) + backward


def muon_step_seconds(shape: ModelShape, layout: Layout, flops_per_s: float, bandwidth: float,
                      replica_bandwidth: float | None = None, tp_bandwidth: float | None = None) -> float:
    """Muon's optimizer step on the busiest rank: Newton-Schulz on every whole matrix of the
    busiest pipeline rank's blocks, each on one owner among every rank that holds a piece of it
    (``ShardedMuon``: the ``dp_shard x cp`` ranks that shard it, times the ``tp`` ranks that split
    it, and, under HSDP, the ``dp_replicate`` replicas too), placed as ``ShardedMuon`` places them
    (``owner_plan``: the busiest owner's FLOPs, at least the largest matrix's, not the mean), and
    its routed experts' (``expert_newton_schulz_flops``), at ``flops_per_s``; its all-to-alls, not
    overlapped, bf16: to the owners and back, over the shard group 2 x 2 B per element of what a
    rank sends or receives, the larger of its pieces (1/(n t) of every matrix) and the busiest
    owner's matrices, (n - 1)/n of it crossing, at ``bandwidth``; over the tp group (the first
    stage, where the owner's tp coordinate gathers 1/n of each of its matrices) the larger of the
    pieces and 1/n of the owned, (t - 1)/t of it, at ``tp_bandwidth``; under HSDP one over the replica
    group (this rank's piece of the other replicas' results: 2 B per element of its 1/(n t),
    (r - 1)/r of it, at ``replica_bandwidth``)."""
    ranks = rank_stages(layout.pipeline, layout.pp, shape.n_layer)
    layers = max((r.all_layers for r in ranks), key=lambda ls: sum(shape.newton_schulz_flops_of_layer(i) for i in ls)
                 + expert_newton_schulz_flops(shape, ls, layout))
    n, t, r = layout.dp_shard * layout.cp, layout.tp, layout.dp_replicate
    flops, owned = busiest_muon_owner(shape, layers, n * t * r)
    flops += expert_newton_schulz_flops(shape, layers, layout)
    piece = sum(shape.muon_params_of_layer(i) for i in layers) / (n * t)  # elements of this rank's pieces
    # the tp stage runs first: the owner's tp coordinate gathers 1/n of each of its matrices there
    seconds = (flops / flops_per_s + 2 * 2 * (max(piece, owned) * _ring(n) / bandwidth
                                              + max(piece, owned / n) * _ring(t) / (tp_bandwidth or bandwidth)))
    if r > 1:
        seconds += 2 * piece * _ring(r) / (replica_bandwidth or bandwidth)
    return seconds


def expert_newton_schulz_flops(shape: ModelShape, layers, layout: Layout) -> float:
    """Newton-Schulz FLOPs of the routed experts a rank holds in ``layers`` (``ExpertMuon``: each
    expert's matrices on the rank that holds the expert, no exchange): the busiest rank's experts,
    ``ceil(ceil(E / ep) / expert_shard)`` per MoE layer (FSDP2 splits a stack along its experts)."""
    if not shape.is_moe:
        return 0.0
    per_expert = newton_schulz_flops(shape.moe_hidden, shape.n_embd) * (3 if shape.mlp == "swiglu" else 2)
    local = -(-(-(-shape.num_experts // layout.ep)) // max(1, layout.expert_shard))
    return sum(local * per_expert for i in layers if shape.is_moe_layer(i))


def busiest_muon_owner(shape: ModelShape, layers, ranks: int) -> tuple[float, int]:
    """(Newton-Schulz FLOPs, matrix elements) of the busiest of ``ranks`` owners of the Muon
    matrices of ``layers``, placed by ``parallel.muon.owner_plan`` as ``ShardedMuon`` places them."""
    shapes = [m for i in layers for m in (shape.layer_matrices[i] if shape.layer_matrices else ())]
    if not shapes:
        return 0.0, 0
    flops, elements = [0.0] * ranks, [0] * ranks
    for (rows, cols), owner in zip(shapes, owner_plan(shapes, ranks)):
        flops[owner] += newton_schulz_flops(rows, cols)
        elements[owner] += rows * cols
    busiest = max(range(ranks), key=lambda o: flops[o])
    return flops[busiest], elements[busiest]


@dataclass(frozen=True)
class Failures:
    job_mtbf_hours: float
    checkpoint_seconds: float
    interval_seconds: float
    """Young/Daly: sqrt(2 x checkpoint cost x job MTBF)."""
    overhead: float
    """Fraction of the run added by checkpoints, lost work and restarts."""


def failures(gpus: int, nodes: int, checkpoint_seconds: float, device_mtbf_hours: float = DEVICE_MTBF_HOURS,
             preemptions_per_node_hour: float = 0.0, restart_seconds: float = RESTART_SECONDS) -> Failures:
    if device_mtbf_hours <= 0:
        raise ValueError(f"device MTBF {device_mtbf_hours} h must be > 0")
    if preemptions_per_node_hour < 0:
        raise ValueError(f"preemption rate {preemptions_per_node_hour} per node-hour must be >= 0")
    rate = gpus / device_mtbf_hours + nodes * preemptions_per_node_hour  # failures per hour, whole job
    mtbf_s = 3600 / rate
    tau = young_daly_interval(checkpoint_seconds, mtbf_s)
    overhead = checkpoint_seconds / tau + (tau / 2 + restart_seconds) / mtbf_s
    return Failures(mtbf_s / 3600, checkpoint_seconds, tau, overhead)


@dataclass(frozen=True)
class Cost:
    hours: float
    """Wall-clock hours of training for the token budget, failures' overhead included."""
    gpu_hours: float
    on_demand: float | None
    """$ at the on-demand price, x1.2; None without a price."""
    spot: float | None
    """$ at the spot price (its preemptions in the overhead), x1.2; None without a spot price."""
    spot_hours: float | None

    @property
    def spot_savings(self) -> float | None:
        if self.on_demand is None or self.spot is None:
            return None
        return self.on_demand - self.spot


def cost(token_budget: float, tokens_per_second: float, gpus: int, overhead: float, price: float | None = None,
         spot_price: float | None = None, spot_overhead: float | None = None) -> Cost:
    if token_budget <= 0:
        raise ValueError(f"token budget {token_budget} must be > 0 (e.g. 2e11 for 200B tokens)")
    base_hours = token_budget / tokens_per_second / 3600
    hours = base_hours * (1 + overhead)
    on_demand = None if price is None else price * gpus * hours * OVERHEAD
    spot_hours = None if spot_price is None else base_hours * (1 + (spot_overhead if spot_overhead is not None
                                                                     else overhead))
    spot = None if spot_hours is None else spot_price * gpus * spot_hours * OVERHEAD
    return Cost(hours, hours * gpus, on_demand, spot, spot_hours)
