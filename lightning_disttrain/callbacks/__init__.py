"""Callbacks for any Lightning project: activation checkpointing, float8, MFU, samples, ..."""

from lightning_disttrain.callbacks.activation_checkpointing import SelectiveActivationCheckpointing
from lightning_disttrain.callbacks.sample import SampleGeneration
