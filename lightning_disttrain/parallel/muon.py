"""Muon under FSDP2 / HSDP / tensor parallel: each matrix orthogonalised once, whole, on one owner
rank among those holding its pieces.

``torch.optim.Muon`` applied to DTensor parameters runs its Newton-Schulz iteration on the sharded
momentum as DTensor math: DTensor redistributes inside every matmul (364 collectives per step on
the tiny GPT under FSDP2 over 2 ranks, issue 41), every rank computes every matrix, and the bf16
iteration on sharded operands rounds differently from one process. ``ShardedMuon`` instead:

1. updates the momentum on each rank's piece (elementwise, so exactly as on the full matrix);
2. gives each matrix one owner among the ranks that hold its pieces (every coordinate of the
   mesh dimensions that split it, and every replica), the owners spread by the iteration's cost
   (largest first, to the least loaded rank; the same plan on every rank);
3. sends every piece of the Nesterov update to its matrix's owner, in bf16, the dtype torch's
   iteration rounds its input to first (``ns_dtype``: float32 runs the iteration and the
   exchanges in fp32 instead): one all-to-all (``comm.all_to_all_packed``) per bucket and mesh
   dimension that splits the matrices, over that dimension's process group, the last dimension
   first (under dp_shard x tp: over tp to the rank at the owner's tp coordinate, then over
   dp_shard to the owner);
4. the owner assembles the whole matrix from the pieces and runs the same Newton-Schulz
   iteration as torch (``newton_schulz``: torch's operations, in torch's order), and the results'
   pieces go back the same way (dp_shard, then tp): one all-to-all per dimension again;
5. each rank applies weight decay and the update to its piece, with the learning rate adjusted
   for the full matrix's shape.

So the update equals ``torch.optim.Muon`` on the unsharded matrices on one process, given the same
gradients (bitwise on one machine: tests/parallel/test_muon_owner.py), and each rank runs about
1/ranks of the iteration's work. Collectives per bucket (``bucket_numel`` elements of full
matrices; one bucket by default): 2 per mesh dimension of more than one rank that splits the
matrices, plus 1 over a replica group:

- FSDP2 / ZeRO-2 (``Shard(0)``), tensor parallel alone (``Shard(0)`` column-parallel, ``Shard(1)``
  row-parallel): 2;
- HSDP (``(Replicate, Shard(0))``), HSDP over tp alone (``(Replicate, Shard(0 or 1))``): 3;
- FSDP2 x TP (dp_shard x tp: ``(_StridedShard(0), Shard(0))`` column-parallel, ``(Shard(0),
  Shard(1))`` row-parallel): 4; HSDP x TP: 5 (FSDP2 x TP's exchanges and HSDP's; the tests, on
  up to 4 ranks, run each of the two but not their product).

Under HSDP the owners are spread over every (replica, shard coordinate) pair, so the work is split
over all the data-parallel ranks, not repeated per replica: each replica's ranks run the
exchanges above for its own matrices only, and one all-to-all over the replica group (the ranks
that hold the same pieces) gives every replica this rank's piece of the others' results.

Layouts: plain tensors (one process, DDP) and DTensors whose placements are ``Replicate``,
``Shard`` or FSDP2-over-TP's ``_StridedShard``, on any mesh dimensions. Every rank's piece is the
product of a set of rows and a set of columns (``Pieces``), computed from the placements with
torch's own split (``piece_indices``; the plan, made at construction, costs no communication)
and checked, for this rank's piece, against ``distribute_tensor`` and the shard the rank holds.
Uneven and empty pieces travel as they are. ``Partial`` (a pending reduction) is refused at
construction by ``sharded_layout_problem``; ``optim.build_optimizer`` then keeps torch's DTensor
path, which is the whole-matrix iteration too, only with per-matmul collectives.

The state (``momentum_buffer``, a DTensor like the gradient) and the groups are torch's Muon's:
the class is a ``torch.optim.Muon``, checkpoints (DCP) hold the same keys.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_disttrain import _torch_compat as torch_compat
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
    x = update.to(dtype, copy=True)  # never the caller's tensor (torch's momentum buffer without Nesterov)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def closure_loss(closure) -> torch.Tensor | None:
    """An optimizer step's ``closure()`` under grad mode (the step runs under ``no_grad``), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def momentum_update(state: dict, grad: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """torch.optim.Muon's momentum step on this rank's piece (elementwise, so as on the whole
    matrix): the ``momentum_buffer`` in ``state`` (created like ``grad``) moves towards the gradient;
    returns the update to orthogonalise (Nesterov's, or the buffer itself)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    local, buf = _local(grad), _local(state["momentum_buffer"])
    buf.lerp_(local, 1 - momentum)
    return local.lerp(buf, momentum) if nesterov else buf


def newton_schulz_cost(shape: tuple[int, int], ns_steps: int = 5) -> int:
    """The iteration's work on a matrix of ``shape``, the unit owners are balanced in:
    min(m, n)^2 x max(m, n) per iteration (its FLOPs are 4x that plus 2 min^3)."""
    return min(shape) ** 2 * max(shape) * ns_steps


def owner_plan(shapes: list[tuple[int, int]], ranks: int, ns_steps: int = 5) -> list[int]:
    """The owner rank (0..ranks-1) of each matrix: by cost (``newton_schulz_cost``), largest first,
    to the least loaded rank, ties to the lower index. The busiest rank's load is at most the mean
    plus the largest matrix's cost; with fewer matrices than ranks some ranks own none. Pure
    arithmetic (the planner prices the step with it)."""
    cost = [newton_schulz_cost(s, ns_steps) for s in shapes]
    heap = [(0, r) for r in range(ranks)]  # (load, rank): the least loaded first, ties to the lower rank
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + cost[i], rank))
    return owners


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate adjustment for a matrix of ``shape``."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class Pieces:
    """How a matrix is spread over the ranks that shard it: for every coordinate of the mesh
    dimensions that split it (``dims``, of ``sizes`` ranks, each > 1; flat coordinates in mesh
    order, the last dimension fastest), the rows and columns its piece holds (a ``slice`` where they
    are consecutive, else an index tensor). Placements only ever split rows or columns, so a piece
    is the product of the two (``Shard(0)``, ``Shard(1)``, FSDP2-over-TP's ``_StridedShard``)."""

    def __init__(self, shape: tuple[int, int], dims: tuple[int, ...], sizes: tuple[int, ...],
                 indices: list[tuple[list[int], list[int]]], device):
        self.shape, self.dims, self.sizes = tuple(shape), dims, sizes
        self.rows = [_as_index(r, device) for r, _ in indices]
        self.cols = [_as_index(c, device) for _, c in indices]
        self.shapes = [(len(r), len(c)) for r, c in indices]
        self.cum = [0]
        for m, n in self.shapes:
            self.cum.append(self.cum[-1] + m * n)
        # the pieces in flat order are the matrix's rows in order (FSDP2's Shard(0)): no index work
        self.row_major = (all(c == list(range(shape[1])) for r, c in indices if r)
                          and [i for r, _ in indices for i in r] == list(range(shape[0])))

    def numel(self, lo: int, hi: int) -> int:
        """Elements of the pieces of flat coordinates ``lo`` .. ``hi`` - 1."""
        return self.cum[hi] - self.cum[lo]

    def assemble(self, flat: torch.Tensor) -> torch.Tensor:
        """The whole matrix from every piece's elements, concatenated in flat order."""
        if self.row_major:
            return flat.view(self.shape)
        full = flat.new_empty(self.shape)
        for y, (r, c) in enumerate(zip(self.rows, self.cols)):
            full[_index(r, c)] = flat[self.cum[y]:self.cum[y + 1]].view(self.shapes[y])
        return full

    def split(self, full: torch.Tensor) -> torch.Tensor:
        """Every piece of ``full``, flattened and concatenated in flat order (``assemble``'s inverse)."""
        if self.row_major:
            return full.reshape(-1)
        return torch.cat([full[_index(r, c)].reshape(-1) for r, c in zip(self.rows, self.cols)])


