"""Counting the bytes a rank receives on the wire, by kind and by node scope (docs/multinode.md#byte-accounting).

Pairwise messages are counted exactly, collectives by the logical bytes each peer contributes. Each
transport calls the counter once where it puts bytes on the wire, so the counts and the wire cannot
drift apart.
"""

from __future__ import annotations

from typing import Sequence

from ..metrics import VERIFICATION, StepMetrics
from .tags import Kind


class ByteCounter:
    """Adds received bytes to ``metrics.recv_bytes[kind][scope]`` (scope: ``intra`` / ``inter`` node)
    and pairwise ones to ``metrics.p2p_recv_bytes``."""

    def __init__(self, metrics: StepMetrics, nodes: Sequence[int], rank: int) -> None:
        self.metrics = metrics
        self.rank = rank
        self._scope = tuple("intra" if n == nodes[rank] else "inter" for n in nodes)

    def count(self, kind: Kind | str, peer: int, nbytes: int, pairwise: bool) -> None:
        """``nbytes`` received from group rank ``peer``."""
        key = kind.value if isinstance(kind, Kind) else kind
        counts = self.metrics.recv_bytes.get(key)
        if counts is None:
            counts = self.metrics.recv_bytes[key] = {"intra": 0, "inter": 0}
        counts[self._scope[peer]] += nbytes
        if pairwise:
            self.metrics.p2p_recv_bytes += nbytes

    def peers(self, kind: Kind | str, nbytes: int, header_bytes: int = 0, pairwise: bool = False) -> None:
        """The same ``nbytes`` (plus ``header_bytes`` of verification) from every other rank."""
        for q in range(len(self._scope)):
            if q != self.rank:
                self.count(kind, q, nbytes, pairwise)
                if header_bytes:
                    self.count(VERIFICATION, q, header_bytes, pairwise)
