"""Parameters ``zero3.initialize`` adopts (made outside ``zero3.Init``) take rank 0's values first.

A model built without ``Init``, or a parameter added after it, holds whatever each rank drew; with a
different seed per rank, partitioning those values as they are would give every parameter rank 0's
first shard, rank 1's second, and so on: a weight no rank ever had. As DeepSpeed's ``Init(module=)``
does, every rank takes rank 0's values before anything is partitioned. The broadcasts are bucketed
(several parameters flattened into one message), so a big model built without ``Init`` costs about
its element count divided by `BUCKET_NUMEL` collectives, not one per parameter.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from ..comm.communicator import Communicator, Kind, Tag

logger = logging.getLogger(__name__)

BUCKET_NUMEL = 1 << 25
"""Elements one broadcast carries at most (128 MiB of fp32); a larger parameter goes alone, in place."""


def take_from_rank0(comm: Communicator, params: Sequence[tuple[str, torch.Tensor]], what: str = "initialize: parameters",
                    log: bool = True) -> None:
    """Overwrite ``params``' values with rank 0's (a collective: every rank passes its tensors in the
    same order; ``what`` names them in the tags). Meta tensors hold no values and are left alone.
    Logs one INFO line on rank 0 when ``log``."""
    todo = [(name, p) for name, p in params if p.device.type != "meta"]
    if comm.world_size == 1 or not todo:
        return
    buckets = _buckets([p for _, p in todo])
    for i, bucket in enumerate(buckets):
        _broadcast(comm, bucket, Tag(Kind.BROADCAST, f"{what} from rank 0 (bucket {i + 1} of {len(buckets)})"))
    if log and comm.rank == 0:
        logger.info("zero3: initialize took the values of %d parameters made outside zero3.Init (%d elements) from "
                    "rank 0, in %d broadcasts, so every rank partitions the same weights", len(todo),
                    sum(p.numel() for _, p in todo), len(buckets))


def _buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` in order, grouped by (device, dtype), each group cut at `BUCKET_NUMEL` elements."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}  # elements in each group's last bucket
    for p in params:
        key = (p.device, p.dtype)
        runs = groups.setdefault(key, [[]])
        if runs[-1] and filled[key] + p.numel() > BUCKET_NUMEL:
            runs.append([])
            filled[key] = 0
        runs[-1].append(p)
        filled[key] = filled.get(key, 0) + p.numel()
    return [run for runs in groups.values() for run in runs]


@torch.no_grad()
def _broadcast(comm: Communicator, bucket: list[torch.Tensor], tag: Tag) -> None:
    """One broadcast of ``bucket``'s values from rank 0 (on the communicator's device: NCCL's CUDA)."""
    device = bucket[0].device if comm.device.type == "cpu" else comm.device
    if len(bucket) == 1 and bucket[0].device == device and bucket[0].data.is_contiguous():
        comm.broadcast(_wire(bucket[0].data.reshape(-1)), 0, tag)
        return
    flat = torch.cat([p.data.reshape(-1).to(device) for p in bucket])
    comm.broadcast(_wire(flat), 0, tag)
    off = 0
    for p in bucket:
        n = p.numel()
        p.data.copy_(flat[off: off + n].view_as(p.data))
        off += n


def _wire(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` itself, or its bytes for a dtype the backends do not carry (float8, uint16/32/64: gloo
    raised "Invalid scalar type", reported as a timeout of initialize, probe 35C); a view either way,
    so the broadcast writes ``flat``."""
    return flat.view(torch.uint8) if flat.dtype in torch.storage._new_dtypes() else flat
