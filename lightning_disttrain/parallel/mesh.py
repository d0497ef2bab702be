"""ParallelDims: the degree of every parallelism, validated up front, and the DeviceMesh they span.

Plain torch, no Lightning. Every check runs in ``__post_init__`` / ``validate_for_model``, i.e.
before any process group exists, so a bad layout is a ``ValueError`` naming the fix instead of a
collective that hangs on some ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_disttrain import _torch_compat as torch_compat

# Outermost to innermost. The order decides which ranks are neighbours: the innermost dimension
# gets consecutive ranks (the same node, the fastest links), so TP, which communicates in every
# layer, is innermost and PP, which sends one activation per micro-batch, is outermost.
MESH_DIMS: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Flattened dimensions built from the ones above (name -> the dims it merges).
FLAT_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "stage": ("dp_replicate", "dp_shard", "cp", "tp"),
    # Lightning's ModelParallelStrategy names, for modules that parallelize themselves in
    # configure_model (self.device_mesh["data_parallel"] / ["tensor_parallel"]): the same ranks
    # as there (tensor parallel innermost, every other data rank in data_parallel).
    "data_parallel": ("dp_replicate", "dp_shard", "cp"),
    "tensor_parallel": ("tp",),
}


class _MeshSet:
    """One layout's meshes in this process: the world mesh, the meshes derived from it (by name
    and by the world dimensions they span) and the process groups they created."""

    def __init__(self, device_type: str, names: tuple[str, ...], sizes: tuple[int, ...], key: tuple) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.key, self.device_type = key, device_type
        self.groups: list = []
        self.by_dims: dict[tuple[str, ...], DeviceMesh] = {}
        self.meshes: dict[str, DeviceMesh] = {"world": self.track(init_device_mesh(device_type, sizes,
                                                                                     mesh_dim_names=names))}

    def track(self, mesh: DeviceMesh) -> DeviceMesh:
        for group in mesh.get_all_groups():
            if group is not torch.distributed.group.WORLD and all(group is not g for g in self.groups):
                self.groups.append(group)
        return mesh

    def destroy(self) -> None:
        for group in self.groups:
            torch.distributed.destroy_process_group(group)
        self.groups, self.by_dims, self.meshes = [], {}, {}
        # torch's caches hold meshes (and so their groups, gloo's threads or an NCCL communicator)
        # until cleared, and would hand a later, equal mesh this one's entries
        torch_compat.clear_mesh_caches(self.device_type)


# Layout -> its meshes, for the life of the default process group: a second ParallelDims of the
# same layout (the next fit in a notebook, a sweep, fit then validate with a new Trainer, the
# test suite's runs) reuses the same meshes instead of making new groups, which no one destroyed
# and each of which keeps threads polling under gloo (docs/benchmarks.md, section 20). Reuse,
# rather than destroy and rebuild, also keeps torch's caches keyed by (equal) meshes right:
# they hand back these very meshes, whose groups are alive. ``ParallelDims.release`` empties it.
_POOL: dict[tuple, _MeshSet] = {}


def release_all_meshes() -> int:
    """Destroy every layout's process groups in this process (``ParallelDims.release`` for each);
    returns how many groups were destroyed. For a process that goes on without them (a notebook
    between sweeps, a test harness): nothing built over them may be used afterwards."""
    count = 0
    for made in list(_POOL.values()):
        count += len(made.groups)
        made.destroy()
    _POOL.clear()
    return count


@dataclass
class ParallelDims:
    """Degrees of parallelism for one run; their product is the world size.

    The world ``DeviceMesh`` built by :meth:`build_mesh` has those of the five dimensions below whose
    size is > 1, in this order, plus the ones it is asked to keep at size 1 (``dp_shard`` for FSDP by
    default): a dimension of size 1 would cost a process group on every rank and carry nothing.
    ``get_mesh(name)`` serves every name below whose ranks are not this rank alone; ``local_rank(name)``
    every name, without a mesh:

    ``pp``
        Pipeline stages. Each stage holds a contiguous range of blocks; activations flow between
        stages point to point. Outermost: the least communication, so it may cross slow links.
    ``dp_replicate``
        Data-parallel replicas that each hold a full copy of the (sharded) model: HSDP's replicate
        dimension. Gradients are all-reduced across it once per step. With ``dp_shard=1`` this is
        plain DDP.
    ``dp_shard``
        Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP / ZeRO-3).
        Parameters are all-gathered per block in forward and backward, gradients reduce-scattered.
    ``cp``
        Context parallel: the sequence of each sample is split across these ranks (ring
        attention). They see the same samples, so they are not data-parallel for the sampler, but
        FSDP shards parameters over them too (``dp_shard_cp``) because their gradients must be
        reduced like data-parallel ones.
    ``tp``
        Tensor parallel: each layer's weights are split across these ranks, with collectives
        inside every block. Innermost: consecutive ranks, the fastest links.

    Flattened dimensions (1-D meshes over several of the above, returned by ``get_mesh(name)``: the
    dimension itself when only one of them has size > 1, else flattened on first use):

    ``dp`` = ``dp_replicate`` x ``dp_shard``
        Every rank that sees different samples: the data sampler's ``num_replicas`` / ``rank`` and
        the group over which the logged loss is averaged.
    ``dp_shard_cp`` = ``dp_shard`` x ``cp``
        The ranks a parameter is sharded over. ``get_mesh("fsdp")`` is this mesh, or for HSDP the
        2-D (``dp_replicate``, ``dp_shard_cp``) view: replicate along dim 0, shard along dim 1.
    ``dp_cp`` = ``dp_replicate`` x ``dp_shard`` x ``cp``
        Every rank whose gradients are averaged: loss averaging when cp > 1.
    ``stage`` = every dimension but ``pp``
        The ranks that hold the same pipeline stage(s): initial weights are broadcast over it.

    ``ep`` (expert parallel) is not a dimension of its own: it borrows ranks from ``dp_shard_cp``
    (experts are sharded over ranks that would otherwise each hold a shard of them), so it must
    divide ``dp_shard * cp``. With ep > 1, ``get_mesh("ep")`` holds groups of ``ep`` consecutive
    FSDP ranks (the all-to-all groups) and ``get_mesh("efsdp")`` the ``dp_shard*cp/ep`` ranks over
    which each expert shard is FSDP-sharded; these ranks still see different samples.
    """

    dp_replicate: int = 1
    """HSDP replicas (gradient all-reduce). 1: no replication."""
    dp_shard: int = -1
    """FSDP shards. -1: whatever the world size leaves after the other degrees."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline stages."""
    ep: int = 1
    """Expert-parallel degree (borrowed from ``dp_shard * cp``)."""
    cp: int = 1
    """Context-parallel degree (sequence split)."""
    world_size: int = 1
    """Number of processes; the product of ``pp, dp_replicate, dp_shard, cp, tp`` must equal it."""

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        ws = self.world_size
        if not isinstance(ws, int) or ws < 1:
            raise ValueError(f"world_size={ws!r} must be an int >= 1")
        for name in ("dp_replicate", "tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1 (1 disables it)")
        if not isinstance(self.dp_shard, int) or (self.dp_shard < 1 and self.dp_shard != -1):
            raise ValueError(f"dp_shard={self.dp_shard!r} must be an int >= 1, or -1 for 'the rest'")
        for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"):
            value = getattr(self, name)
            if value > 1 and ws % value:
                raise ValueError(f"{name}={value} does not divide world_size={ws}; choose {name} among the "
                                 f"divisors of {ws} (or change the number of devices/nodes)")

        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if ws % others:
                raise ValueError(
                    f"dp_replicate*cp*tp*pp = {self.dp_replicate}*{self.cp}*{self.tp}*{self.pp} = {others} "
                    f"does not divide world_size={ws}, so dp_shard=-1 cannot take the rest; choose degrees "
                    f"whose product divides {ws} (or change the number of devices/nodes)")
            self.dp_shard = ws // others
        product = others * self.dp_shard
        if product != ws:
            raise ValueError(
                f"pp*dp_replicate*dp_shard*cp*tp = {self.pp}*{self.dp_replicate}*{self.dp_shard}*{self.cp}*"
                f"{self.tp} = {product} but world_size={ws}; make the product equal the world size, "
                f"e.g. set dp_shard=-1 to let it take whatever is left")
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp_shard*cp = {self.dp_shard}*{self.cp} = {self.dp_shard * self.cp} "
                f"(expert parallel borrows its ranks from the FSDP dimension); pick ep among the divisors of "
                f"{self.dp_shard * self.cp}")

    def validate_for_model(self, config: Any) -> None:
        """Check the degrees against a model's shapes (any object with GPTConfig-like attributes).

        Attributes the config lacks are skipped, so this works for configs of other models too.
        """
        def get(name: str) -> int | None:
            value = getattr(config, name, None)
            return value if isinstance(value, int) else None

        if self.tp > 1:
            for name in ("n_head", "n_kv_head", "n_embd", "mlp_hidden", "padded_vocab_size"):
                size = get(name)
                if size is not None and size % self.tp:
                    raise ValueError(
                        f"tp={self.tp} does not divide {name}={size}; tensor parallel splits it evenly "
                        f"across ranks, so choose tp among the divisors of {size}")
        if self.pp > 1 and (n_layer := get("n_layer")) is not None and n_layer < self.pp:
            raise ValueError(
                f"pp={self.pp} exceeds n_layer={n_layer}; every pipeline stage needs at least one "
                f"block, so use pp <= {n_layer}")
        if self.cp > 1 and (block_size := get("block_size")) is not None and block_size % (2 * self.cp):
            raise ValueError(
                f"block_size={block_size} is not a multiple of 2*cp={2 * self.cp}; context parallel "
                f"splits each sequence into 2*cp load-balanced chunks, so choose cp with "
                f"block_size % (2*cp) == 0")
        experts_field = "moe_num_experts" if get("moe_num_experts") is not None else "n_experts"
        n_experts = get(experts_field)
        if self.ep > 1 and n_experts == 0:
            raise ValueError(
                f"ep={self.ep} but the model has no mixture-of-experts layers ({experts_field}=0); set ep=1, "
                f"or give it experts ({experts_field} >= {self.ep})")
        if self.ep > 1 and n_experts is not None and n_experts % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide {experts_field}={n_experts}; every expert-parallel rank holds "
                f"the same number of experts, so choose ep among the divisors of {n_experts}")

    # -- derived degrees --------------------------------------------------------------------

    @property
    def degrees(self) -> dict[str, int]:
        """Size of every world-mesh dimension, in mesh order."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    @property
    def dp_size(self) -> int:
        """Ranks that see different samples (sampler ``num_replicas``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks a parameter is sharded over."""
        return self.dp_shard * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP wraps the model whenever parameters are sharded or replicated over data ranks."""
        return self.dp_shard * self.cp > 1 or self.dp_replicate > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.fsdp_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def __str__(self) -> str:
        return " x ".join(f"{k}={v}" for k, v in self.degrees.items()) + f" (world {self.world_size})"

    # -- meshes -----------------------------------------------------------------------------

    def mesh_dims(self, keep: tuple[str, ...] = ("dp_shard",)) -> tuple[str, ...]:
        """The world mesh's dimensions: those of size > 1, plus ``keep`` (in ``MESH_DIMS`` order).

        ``dp_shard`` is kept by default, size 1 included: FSDP wraps over it even on one data-parallel
        rank (every parameter a DTensor), and HSDP/DDP's 2-D mesh is its slice with ``dp_replicate``.
        Never empty (one process: ``dp_shard`` of size 1, the default group)."""
        unknown = set(keep) - set(MESH_DIMS)
        if unknown:
            raise ValueError(f"keep={sorted(unknown)}: only mesh dimensions {MESH_DIMS} can be kept at size 1")
        dims = tuple(d for d in MESH_DIMS if getattr(self, d) > 1 or d in keep)
        return dims or ("dp_shard",)

    def build_mesh(self, device_type: str, keep: tuple[str, ...] = ("dp_shard",),
                   aliases: tuple[str, ...] = ()) -> DeviceMesh:
        """Create the world mesh over :meth:`mesh_dims` and return it.

        Process groups (what each costs per rank: a communicator, its buffers, threads under gloo)
        are made only for rank sets a layout uses, one per distinct set, as torchtitan's ParallelDims:

        - the world mesh has the dimensions of size > 1 (and ``keep``); a size-1 dimension makes no
          group (torch would make one per rank, ``world_size`` ``new_group`` calls each);
        - a flattened dimension (``FLAT_DIMS``) with one dimension of size > 1 *is* that dimension
          (``get_mesh("dp")`` with ``dp_replicate=1`` is the ``dp_shard`` mesh: the same group); one
          over several is flattened on first use (``get_mesh``), once per set of dimensions
          (``dp_cp`` and ``data_parallel`` share it);
        - ``aliases`` (``data_parallel``, ``tensor_parallel``: Lightning's ModelParallelStrategy names,
          for modules that parallelize themselves) are registered on the world mesh so that
          ``device_mesh[name]`` works, as views of the group above (no group of their own).

        Collective: every rank calls it, and every later ``get_mesh`` that creates a group, at the
        same point (the package's code is SPMD: every rank asks for the same meshes in one order).
        :meth:`release` destroys what was created.
        """
        if torch.distributed.get_world_size() != self.world_size:
            raise ValueError(f"ParallelDims was built for world_size={self.world_size} but the process "
                             f"group has {torch.distributed.get_world_size()} ranks")
        if getattr(self, "_set", None) is not None:
            raise RuntimeError("ParallelDims.build_mesh() ran already on this process: one mesh per ParallelDims "
                               "(call release() first to build it again)")
        for name in aliases:
            if name not in FLAT_DIMS:
                raise ValueError(f"aliases={aliases!r}: {name!r} is not a flattened dimension; choose among "
                                 f"{sorted(FLAT_DIMS)}")
        names = self.mesh_dims(keep)
        key = (torch.distributed.group.WORLD, device_type, tuple((d, getattr(self, d)) for d in names), self.ep,
               tuple(aliases))
        for stale in [k for k in _POOL if k[0] is not key[0]]:  # made under a default group since destroyed
            del _POOL[stale]
        made = _POOL.get(key)
        if made is None:  # a layout this process has not built: its groups, once
            made = _POOL[key] = _MeshSet(device_type, names, tuple(getattr(self, d) for d in names), key)
        self._set = made
        self._world_dims = names
        for name in aliases:
            if name not in made.meshes:
                made.meshes[name] = torch_compat.alias_mesh(self.get_mesh(name), name)
        return made.meshes["world"]

    @property
    def _meshes(self) -> dict[str, DeviceMesh] | None:
        made = getattr(self, "_set", None)
        return None if made is None else made.meshes

    def _dims_of(self, name: str) -> tuple[str, ...]:
        """The world-mesh dimensions a mesh name spans: those of size > 1 among its constituents,
        else a kept size-1 one (the ranks are this rank alone either way)."""
        dims = FLAT_DIMS.get(name, (name,))
        wide = tuple(d for d in dims if getattr(self, d) > 1)
        if wide:
            return wide
        kept = tuple(d for d in dims if d in self._world_dims)
        if kept:
            return kept[:1]
        if self.world_size == 1:
            return self._world_dims
        raise ValueError(f"{name} has size 1 in this layout ({self}) and no process group: nothing "
                         f"communicates over it. Check the degree first (e.g. dims.tp_enabled), or use "
                         f"dims.local_rank({name!r}), which is 0")

    def _mesh_over(self, dims: tuple[str, ...]) -> DeviceMesh:
        """The 1-D mesh over the world-mesh dimensions ``dims``: the dimension itself, or their
        flattening, made once (collective) and shared by every name over the same dimensions."""
        made = self._set
        world = made.meshes["world"]
        if dims not in made.by_dims and len(dims) == 1:
            made.by_dims[dims] = world if world.ndim == 1 else world[dims[0]]  # a slice: its group
        if dims not in made.by_dims:
            made.by_dims[dims] = made.track(torch_compat.flatten_mesh(world[dims], "_".join(dims)))
        return made.by_dims[dims]

    def get_mesh(self, name: str) -> DeviceMesh:
        """A mesh over this layout's ranks: ``world``, one of ``MESH_DIMS`` or ``FLAT_DIMS`` (1-D), or
        ``fsdp`` (what ``fully_shard`` takes: 1-D ``dp_shard_cp``, or for HSDP / DDP the 2-D
        (``dp_replicate``, ``dp_shard_cp``) over which it replicates along dim 0 and shards along
        dim 1; with ``dp_shard*cp == 1`` that has shape (r, 1) and FSDP only all-reduces, i.e. DDP),
        or with ep > 1 ``ep`` / ``efsdp``.

        A name whose ranks are one world-mesh dimension returns that dimension's mesh (its
        ``mesh_dim_names`` are that dimension's); one over several is flattened on first use, which
        is collective. A name of size 1 with no kept dimension raises (it has no group).
        """
        meshes = getattr(self, "_meshes", None)
        if meshes is None:
            raise RuntimeError("ParallelDims.build_mesh() has not run yet on this process; the meshes "
                               "exist only after the process group is initialised")
        if name in meshes:
            return meshes[name]
        if name in MESH_DIMS or name in FLAT_DIMS:
            mesh = self._mesh_over(self._dims_of(name))
        elif name == "fsdp":
            mesh = self._fsdp_mesh()
        elif name in ("ep", "efsdp") and self.ep > 1:
            # Expert parallel: the FSDP ranks regrouped as (efsdp, ep), ep innermost (consecutive
            # ranks: all-to-all in every MoE layer). Experts are sharded over ep, each shard FSDP-
            # sharded over efsdp; both keep the world mesh as root, as FSDP2 needs to compose them.
            split = self._set.track(torch_compat.unflatten_mesh(
                self.get_mesh("dp_shard_cp"), 0, (self.fsdp_size // self.ep, self.ep), ("efsdp", "ep")))
            meshes["ep"], meshes["efsdp"] = split["ep"], split["efsdp"]
            return meshes[name]
        else:
            choices = sorted({"world", "fsdp", *MESH_DIMS, *FLAT_DIMS, *(("ep", "efsdp") if self.ep > 1 else ())})
            raise ValueError(f"no mesh named {name!r}; choose one of {choices}")
        meshes[name] = mesh
        return mesh

    def _fsdp_mesh(self) -> DeviceMesh:
        shard = self.get_mesh("dp_shard_cp")
        if self.dp_replicate == 1:
            return shard
        # HSDP / DDP: replicate along dim 0, shard along dim 1, over the groups the world mesh
        # (and dp_shard_cp) already have, rooted at the world mesh (FSDP composes it with TP).
        world = self._set.meshes["world"]
        if self.cp == 1 and "dp_shard" in self._world_dims:
            return world["dp_replicate", "dp_shard"]
        return torch_compat.concatenate_meshes([world["dp_replicate"], shard])

    def local_rank(self, name: str) -> int:
        """This rank's index along a dimension or flattened dimension (0 when it has size 1),
        computed from the global rank and the degrees: no mesh or group needed."""
        dims = FLAT_DIMS.get(name, (name,))
        if any(d not in MESH_DIMS for d in dims):
            raise ValueError(f"local_rank({name!r}): choose one of {MESH_DIMS} or {sorted(FLAT_DIMS)}")
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        coords: dict[str, int] = {}
        for d in reversed(MESH_DIMS):  # tp innermost
            size = getattr(self, d)
            coords[d], rank = rank % size, rank // size
        index = 0
        for d in dims:
            index = index * getattr(self, d) + coords[d]
        return index

    def process_groups(self) -> list:
        """The process groups this layout's meshes created (the default group excluded)."""
        made = getattr(self, "_set", None)
        return [] if made is None else list(made.groups)

    def release(self) -> None:
        """Destroy the process groups of this layout's meshes and forget them, here and in the
        process's pool (see ``_POOL``): every ParallelDims of this layout in the process loses them,
        and nothing may use them afterwards (a model sharded over them included). Torch's caches
        keyed by meshes are cleared too (``torch_compat.clear_mesh_caches``): a later mesh of the same
        layout is equal to this one and would otherwise be served this one's entries. Local: no
        collective, but every rank should release at the same point (a group destroyed on some
        ranks only hangs the others' next collective on it)."""
        made = getattr(self, "_set", None)
        if made is None:
            return
        if _POOL.get(made.key) is made:
            del _POOL[made.key]
        made.destroy()
        self._set = None

    @property
    def world_mesh(self) -> DeviceMesh:
        return self.get_mesh("world")

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (sampler ``rank``)."""
        return self.local_rank("dp")
