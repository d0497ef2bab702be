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


@dataclass
class ParallelDims:
    """Degrees of parallelism for one run; their product is the world size.

    The world ``DeviceMesh`` built by :meth:`build_mesh` always has all five named dimensions
    below, in this order (size-1 ones included, so ``mesh["tp"]`` exists in every run and code never
    branches on which dimensions happen to be present; a size-1 dimension costs no communication):

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

    Flattened dimensions (1-D meshes over several of the above, created by :meth:`build_mesh` and
    returned by ``get_mesh(name)``):

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

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh (all of ``MESH_DIMS``) and the derived meshes; return the world mesh.

        Needs an initialised default process group of ``world_size`` ranks. Collective: every rank
        must call it, in the same order (each derived mesh creates process groups). The derived
        meshes are kept here (``get_mesh``) rather than re-sliced from the world mesh by name,
        which torch deprecates for flattened dimensions.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if torch.distributed.get_world_size() != self.world_size:
            raise ValueError(f"ParallelDims was built for world_size={self.world_size} but the process "
                             f"group has {torch.distributed.get_world_size()} ranks")
        world = init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=MESH_DIMS)
        meshes: dict[str, DeviceMesh] = {"world": world}
        meshes.update({name: world[name] for name in MESH_DIMS})
        for flat_name, dims in FLAT_DIMS.items():
            meshes[flat_name] = torch_compat.flatten_mesh(world[dims], flat_name)
        if self.dp_replicate > 1:
            # HSDP: a 2-D (replicate, shard) view of the same ranks as dp_cp. Unflattening keeps the
            # world mesh as its root, which FSDP needs to compose with tensor parallel later.
            meshes["fsdp"] = torch_compat.unflatten_mesh(
                meshes["dp_cp"], 0, (self.dp_replicate, self.fsdp_size), ("dp_replicate", "dp_shard_cp"))
        else:
            meshes["fsdp"] = meshes["dp_shard_cp"]
        if self.ep > 1:
            # Expert parallel: the FSDP ranks regrouped as (efsdp, ep), ep innermost (consecutive
            # ranks: all-to-all in every MoE layer). Experts are sharded over ep, each shard FSDP-
            # sharded over efsdp; both keep the world mesh as root, as FSDP2 needs to compose them.
            split = torch_compat.unflatten_mesh(meshes["dp_shard_cp"], 0, (self.fsdp_size // self.ep, self.ep),
                                                ("efsdp", "ep"))
            meshes["ep"], meshes["efsdp"] = split["ep"], split["efsdp"]
        self._meshes = meshes
        return world

    def get_mesh(self, name: str) -> DeviceMesh:
        """A mesh built by :meth:`build_mesh`: ``world``, one of ``MESH_DIMS``, one of ``FLAT_DIMS``
        or ``fsdp`` (what ``fully_shard`` takes: 1-D ``dp_shard_cp``, or for HSDP the 2-D
        (``dp_replicate``, ``dp_shard_cp``) over which it replicates along dim 0 and shards along
        dim 1; with ``dp_shard*cp == 1`` that has shape (r, 1) and FSDP only all-reduces, i.e. DDP).
        """
        meshes = getattr(self, "_meshes", None)
        if meshes is None:
            raise RuntimeError("ParallelDims.build_mesh() has not run yet on this process; the meshes "
                               "exist only after the process group is initialised")
        if name not in meshes:
            raise ValueError(f"no mesh named {name!r}; choose one of {sorted(meshes)}")
        return meshes[name]

    @property
    def world_mesh(self) -> DeviceMesh:
        return self.get_mesh("world")

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (sampler ``rank``); needs the mesh."""
        return self.get_mesh("dp").get_local_rank()
