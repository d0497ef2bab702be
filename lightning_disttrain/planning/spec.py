"""The planner's inputs, validated: the cluster, the workload, and one candidate layout.

Units: bytes, and GB = 10^9 bytes (decimal, as datasheets print memory and as the reference
figures are stated: 7B parameters x 16 B = 112 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_disttrain.parallel.activation import POLICIES as AC_POLICIES
from lightning_disttrain.parallel.pipeline import PipelineOptions
from lightning_disttrain.peak_flops import CHIPS

GB = 1e9

GPU_MEMORY_GB: dict[str, float] = {
    "A100": 80, "H100 SXM": 80, "H100 PCIe": 80, "H100 NVL": 94, "GH200": 96, "H200": 141, "H200 NVL": 141,
    "B200": 180, "GB200": 186, "L4": 24, "L40S": 48, "A10G": 24,
}
"""Memory per GPU as the datasheets print it (the larger part where there are two: A100 40 GB is
``--gpu-memory 40``). HGX B200: 1,440 GB per 8 GPUs; GB200 NVL72: 13.4 TB per 72."""

PRECISIONS = ("bf16", "fp8", "fp32", "bf16-pure")
OPTIMIZERS = ("adamw", "muon")
"""``GPTModule(optimizer=...)``: AdamW everywhere, or Muon on the blocks' 2-D weights and AdamW on the rest."""


@dataclass(frozen=True)
class Cluster:
    """The machines: ``gpu`` is a row of the peak table (``lightning_disttrain/peak_flops.py``) or ``"cpu"``."""

    gpu: str = "H100 SXM"
    gpus_per_node: int = 8
    nodes: int = 1
    memory_gb: float | None = None
    """Memory per device; None: ``GPU_MEMORY_GB[gpu]`` (required for ``cpu``)."""

    def __post_init__(self) -> None:
        if self.gpu != "cpu" and self.gpu not in CHIPS:
            raise ValueError(f"unknown GPU {self.gpu!r}; use one of {sorted(CHIPS)} or 'cpu' (with --gpu-memory)")
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} and nodes={self.nodes} must be >= 1")
        if self.memory_gb is None and self.gpu == "cpu":
            raise ValueError("gpu='cpu' has no memory size in the table: pass --gpu-memory GB")
        if self.memory_gb is not None and self.memory_gb <= 0:
            raise ValueError(f"memory_gb={self.memory_gb} must be > 0")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def memory_bytes(self) -> float:
        return (self.memory_gb if self.memory_gb is not None else GPU_MEMORY_GB[self.gpu]) * GB


