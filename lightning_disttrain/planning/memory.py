"""Memory per GPU of one layout: model state, activations, logits, buffers.

Model state (bytes per parameter, ``STATE_BYTES``). The reference is mixed-precision AdamW,
16 B/param = 2 (bf16 weights) + 2 (bf16 gradients) + 4 (fp32 master weights) + 4 + 4 (AdamW's two
fp32 moments) (ZeRO, Rajbhandari et al. 2020, section 3.1). ZeRO stage z over N ranks keeps:

    z=0 (DDP)   2 + 2 + 12        = 16
    z=1         2 + 2 + 12/N      (optimizer state sharded)
    z=2         2 + (2 + 12)/N    (+ gradients)
    z=3         16/N              (+ parameters: FSDP2)

so at N=8 ZeRO-1/2/3 hold 2.9x / 4.3x / 8x less than DDP, at N=64 3.8x / 7.2x / 64x. With
``Workload(optimizer="muon")`` the blocks' 2-D weights and the routed experts' stacks keep one fp32 momentum (4 B; 2 in
``bf16-pure``) instead of AdamW's two moments, sharded as AdamW's are. Tensor and
pipeline parallel divide the parameters a rank holds first (blocks by tp and pp; the embedding and
head by tp and sit on the first / last stage); expert parallel divides the routed experts by ep,
which then shard over ``dp_shard / ep`` ranks.

Activations: what this package's GPT keeps for backward, per token and block, from its
``GPTConfig`` fields and the checkpointing policy (``planning/activations.py``, checked to the byte
against ``parallel.activation.activation_bytes`` on CPU), times the tokens of one micro-batch, times
the blocks of the rank's stage, times the micro-batch forwards the rank holds at once: 1 without a
pipeline; with one, as many as the strategy's schedule holds (``planning/pipeline.py``: GPipe all m,
1F1B min(m, p - r) on rank r, interleaved as torch's schedule orders them). The peak is the larger
of the forward's end (all of that, the head, the logits) and, with checkpointing, the backward of
a recomputed block (``activations.backward_peak``: the blocks before it, all it recomputes, the
gradients in flight; the logits are gone by then). The most loaded pipeline rank is the estimate. Megatron's per-layer form (Korthikanti et al. 2022, table 2), for
comparison, is ``activation_bytes_per_layer``::

    s*b*h * (10 + 24/t + 5*a*s/(h*t))    tensor parallel t          (t=1: 34 + 5as/h)
    s*b*h * (34/t + 5*a*s/(h*t))         + sequence parallel
    s*b*h * (10 + 24/t)                  + selective recompute, or FlashAttention
    s*b*h * 2                            full recompute: each block's input only (/t with SP)

(the example s=8192, b=1, h=4096, L=32, a=32, t=1 gives 380 GB). It fits GPT-2-style blocks with
dropout; for SwiGLU, grouped-query attention, MoE and this package's selective policy (which keeps
matmul outputs and recomputes the rest) the derived terms differ by 20-30%.

Context parallel divides every per-token term by cp (a rank holds 1/cp of each sequence): ring
attention keeps nothing more (``activations``: measured to the byte on 2 and 4 ranks); its
backward's buffers in flight count at a recomputed block's backward (``ring_backward_bytes``; with
no recomputation the loss's peak is higher).

Logits: s*b*V/t elements (the head is vocabulary-parallel under tp, with loss parallel). The loss
(``GPTModule.loss_fn``: an fp32 log-softmax) keeps its fp32 output for backward (4 B), and its
backward holds two fp32 gradients beside it, the incoming one and the input's (8 B): 12 B per
element at the loss's backward in every precision (the forward's end is less: the fp32 copy and
the log-softmax output, 8 B, in 16-bit; 12 B in fp32, whose padded-vocabulary slice is copied).
Measured: the loss alone on CPU, 12.1 B at its backward and 8.1 B at the forward's end in bf16
(``tests/planning/test_logit_bytes.py``), and gpt2-124m on one H200 (``gpu_paths.py
plan_memory``, docs/benchmarks.md 9.2). Without a pipeline the logits themselves are freed when
the training step returns; a pipeline's last stage keeps each micro-batch's stage output (the
logits, at the compute dtype) until its backward, so holding n micro-batches (GPipe) it keeps
n x (4 + 2) B in 16-bit or n x (4 + 4) B in fp32, and one micro-batch's 8 B of gradients.

Gradient accumulation (k micro-batches per optimizer step) under FSDP: by default every
micro-batch reduce-scatters and adds its shard to the parameter's sharded gradient, so nothing
beyond the sharded gradients above is held (HSDP's partial sum across replicas is one sharded
gradient too, in place of the parameter's until the last micro-batch). With the strategy's
``accumulate_unsharded_grads`` (``Layout.accumulate_unsharded_grads``) FSDP skips the
reduce-scatter and each unit keeps its whole unsharded gradient in the reduce dtype (fp32,
``REDUCE_BYTES``) from the window's first backward to its last; the sharded gradients are freed
when the window starts (``zero_grad``), so ``grads`` is then the unsharded gradient of the rank's
part of the model: 4 B/param / tp instead of 2-4 B/param / shard (measured on 2 CPU ranks,
tests/planning/test_accumulation_memory.py).

Buffers, stated: FSDP2 (ZeRO-3) holds the root unit (embedding, head, final norm) and two blocks
all-gathered at a time (the current one and the prefetched next) at the compute dtype, plus one
block's unsharded fp32 gradient for the reduce-scatter; under a pipeline the strategy keeps every
parameter of the stage gathered from forward to backward (``reshard_after_forward=False``), and
it runs no FSDP at all for pipeline
stages without tp on one data-parallel rank in fp32 (nothing to shard: no buffers); a pipeline
stage also keeps, from its first step on, a receive buffer per micro-batch for its input (all but the
first stage) and for its output's gradient (all but the last) (torch's ``PipelineStage``); ZeRO-1/2 and
DDP the gradient buckets (2 x 25 MB, DDP's default bucket); on a GPU a fixed 2 GB for the CUDA
context, cuBLAS workspaces and NCCL's channel buffers. A layout fits when the total is within ``1 - margin`` of the
device's memory (default margin 10%: the caching allocator's fragmentation).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_disttrain.planning.activations import backward_peak, head_bytes, stage_bytes
from lightning_disttrain.planning.model_shape import ModelShape
from lightning_disttrain.planning.pipeline import RankStages, rank_stages
from lightning_disttrain.planning.spec import GB, Cluster, Layout, Workload


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each part of the model state."""

    weights: float
    grads: float
    master: float
    moments: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.moments


