"""Expert parallel: each rank of the ``ep`` mesh holds ``num_experts / ep`` of every MoE layer's
routed experts, and tokens travel to their experts' ranks and back by all-to-all.

Torch-native pieces only: the experts' stacked weights become DTensors sharded on dim 0 (the
expert dimension) over the ``ep`` mesh (``distribute_tensor``), so checkpoints see full
``[num_experts, ...]`` tensors and reshard to any ``ep``; tokens move with the functional
``all_to_all_single``, which carries autograd (its backward is the reverse all-to-all). FSDP
then shards each expert shard over the remaining data-parallel ranks (``efsdp``), see
``parallel.recipe``.

The dispatch, per MoE layer and micro-batch (replacing ``moe.local_dispatch``):

1. routing and the sort by expert happen locally, as without EP: assignments are ordered by
   expert, hence by the rank that holds the expert;
2. one all-to-all of the per-expert counts tells every rank how many rows it will receive from
   each peer for each of its experts (the split sizes must be known on the host: one copy of
   all the layer's sizes, its one sync);
3. all-to-all of the token rows; the received rows (grouped by source rank, then expert) are
   regrouped by expert, the local experts run as one grouped GEMM, the rows go back to source
   order and return by the reverse all-to-all;
4. the router weights scale the returned rows and they are added into their tokens, as locally.

Gradients: an expert's weight gradient sums the contributions of the tokens of every ep rank,
which FSDP then averages over the ``efsdp`` ranks only; ``expert_grad_divide_factor`` restores
the data-parallel mean the dense parameters get.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_disttrain import comm
from lightning_disttrain.models.moe import MoE, GroupedExperts

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def check_ep(ep: int, layers: list[MoE], what: str = "the model") -> None:
    """``ep`` against the MoE layers; a ``ValueError`` naming the fix, before any collective."""
    if ep <= 1:
        return
    if not layers:
        raise ValueError(f"ep={ep} but {what} has no mixture-of-experts layers; set ep=1, or give the model "
                         f"MoE blocks (e.g. GPTConfig.moe_num_experts >= ep)")
    for layer in layers:
        n = layer.config.num_experts
        if n % ep:
            raise ValueError(f"ep={ep} does not divide num_experts={n}; every expert-parallel rank holds the same "
                             f"number of experts, so choose ep among the divisors of {n}")


def shard_experts(layers: list[MoE], ep_mesh: DeviceMesh) -> None:
    """Shard every layer's routed experts over ``ep_mesh`` (dim 0) and route its tokens there."""
    check_ep(ep_mesh.size(), layers)
    for layer in layers:
        experts = layer.experts
        for name in EXPERT_WEIGHTS:
            weight = getattr(experts, name)
            if weight is None or isinstance(weight, DTensor):
                continue
            # Every rank holds the same full weights here (the strategy seeded or broadcast them),
            # so each keeps its slice without communication (meta tensors stay meta).
            sharded = distribute_tensor(weight.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
        experts.expert_parallel = True  # FSDP makes it a unit of its own (parallel.fsdp.apply_fsdp)
        layer.dispatch = partial(ep_dispatch, mesh=ep_mesh)
        layer.ep_mesh = ep_mesh


def ep_dispatch(x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                experts: GroupedExperts, *, mesh: DeviceMesh) -> torch.Tensor:
    """``moe.local_dispatch`` with the experts spread over ``mesh``: same arguments, same result."""
    ep = mesh.size()
    num_experts = counts.numel()
    local = num_experts // ep
    token = order // weights.size(-1)
    rows = x[token]  # sorted by expert, so by destination rank
    # received[r, e]: rows rank r sends to this rank's local expert e
    received = comm.all_to_all_single(counts, None, None, mesh).view(ep, local)
    # Every size the host needs, in one copy (the layer's one sync): the rows sent to and received
    # from each rank (the all-to-all's splits) and the rows of each local expert (its loop).
    sizes = torch.cat([counts.view(ep, local).sum(1), received.sum(1), received.sum(0)]).tolist()
    send_splits, recv_splits, expert_rows = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
    got = comm.all_to_all_single(rows, recv_splits, send_splits, mesh)
    # regroup (source rank, expert) -> (expert, source rank) for one grouped GEMM over local experts;
    # with its output size known, repeat_interleave needs no sync of its own
    segment = torch.repeat_interleave(torch.arange(ep * local, device=got.device), received.reshape(-1),
                                      output_size=sum(recv_splits))
    by_expert = torch.argsort((segment % local) * ep + segment // local, stable=True)
    out = experts(got[by_expert], received.sum(0), expert_rows)
    back = torch.empty_like(by_expert)
    back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    returned = comm.all_to_all_single(out[back], send_splits, recv_splits, mesh)
    returned = returned * weights.reshape(-1)[order].unsqueeze(-1).to(returned.dtype)
    return x.new_zeros(x.shape).index_add(0, token, returned)
