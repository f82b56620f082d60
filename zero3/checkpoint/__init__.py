"""Sharded checkpoints (save and resume at any world size), offline consolidation into one state
dict, and loading pretrained weights into a partitioned model.

Activation checkpointing (recompute in backward) is a different feature: `zero3.activation`.
"""

from .checkpoint import (
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
