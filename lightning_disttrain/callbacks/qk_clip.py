"""QK-clip: bound every attention head's largest pre-softmax logit (Kimi K2's MuonClip with Muon).

Muon's updates can let query and key weights grow until some heads' logits explode (the "max
logit" of Kimi K2's report climbs past 1,000 without a clip), the loss spikes, and training
diverges. QK-clip watches the largest logit ``S_h = max scale * q_i . k_j`` of each head ``h``
(causal pairs, every training forward of the step: ``models/max_logit.py``) and, after each
optimizer step, for each head with ``S_h > tau`` rescales that head's query and key projections
(weights and biases) by ``gamma = tau / S_h``, so that the same inputs would give it ``tau``:

- multi-head attention: the head's query rows and key rows by ``sqrt(gamma)`` each;
- grouped-query attention (a key head shared by several query heads): the query rows by
  ``gamma``, the shared keys untouched (the other heads of the group keep their logits).

Heads at or under ``tau`` are left alone. With ``optimizer="muon"`` this is MuonClip; it works with
any optimizer. Models with ``qk_norm`` are refused: the per-head RMSNorm undoes a rescaled
projection (and already bounds the logits by its own weights).

Layouts: each rank records its own heads (under tensor parallel its slice of them, under pipeline
parallel its stage's layers, under context parallel its queries against the whole sequence,
through a ring of the keys); one all-reduce (max) of a ``(n_layer, n_head)`` float32 tensor over
all ranks per optimizer step gives every rank every head's maximum over the step's data, and each
rank rescales the rows it holds (DTensor math on sharded weights: local rows only, no gather). On
the device, no host sync: the maximum is read to the host only at the steps the loggers write,
logged as ``attn/max_logit`` (the step's largest logit before clipping) and ``attn/clipped_heads``.
Not with the fault-tolerant replica groups (their heads would be clipped apart; refused).

Cost when on: one extra ``Q K^T`` per layer per training forward (in row chunks, no gradients;
under context parallel one more ring of the keys), the all-reduce above, and the rescale of the
clipped heads' rows after the step.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from lightning_disttrain import _lightning_compat as compat
from lightning_disttrain import comm
from lightning_disttrain.models.gpt import GPT, CausalSelfAttention, GPTConfig


class QKClip(pl.Callback):
    """Clip each attention head's largest pre-softmax logit to ``tau`` after every optimizer step
    (module docstring). Needs the package's ``GPT`` in the LightningModule (``GPTModule``'s, or one
    of your own).

    Args:
        tau: The bound on every head's largest logit ``scale * q . k`` (Kimi K2: 100). Positive.
    """

    def __init__(self, tau: float = 100.0):
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"QKClip(tau={tau!r}): tau is the bound on every head's largest attention logit and must "
                             f"be a positive number (Kimi K2 used 100)")
        self.tau = float(tau)
        self.max_logit: float | None = None
        """The largest logit (before clipping) of the last step the loggers wrote, on the host."""
        self.clipped_heads: int | None = None
        """How many heads that step clipped."""
        self._attention: list[CausalSelfAttention] = []
        self._shape: tuple[int, int] = (0, 0)
        self._step: tuple[torch.Tensor, torch.Tensor] | None = None  # (max logit, clipped heads) on the device
        self._hooks: list = []
        self._steps_before_batch = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if getattr(trainer.strategy, "fault_tolerance", None) is not None:
            raise ValueError("QKClip does not run with fault_tolerance yet: each replica group would clip its heads "
                             "from its own data's logits and the groups' weights would part; drop QKClip or the "
                             "strategy's fault_tolerance")
        config = getattr(pl_module, "config", None)  # GPTModule's, before configure_model builds the GPT
        if isinstance(config, GPTConfig):
            _check(config)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        config = _the_gpt(pl_module).config  # built by now (configure_model), before any step
        _check(config)
        self._shape = (config.n_layer, config.n_head)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the strategy's setup: under pipeline parallel only this rank's stage's layers are left
        self._attention = [m for m in pl_module.modules() if isinstance(m, CausalSelfAttention)]
        for attn in self._attention:
            attn.track_max_logit, attn.max_logit = True, None
        # the optimizer that steps the query weights (one per rank: each rank's own, its stage's under a
        # pipeline), so the clip and its all-reduce run once per step on every rank alike
        queries = {id(a.wq.weight) for a in self._attention}
        owners = [opt for opt in trainer.optimizers
                  if any(id(p) in queries for group in opt.param_groups for p in group["params"])]
        self._hooks = [opt.register_step_post_hook(self._after_step) for opt in (owners or trainer.optimizers)[:1]]

    def _stop(self) -> None:
        for attn in self._attention:
            attn.track_max_logit, attn.max_logit = False, None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()  # the attention stops recording and the optimizer hook goes

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()  # a fit that raised: no extra Q K^T in the model's later forwards

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._steps_before_batch = trainer.global_step

    @torch.no_grad()
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        maxima = self._gather()
        gamma = torch.where(maxima > self.tau, self.tau / maxima, torch.ones_like(maxima))
        for attn in self._attention:
            clip_heads_(attn, gamma[attn.layer])
            attn.max_logit = None
        self._step = (maxima.max(), (maxima > self.tau).sum())

    def _gather(self) -> torch.Tensor:
        """Every head's largest logit of the step, on every rank: each rank's own heads in place
        (its layers, its tensor-parallel slice of the heads), -inf elsewhere, reduced by max."""
        device = next((a.max_logit.device for a in self._attention if a.max_logit is not None), None)
        if device is None:
            device = next((a.wq.weight.device for a in self._attention), torch.device("cpu"))
        if isinstance(device, torch.device) and device.type == "meta":
            device = torch.device("cpu")
        maxima = torch.full(self._shape, -math.inf, dtype=torch.float32, device=device)
        for attn in self._attention:
            if attn.max_logit is not None:
                local = attn.max_logit.to(device)
                start = _tp_rank(attn.wq.weight) * local.numel()
                maxima[attn.layer, start:start + local.numel()] = local
        return comm.all_reduce(maxima, "max")

    def last_step(self) -> tuple[float, int] | None:
        """The last optimizer step's largest logit (before its clip) and how many heads it clipped,
        read to the host now (on an accelerator: a sync); None before the first step."""
        if self._step is None:
            return None
        return float(self._step[0]), int(self._step[1])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._step is None or trainer.global_step == self._steps_before_batch:
            return  # a micro-batch of gradient accumulation: no step yet
        if not compat.loggers_write_step(trainer, trainer.global_step):
            return  # nothing read to the host at this step
        self.max_logit, self.clipped_heads = self.last_step()
        metrics = {"attn/max_logit": self.max_logit, "attn/clipped_heads": float(self.clipped_heads)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step - 1)  # the row of this step's train/loss


@torch.no_grad()
def clip_heads_(attn: CausalSelfAttention, gamma: torch.Tensor) -> None:
    """Rescale ``attn``'s query and key projections so that head ``h``'s logits scale by
    ``gamma[h]`` (``(n_head,)``, 1 for a head left alone): ``sqrt(gamma)`` on its query and key
    rows under multi-head attention, ``gamma`` on its query rows under grouped-query attention."""
    if attn.n_kv_head == attn.n_head:
        q_scale = k_scale = gamma.sqrt()
    else:
        q_scale, k_scale = gamma, None
    _scale_rows_(attn.wq, q_scale.repeat_interleave(attn.head_dim))
    if k_scale is not None:
        _scale_rows_(attn.wk, k_scale.repeat_interleave(attn.head_dim))


def _scale_rows_(linear: torch.nn.Linear, row_scale: torch.Tensor) -> None:
    """Multiply each row of ``linear``'s weight (and bias) by ``row_scale``, on each rank's own rows:
    a sharded weight's local rows of the scale come from ``distribute_tensor`` with its placements
    (no communication; a split of the columns does not change a row's scale), applied to the local
    shard wherever it lives (host memory under CPU offload)."""
    for param, shape in ((linear.weight, (-1, 1)), (linear.bias, (-1,))):
        if param is None:
            continue
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            rows = [Replicate() if not isinstance(p, Replicate) and getattr(p, "dim", None) == 1 else p
                    for p in param.placements]
            scale = distribute_tensor(row_scale.view(shape).to(mesh.device_type), mesh, rows,
                                      src_data_rank=None).to_local()
            local = param.to_local()
            local.mul_(scale.to(local.device, local.dtype))
        else:
            param.mul_(row_scale.view(shape).to(param.device, param.dtype))


def _tp_rank(weight: torch.Tensor) -> int:
    """This rank's place among the tensor-parallel ranks that split the heads (0 without TP)."""
    if isinstance(weight, DTensor) and "tp" in (weight.device_mesh.mesh_dim_names or ()):
        return weight.device_mesh.get_local_rank("tp")
    return 0


def _check(config: GPTConfig) -> None:
    if config.qk_norm:
        raise ValueError("QKClip rescales the query and key projections, which the model's qk_norm (an RMSNorm of "
                         "each head's queries and keys) undoes: use qk_norm=False with QKClip, or qk_norm without it")


def _the_gpt(pl_module: pl.LightningModule) -> GPT:
    gpts = [m for m in pl_module.modules() if isinstance(m, GPT)]
    if len(gpts) != 1:
        raise ValueError(f"QKClip clips the attention of lightning_disttrain's GPT; this LightningModule holds "
                         f"{len(gpts)} of them: use it with GPTModule or a module holding one GPT")
    return gpts[0]