def _index(rows, cols) -> tuple:
    if isinstance(rows, slice) or isinstance(cols, slice):
        return rows, cols
    return rows[:, None], cols


def _as_index(index: list[int], device):
    """A slice where the indices are consecutive, else a tensor of them on ``device``."""
    if not index:
        return slice(0, 0)
    if index == list(range(index[0], index[0] + len(index))):
        return slice(index[0], index[0] + len(index))
    return torch.tensor(index, dtype=torch.long, device=device)


def _sharded(placement) -> bool:
    return isinstance(placement, (Shard, torch_compat.strided_shard_type()))


def piece_indices(shape: tuple[int, int], mesh_shape: tuple[int, ...], placements) -> list[tuple[list, list]]:
    """The (rows, columns) of every rank's piece of a matrix of ``shape`` laid out by ``placements``
    (``Replicate``, ``Shard``, ``_StridedShard``) over a mesh of ``mesh_shape``, one per coordinate
    of the mesh dimensions that split it (size > 1), flat in mesh order: torch's own split of each
    placement, which ``distribute_tensor(..., src_data_rank=None)`` applies for one rank."""
    rows, cols = shape
    level = [(torch.arange(rows).view(rows, 1), torch.arange(cols).view(1, cols))]
    for d, placement in enumerate(placements):
        if not _sharded(placement) or mesh_shape[d] == 1:
            continue
        axis = placement.dim % 2
        level = [(part, c) if axis == 0 else (r, part) for r, c in level
                 for part in torch_compat.placement_pieces(placement, r if axis == 0 else c, mesh_shape[d])]
    return [(r.reshape(-1).tolist(), c.reshape(-1).tolist()) for r, c in level]


