"""Memory per GPU of one layout: model state, activations, logits, buffers.

Model state (bytes per parameter, ``STATE_BYTES``). The reference is mixed-precision AdamW,
16 B/param = 2 (bf16 weights) + 2 (bf16 gradients) + 4 (fp32 master weights) + 4 + 4 (AdamW's two
fp32 moments) (ZeRO, Rajbhandari et al. 2020, section 3.1). ZeRO stage z over N ranks keeps:

    z=0 (DDP)   2 + 2 + 12        = 16
    z=1         2 + 2 + 12/N      (optimizer state sharded)
    z=2         2 + (2 + 12)/N    (+ gradients)
    z=3         16/N              (+ parameters: FSDP2)

so at N=8 ZeRO-1/2/3 hold 2.9x / 4.3x / 8x less than DDP, at N=64 3.8x / 7.2x / 64x. Tensor and
pipeline parallel divide the parameters a rank holds first (blocks by tp and pp; the embedding and
head by tp and sit on the first / last stage); expert parallel divides the routed experts by ep,
which then shard over ``dp_shard / ep`` ranks.

Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", table 2; 16-bit activations, 1-byte dropout masks)::

    s*b*h * (10 + 24/t + 5*a*s/(h*t))    tensor parallel t          (t=1: 34 + 5as/h)
    s*b*h * (34/t + 5*a*s/(h*t))         + sequence parallel
    s*b*h * (10 + 24/t)                  + selective recompute, or FlashAttention: the attention
                                           scores (the 5as/h term) are never stored
    s*b*h * 34/t                         sequence parallel + selective / FlashAttention
    s*b*h * 2                            full recompute: each block's input only (/t with SP)

times L layers (a 1F1B pipeline's first stage holds p micro-batches of L/p layers: L again), and
times act_bytes/2 for 32-bit activations. Full recompute adds one block's stored activations: the
working set while that block is recomputed in backward. The example s=8192, b=1, h=4096, L=32,
a=32, t=1 gives 380 GB.

Logits: s*b*V/t elements (the head is vocabulary-parallel under tp, with loss parallel), each
10 B in 16-bit training (bf16 logits 2 + the fp32 copy the cross-entropy reads 4 + its fp32
gradient 4) and 12 B in fp32 (logits, log-softmax output, gradient).

Buffers, stated: FSDP2 (ZeRO-3) holds the root unit (embedding, head, final norm) and two blocks
all-gathered at a time (the current one and the prefetched next) at the compute dtype, plus one
block's unsharded fp32 gradient for the reduce-scatter; ZeRO-1/2 and DDP the gradient buckets
(2 x 25 MB, DDP's default bucket); on a GPU a fixed 2 GB for the CUDA context, cuBLAS workspaces
and NCCL's channel buffers. A layout fits when the total is within ``1 - margin`` of the
device's memory (default margin 10%: the caching allocator's fragmentation).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lightning_disttrain.planning.model_shape import ModelShape
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
LOGIT_BYTES = {"bf16": 10, "fp8": 10, "fp32": 12, "bf16-pure": 10}
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
        out = {k: v / GB for k, v in asdict(self).items() if k != "margin"}
        return out | {"state": self.state / GB, "total": self.total / GB, "headroom": self.headroom / GB,
                      "fits": self.fits, "margin": self.margin}


def local_params(shape: ModelShape, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters on the most loaded rank before ZeRO sharding: blocks split by
    tp and pp, the embedding/head by tp on an edge stage, routed experts by ep."""
    t, p = layout.tp, layout.pp
    blocks = shape.dense_params - shape.embedding_params
    if p > 1 and not shape.tied:
        edge = shape.embedding_params / 2  # untied: the table on the first stage, the head on the last
    else:
        edge = shape.embedding_params
    dense = blocks / (t * p) + edge / t
    return dense, shape.expert_params / (p * layout.ep)


def memory_per_gpu(shape: ModelShape, layout: Layout, workload: Workload, cluster: Cluster,
                   margin: float = DEFAULT_MARGIN) -> MemoryEstimate:
    """The memory estimate of ``layout`` for ``shape`` trained as ``workload`` on ``cluster``."""
    sb = STATE_BYTES[workload.precision]
    dense, experts = local_params(shape, layout)
    expert_shard = layout.dp_shard // layout.ep if layout.zero else 1

    def part(bytes_of) -> float:
        return dense * bytes_of(layout.shard) + experts * bytes_of(expert_shard)

    z = layout.zero
    params = part(lambda n: sb.weights / n if z == 3 else sb.weights)
    grads = part(lambda n: sb.grads / n if z >= 2 else sb.grads)
    optimizer = part(lambda n: (sb.master + sb.moments) / n if z >= 1 else sb.master + sb.moments)

    s, b, t = workload.seq_len, workload.micro_batch, layout.tp
    act = ACTIVATION_BYTES[workload.precision]
    per_layer = activation_bytes_per_layer(s, b, shape.n_embd, shape.n_head, t, sequence_parallel=t > 1,
                                           recompute=layout.ac, flash=workload.flash, act_bytes=act)
    activations = per_layer * shape.n_layer
    if layout.ac == "full":  # the block being recomputed holds its activations meanwhile
        activations += activation_bytes_per_layer(s, b, shape.n_embd, shape.n_head, t, sequence_parallel=t > 1,
                                                  flash=workload.flash, act_bytes=act)
    logits = s * b * shape.vocab / t * LOGIT_BYTES[workload.precision]

    compute_bytes = 4 if workload.precision == "fp32" else 2
    experts_per_block = shape.expert_params / shape.moe_layers if shape.moe_layers else 0
    block = (shape.block_params - experts_per_block * (1 - 1 / layout.ep)) / t  # one FSDP unit, this rank's part
    if z == 3:
        root = shape.embedding_params / t
        buffers = (root + 2 * block) * compute_bytes + block * 4
    elif z == 2:
        buffers = block * 4
    else:
        buffers = DDP_BUCKETS
    if cluster.gpu != "cpu":
        buffers += GPU_RESERVED
    return MemoryEstimate(params=params, grads=grads, optimizer=optimizer, activations=activations, logits=logits,
                          buffers=buffers, capacity=cluster.memory_bytes, margin=margin)
