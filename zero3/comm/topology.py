"""Which ranks share a node (a machine): for hpZ's node groups and for counting bytes intra / inter node.

A rank names its node by the host it runs on plus torchrun's ``GROUP_RANK`` (the agent's node rank)
when that is set, so two torchrun agents started on one machine (``--nnodes 2``, as the tests and the
benchmark do) count as two nodes, while ranks that a script spawns itself on one host are one node.
The communicator exchanges these names once when it is built (communicator.py) and keeps the node of every
rank of its group; what follows from them is decided here, without a process group.
"""

from __future__ import annotations

import logging
import os
import socket
from collections import Counter
from typing import Sequence

from ..errors import ZeroConfigError

logger = logging.getLogger(__name__)

AUTO = -1
"""``zero_hpz_partition_size = -1``: the number of ranks on this rank's node (those sharing its node identity)."""


def node_identity() -> str:
    """This process's node: its host name, plus torchrun's node rank (``GROUP_RANK``) when set."""
    group_rank = os.environ.get("GROUP_RANK")
    host = socket.gethostname()
    return host if group_rank is None else f"{host}/node{group_rank}"


def node_ids(identities: Sequence[str]) -> tuple[int, ...]:
    """Every rank's node as a small integer (numbered by first appearance), from every rank's identity."""
    ids: dict[str, int] = {}
    return tuple(ids.setdefault(name, len(ids)) for name in identities)


def hpz_group_size(requested: int, nodes: Sequence[int]) -> int:
    """The number of ranks of a secondary (hpZ) group, or 1 when hpZ has nothing to do.

    Groups are blocks of consecutive ranks of the data-parallel group (torchrun numbers the ranks of a
    node consecutively). ``requested`` is ``zero_hpz_partition_size``: 1 (off), ``AUTO`` (the ranks of
    one node; nodes must have equal rank counts and consecutive ranks), or an explicit size that must
    divide the world size. A group as large as the world would hold what the primary partition holds:
    hpZ is then off (logged). An explicit size whose blocks span nodes works, but its backward gathers
    cross nodes: that is logged as a warning.

    Raises:
        ZeroConfigError: the size does not divide the world, or AUTO on unequal or interleaved nodes.
    """
    world = len(nodes)
    if requested == 1 or world == 1:
        return 1
    if requested == AUTO:
        counts = Counter(nodes)
        sizes = sorted(set(counts.values()))
        if len(sizes) != 1:
            raise ZeroConfigError(f"zero_hpz_partition_size=-1 takes the ranks per node, but the nodes hold "
                                  f"{dict(sorted(counts.items()))} ranks (node: count); set the size explicitly")
        size = sizes[0]
        blocks = [set(nodes[i:i + size]) for i in range(0, world, size)]
        if any(len(b) != 1 for b in blocks):
            raise ZeroConfigError(f"zero_hpz_partition_size=-1 needs each node's ranks to be consecutive, but the "
                                  f"ranks' nodes are {list(nodes)}; start one launcher per node (torchrun does this) "
                                  "or set the size explicitly")
    else:
        size = requested
        if size > world or world % size:
            raise ZeroConfigError(f"zero_hpz_partition_size={size} must divide the data-parallel world size "
                                  f"{world} (the secondary groups are blocks of {size} consecutive ranks)")
    if size == world:
        logger.info("zero3: hpZ off: a secondary group of all %d ranks would hold what the primary partition holds",
                    world)
        return 1
    spanning = [i // size for i in range(0, world, size) if len(set(nodes[i:i + size])) > 1]
    if spanning:
        logger.warning("zero3: zero_hpz_partition_size=%d makes secondary groups %s span nodes (ranks' nodes: %s); "
                       "their backward all-gathers cross nodes", size, spanning, list(nodes))
    return size
