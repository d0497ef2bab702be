"""How the GPT of ``models/gpt.py`` is tensor-parallelized: its ``ParallelStyle`` plan (Megatron's layout).

Per block: q, k, v and the first MLP projection(s) column-parallel (each rank computes whole
attention heads and a slice of the MLP's hidden units; no communication), the attention output
and the last MLP projection row-parallel (their partial sums meet in one collective). With
sequence parallel the norms, dropout and residual stream between them hold 1/tp of the sequence
each: an all-gather of the sequence before attention / MLP, a reduce-scatter after.

Root: the token (and learned position) embedding row-parallel on the vocabulary (positions),
the final norm sequence-parallel, the head column-parallel on the vocabulary. With loss parallel
the logits stay vocabulary-sharded (a DTensor) for the cross-entropy; without, they are gathered.
A tied head shares the embedding's weight, which both layouts shard on the vocabulary rows.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_disttrain.models.gpt import GPTConfig
from lightning_disttrain.parallel.tensor import ReplicateOnShardedInput, TensorParallelOptions


def block_plan(config: GPTConfig, options: TensorParallelOptions) -> dict[str, ParallelStyle]:
    """Styles for one ``Block``, by name within it."""
    if config.moe_num_experts:
        raise ValueError("tensor parallel of mixture-of-experts blocks is not supported yet; use tp=1 with "
                         "GPTConfig.moe_num_experts > 0 (expert parallel will shard the experts instead)")
    sp = options.sequence_parallel
    residual = Shard(1) if sp else Replicate()  # how the residual stream is laid out between blocks
    plan: dict[str, ParallelStyle] = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=residual),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=residual),
    }
    if config.mlp == "swiglu":
        plan["mlp.w3"] = ColwiseParallel()
    if config.qk_norm:
        # (B, T, local heads, head_dim): normalised per head, weights shared by all heads.
        plan["attn.q_norm"] = ReplicateOnShardedInput(dim=2)
        plan["attn.k_norm"] = ReplicateOnShardedInput(dim=2)
    if sp:
        plan.update({
            "attn_norm": SequenceParallel(),
            "mlp_norm": SequenceParallel(),
            # Gather the sequence once per attention / MLP (the second attention input is RoPE's tables).
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        })
    return plan


def root_plan(config: GPTConfig, options: TensorParallelOptions, prefix: str = "") -> dict[str, ParallelStyle]:
    """Styles for the embeddings, the final norm and the head, by name under ``prefix``."""
    sp, lp = options.sequence_parallel, options.loss_parallel
    p = f"{prefix}." if prefix else ""
    plan: dict[str, ParallelStyle] = {
        # Each rank looks up the tokens of its vocabulary rows; the partial sums are reduce-scattered
        # onto the sequence (SP) or all-reduced.
        f"{p}wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        f"{p}lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                       output_layouts=Shard(-1) if lp else Replicate(), use_local_output=not lp),
    }
    if config.pos_emb == "learned":
        # wpe(arange(T)) is (T, C): its sequence dimension is 0.
        plan[f"{p}wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0) if sp else Replicate())
    if sp:
        plan[f"{p}ln_f"] = SequenceParallel()
    return plan