STATE_BYTES: dict[str, StateBytes] = {
    "bf16": StateBytes(weights=2, grads=2, master=4, moments=8),
    "fp8": StateBytes(weights=2, grads=2, master=4, moments=8),  # torchao keeps weights high-precision
    "fp32": StateBytes(weights=4, grads=4, master=0, moments=8),
    "bf16-pure": StateBytes(weights=2, grads=2, master=0, moments=4),
}
ACTIVATION_BYTES = {"bf16": 2, "fp8": 2, "fp32": 4, "bf16-pure": 2}
"""Bytes per activation element (fp8 runs keep 16-bit activations between layers)."""
LOGIT_SAVED_BYTES = 4
"""Per logit element, what each micro-batch's loss keeps for its backward: the fp32 log-softmax output."""
LOGIT_GRAD_BYTES = 8
"""Per logit element, the loss's backward: the fp32 gradient it receives and the one it returns, one
micro-batch's at a time."""
LOGIT_OUTPUT_BYTES = {"bf16": 2, "fp8": 2, "fp32": 4, "bf16-pure": 2}
"""The logits themselves (the head's output dtype): held until backward only by a pipeline's last
stage, which keeps each micro-batch's stage output."""
REDUCE_BYTES = 4
"""Bytes per element of FSDP's gradient reduction (``mp_policy_for_precision``: fp32 in every precision),
the dtype unsharded gradients accumulate in when the reduce-scatter is skipped."""
DDP_BUCKETS = 2 * 25e6
GPU_RESERVED = 2 * GB
DEFAULT_MARGIN = 0.10


