"""Activation checkpointing per block: trade recomputation in backward for activation memory.

Policies (``ActivationCheckpointConfig.policy``):

- ``"selective"``: op-level selective checkpointing (SAC) in every block. The outputs of the
  FLOP-dense ops (matmuls, scaled-dot-product attention, collectives) are kept; everything cheap
  (norms, activations, residual adds, RoPE) is recomputed in backward from them. Attention is
  therefore never recomputed: the one op whose recomputation costs as much as its forward (and,
  on GPU, a second FlashAttention kernel) runs once per block per step.
  ``recompute_matmuls="every_other"`` additionally recomputes every second matmul of each block,
  for more memory saved at the cost of about half the block's linear-layer FLOPs again.
- ``"block"``: every ``every_k``-th block (0, k, 2k, ...) is fully recomputed; the others keep all
  their activations.
- ``"full"``: every block is fully recomputed (memory: one block input per block).
- ``"none"``: nothing is changed.

How blocks are wrapped, and why not ``checkpoint_wrapper``: wrapping a block in a
``CheckpointWrapper`` inserts ``_checkpoint_wrapped_module.`` into every parameter name below it.
Its state-dict hooks strip that again, but ``named_parameters()`` / ``named_modules()`` from the
root keep it, so optimizer parameter names, tensor-parallel plans and FQN filters (float8's
``filter_fqns``) would all see two spellings of one model. Instead the block keeps its place and
class and gets an instance-level ``forward`` that runs the class's forward under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``. Every FQN stays as it was, and module
hooks (FSDP2's all-gather / reshard, float8's) stay outside the checkpointed region as they would
around a wrapper. The bound method is a ``types.MethodType``, so ``copy.deepcopy`` of a
checkpointed model checkpoints the copy's own weights. (Pickling restores the block without
checkpointing: apply again after unpickling.)

Blocks that write a KV cache: checkpointing runs a block's forward twice (forward, then the
recomputation in backward), so whatever the forward writes outside the block is written twice.
Hugging Face decoder layers append their keys/values to the ``Cache`` object they are passed
(``use_cache`` defaults to ``True`` in their configs, also in training): in the recomputation the
layer reads back its own first write, attends over 2T keys and slices them back to T. Selective
checkpointing replays the forward's per-op decisions by (op, invocation index), so the extra
``cat``/``slice`` ops fail with "aten.slice.Tensor encountered during backward but not found in
storage"; full checkpointing gets the right numbers by coincidence, leaves a cache of twice the
length and keeps every layer's keys/values alive. So while a block is checkpointed with
gradients on, a cache argument it is given (``cache``, ``past_key_values``, ``past_key_value``,
``layer_past``, by keyword or position) is replaced by None, as HF's own gradient checkpointing
does (``GradientCheckpointingLayer``), unless the block declares ``_can_checkpoint_with_cache``
(a layer that only reads the cache). Without gradients (generation) the cache is left alone.
"""

from __future__ import annotations

import inspect
import time
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from lightning_disttrain import _torch_compat as torch_compat
from lightning_disttrain.models.ring_attention import RING_ATTENTION_OP
from lightning_disttrain.parallel.plan import as_block_list

ACPolicy = Literal["none", "selective", "block", "full"]
MatmulRecompute = Literal["none", "every_other"]
POLICIES: tuple[str, ...] = ("none", "selective", "block", "full")
MATMUL_RECOMPUTE: tuple[str, ...] = ("none", "every_other")


def _resolve(names: Iterable[str]) -> frozenset:
    """OpOverloads by dotted name; ops this build lacks (no distributed, no cuDNN) are skipped."""
    found = set()
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return frozenset(found)


MATMUL_OPS = _resolve([
    # nn.Linear reaches dispatch as addmm (with bias) or mm (without): aten.linear and aten.matmul
    # are composite and decompose before any dispatch mode sees them; listed for subclasses that
    # intercept them whole.
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten.matmul.default", "aten.linear.default",
    "aten._scaled_mm.default",  # float8 matmuls (torchao Float8Linear)
])
"""Matmuls: saved under ``"selective"``; every second one recomputed with ``"every_other"``."""

ATTENTION_OPS = _resolve([
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
]) | {RING_ATTENTION_OP}
"""The fused SDPA kernels ``F.scaled_dot_product_attention`` dispatches to (the math fallback is
composite: it reaches dispatch as bmm/softmax, whose bmm outputs are saved as matmuls), and
context parallel's ring attention, one operator: kept, a recomputed block does not run the ring
(its transfers) again."""