@dataclass(frozen=True)
class Workload:
    """What is trained: sequence length, batch sizes (in sequences), precision, attention kernel."""

    seq_len: int
    global_batch: int
    """Sequences per optimizer step, over every data-parallel rank and accumulation step."""
    micro_batch: int = 1
    """Sequences per forward on one GPU."""
    precision: str = "bf16"
    """``bf16`` (mixed: bf16 compute, fp32 master weights and AdamW), ``fp8`` (the same state, float8
    matmuls through torchao), ``fp32``, or ``bf16-pure`` (bf16 weights and AdamW moments, no master)."""
    flash: bool = True
    """Attention without a materialised score matrix (FlashAttention; torch's SDPA picks it on
    GPUs and its CPU flash kernel on CPU for causal attention without dropout)."""
    optimizer: str = "adamw"
    """``adamw`` or ``muon`` (``GPTModule(optimizer=...)``): Muon keeps one momentum per matrix
    element instead of AdamW's two moments, and its step runs Newton-Schulz on each whole matrix."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is unknown; use one of {PRECISIONS}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} is unknown; use one of {OPTIMIZERS}")
        for name in ("seq_len", "global_batch", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


DEGREES: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
"""The ``NDParallelStrategy`` degrees a ``Layout`` carries, in the order plans print them."""


@dataclass(frozen=True)
class Layout:
    """One way to lay the model out: the degrees of ``NDParallelStrategy`` (``cp``: context parallel,
    each sequence split over ``cp`` ranks that FSDP also shards over) plus the ZeRO stage, the
    activation checkpointing policy and, with ``pp > 1``, the strategy's pipeline arguments.
    ``zero``: 0 = DDP (nothing sharded), 1 = optimizer state sharded, 2 = + gradients (FSDP2
    ``reshard_after_forward=False``), 3 = + parameters (FSDP2). ``ac``: the policy of
    ``SelectiveActivationCheckpointing`` (``parallel.activation.POLICIES``), ``ac_every_k`` its
    ``every_k`` for ``"block"``."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    zero: int = 3
    ac: str = "none"
    ac_every_k: int = 2
    pp_schedule: str = "1F1B"
    """``NDParallelStrategy(pp_schedule=...)``; with ``pp=1`` unused."""
    pp_microbatches: int | None = None
    """``NDParallelStrategy(pp_microbatches=...)``: micro-batches each batch is split into; None:
    the strategy's default (one per stage)."""
    pp_stages_per_rank: int | None = None
    """``NDParallelStrategy(pp_stages_per_rank=...)``; None: the strategy's default for the schedule."""
    accumulate_unsharded_grads: bool = False
    """``NDParallelStrategy(accumulate_unsharded_grads=...)`` (FSDP layouts, ``zero >= 2``): with gradient
    accumulation, False reduce-scatters every micro-batch (gradients stay sharded), True once per
    step (the whole unsharded fp32 gradient held between micro-batches)."""

    def __post_init__(self) -> None:
        for name in DEGREES:
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name}={getattr(self, name)} must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Layout.zero={self.zero} must be 0 (DDP), 1, 2 or 3")
        if self.ac not in AC_POLICIES:
            raise ValueError(f"Layout.ac={self.ac!r} is unknown; use one of {AC_POLICIES}")
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp_shard*cp={self.dp_shard * self.cp} (experts borrow FSDP "
                             f"ranks)")
        if not isinstance(self.ac_every_k, int) or self.ac_every_k < 1:
            raise ValueError(f"Layout.ac_every_k={self.ac_every_k!r} must be an int >= 1")
        if self.pp > 1:
            PipelineOptions(self.pp_schedule, self.pp_microbatches, self.pp_stages_per_rank)  # the strategy's checks
        if self.accumulate_unsharded_grads and self.zero < 2:
            raise ValueError(f"Layout.accumulate_unsharded_grads=True is an FSDP option (zero 2 or 3), not for "
                             f"zero={self.zero}: leave it False")

    @property
    def pipeline(self) -> PipelineOptions:
        """The ``PipelineOptions`` ``NDParallelStrategy`` builds from these pipeline arguments."""
        return PipelineOptions(self.pp_schedule, self.pp_microbatches, self.pp_stages_per_rank)

    @property
    def microbatches(self) -> int:
        """Micro-batches per data-parallel batch: the pipeline's (1 without one)."""
        return self.pipeline.num_microbatches(self.pp) if self.pp > 1 else 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks a dense parameter is sharded over (ZeRO): ``dp_shard`` x ``cp`` (the strategy's
        ``dp_shard_cp``: a cp group's ranks hold the same weights and average their gradients)."""
        return self.dp_shard * self.cp if self.zero else 1

    @property
    def expert_shard(self) -> int:
        """Ranks a routed expert's parameters are sharded over: ``dp_shard`` x ``cp`` / ``ep``."""
        return self.dp_shard * self.cp // self.ep if self.zero else 1

    @property
    def name(self) -> str:
        if self.zero == 0:
            parts = [f"DDP x{self.dp}"]
        elif self.dp_replicate > 1:
            parts = [f"HSDP {self.dp_replicate}x{self.dp_shard}"]
        else:
            parts = [f"ZeRO-{self.zero} x{self.dp_shard}" if self.zero < 3 else f"FSDP2 x{self.dp_shard}"]
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.pp > 1:
            o = self.pipeline
            v = f" v{o.local_stages}" if o.local_stages > 1 else ""
            parts.append(f"PP {self.pp} ({o.schedule}{v}, {o.num_microbatches(self.pp)} mb)")
        if self.ep > 1:
            parts.append(f"EP {self.ep}")
        if self.ac != "none":
            parts.append(f"AC {self.ac}" + (f"/{self.ac_every_k}" if self.ac == "block" else ""))
        return " + ".join(parts)
