"""Mixture-of-experts feed-forward: a drop-in for the GPT's MLP. Plain torch, no Lightning.

Each token is scored by a router, goes to its ``top_k`` routed experts (plus the always-on shared
experts), and the expert outputs are summed with the router's weights. The pieces, in order:

- ``MoE.route``: router scores (``softmax``, or ``sigmoid`` renormalised over the chosen experts
  as in DeepSeek-V3) and the top-k choice. DeepSeek-V3's auxiliary-loss-free balancing adds a
  per-expert bias to the scores for the *choice only*; the combine weights never see it.
- ``sort_by_expert``: the (token, expert) assignments sorted by expert, with the per-expert counts
  and, when a capacity is set, the assignments beyond it dropped.
- ``MoE.dispatch`` (``local_dispatch``): gather the sorted tokens, run the experts, weight and
  scatter-add back. A plain attribute, so that expert parallel can replace it with an all-to-all
  version without touching routing or the experts.
- ``GroupedExperts``: all routed experts' weights stacked in 3-D parameters ``[num_experts, out,
  in]`` (shardable over experts), one grouped GEMM per projection over the sorted tokens
  (``torch.nn.functional.grouped_mm``), or a loop over experts where that kernel does not take the dtype.

Dropless by default: every token reaches its ``top_k`` experts. Balancing state: ``expert_bias``
is a persistent buffer (saved with checkpoints); the per-expert token counts of the forward passes
since the last ``update_bias`` are a plain attribute, not a buffer, so that DDP's buffer broadcast
cannot overwrite another rank's counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lightning_disttrain import comm
from lightning_disttrain.models import param_init

ACTIVATIONS = ("gelu", "swiglu", "relu2")
SCORES = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    """Shape and routing of one mixture-of-experts feed-forward. ``GPTConfig`` holds the same
    options as ``moe_<name>`` fields (``moe_top_k``, ...); ``dim``/``activation`` come from its
    ``n_embd``/``mlp``."""

    dim: int
    """Width of the residual stream (input and output of the layer)."""
    hidden: int
    """Hidden width of each expert (routed and shared)."""
    num_experts: int = 8
    """Routed experts."""
    top_k: int = 2
    """Routed experts per token."""
    shared_experts: int = 0
    """Always-on experts of width ``hidden`` that every token passes through (DeepSeek's shared experts)."""
    activation: str = "swiglu"
    """Expert feed-forward: ``gelu`` (tanh approximation, as GPT-2), ``swiglu`` or ``relu2``."""
    score: str = "softmax"
    """Router score: ``softmax`` over experts (weights = the chosen experts' probabilities), or
    ``sigmoid`` per expert, with the chosen experts' weights renormalised to sum to 1 (DeepSeek-V3)."""
    capacity_factor: float | None = None
    """None: dropless. Otherwise each expert takes at most ``ceil(capacity_factor · tokens · top_k
    / num_experts)`` assignments per forward (tokens of that forward, on this rank), in token
    order; later ones are dropped (the token keeps its other experts and the residual)."""
    bias_update_speed: float = 1e-3
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each optimizer step ``update_bias`` adds
    ``speed · sign(mean_load - load)`` to each expert's selection bias. 0 turns it off."""
    aux_loss_coef: float = 0.0
    """Weight of DeepSeek-V3's complementary sequence-wise balance loss (0: not computed)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss, mean of logsumexp(logits)² (ST-MoE; 0: not computed)."""
    names: str = field(default="MoEConfig.", repr=False, compare=False)
    """How errors name the fields: ``"MoEConfig."`` or ``"GPTConfig.moe_"``."""

    def __post_init__(self) -> None:
        n = self.names
        if self.num_experts < 1:
            raise ValueError(f"{n}num_experts={self.num_experts} must be >= 1 for a mixture of experts")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"{n}top_k={self.top_k} must be between 1 and {n}num_experts={self.num_experts}; "
                             f"lower top_k or add experts")
        if self.shared_experts < 0:
            raise ValueError(f"{n}shared_experts={self.shared_experts} must be >= 0")
        if self.hidden < 1 or self.dim < 1:
            raise ValueError(f"{n}hidden={self.hidden} and dim={self.dim} must be >= 1")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is unknown; use one of {ACTIVATIONS}")
        if self.score not in SCORES:
            raise ValueError(f"{n}score={self.score!r} is unknown; use one of {SCORES}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"{n}capacity_factor={self.capacity_factor} must be > 0, or None for dropless routing")
        for name in ("bias_update_speed", "aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{n}{name}={getattr(self, name)} must be >= 0 (0 turns it off)")


def check_gpt_moe_fields(config) -> None:
    """Check a ``GPTConfig``'s ``moe_*`` fields; errors name the field and the fix."""
    if config.moe_num_experts < 0:
        raise ValueError(f"GPTConfig.moe_num_experts={config.moe_num_experts} must be >= 0 (0: no MoE)")
    if config.moe_num_experts == 0:
        changed = [f.name for f in fields(config) if f.name.startswith("moe_") and getattr(config, f.name) != f.default]
        if changed:
            raise ValueError(f"GPTConfig.{changed[0]} is set but moe_num_experts=0 (MoE off); set moe_num_experts "
                             f">= 1 to use a mixture of experts, or leave {changed} at their defaults")
        return
    config.moe_config()  # MoEConfig checks the shared fields, naming them GPTConfig.moe_*
    if config.moe_every < 1:
        raise ValueError(f"GPTConfig.moe_every={config.moe_every} must be >= 1 (1: every block after moe_first_dense)")
    if not 0 <= config.moe_first_dense < config.n_layer:
        raise ValueError(f"GPTConfig.moe_first_dense={config.moe_first_dense} leaves no MoE block among "
                         f"n_layer={config.n_layer}; use 0 <= moe_first_dense < n_layer, or moe_num_experts=0")


# ---- expert compute ---------------------------------------------------------------------------

def grouped_mm_supported(*tensors: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` (torch's ``_grouped_mm`` kernel, called as is)
    takes these operands: on CPU float32/bfloat16/float16, on CUDA bfloat16 (its kernel's only
    unscaled dtype), and on both the last dimension of every operand a multiple of 16 bytes (the
    kernel refuses other strides). Under ``torch.compile`` bfloat16 only: the kernel's meta
    function refuses the others."""
    if not hasattr(F, "grouped_mm"):
        return False
    t = tensors[0]
    ok_dtypes = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}
    if torch.compiler.is_compiling():  # the kernel's meta function (tracing) takes bf16 only (torch 2.13)
        ok_dtypes = {"cpu": (torch.bfloat16,), "cuda": (torch.bfloat16,)}
    if t.dtype not in ok_dtypes.get(t.device.type, ()):
        return False
    return all(x.dtype == t.dtype and (x.size(-1) * x.element_size()) % 16 == 0 for x in tensors)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: torch.Tensor | list[int],
                   grouped: bool) -> torch.Tensor:
    """Rows of ``x`` (N, in), sorted by expert, times each expert's ``weight[e]`` (num_experts, out,
    in) transposed, like ``nn.Linear``: (N, out). ``groups`` says which rows are whose: for the
    grouped GEMM the end row of each expert's rows (int32, on the device), for the loop over
    experts their row counts on the host."""
    if grouped:
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=groups)
    parts = x.split(groups)
    return torch.cat([part @ weight[e].T for e, part in enumerate(parts)])


def _activate(kind: str, h: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    if kind == "gelu":
        return F.gelu(h, approximate="tanh")
    if kind == "relu2":
        return F.relu(h).square()
    return F.silu(h) * gate


class GroupedExperts(nn.Module):
    """The routed experts, weights stacked ``[num_experts, out, in]`` (per expert like
    ``nn.Linear.weight``): w1 (and w3 for swiglu) ``[E, hidden, dim]``, w2 ``[E, dim, hidden]``.
    No biases: a grouped GEMM carries none."""

    use_grouped_mm: bool | None = None
    """None: ``F.grouped_mm`` where ``grouped_mm_supported``, else a loop over experts;
    True/False forces one path (True fails where the kernel refuses)."""

    def __init__(self, num_experts: int, dim: int, hidden: int, activation: str):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim)) if activation == "swiglu" else None

    def forward(self, x: torch.Tensor, counts: torch.Tensor, host_counts: list[int] | None = None) -> torch.Tensor:
        """``x`` (N, dim) sorted by expert with ``counts`` (num_experts,) rows each → (N, dim).
        ``host_counts``: ``counts`` already on the host, where the caller has them (expert
        parallel), for the loop over experts."""
        # Under expert parallel the weights are DTensors sharded over experts: compute on this
        # rank's experts (``counts`` then holds only theirs; see ``parallel.expert``).
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        grouped = self.use_grouped_mm
        if grouped is None:
            grouped = grouped_mm_supported(x, w1, w2)
        if grouped:  # nothing read on the host
            groups = torch.cumsum(counts, dim=0, dtype=torch.int32)  # end row of each expert's group
        else:  # the loop's split sizes: at most one host read (a sync) for the three projections
            groups = host_counts if host_counts is not None else counts.tolist()
        h = grouped_linear(x, w1, groups, grouped)
        gate = grouped_linear(x, w3, groups, grouped) if w3 is not None else None
        return grouped_linear(_activate(self.activation, h, gate), w2, groups, grouped)


def _local(weight: torch.Tensor | None) -> torch.Tensor | None:
    return weight.to_local() if isinstance(weight, DTensor) else weight


class SharedExperts(nn.Module):
    """``n`` always-on experts of width ``hidden``, as one feed-forward of width ``n · hidden``
    (the same function: the activation is element-wise, so the n outputs simply add up)."""

    def __init__(self, n: int, dim: int, hidden: int, activation: str):
        super().__init__()
        self.activation = activation
        self.w1 = nn.Linear(dim, n * hidden, bias=False)
        self.w2 = nn.Linear(n * hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, n * hidden, bias=False) if activation == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w3(x) if self.w3 is not None else None
        return self.w2(_activate(self.activation, self.w1(x), gate))


# ---- token dispatch -------------------------------------------------------------------------

def sort_by_expert(expert_idx: torch.Tensor, num_experts: int, capacity: int | None = None):
    """The (token, slot) assignments of ``expert_idx`` (T, k) sorted by expert (stable: token
    order within an expert).

    Returns ``order`` (indices into the flattened (T·k) assignments, dropped ones left out),
    ``counts`` (num_experts,) the kept assignments per expert, and ``routed`` (num_experts,)
    the assignments per expert before any drop. With ``capacity`` an expert keeps its first
    ``capacity`` assignments.
    """
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # a scatter-add rather than bincount: same counts, but a static output shape that
    # torch.compile traces without a graph break
    routed = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    if capacity is None:
        return order, routed, routed
    start = torch.cumsum(routed, 0) - routed  # first sorted position of each expert
    rank = torch.arange(flat.numel(), device=flat.device) - start[flat[order]]
    return order[rank < capacity], routed.clamp(max=capacity), routed


def local_dispatch(x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                   experts: GroupedExperts) -> torch.Tensor:
    """All experts on this rank: gather the tokens in ``order``, run the experts, scale each row
    by its router weight and add it back to its token. ``x`` (T, dim), ``weights`` (T, k)."""
    token = order // weights.size(-1)
    y = experts(x[token], counts)
    y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    return x.new_zeros(x.shape).index_add(0, token, y)


# ---- the layer --------------------------------------------------------------------------------

class MoE(nn.Module):
    """Router + routed experts (+ shared experts). ``forward`` maps (B, T, dim) → (B, T, dim).

    After a forward: ``last_load`` (tokens routed to each expert), ``aux_loss`` (the weighted
    sum of the enabled auxiliary losses, with gradient; None when all are off), ``balance_loss``
    / ``z_loss`` (unweighted, detached; None when off) and ``dropped_tokens`` (assignments
    dropped by the capacity; None when dropless). ``metrics()`` summarises them.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        c = self.config = config
        self.router = nn.Linear(c.dim, c.num_experts, bias=False)
        self.experts = GroupedExperts(c.num_experts, c.dim, c.hidden, c.activation)
        self.shared = SharedExperts(c.shared_experts, c.dim, c.hidden, c.activation) if c.shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(c.num_experts, dtype=torch.float32))
        self.dispatch = local_dispatch  # replaceable: expert parallel swaps in an all-to-all version
        self._pending_load: torch.Tensor | None = None
        self.last_load = self.step_load = None
        self.aux_loss = self.balance_loss = self.z_loss = self.dropped_tokens = None

    @torch.no_grad()
    def init_weights(self, std: float, resid_std: float, prefix: str = "") -> None:
        """Expert weights N(0, std), the output projection N(0, resid_std) (it writes into the
        residual stream, like the dense MLP's w2); bias and counts zero. The router and shared
        experts are ``nn.Linear``s: the GPT's loop initialises them. Each stacked weight is drawn
        whole from its own generator (``param_init``; ``prefix``: this layer's name in the model),
        so an expert's values do not depend on which expert-parallel rank holds it."""
        at = f"{prefix}.experts." if prefix else "experts."
        param_init.normal_(self.experts.w1, at + "w1", std=std)
        param_init.normal_(self.experts.w2, at + "w2", std=resid_std)
        if self.experts.w3 is not None:
            param_init.normal_(self.experts.w3, at + "w3", std=std)
        self.expert_bias.zero_()
        self._pending_load = None

    def route(self, x: torch.Tensor):
        """Tokens (N, dim) → ``(expert_idx (N, k), weights (N, k), scores (N, E), logits (N, E))``.
        The router runs in fp32; the balancing bias only decides ``expert_idx``."""
        logits = F.linear(x.float(), self.router.weight.float())
        scores = logits.softmax(-1) if self.config.score == "softmax" else logits.sigmoid()
        expert_idx = (scores.detach() + self.expert_bias).topk(self.config.top_k, dim=-1).indices
        weights = scores.gather(-1, expert_idx)
        if self.config.score == "sigmoid":
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return expert_idx, weights, scores, logits

    def capacity(self, num_tokens: int) -> int | None:
        c = self.config
        if c.capacity_factor is None:
            return None
        return math.ceil(c.capacity_factor * num_tokens * c.top_k / c.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        flat = x.reshape(-1, c.dim)
        expert_idx, weights, scores, logits = self.route(flat)
        order, counts, routed = sort_by_expert(expert_idx, c.num_experts, self.capacity(flat.size(0)))
        out = self.dispatch(flat, weights, order, counts, self.experts)
        if self.shared is not None:
            out = out + self.shared(flat)
        self._record(x, expert_idx, scores, logits, counts, routed)
        return out.view(x.shape)

    def _record(self, x, expert_idx, scores, logits, counts, routed) -> None:
        c = self.config
        self.last_load = routed.detach()
        if self.training:  # counted for the balancing bias (not in eval / validation forwards)
            pending = self._pending_load
            self._pending_load = routed.detach().clone() if pending is None else pending + routed.detach()
        self.dropped_tokens = (routed - counts).sum().detach() if c.capacity_factor is not None else None
        losses = []
        self.balance_loss = self.z_loss = None
        if c.aux_loss_coef > 0:
            seqs = x.size(0) if x.dim() == 3 else 1
            loss = sequence_balance_loss(scores.view(seqs, -1, c.num_experts),
                                         expert_idx.view(seqs, -1, c.top_k), c.top_k)
            self.balance_loss = loss.detach()
            losses.append(c.aux_loss_coef * loss)
        if c.z_loss_coef > 0:
            loss = torch.logsumexp(logits, dim=-1).square().mean()
            self.z_loss = loss.detach()
            losses.append(c.z_loss_coef * loss)
        self.aux_loss = sum(losses) if losses else None

    def update_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """One balancing step; see ``update_moe_biases``."""
        update_moe_biases([self], group)

    def metrics(self) -> dict[str, torch.Tensor]:
        """Per-layer numbers after a forward: ``tokens_per_expert`` and ``max_load_ratio``
        (max / mean) of the last optimizer step's all-reduced load when ``update_bias`` has run,
        else of the last forward; ``bias_norm``; the losses and ``dropped_tokens`` when on."""
        load = self.step_load if self.step_load is not None else self.last_load
        out = {"bias_norm": self.expert_bias.norm()}
        if load is not None:
            out["tokens_per_expert"] = load
            out["max_load_ratio"] = load.max() / load.float().mean().clamp(min=1e-9)
        for name in ("balance_loss", "z_loss", "dropped_tokens"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def sequence_balance_loss(scores: torch.Tensor, expert_idx: torch.Tensor, top_k: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (eqs. 17-20), before its weight:
    per sequence ``sum_i f_i · P_i`` with ``f_i = E / (k·T) · #{t: i chosen for t}`` and ``P_i``
    the mean over the sequence of the scores normalised per token; averaged over sequences.
    ``scores`` (S, T, E), ``expert_idx`` (S, T, k)."""
    S, T, E = scores.shape
    chosen = torch.zeros_like(scores).scatter_(-1, expert_idx, 1.0)
    f = chosen.sum(1) * (E / (top_k * T))
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return (f * p).sum(-1).mean()


@torch.no_grad()
def update_moe_biases(layers: Iterable[MoE], group: dist.ProcessGroup | None = None) -> None:
    """After an optimizer step: each layer's bias += ``speed · sign(mean_load - load)``, with the
    load counted over the forward passes since the last call (all micro-batches of the step) and
    summed over ``group`` (None: the default process group) when torch.distributed is
    initialized, in one all-reduce for all layers, so every rank keeps the same bias. Every
    rank of ``group`` must call it with the same layers. Counts that all scale alike (e.g. a
    forward recomputed by activation checkpointing) do not change the sign, hence the update."""
    layers = list(layers)
    if not layers:
        return
    loads = []
    for layer in layers:
        pending = layer._pending_load
        loads.append(pending if pending is not None else torch.zeros_like(layer.expert_bias, dtype=torch.long))
    device = layers[0].expert_bias.device
    total = torch.cat([load.to(device=device, dtype=torch.float32) for load in loads])
    comm.all_reduce(total, group=group)
    for layer, load in zip(layers, total.split([len(x) for x in loads])):
        layer.step_load = load
        layer._pending_load = None
        speed = layer.config.bias_update_speed
        # No "was anything routed?" test: it would read the load on the host (a sync), and an
        # all-zero load moves nothing anyway (sign(0) = 0).
        if speed > 0:
            step = speed * torch.sign(load.mean() - load)
            layer.expert_bias.copy_((layer.expert_bias.float() + step).to(layer.expert_bias.dtype))


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """The MoE layers of a model, keyed by their block index (the first integer in the module's
    name, ``blocks.3.mlp`` → 3; wrappers such as FSDP, checkpointing or compile keep it)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            index = next((int(p) for p in name.split(".") if p.isdigit()), len(found))
            found[index] = module
    return found


def active_params(layer: MoE) -> int:
    """Parameters a token passes through: the router, its ``top_k`` routed experts, the shared
    experts (the balancing bias is a buffer, not a parameter)."""
    e = layer.experts
    per_expert = sum(math.prod(w.shape[1:]) for w in (e.w1, e.w2, e.w3) if w is not None)
    total = sum(p.numel() for p in layer.parameters())
    return total - (layer.config.num_experts - layer.config.top_k) * per_expert
