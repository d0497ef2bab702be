"""Callbacks for any Lightning project: activation checkpointing, float8, MFU, samples, profiling,
preemption checkpoints, QK-clip.

Each works under lightning-disttrain's strategies (registering its model transform with the
strategy, which applies it at its place in the fixed order) and under any other strategy.
"""

from lightning_disttrain.callbacks.activation_checkpointing import SelectiveActivationCheckpointing
from lightning_disttrain.callbacks.checkpoint_cadence import CheckpointCadence
from lightning_disttrain.callbacks.checkpoint_eval import CheckpointEval
from lightning_disttrain.callbacks.float8 import Float8Training
from lightning_disttrain.callbacks.mfu import MFUMonitor
from lightning_disttrain.callbacks.preemption import PreemptionCheckpoint, PreemptionExit
from lightning_disttrain.callbacks.preemption_notices import AWSSpotNotice, GCPPreemptionNotice
from lightning_disttrain.callbacks.profiler import ProfilerCallback
from lightning_disttrain.callbacks.qk_clip import QKClip
from lightning_disttrain.callbacks.sample import SampleGeneration
from lightning_disttrain.peak_flops import peak_flops  # the peak table lives below the callbacks (planning reads it)

__all__ = ["AWSSpotNotice", "CheckpointCadence", "CheckpointEval", "Float8Training", "GCPPreemptionNotice", "MFUMonitor",
           "PreemptionCheckpoint", "PreemptionExit", "ProfilerCallback", "QKClip", "SampleGeneration", "SelectiveActivationCheckpointing", "peak_flops"]