def state_bytes_per_param(zero: int, n: int, sb: StateBytes = STATE_BYTES["bf16"]) -> float:
    """Bytes per parameter one rank holds under ZeRO stage ``zero`` over ``n`` ranks."""
    if zero == 0:
        return sb.total
    if zero == 1:
        return sb.weights + sb.grads + (sb.master + sb.moments) / n
    if zero == 2:
        return sb.weights + (sb.grads + sb.master + sb.moments) / n
    if zero == 3:
        return sb.total / n
    raise ValueError(f"zero={zero} must be 0 (DDP), 1, 2 or 3")


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                               recompute: str = "none", flash: bool = False, act_bytes: int = 2) -> float:
    """Bytes one transformer layer stores for backward (Korthikanti et al. 2022; see the module doc)."""
    sbh = s * b * h
    if recompute == "full":
        coef = 2 / t if sequence_parallel else 2
    elif recompute in ("none", "selective"):
        coef = 34 / t if sequence_parallel else 10 + 24 / t
        if recompute == "none" and not flash:
            coef += 5 * a * s / (h * t)
    else:
        raise ValueError(f"recompute={recompute!r} is unknown; use 'none', 'selective' or 'full'")
    return sbh * coef * act_bytes / 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU (the most loaded rank) of one layout, by part."""

    params: float
    grads: float
    optimizer: float
    """Master weights and AdamW moments."""
    activations: float
    logits: float
    buffers: float
    capacity: float
    margin: float
    rank: int = 0
    """The pipeline rank this is (the most loaded one); 0 without a pipeline."""
    persistent: float = 0.0
    """Of ``buffers``, what stays allocated between steps (a pipeline stage's receive buffers)."""

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations + self.logits + self.buffers

    @property
    def usable(self) -> float:
        return self.capacity * (1 - self.margin)

    @property
    def headroom(self) -> float:
        """Usable memory left (negative: over by that much)."""
        return self.usable - self.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0

    def as_gb(self) -> dict:
        out = {k: v / GB for k, v in asdict(self).items() if k not in ("margin", "rank", "persistent")}
        return out | {"state": self.state / GB, "total": self.total / GB, "headroom": self.headroom / GB,
                      "fits": self.fits, "margin": self.margin, "pp_rank": self.rank}


def _rank_params(shape: ModelShape, layout: Layout, rs: RankStages) -> tuple[float, float]:
    """(dense, expert) parameters pipeline rank ``rs`` holds before ZeRO sharding: its blocks' and
    its edge modules' by tp, its routed experts by ep."""
    layers = rs.all_layers
    blocks = sum(shape.params_of_layer(i) - shape.experts_of_layer(i) for i in layers)
    edges = (shape.first_stage_params if rs.first else 0.0) + (shape.last_stage_params if rs.last else 0.0)
    return (blocks + edges) / layout.tp, sum(shape.experts_of_layer(i) for i in layers) / layout.ep


def local_params(shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters on the most loaded pipeline rank before ZeRO sharding."""
    shape = shape.untied() if layout.pp > 1 else shape
    ranks = rank_stages(layout.pipeline, layout.pp, shape.n_layer)
    return max((_rank_params(shape, layout, rs) for rs in ranks), key=sum)


def runs_fsdp(layout: Layout, precision: str) -> bool:
    """Whether ``NDParallelStrategy`` wraps the model in FSDP2 for ``layout`` (ZeRO >= 1): not for
    pipeline stages without tp on one data-parallel rank in full precision."""
    return layout.zero > 0 and not (layout.pp > 1 and layout.tp == 1 and layout.dp == 1 and precision == "fp32")


def unsharded_accumulation(layout: Layout, accumulation: int, fsdp: bool = True) -> bool:
    """Whether FSDP holds unsharded gradients between the micro-batches of an optimizer step: gradient
    accumulation with ``accumulate_unsharded_grads`` on an FSDP layout."""
    return fsdp and layout.zero >= 2 and accumulation > 1 and layout.accumulate_unsharded_grads


def memory_per_rank(shape: ModelShape, layout: Layout, workload: Workload, cluster: Cluster,
                    margin: float = DEFAULT_MARGIN, accumulation: int = 1) -> list[MemoryEstimate]:
    """The memory estimate of every pipeline rank of ``layout`` (one without a pipeline), for
    ``shape`` trained as ``workload`` on ``cluster``. ``workload.micro_batch`` is the sequences of
    one forward: under a pipeline, one of its micro-batches."""
    if layout.pp > 1:
        shape = shape.untied()  # the strategy's stages need their own head
    return [_rank_memory(shape, layout, workload, cluster, margin, accumulation, rs)
            for rs in rank_stages(layout.pipeline, layout.pp, shape.n_layer)]


def memory_per_gpu(shape: ModelShape, layout: Layout, workload: Workload, cluster: Cluster,
                   margin: float = DEFAULT_MARGIN, accumulation: int = 1) -> MemoryEstimate:
    """The most loaded rank's ``memory_per_rank`` estimate: what must fit."""
    return max(memory_per_rank(shape, layout, workload, cluster, margin, accumulation), key=lambda m: m.total)


def _rank_memory(shape: ModelShape, layout: Layout, workload: Workload, cluster: Cluster, margin: float,
                 accumulation: int, rs: RankStages) -> MemoryEstimate:
    sb = STATE_BYTES[workload.precision]
    dense, experts = _rank_params(shape, layout, rs)
    fsdp = runs_fsdp(layout, workload.precision)
    z = layout.zero if fsdp or layout.zero == 0 else 0
    shard = layout.shard if fsdp else 1
    expert_shard = layout.expert_shard if fsdp else 1

    def part(bytes_of) -> float:
        return dense * bytes_of(shard) + experts * bytes_of(expert_shard)

    params = part(lambda n: sb.weights / n if z == 3 else sb.weights)
    grads = part(lambda n: sb.grads / n if z >= 2 else sb.grads)
    optimizer = part(lambda n: (sb.master + sb.moments) / n if z >= 1 else sb.master + sb.moments)
    if workload.optimizer == "muon":  # one momentum per element of the blocks' matrices, not AdamW's two moments
        muon = sum(shape.muon_params_of_layer(i) for i in rs.all_layers) / layout.tp
        optimizer -= muon * sb.moments / 2 / (shard if z >= 1 else 1)
        optimizer -= experts * sb.moments / 2 / (expert_shard if z >= 1 else 1)  # the experts' stacks (ExpertMuon)
    if unsharded_accumulation(layout, accumulation, fsdp):
        grads = (dense + experts) * REDUCE_BYTES  # every unit's whole gradient, between micro-batches

    s, b, t = workload.seq_len, workload.micro_batch, layout.tp
    tokens = s * b / layout.cp  # this rank's: context parallel splits every sequence over cp ranks
    e = ACTIVATION_BYTES[workload.precision]
    cpu = cluster.gpu == "cpu"
    kw = dict(e=e, t=t, ep=layout.ep, cp=layout.cp, cpu=cpu, flash=workload.flash, seq_len=s)
    ac, k = layout.ac, layout.ac_every_k
    per_chunk = max(stage_bytes(shape, stage, ac, k, **kw) for stage in rs.layers)
    if layout.pp > 1 and not rs.last:
        per_chunk += e * shape.n_embd / t  # the stage's output, kept for its send and its backward
    recomputing = max(backward_peak(shape, stage, ac, k, **kw) for stage in rs.layers)
    head = logit_held = 0.0
    if rs.last:
        head = tokens * head_bytes(shape, e, t, cpu)
        output = LOGIT_OUTPUT_BYTES[workload.precision] if layout.pp > 1 else 0
        logit_held = tokens * shape.vocab / t * (LOGIT_SAVED_BYTES + output)
    logit_grad = tokens * shape.vocab / t * LOGIT_GRAD_BYTES if rs.last else 0.0
    # the forward's end (and the loss's backward): every held micro-batch's blocks, head and logits,
    # one logits gradient; or a recomputed block's backward, the other held micro-batches beside it
    at_loss = (tokens * rs.inflight * per_chunk + rs.last_inflight * head,
               rs.last_inflight * logit_held + logit_grad)
    in_backward = (tokens * ((rs.inflight - 1) * per_chunk + recomputing)
                   + (rs.last_inflight - 1) * head, (rs.last_inflight - 1) * logit_held)
    activations, logits = max(at_loss, in_backward, key=sum)

    compute_bytes = 4 if workload.precision == "fp32" else 2
    block = max((shape.params_of_layer(i) - shape.experts_of_layer(i) + shape.experts_of_layer(i) / layout.ep) / t
                for i in rs.all_layers)  # one FSDP unit, this rank's part
    if z == 3 and layout.pp > 1:  # the stage stays gathered from forward to backward
        buffers = (dense + experts) * compute_bytes + block * 4
    elif z == 3:
        root = ((shape.first_stage_params if rs.first else 0.0) + (shape.last_stage_params if rs.last else 0.0)) / t
        buffers = (root + 2 * block) * compute_bytes + block * 4
    elif z == 2:
        buffers = block * 4
    elif fsdp or layout.pp == 1:
        buffers = DDP_BUCKETS
    else:
        buffers = 0.0  # a pipeline stage alone on its data-parallel rank: no FSDP, no DDP
    receive = 0.0
    if layout.pp > 1:  # torch's stages keep a receive buffer per micro-batch: inputs, and gradients of outputs
        n_stages = layout.pipeline.num_stages(layout.pp)
        ends = sum((stage != 0) + (stage != n_stages - 1) for stage in rs.stages)
        receive = ends * layout.microbatches * tokens * e * shape.n_embd / t
    buffers += receive
    if not cpu:
        buffers += GPU_RESERVED
    return MemoryEstimate(params=params, grads=grads, optimizer=optimizer, activations=activations, logits=logits,
                          buffers=buffers, capacity=cluster.memory_bytes, margin=margin, rank=rs.rank,
                          persistent=receive)
