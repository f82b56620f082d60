"""Sharded checkpoints (save and resume at any world size), offline consolidation into one state
dict, and loading pretrained weights into a partitioned model.

By job: `format` (names, metadata version, the errors re-exported here), `save`, `reader` (any
world size, no engine), `load` (into a live engine), `consolidate` (offline, ``python -m
zero3.consolidate``), `live_state_dict` (gathered from a live engine), `hf_save` (a Hugging Face
directory streamed from a live engine, ``engine.save_pretrained``), `pretrained`, `safetensors`, `foreign`
(another framework's checkpoint directory, refused by name).

Activation checkpointing (recompute in backward) is a different feature: `zero3.activation`.
"""

from .format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
]
