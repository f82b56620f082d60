"""hpZ: the communicator over a rank's secondary group (a block of consecutive ranks, usually a node).

Backward gathers each weight from the secondary slices (secondary.py) the group's ranks kept from
forward, over this communicator, so the bytes stay inside the node (runtime/hpz.py [Note: hpZ
secondary shards]). It is a communicator of its own, built once next to the data-parallel one; the
data-parallel one only knows the group size (``Communicator.hpz``), fixed when it was built.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ..errors import ZeroConfigError
from .communicator import Communicator
from .own_groups import align_group_counts, step_past_taken_names


def secondary_communicator(parent: Communicator) -> Communicator:
    """A new communicator over ``parent``'s secondary group (its ``hpz`` consecutive group ranks),
    with its settings and metrics, that gathers from secondary slices (`all_gather_secondary`).

    Each rank creates only its own block's process group (``use_local_synchronization``), so the
    blocks need no common order; every rank of a block must call this at the same point
    (``zero3.initialize`` does).
    """
    size, w = parent.hpz, parent.world_size
    if size < 2 or size >= w or w % size:
        raise ZeroConfigError(f"an hpZ group of {size} ranks needs 1 < size < world size {w} dividing it")
    first = parent.rank // size * size
    ranks = [parent.global_rank(first + j) for j in range(size)]
    cfg = parent.config
    kwargs = {"timeout": datetime.timedelta(seconds=cfg.timeout_s)} if cfg.timeout_s > 0 else {}
    align_group_counts(parent.group, parent.backend, parent.device)  # so torch names the block alike (own_groups.py)
    step_past_taken_names(parent.group, ranks, parent.backend, parent.device)
    group = dist.new_group(ranks, backend=parent.backend, use_local_synchronization=True, **kwargs)
    return Communicator(group, cfg.replace(quantize_gradients=0, hpz_partition_size=1), metrics=parent.metrics,
                        world_size=size, rank=parent.rank - first, nodes=parent.nodes[first: first + size],
                        dedicated=True, secondary_span=w // size)