_PIECES: dict = {}


def pieces_of(param: torch.Tensor) -> Pieces:
    """``param``'s ``Pieces`` (cached by shape, placements, mesh shape, this rank's coordinate and
    device). This rank's own piece is checked against ``distribute_tensor``'s and the shard it
    holds: ``ValueError`` if they differ. No communication."""
    mesh, placements = param.device_mesh, tuple(param.placements)
    coordinate = tuple(mesh.get_coordinate())
    device = param.to_local().device
    key = (tuple(param.shape), placements, tuple(mesh.shape), coordinate, str(device))
    if key in _PIECES:
        return _PIECES[key]
    dims = tuple(d for d, pl in enumerate(placements) if _sharded(pl) and mesh.size(d) > 1)
    sizes = tuple(mesh.size(d) for d in dims)
    indices = piece_indices(tuple(param.shape), tuple(mesh.shape), placements)
    mine = 0
    for d, size in zip(dims, sizes):
        mine = mine * size + coordinate[d]
    rows, cols = param.shape
    # this rank's piece as torch distributes it (rows and columns apart: each placement splits one of them)
    by_torch = [distribute_tensor(index, mesh, [pl if _sharded(pl) and pl.dim % 2 == axis else Replicate()
                                                for pl in placements], src_data_rank=None).to_local().reshape(-1)
                for axis, index in ((0, torch.arange(rows).view(rows, 1)), (1, torch.arange(cols).view(1, cols)))]
    if [t.tolist() for t in by_torch] != list(indices[mine]):
        raise ValueError(f"this rank's piece (mesh coordinate {coordinate}) holds rows {_short(by_torch[0].tolist())} "
                         f"and columns {_short(by_torch[1].tolist())} as distribute_tensor lays it out, not the rows "
                         f"{_short(indices[mine][0])} and columns {_short(indices[mine][1])} computed for it")
    held = tuple(param.to_local().shape)
    if held != (len(indices[mine][0]), len(indices[mine][1])):
        raise ValueError(f"this rank holds a {held} shard; {placements} over the mesh {tuple(mesh.shape)} give it "
                         f"{(len(indices[mine][0]), len(indices[mine][1]))}")
    pieces = Pieces((rows, cols), dims, sizes, indices, device)
    _PIECES[key] = pieces
    return pieces


def _short(index: list[int]) -> str:
    return str(index) if len(index) <= 8 else f"[{', '.join(map(str, index[:4]))}, ... {index[-1]}] ({len(index)})"