COLLECTIVE_OPS = _resolve([
    # Under tensor/sequence parallel a recomputed collective is a second round of communication.
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional.all_reduce.default",
    # Expert parallel: the token dispatch/combine (and the count exchange before them).
    "_c10d_functional.all_to_all_single.default",
])

LOW_PRECISION_OPS = _resolve([
    # float8 scaling: amax results are scalars (free to keep) and recomputing one of an FSDP-
    # sharded weight would mean another all-reduce.
    "aten.max.default",
])

DEFAULT_SAVE_OPS: frozenset = MATMUL_OPS | ATTENTION_OPS | COLLECTIVE_OPS | LOW_PRECISION_OPS
"""What ``"selective"`` keeps (MUST_SAVE); every other op is PREFER_RECOMPUTE."""

_MARK = "_ldt_activation_checkpoint"  # instance attribute: the config a block was wrapped with


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    """How blocks are checkpointed; validated on construction."""

    policy: ACPolicy = "selective"
    """``"selective"`` (op-level, default), ``"block"`` (every ``every_k``-th block), ``"full"``
    (every block) or ``"none"``."""
    every_k: int = 2
    """With ``policy="block"``: checkpoint blocks 0, k, 2k, ... (1 is the same as ``"full"``)."""
    recompute_matmuls: MatmulRecompute = "none"
    """With ``policy="selective"``: ``"every_other"`` recomputes the 2nd, 4th, ... matmul of each
    block instead of keeping it."""
    preserve_rng_state: bool = True
    """Replay the forward's RNG state in the recomputation so dropout draws the same mask. Costs a
    state save per block and call; ``False`` is safe only without dropout (or other randomness)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"activation checkpointing policy={self.policy!r} is unknown; "
                             f"use one of {POLICIES}")
        if self.recompute_matmuls not in MATMUL_RECOMPUTE:
            raise ValueError(f"recompute_matmuls={self.recompute_matmuls!r} is unknown; "
                             f"use one of {MATMUL_RECOMPUTE}")
        if isinstance(self.every_k, bool) or not isinstance(self.every_k, int) or self.every_k < 1:
            raise ValueError(f"every_k={self.every_k!r} must be an int >= 1 (1 checkpoints every "
                             f"block, like policy='full')")
        if self.recompute_matmuls != "none" and self.policy != "selective":
            raise ValueError(f"recompute_matmuls={self.recompute_matmuls!r} only applies to "
                             f"policy='selective' (got policy={self.policy!r}); drop it or "
                             f"switch the policy")


def selective_context_fn(
    save_ops: frozenset = DEFAULT_SAVE_OPS,
    recompute_matmuls: MatmulRecompute = "none",
) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``checkpoint`` that saves ``save_ops``' outputs and recomputes the rest.

    The decision depends on the op alone, and with ``"every_other"`` on its place among this
    block's matmuls in this call: nothing that differs between the forward and the recomputation.
    torch (2.13) asks the policy in the forward only, files each op's output (or "recompute")
    under (op, n-th call of that op), and the recomputation looks its ops up by the same key; so
    the recomputation must run the very ops the forward ran, which is why checkpointed blocks run
    without a KV cache (module docstring). ``checkpoint`` calls ``context_fn`` once per call, so
    the matmul counter is per block and per forward. It is split by ``ctx.is_recompute`` for
    older torch, which consults the policy again while recomputing: each pass counts 1, 2, 3, ...
    """
    every_other = recompute_matmuls == "every_other"
    # FSDP2 units inside a block (expert parallel's experts) annotate their hooks with
    # record_function a different number of times in the forward and in the recomputation; SAC
    # matches ops by call index and would fail at the first backward ("invocation index 2 ...
    # not found in storage"). Profiler annotations are left out of its matching.
    torch_compat.ignore_profiler_ops_in_selective_checkpointing()

    def context_fn():
        matmuls_seen = {False: 0, True: 0}  # keyed by ctx.is_recompute

        def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
            if op not in save_ops:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if every_other and op in MATMUL_OPS:
                matmuls_seen[ctx.is_recompute] += 1
                if matmuls_seen[ctx.is_recompute] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            # MUST (not PREFER): torch.compile's partitioner may not override it and recompute
            # attention after all.
            return CheckpointPolicy.MUST_SAVE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


