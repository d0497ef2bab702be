"""Callbacks for any Lightning project: activation checkpointing, float8, MFU, samples, ..."""

from lightning_disttrain.callbacks.activation_checkpointing import SelectiveActivationCheckpointing
from lightning_disttrain.callbacks.sample import SampleGeneration
from lightning_disttrain.callbacks.float8 import Float8Training
from lightning_disttrain.callbacks.mfu import MFUMonitor
# Last, after mfu imported the submodule: the package name `peak_flops` is the function.
from lightning_disttrain.callbacks.peak_flops import peak_flops
