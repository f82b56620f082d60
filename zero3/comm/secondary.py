"""hpZ secondary slices: what a rank keeps of each weight gathered in forward, cut from the finished gather.

A rank keeps, from each forward gather, 1/L of the parameter (L the ranks of its secondary group,
a block of consecutive ranks, usually a node: `topology.hpz_group_size`); backward gathers the
parameter from those slices over the secondary group's own communicator (hpz.py), so the bytes stay
inside the node (runtime/hpz.py [Note: hpZ secondary shards]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..partition import sharding
from ..partition.param import ZeroParameter, raw_data


@dataclass(eq=False)
class Secondary:
    """hpZ: what a rank keeps of one parameter from a forward gather until the step ends, its
    secondary slice (`sharding.secondary_range`): in the parameter's dtype, padded; or under qwZ the
    quantized bytes of the N primary shards the slice spans, as they arrived (each shard's values,
    then its scales), so backward computes with the very weights forward did."""

    data: torch.Tensor
    quantized: bool

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(frozen=True, slots=True)
class SecondaryCutter:
    """Cuts this rank's secondary slices from a finished gather over ``world`` ranks, in secondary
    groups of ``size``."""

    world: int
    size: int
    rank: int

    def from_rows(self, params: Sequence[ZeroParameter], rows: list[torch.Tensor],
                  layout: list[tuple[int, int, int]]) -> dict[int, Secondary]:
        """qwZ: the quantized pieces of the primary shards the slice spans, as they arrived."""
        span, local = self.world // self.size, self.rank % self.size
        out: dict[int, Secondary] = {}
        off = 0
        for p, (_, v, nb) in zip(params, layout):
            seg = v + 4 * nb
            pieces = [rows[local * span + i][off: off + seg] for i in range(span)]
            out[p._zero.id] = Secondary(torch.cat(pieces), quantized=True)
            off += seg
        return out

    def from_storage(self, params: Sequence[ZeroParameter]) -> dict[int, Secondary]:
        """A copy of 1/``size`` of each gathered parameter."""
        local = self.rank % self.size
        out: dict[int, Secondary] = {}
        for p in params:
            z = p._zero
            data = torch.zeros(sharding.secondary_numel(z.numel, self.world, self.size), dtype=raw_data(p).dtype,
                               device=raw_data(p).device)
            lo, hi = sharding.secondary_range(z.numel, self.world, self.size, local)
            if hi > lo:
                data[: hi - lo].copy_(raw_data(p).view(-1)[lo:hi])
            out[z.id] = Secondary(data, quantized=False)
        return out
