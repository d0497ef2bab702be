"""Optimizers and learning-rate schedules for GPT training.

- AdamW with weight decay on 2-D weights only (norms, biases: none), fused (torch's fused kernels
  instead of foreach's op per step of the update) on CUDA and on CPU alike.
- Hybrid Muon: ``torch.optim.Muon``'s update on the 2-D hidden matrices of the blocks (under FSDP2 /
  HSDP / tensor parallel ``parallel.muon.ShardedMuon``: each matrix orthogonalised once, whole, on an
  owner rank; the routed experts' stacks per expert matrix, where each lives:
  ``parallel.expert_muon.ExpertMuon``), AdamW on the embedding, the head, norms and biases (Muon
  is defined for hidden matrices only; Keller Jordan's recipe). Lightning's automatic optimization takes one optimizer,
  so the two travel together as one ``HybridOptimizer``; checkpointing code unpacks ``.optimizers``.
- Schedules as multipliers of each group's base LR, stepped once per optimizer step: linear
  warmup then cosine down to ``min_lr_ratio``, or warmup-stable-decay (WSD: hold, then linear
  decay over the final ``decay_fraction`` of training).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
from torch.optim import Optimizer

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain.parallel.expert_muon import ExpertMuon, expert_layout_problem
from lightning_disttrain.parallel.muon import ShardedMuon, closure_loss, sharded_layout_problem

OPTIMIZERS = ("adamw", "muon")
OPTIMIZER_CHANGED = ("the optimizer changed since the checkpoint was saved. A mixture of experts trained with "
                     "optimizer='muon' and saved before 2026-12-04 (its experts' stacks on AdamW) resumes with "
                     "GPTModule(muon_experts=False); otherwise configure the optimizer the checkpoint was saved with")
"""What a resume whose optimizer state does not match the checkpoint's says to do."""
SCHEDULES = ("cosine", "wsd", "constant")


class HybridOptimizer(Optimizer):
    """Several optimizers stepped as one; ``param_groups`` and ``state`` are their union.

    Schedulers see every group (each keeps its own base LR); ``state_dict`` nests the parts.
    """

    def __init__(self, optimizers: list[Optimizer]):
        self.optimizers = list(optimizers)
        # Deliberately not calling Optimizer.__init__: the parts own the groups and the state.
        self.defaults = {}
        torch_compat.init_optimizer_hooks(self)  # the hook dicts Optimizer.__init__ would create

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        merged: dict = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged

    @Optimizer.profile_hook_step  # step pre/post hooks (global and registered) run, as for torch's optimizers
    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = closure_loss(closure)
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def _no_state_dict_hooks(self, *args, **kwargs):
        raise NotImplementedError("HybridOptimizer's state_dict nests its parts' own; register state_dict hooks on "
                                  "the parts (HybridOptimizer.optimizers), each a torch optimizer")

    register_state_dict_pre_hook = register_state_dict_post_hook = _no_state_dict_hooks
    register_load_state_dict_pre_hook = register_load_state_dict_post_hook = _no_state_dict_hooks

    def load_state_dict(self, state_dict: dict) -> None:
        parts = state_dict["optimizers"]
        if len(parts) != len(self.optimizers):
            raise ValueError(f"checkpoint holds {len(parts)} optimizers, this run has {len(self.optimizers)} "
                             f"({self!r}): {OPTIMIZER_CHANGED}")
        for opt, sd in zip(self.optimizers, parts):
            opt.load_state_dict(sd)

    def __repr__(self) -> str:
        return f"HybridOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"


def _split_decay(named: Iterable[tuple[str, nn.Parameter]]) -> tuple[list, list]:
    decay, no_decay = [], []
    for _, p in named:
        (decay if p.dim() >= 2 else no_decay).append(p)
    return decay, no_decay


_FUSED_DEVICES = frozenset({"cuda", "cpu"})


def _fused_ok(params: list[torch.Tensor]) -> bool:
    """Fused AdamW wants every parameter on one device type it has a kernel for (DTensors qualify).
    CPU too: there, as on CUDA, it is the cheapest step, and with the parameters as DTensors (FSDP2,
    TP) its first step leaves DTensor fewer ops to plan the sharding of, each over every parameter
    (tiny GPT, CPU per rank: FSDP2 x2 122 ms against foreach's 467, HSDP 2x2 243 against 656;
    later steps 8.5 against 19.7 ms: docs/benchmarks.md section 26). The tests, which run on CPU,
    so exercise the optimizer a GPU run uses."""
    kinds = {p.device.type for p in params}
    return len(kinds) == 1 and kinds <= _FUSED_DEVICES


