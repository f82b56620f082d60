"""Pure partition math: how a tensor of ``numel`` elements is split into equal padded shards.

Rank ``r`` of ``world_size`` owns the flat range ``[r * shard_numel, (r + 1) * shard_numel)`` of the
tensor padded with zeros to ``world_size * shard_numel`` elements. Only the last ranks hold padding,
and padding is never visible to the user: gathering slices it off. No process group here.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def shard_numel(numel: int, world_size: int) -> int:
    """Elements in each rank's (padded) shard: ``ceil(numel / world_size)``."""
    _check_world(world_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return math.ceil(numel / world_size)


def padded_numel(numel: int, world_size: int) -> int:
    return shard_numel(numel, world_size) * world_size


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """Range of *real* (unpadded) elements rank ``rank`` owns, as ``(start, end)``; may be empty."""
    _check_rank(rank, world_size)
    s = shard_numel(numel, world_size)
    start = min(rank * s, numel)
    return start, min(start + s, numel)


def shard_tensor(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """This rank's padded 1-D shard of ``full`` (a new tensor, never a view of ``full``)."""
    _check_rank(rank, world_size)
    flat = full.reshape(-1)
    s = shard_numel(flat.numel(), world_size)
    out = torch.zeros(s, dtype=full.dtype, device=full.device)
    start, end = shard_range(flat.numel(), world_size, rank)
    if end > start:
        out[: end - start].copy_(flat[start:end])
    return out


def unshard(shards: Sequence[torch.Tensor], shape: torch.Size | Sequence[int]) -> torch.Tensor:
    """Rebuild the full tensor of ``shape`` from every rank's padded shard, in rank order."""
    shape = torch.Size(shape)
    numel = shape.numel()
    sizes = {s.numel() for s in shards}
    if len(sizes) > 1:
        raise ValueError(f"shards must all have the same size, got sizes {sorted(sizes)}")
    expected = shard_numel(numel, len(shards))
    if shards and shards[0].numel() != expected:
        raise ValueError(f"shard size {shards[0].numel()} does not match {expected} for numel {numel}")
    return torch.cat([s.reshape(-1) for s in shards])[:numel].view(shape)


def _check_world(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def _check_rank(rank: int, world_size: int) -> None:
    _check_world(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def secondary_numel(numel: int, world_size: int, group_size: int) -> int:
    """hpZ: elements of each secondary slice (padded). A secondary group of ``group_size`` ranks splits
    a tensor in ``group_size`` slices of ``N = world_size / group_size`` consecutive primary shards
    each, so a slice is a union of whole primary shards: what the forward gathered (or its quantized
    bytes) is kept as it arrived, with the primary padding."""
    _check_group(world_size, group_size)
    return (world_size // group_size) * shard_numel(numel, world_size)


def secondary_range(numel: int, world_size: int, group_size: int, local_rank: int) -> tuple[int, int]:
    """Range of real elements the secondary slice of rank ``local_rank`` of its group covers; may be empty."""
    _check_rank(local_rank, group_size)
    n = secondary_numel(numel, world_size, group_size)
    start = min(local_rank * n, numel)
    return start, min(start + n, numel)


def _check_group(world_size: int, group_size: int) -> None:
    _check_world(world_size)
    if group_size < 1 or world_size % group_size:
        raise ValueError(f"group_size must divide world_size {world_size}, got {group_size}")
