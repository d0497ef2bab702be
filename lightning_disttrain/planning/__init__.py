"""Memory, layout, speed, cost and checkpoint-interval arithmetic behind ``lightning-disttrain plan``.

Plain arithmetic over a model's parameter counts and ``GPTConfig`` fields (``model_shape``), no
Lightning and no process group: ``spec`` (inputs), ``activations`` (bytes a block keeps, by
checkpointing policy), ``pipeline`` (what a pipeline rank holds, from the strategy's schedule
arguments), ``memory`` (bytes per GPU), ``layouts`` (candidates, recommendation), ``throughput``
(time by term, cost, Young/Daly), ``planner`` (one plan), ``report`` / ``config_yaml`` /
``command`` (the CLI's table, JSON and YAML).
"""

from lightning_disttrain.planning.layouts import Candidate, evaluate, recommend
from lightning_disttrain.planning.memory import (
    STATE_BYTES,
    MemoryEstimate,
    activation_bytes_per_layer,
    memory_per_gpu,
    memory_per_rank,
    state_bytes_per_param,
)
from lightning_disttrain.planning.model_shape import ModelShape, config_for, shape_of
from lightning_disttrain.planning.planner import Money, Plan, make_plan
from lightning_disttrain.planning.spec import GB, Cluster, Layout, Workload
from lightning_disttrain.planning.throughput import young_daly_interval

__all__ = ["GB", "STATE_BYTES", "Candidate", "Cluster", "Layout", "MemoryEstimate", "ModelShape", "Money", "Plan",
           "Workload", "activation_bytes_per_layer", "config_for", "evaluate", "make_plan", "memory_per_gpu",
           "memory_per_rank",
           "recommend", "shape_of", "state_bytes_per_param", "young_daly_interval"]