def build_adamw(named: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float,
                betas: tuple[float, float], eps: float) -> torch.optim.AdamW:
    decay, no_decay = _split_decay(named)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    fused = _fused_ok([p for g in groups for p in g["params"]])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None,
                             foreach=None if fused else True)


def build_optimizer(model: nn.Module, name: str = "adamw", *, lr: float = 6e-4, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, muon_lr: float = 0.02,
                    muon_momentum: float = 0.95, hidden_matrices: Callable[[str, nn.Parameter], bool] | None = None,
                    muon_experts: bool = True) -> Optimizer:
    """The optimizer ``GPTModule`` trains with.

    ``hidden_matrices(name, param)`` picks Muon's parameters; by default the 2-D weights inside
    ``blocks`` and the routed experts' ``(experts, rows, cols)`` stacks (not the embedding, head,
    norms or biases); ``muon_experts=False`` leaves the stacks to AdamW. Parts, in order: the
    matrices' Muon, the experts' (``ExpertMuon``, with a mixture of experts), AdamW.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; use one of {OPTIMIZERS}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "adamw":
        return build_adamw(named, lr, weight_decay, tuple(betas), eps)
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(f"optimizer='muon' needs torch.optim.Muon (torch>=2.9); this is torch {torch.__version__}")
    is_hidden = hidden_matrices or (lambda n, p: p.dim() in (2, 3) and ".blocks." in f".{n}")
    chosen = [(n, p) for n, p in named if is_hidden(n, p)]
    wrong = [(n, tuple(p.shape)) for n, p in chosen if p.dim() not in (2, 3)]
    if wrong:
        raise ValueError(f"optimizer='muon': hidden_matrices chose {len(wrong)} parameters that are not matrices (first "
                         f"{wrong[0][0]!r} of shape {wrong[0][1]}): Muon takes 2-D matrices and (experts, rows, cols) "
                         f"stacks of them; return False for the others (they train with AdamW)")
    # adjust_lr_fn="match_rms_adamw" scales Muon's update to AdamW's RMS so one weight decay fits both.
    muon_kwargs = dict(lr=muon_lr, weight_decay=weight_decay, momentum=muon_momentum, adjust_lr_fn="match_rms_adamw")
    experts = [(n, p) for n, p in chosen if p.dim() == 3] if muon_experts else []
    refused = {n: why for n, p in experts if (why := expert_layout_problem(p))}
    if refused:
        name, why = next(iter(refused.items()))
        warnings.warn(f"optimizer='muon': the routed experts' stacks train with AdamW ({len(refused)} stacks; first "
                      f"{name!r}: {why})", stacklevel=2)
        experts = []
    hidden = [(n, p) for n, p in chosen if p.dim() == 2]
    taken = {id(p) for _, p in hidden + experts}
    rest = [(n, p) for n, p in named if id(p) not in taken]
    if not hidden:
        raise ValueError("optimizer='muon' found no 2-D hidden matrices; pass hidden_matrices= to choose them")
    problems = {n: sharded_layout_problem(p) for n, p in hidden}
    unsupported = {n: why for n, why in problems.items() if why}
    if not unsupported:  # plain tensors, FSDP2, HSDP, TP and their products: each matrix once, on its owner rank
        muon: Optimizer = ShardedMuon([p for _, p in hidden], **muon_kwargs)
    else:
        # A layout the owner path does not take (Partial): torch's Muon on the DTensors, whose
        # Newton-Schulz is DTensor math on the whole matrix (collectives inside each matmul).
        name, why = next(iter(unsupported.items()))
        warnings.warn(f"optimizer='muon': {len(unsupported)} matrices (first {name!r}: {why}); using torch.optim.Muon "
                      "on the DTensors for all of them (whole-matrix Newton-Schulz through DTensor's collectives, "
                      "every rank computing every matrix)", stacklevel=2)
        muon = torch.optim.Muon([p for _, p in hidden], **muon_kwargs)
    parts: list[Optimizer] = [muon]
    if experts:  # each expert's matrix on its own, on the rank that holds it
        parts.append(ExpertMuon([p for _, p in experts], **muon_kwargs))
    if rest:
        parts.append(build_adamw(rest, lr, weight_decay, tuple(betas), eps))
    return HybridOptimizer(parts)


def lr_multiplier(step: int, *, schedule: str, warmup_steps: int, total_steps: int,
                  min_lr_ratio: float = 0.1, decay_fraction: float = 0.2) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, int(round(decay_fraction * total_steps)))
    decay_start = max(warmup_steps, total_steps - decay_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    return 1.0 - (1.0 - min_lr_ratio) * progress


def build_scheduler(optimizer: Optimizer, **kwargs) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, **kwargs))