CACHE_ARGUMENTS: tuple[str, ...] = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Names under which blocks receive a KV cache they write to (Hugging Face's, across versions)."""

_positional_names: dict[type, tuple[str, ...]] = {}
_CACHE_WARNED = "_ldt_ac_cache_warned"  # instance attribute: this block said it drops its cache


def _parameter_names(cls: type) -> tuple[str, ...]:
    # Follows __wrapped__ through HF's decorators to the real signature.
    if cls not in _positional_names:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]  # drop self
        except (TypeError, ValueError):
            params = []
        _positional_names[cls] = tuple(
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return _positional_names[cls]


def _without_cache(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with any cache the block would write replaced by None."""
    if torch_compat.checkpoints_with_cache(block):
        return args, kwargs
    dropped = [name for name in CACHE_ARGUMENTS if kwargs.get(name) is not None]
    if dropped:
        kwargs = {**kwargs, **dict.fromkeys(dropped, None)}
    names = _parameter_names(type(block))
    positions = [i for i, name in enumerate(names[:len(args)])
                 if name in CACHE_ARGUMENTS and args[i] is not None]
    if positions:
        args = tuple(None if i in positions else a for i, a in enumerate(args))
        dropped += [names[i] for i in positions]
    if dropped and not block.__dict__.get(_CACHE_WARNED):
        object.__setattr__(block, _CACHE_WARNED, True)
        warnings.warn(f"activation checkpointing: {type(block).__name__} was given a KV cache "
                      f"({', '.join(dropped)}) in training; the recomputation in backward would "
                      f"write it a second time, so checkpointed blocks run without it (pass "
                      f"use_cache=False to the model to silence this)", stacklevel=3)
    return args, kwargs


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    # Bound to the block as an instance attribute; runs the class's own forward under checkpoint.
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():  # eval / no_grad: nothing is saved, so nothing to trade
        return forward(*args, **kwargs)
    cfg: ActivationCheckpointConfig = getattr(self, _MARK)
    args, kwargs = _without_cache(self, args, kwargs)
    extra = {}
    if cfg.policy == "selective":
        extra["context_fn"] = self._ldt_ac_context_fn
    return checkpoint(forward, *args, use_reentrant=False,
                      preserve_rng_state=cfg.preserve_rng_state, **extra, **kwargs)


def checkpoint_config_of(block: nn.Module) -> ActivationCheckpointConfig | None:
    """The config ``block`` was checkpointed with, or None."""
    return block.__dict__.get(_MARK)


def checkpoint_block(block: nn.Module, config: ActivationCheckpointConfig,
                     save_ops: frozenset = DEFAULT_SAVE_OPS) -> None:
    """Make ``block``'s forward checkpointed (``config.policy`` "selective" or "full"), in place."""
    if config.policy not in ("selective", "full"):
        raise ValueError(f"checkpoint_block takes policy 'selective' or 'full' for one block, "
                         f"got {config.policy!r}; use apply_activation_checkpointing for a list")
    if checkpoint_config_of(block) is not None:
        raise ValueError(f"{type(block).__name__} is already checkpointed "
                         f"({checkpoint_config_of(block)}); call remove_activation_checkpointing "
                         f"first to change the policy")
    if "forward" in block.__dict__:
        raise ValueError(f"{type(block).__name__} already has an instance-level forward (another "
                         f"wrapper?); checkpointing would bypass it. Apply checkpointing first.")
    # Read the block class's forward signature now, not first inside a compiled forward: filling
    # the module-level cache there made dynamo guard on it and recompile the next block.
    _parameter_names(type(block))
    # Plain instance attributes (not submodules / buffers): state_dict and FQNs are untouched.
    object.__setattr__(block, _MARK, config)
    object.__setattr__(block, "_ldt_ac_context_fn",
                       selective_context_fn(save_ops, config.recompute_matmuls))
    object.__setattr__(block, "forward", types.MethodType(_checkpointed_forward, block))


def remove_activation_checkpointing(blocks: Iterable[nn.Module]) -> None:
    """Undo ``apply_activation_checkpointing``: blocks run their class's forward again."""
    for block in blocks:
        for name in ("forward", _MARK, "_ldt_ac_context_fn", _CACHE_WARNED):
            block.__dict__.pop(name, None)


def apply_activation_checkpointing(
    blocks: nn.ModuleList | nn.ModuleDict,
    policy: ACPolicy = "selective",
    every_k: int = 2,
    recompute_matmuls: MatmulRecompute = "none",
    preserve_rng_state: bool = True,
    save_ops: frozenset = DEFAULT_SAVE_OPS,
) -> list[int]:
    """Checkpoint ``blocks`` in place by ``policy``; returns the layer indices of the blocks changed
    (in the whole model: a pipeline stage reports its own layers, e.g. [2, 3]).

    Runs at stage ``"activation_checkpointing"``: after tensor parallel (so it checkpoints the
    sharded block, collectives included) and before compile (so dynamo traces the policy into
    the graph) and FSDP (whose hooks stay outside the checkpointed region).

    ``save_ops`` (selective only) replaces the set of ops whose outputs are kept.
    """
    config = ActivationCheckpointConfig(policy=policy, every_k=every_k,
                                        recompute_matmuls=recompute_matmuls,
                                        preserve_rng_state=preserve_rng_state)
    if config.policy == "none":
        return []
    # Each block's layer index in the whole model: a pipeline stage's ModuleDict holds some layers.
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else None
    layers = [getattr(blocks, "_ldt_all_keys", keys).index(k) for k in keys] if keys else range(len(blocks))
    blocks = as_block_list(blocks)  # a ModuleDict's blocks in insertion order
    if config.policy == "block":
        chosen = [i for i, layer in enumerate(layers) if layer % config.every_k == 0]
        per_block = ActivationCheckpointConfig(policy="full", preserve_rng_state=preserve_rng_state)
    else:
        chosen = list(range(len(blocks)))
        per_block = config
    for i in chosen:
        checkpoint_block(blocks[i], per_block, save_ops=frozenset(save_ops))
    return [layers[i] for i in chosen]


def _plain(t: Any) -> bool:
    # Tensor subclasses (DTensor, float8) may have no storage of their own; meta tensors none.
    return type(t) in (torch.Tensor, nn.Parameter) and t.device.type != "meta"


class _NewStorageTracker(torch_compat.TorchDispatchMode):
    # Weak references to every storage an op allocated (outputs that are not views of an input),
    # keyed by the storage's identity (StorageWeakRef.cdata: the storage's own id, as an int).
    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {StorageWeakRef(t.untyped_storage()).cdata
                  for t in torch_compat.tree_leaves((args, kwargs)) if _plain(t)}
        for t in torch_compat.tree_leaves(out):
            if _plain(t):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in inputs and ref.cdata not in self.storages:
                    self.storages[ref.cdata] = (ref, storage.nbytes())
        return out


def activation_bytes(forward: Callable[[], Any], settle_s: float = 0.0) -> tuple[Any, int]:
    """Run ``forward()``; return its result and the bytes of the tensors it allocated that are
    still alive when it returns: what backward will read (plus the result itself).

    Why not sum tensors in a ``saved_tensors_hooks`` pack hook: only the innermost pair of hooks
    sees a saved tensor, and non-reentrant checkpointing installs its own around each block, so
    an outer hook never sees what a checkpointed block keeps (its inputs, held by the
    recomputation closure, and SAC's cache of op outputs). Counting live storages sees all of
    them. Views share their base's storage and count once; parameters are not allocated by the
    forward and do not count.

    ``settle_s``: a collective's work object can hold its tensors a moment after the collective
    was waited on (gloo's worker thread drops its reference after signalling completion). With
    ``settle_s > 0`` the count is read again every 10 ms until it has not changed for 200 ms
    (twenty readings in a row), at most ``settle_s`` seconds: what is left is what the forward keeps.
    """
    tracker = _NewStorageTracker()
    with tracker:
        result = forward()

    def alive() -> int:
        return sum(n for ref, n in tracker.storages.values() if not ref.expired())

    return result, settled(alive, settle_s)


def settled(read: Callable[[], int], most_s: float, quiet_s: float = 0.2) -> int:
    """``read()`` once it has not changed for ``quiet_s`` (read every 10 ms), at most ``most_s``
    seconds: a count of live bytes after gloo's worker threads have dropped the tensors of
    collectives already waited on. ``most_s <= 0``: one read."""
    count, deadline, since = read(), time.monotonic() + most_s, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.01)
        now = read()
        if now != count:
            count, since = now, time.monotonic()
    return count
