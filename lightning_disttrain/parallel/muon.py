"""Muon under FSDP2 / HSDP: each matrix orthogonalised once, on one owner rank of its shard group.

``torch.optim.Muon`` applied to FSDP2's DTensor parameters runs its Newton-Schulz iteration on
the sharded momentum as DTensor math: DTensor redistributes inside every matmul (364 collectives
per step on the tiny GPT over 2 ranks, issue 41), every rank computes every matrix, and the bf16
iteration on sharded operands rounds differently from one process. ``ShardedMuon`` instead:

1. updates the momentum on each rank's shard (elementwise, so exactly as on the full matrix);
2. gives each matrix one owner rank of the group that shards it, the owners spread by the
   iteration's cost (largest first, to the least loaded rank; the same plan on every rank);
3. sends every shard of the Nesterov update to its matrix's owner: one all-to-all per bucket
   (``comm.all_to_all_packed``), in bf16, the dtype torch's iteration rounds its input to first
   (``ns_dtype``: float32 runs the iteration and the exchanges in fp32 instead);
4. the owner runs the same Newton-Schulz iteration as torch (``newton_schulz``: torch's
   operations, in torch's order) on the whole matrix, and sends each rank its rows of the result:
   the second all-to-all of the bucket;
5. each rank applies weight decay and the update to its shard, with the learning rate adjusted
   for the full matrix's shape.

So the update equals ``torch.optim.Muon`` on the unsharded matrices on one process, given the same
gradients (bitwise on one machine: tests/parallel/test_muon_owner.py), with 2 collectives per bucket
(``bucket_numel`` elements of full matrices; one bucket by default) and 1/ranks of the iteration's
work per rank. Uneven shards (torch.chunk's rows per rank, empty ones included) travel as they are.

Layouts: plain tensors (one process, DDP) and DTensors whose placements are ``Replicate`` except at
most one ``Shard(0)`` (FSDP2, ZeRO-2/3; HSDP: ``(Replicate, Shard(0))``). Under HSDP the owners
are spread over every (replica, shard rank) pair, so the iteration's work is split over all the
data-parallel ranks, not repeated per replica: each replica's shard group runs the two
all-to-alls for its own matrices only, and a third collective, one all-to-all over the replica
group (the ranks that hold the same rows), gives every replica this rank's rows of the others'
results: 3 collectives per bucket under HSDP, 2 under FSDP2. Anything else (tensor
parallel: a ``Shard(1)``, two sharded mesh dimensions, ``_StridedShard``; ``Partial``) is refused
at construction by ``sharded_layout_problem``; ``optim.build_optimizer`` then keeps torch's
DTensor path, which is the whole-matrix iteration too, only with per-matmul collectives.

The state (``momentum_buffer``, a DTensor like the gradient) and the groups are torch's Muon's:
the class is a ``torch.optim.Muon``, checkpoints (DCP) hold the same keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_disttrain import comm

NS_DTYPE = torch.bfloat16  # torch.optim.Muon's iteration rounds its input to bf16 first


def newton_schulz(update: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                  eps: float, dtype: torch.dtype = NS_DTYPE) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Muon (Keller Jordan's), operation for operation as
    ``torch.optim.Muon`` runs it (torch 2.9-2.13), so that in bf16 it gives the same bits on the same
    matrix (tests/parallel/test_muon_owner.py), with the iteration's dtype a parameter (torch's is
    bf16 only; fp32 is what the parity tests against one process use). Returned in ``dtype``."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if update.dim() != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate adjustment for a matrix of ``shape``."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def shard_rows(rows: int, ranks: int) -> list[int]:
    """Rows of each rank under ``Shard(0)`` (torch.chunk's split, as FSDP2 and DTensor: ceil-sized
    pieces, the last ones short or empty)."""
    piece = -(-rows // ranks) if rows else 0
    return [max(0, min(rows, (r + 1) * piece) - r * piece) for r in range(ranks)]


def sharded_layout_problem(param: torch.Tensor) -> str | None:
    """Why ``ShardedMuon`` cannot take ``param`` (None: it can)."""
    if param.dim() != 2:
        return f"Muon takes 2-D matrices; this parameter has shape {tuple(param.shape)}"
    if not isinstance(param, DTensor):
        return None
    placements = param.placements
    shards = [i for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    if len(shards) > 1 or any(type(placements[i]) is not Shard or placements[i].dim != 0 for i in shards):
        return (f"placements {tuple(placements)} over mesh dimensions {param.device_mesh.mesh_dim_names}: the "
                "owner-based Muon supports FSDP2 / HSDP's Shard(0) over one mesh dimension (plus replicas), not "
                "tensor parallel (Shard(1) or a second sharded dimension), _StridedShard or Partial yet")
    return None


def _rows_problem(param: torch.Tensor) -> str | None:
    """The shard's rows differ from torch.chunk's (what the exchange assumes on every rank)."""
    dim = _shard_mesh_dim(param)
    if dim is None:
        return None
    pg = param.device_mesh.get_group(dim)
    expected = shard_rows(param.shape[0], comm.world_size(pg))[comm.rank(pg)]
    held = param.to_local().shape[0]
    if held != expected:
        return f"this rank holds {held} of its rows, Shard(0)'s torch.chunk split gives it {expected}"
    return None


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon``, with each sharded matrix orthogonalised once, on an owner rank of its
    shard group (module docstring). ``bucket_numel``: elements of full matrices per exchange (2
    collectives each); None: one bucket per shard group and parameter group. ``ns_dtype``: the
    iteration's dtype (and the exchanges'); torch's is bf16, float32 makes the update
    insensitive to the last bits of the gradient (the fp32 parity tests: a data-parallel gradient
    is summed in another order than one process's, and one bf16 rounding flipped by that moves a
    weight by ~lr * 2^-8)."""

    def __init__(self, params: Iterable, *, bucket_numel: int | None = None, ns_dtype: torch.dtype = NS_DTYPE,
                 **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                problem = sharded_layout_problem(p) or _rows_problem(p)
                if problem:
                    raise ValueError(f"ShardedMuon: a parameter of shape {tuple(p.shape)}: {problem}")
        if bucket_numel is not None and bucket_numel <= 0:
            raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
        self.bucket_numel = bucket_numel
        self.ns_dtype = ns_dtype
        self._plans: dict = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        lr = float(group["lr"])
        wd, momentum, nesterov = group["weight_decay"], group["momentum"], group["nesterov"]
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
        by_group: dict = {}  # (shard process group, replica process group or None) -> [(param, local update)]
        for p in group["params"]:
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if nesterov else buf
            shard_dim = _shard_mesh_dim(p)
            if shard_dim is None:  # the whole matrix is here (one process, DDP, a replicated DTensor)
                _apply(p, newton_schulz(update, *ns), lr, wd, group["adjust_lr_fn"])
                continue
            pg = p.device_mesh.get_group(shard_dim)
            by_group.setdefault((pg, _replica_group(p)), []).append((p, update))
        for (pg, rpg), items in by_group.items():
            ranks, me = comm.world_size(pg), comm.rank(pg)
            replicas = comm.world_size(rpg) if rpg is not None else 1
            replica = comm.rank(rpg) if rpg is not None else 0
            # owners over every (replica, shard rank) pair: replica g // ranks, shard rank g % ranks
            owners = self._owners(pg, [p for p, _ in items], ranks * replicas, ns[1])
            for bucket in self._buckets(items):
                slots = [owners[id(p)] for p, _ in bucket]
                mine = [i for i, g in enumerate(slots) if g // ranks == replica]
                results = self._exchange([bucket[i] for i in mine], [slots[i] % ranks for i in mine], pg, ranks, me,
                                         ns) if mine else []
                updates = dict(zip(mine, results))
                if replicas > 1:  # the other replicas' matrices: this rank's rows of their results
                    updates.update(self._from_replicas(bucket, slots, results, rpg, replicas, replica, ranks, me))
                for i, (p, _) in enumerate(bucket):
                    _apply(p, updates[i], lr, wd, group["adjust_lr_fn"])

    def _owners(self, pg, params: list, ranks: int, ns_steps: int) -> dict[int, int]:
        """Each matrix's owner: by cost (min(m, n)^2 * max(m, n) per iteration), largest first, to
        the least loaded rank; the same on every rank (it depends on shapes and order only)."""
        key = (id(pg), tuple(id(p) for p in params))
        plan = self._plans.get(key)
        if plan is None:
            cost = [min(p.shape) ** 2 * max(p.shape) * ns_steps for p in params]
            load, plan = [0] * ranks, {}
            for i in sorted(range(len(params)), key=lambda i: (-cost[i], i)):
                owner = min(range(ranks), key=lambda r: (load[r], r))
                load[owner] += cost[i]
                plan[id(params[i])] = owner
            self._plans[key] = plan
        return plan

    def _buckets(self, items: list) -> list[list]:
        if self.bucket_numel is None:
            return [items]
        buckets, size = [[]], 0
        for item in items:
            numel = item[0].numel()
            if buckets[-1] and size + numel > self.bucket_numel:
                buckets.append([])
                size = 0
            buckets[-1].append(item)
            size += numel
        return buckets

    def _exchange(self, bucket: list, owners: list[int], pg, ranks: int, me: int, ns) -> list[torch.Tensor]:
        """This rank's rows of each orthogonalised matrix of ``bucket`` (owner ``owners[i]`` of the
        shard group ``pg``): two all-to-alls."""
        device = bucket[0][1].device
        rows = [shard_rows(p.shape[0], ranks) for p, _ in bucket]  # checked against the shards at construction
        # 1. every shard of each matrix to its owner (bucket order within each destination)
        dtype = self.ns_dtype
        sends = [_cat([u.to(dtype) for (_, u), o in zip(bucket, owners) if o == d], dtype, device)
                 for d in range(ranks)]
        mine = [i for i, o in enumerate(owners) if o == me]
        recv = comm.all_to_all_packed(
            sends, [sum(rows[i][s] * bucket[i][0].shape[1] for i in mine) for s in range(ranks)], pg)
        # 2. the owner's iteration on each whole matrix; each rank's rows go back
        offsets = [0] * ranks
        back: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
        for i in mine:
            cols = bucket[i][0].shape[1]
            pieces = []
            for s in range(ranks):
                n = rows[i][s] * cols
                pieces.append(recv[s][offsets[s]:offsets[s] + n].view(rows[i][s], cols))
                offsets[s] += n
            result = newton_schulz(torch.cat(pieces), *ns)
            for d, part in enumerate(result.split(rows[i])):
                back[d].append(part)
        home = comm.all_to_all_packed(
            [_cat(parts, dtype, device) for parts in back],
            [sum(rows[i][me] * bucket[i][0].shape[1] for i, o in enumerate(owners) if o == s) for s in range(ranks)],
            pg)
        # 3. each rank's rows of each result
        offsets, out = [0] * ranks, []
        for i, ((p, _), o) in enumerate(zip(bucket, owners)):
            n = rows[i][me] * p.shape[1]
            out.append(home[o][offsets[o]:offsets[o] + n].view(rows[i][me], p.shape[1]))
            offsets[o] += n
        return out

    def _from_replicas(self, bucket: list, slots: list[int], results: list[torch.Tensor], rpg, replicas: int,
                       replica: int, ranks: int, me: int) -> dict[int, torch.Tensor]:
        """HSDP: each replica orthogonalised its own matrices of ``bucket``; one all-to-all over the
        replica group (the ranks holding the same rows) sends this rank's rows of its replica's
        results to every other replica and receives theirs."""
        dtype, device = self.ns_dtype, bucket[0][1].device
        held = [shard_rows(p.shape[0], ranks)[me] for p, _ in bucket]  # this rank's rows of each matrix
        rows = [n * p.shape[1] for n, (p, _) in zip(held, bucket)]
        of = [[i for i, g in enumerate(slots) if g // ranks == r] for r in range(replicas)]
        mine = _cat(results, dtype, device)
        sends = [mine if r != replica else torch.empty(0, dtype=dtype, device=device) for r in range(replicas)]
        recv = comm.all_to_all_packed(sends, [sum(rows[i] for i in of[r]) if r != replica else 0
                                              for r in range(replicas)], rpg)
        out = {}
        for r in range(replicas):
            if r == replica:
                continue
            offset = 0
            for i in of[r]:
                out[i] = recv[r][offset:offset + rows[i]].view(held[i], bucket[i][0].shape[1])
                offset += rows[i]
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t  # under no_grad: the shard itself (in place works)


def _shard_mesh_dim(p: torch.Tensor) -> int | None:
    if not isinstance(p, DTensor):
        return None
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    return dims[0] if dims else None


def _replica_group(p: torch.Tensor):
    """HSDP: the process group of the mesh dimension over which ``p`` is replicated (the ranks
    holding the same shard), when there is exactly one; None otherwise (FSDP2, one process)."""
    if not isinstance(p, DTensor) or p.device_mesh.ndim < 2:
        return None
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Replicate)]
    return p.device_mesh.get_group(dims[0]) if len(dims) == 1 else None


def _cat(parts: list[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1) for t in parts])


def _apply(p: torch.Tensor, update: torch.Tensor, lr: float, wd: float, adjust_lr_fn) -> None:
    """torch.optim.Muon's update of ``p`` (its local shard) from its orthogonalised ``update``."""
    local = _local(p)
    local.mul_(1 - lr * wd)
    local.add_(update, alpha=-adjusted_lr(lr, adjust_lr_fn, p.shape))