def sharded_layout_problem(param: torch.Tensor) -> str | None:
    """Why ``ShardedMuon`` cannot take ``param`` (None: it can)."""
    if param.dim() != 2:
        return f"Muon takes 2-D matrices; this parameter has shape {tuple(param.shape)}"
    if not isinstance(param, DTensor):
        return None
    placements = tuple(param.placements)
    names = param.device_mesh.mesh_dim_names
    unknown = [pl for pl in placements if not (isinstance(pl, Replicate) or _sharded(pl))]
    if unknown:
        return (f"placements {placements} over mesh dimensions {names}: the owner-based Muon takes Replicate, "
                f"Shard and _StridedShard (FSDP2, HSDP, tensor parallel and their products), not {unknown[0]}"
                + (" (a pending reduction)" if unknown[0].is_partial() else ""))
    try:
        pieces_of(param)
    except ValueError as e:
        return f"placements {placements} over mesh dimensions {names}: {e}"
    return None


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon``, with each sharded matrix orthogonalised once, on an owner rank among
    those holding its pieces (module docstring). ``bucket_numel``: elements of full matrices per
    exchange; None: one bucket per set of groups and parameter group. ``ns_dtype``: the
    iteration's dtype (and the exchanges'); torch's is bf16, float32 makes the update
    insensitive to the last bits of the gradient (the fp32 parity tests: a data-parallel gradient
    is summed in another order than one process's, and one bf16 rounding flipped by that moves a
    weight by ~lr * 2^-8)."""

    def __init__(self, params: Iterable, *, bucket_numel: int | None = None, ns_dtype: torch.dtype = NS_DTYPE,
                 **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                problem = sharded_layout_problem(p)
                if problem:
                    raise ValueError(f"ShardedMuon: a parameter of shape {tuple(p.shape)}: {problem}")
        if bucket_numel is not None and bucket_numel <= 0:
            raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
        self.bucket_numel = bucket_numel
        self.ns_dtype = ns_dtype
        self._plans: dict = {}
        self._layouts: dict = {}

    def _layout(self, p: DTensor) -> Pieces:
        layout = self._layouts.get(id(p))
        if layout is None:
            layout = self._layouts[id(p)] = pieces_of(p)
        return layout

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        lr = float(group["lr"])
        wd, momentum, nesterov = group["weight_decay"], group["momentum"], group["nesterov"]
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
        by_group: dict = {}  # (the splitting dimensions' process groups, replica group or None) -> [(param, update)]
        for p in group["params"]:
            if p.grad is None:
                continue
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            update = momentum_update(self.state[p], p.grad, momentum, nesterov)
            groups = tuple(p.device_mesh.get_group(d) for d in self._layout(p).dims) if isinstance(p, DTensor) else ()
            rpg = _replica_group(p)
            if not groups and rpg is None:  # the whole matrix is here (one process, DDP, 1-rank or replicated mesh)
                _apply(p, newton_schulz(update, *ns), lr, wd, group["adjust_lr_fn"])
                continue
            by_group.setdefault((groups, rpg), []).append((p, update))
        for (groups, rpg), items in by_group.items():
            sizes = [comm.world_size(g) for g in groups]
            me = [comm.rank(g) for g in groups]
            ranks = math.prod(sizes)
            replicas = comm.world_size(rpg) if rpg is not None else 1
            replica = comm.rank(rpg) if rpg is not None else 0
            # owners over every (replica, coordinate of the splitting dimensions) pair: replica g // ranks,
            # flat coordinate g % ranks
            owners = self._owners((groups, rpg), [p for p, _ in items], ranks * replicas, ns[1])
            for bucket in self._buckets(items):
                slots = [owners[id(p)] for p, _ in bucket]
                mine = [i for i, g in enumerate(slots) if g // ranks == replica]
                results = self._exchange([bucket[i] for i in mine], [_unravel(slots[i] % ranks, sizes) for i in mine],
                                         groups, sizes, me, ns) if mine else []
                updates = dict(zip(mine, results))
                if replicas > 1:  # the other replicas' matrices: this rank's piece of their results
                    updates.update(self._from_replicas(bucket, slots, results, rpg, replicas, replica, ranks))
                for i, (p, _) in enumerate(bucket):
                    _apply(p, updates[i], lr, wd, group["adjust_lr_fn"])

    def _owners(self, key, params: list, ranks: int, ns_steps: int) -> dict[int, int]:
        """Each matrix's owner (``owner_plan``); the same on every rank (shapes and order only)."""
        key = (key, tuple(id(p) for p in params))
        plan = self._plans.get(key)
        if plan is None:
            owners = owner_plan([tuple(p.shape) for p in params], ranks, ns_steps)
            plan = self._plans[key] = {id(p): o for p, o in zip(params, owners)}
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

    def _exchange(self, bucket: list, owners: list[tuple[int, ...]], groups: tuple, sizes: list[int], me: list[int],
                  ns) -> list[torch.Tensor]:
        """This rank's piece of each orthogonalised matrix of ``bucket`` (owner at coordinates
        ``owners[i]`` of the splitting dimensions, whose process groups are ``groups``): the pieces
        travel to the owner one dimension at a time, the last first (each rank of a group gathering
        the pieces of its matrices' owners' coordinate there), the owner assembles the whole
        matrix and runs the iteration, and the results' pieces come back the same way, the first
        dimension first: one all-to-all per dimension each way.

        What a rank holds of a matrix between stages is the pieces of a run of consecutive flat
        coordinates (mesh order, the last dimension fastest), concatenated in that order: after
        gathering over dimensions j..k-1, those whose coordinates 0..j-1 are this rank's."""
        k, dtype = len(groups), self.ns_dtype
        pieces = [self._layout(p) if isinstance(p, DTensor) else None for p, _ in bucket]
        strides = [math.prod(sizes[j + 1:]) for j in range(k)]
        flat = sum(c * s for c, s in zip(me, strides))
        held = {i: u.to(dtype).reshape(-1) for i, (_, u) in enumerate(bucket)}  # this rank's own piece
        for j in reversed(range(k)):  # to the owners, the last dimension first
            run, block = strides[j], strides[j] * sizes[j]
            base = flat - flat % block  # the first flat coordinate whose 0..j-1 are this rank's
            sends = [[held[i] for i in held if owners[i][j] == v] for v in range(sizes[j])]
            keep = [i for i in held if owners[i][j] == me[j]]
            recv = comm.all_to_all_packed(
                [_cat(parts, dtype, bucket[0][1].device) for parts in sends],
                [sum(pieces[i].numel(base + v * run, base + (v + 1) * run) for i in keep) for v in range(sizes[j])],
                groups[j])
            offsets, gathered = [0] * sizes[j], {}
            for i in keep:
                parts = []
                for v in range(sizes[j]):
                    n = pieces[i].numel(base + v * run, base + (v + 1) * run)
                    parts.append(recv[v][offsets[v]:offsets[v] + n])
                    offsets[v] += n
                gathered[i] = torch.cat(parts)
            held = gathered
        for i in held:  # the owner: every piece, in flat order
            full = pieces[i].assemble(held[i]) if k else held[i].view(bucket[i][0].shape)
            result = newton_schulz(full, *ns)
            held[i] = pieces[i].split(result) if k else result.reshape(-1)
        for j in range(k):  # the results' pieces back, the first dimension first
            run, block = strides[j], strides[j] * sizes[j]
            base = flat - flat % block
            sends = [[held[i][pieces[i].numel(base, base + v * run):pieces[i].numel(base, base + (v + 1) * run)]
                      for i in held] for v in range(sizes[j])]
            # from the rank at the owner's coordinate j, for the matrices whose owners' coordinates j+1.. are this rank's
            come = [i for i, o in enumerate(owners) if list(o[j + 1:]) == me[j + 1:]]
            mine = (base + me[j] * run, base + (me[j] + 1) * run)
            recv = comm.all_to_all_packed(
                [_cat(parts, dtype, bucket[0][1].device) for parts in sends],
                [sum(pieces[i].numel(*mine) for i in come if owners[i][j] == v) for v in range(sizes[j])], groups[j])
            offsets, returned = [0] * sizes[j], {}
            for i in come:
                v, n = owners[i][j], pieces[i].numel(*mine)
                returned[i] = recv[v][offsets[v]:offsets[v] + n]
                offsets[v] += n
            held = returned
        return [held[i].view(_local(p).shape) for i, (p, _) in enumerate(bucket)]

    def _from_replicas(self, bucket: list, slots: list[int], results: list[torch.Tensor], rpg, replicas: int,
                       replica: int, ranks: int) -> dict[int, torch.Tensor]:
        """HSDP: each replica orthogonalised its own matrices of ``bucket``; one all-to-all over the
        replica group (the ranks holding the same pieces) sends this rank's piece of its replica's
        results to every other replica and receives theirs."""
        dtype, device = self.ns_dtype, bucket[0][1].device
        held = [_local(p).shape for p, _ in bucket]  # this rank's piece of each matrix
        sizes = [shape.numel() for shape in held]
        of = [[i for i, g in enumerate(slots) if g // ranks == r] for r in range(replicas)]
        mine = _cat(results, dtype, device)
        sends = [mine if r != replica else torch.empty(0, dtype=dtype, device=device) for r in range(replicas)]
        recv = comm.all_to_all_packed(sends, [sum(sizes[i] for i in of[r]) if r != replica else 0
                                              for r in range(replicas)], rpg)
        out = {}
        for r in range(replicas):
            if r == replica:
                continue
            offset = 0
            for i in of[r]:
                out[i] = recv[r][offset:offset + sizes[i]].view(held[i])
                offset += sizes[i]
        return out


def _unravel(flat: int, sizes: list[int]) -> tuple[int, ...]:
    """The coordinates of flat coordinate ``flat`` (mesh order, the last dimension fastest)."""
    out = []
    for size in reversed(sizes):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t  # under no_grad: the shard itself (in place works)


def _replica_group(p: torch.Tensor):
    """HSDP: the process group of the mesh dimension over which ``p`` is replicated (the ranks
    holding the same shard), when there is exactly one; None otherwise (FSDP2, one process)."""
    if not isinstance(p, DTensor) or p.device_mesh.ndim < 2:
        return None
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Replicate) and p.device_mesh.size(i) > 1]
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
