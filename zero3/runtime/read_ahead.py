"""Reading parameter shards from the drive ahead of their gathers (``offload_param="nvme"``).

[Note: reading shards ahead]
With ``offload_param="nvme"`` a shard is only on the drive until it is needed (offload/nvme.py
[Note: swapping]). Every gather first makes its shards readable (`ReadAhead.readable`); when a trace
is followed, the order of the step's gathers is known (each action's demand fetch, then its
prefetch: `gather_order`), and after every event the coordinator reads the shards of the next
gathers into the buffer pool, as far as the pool has room, so the drive works while the modules
compute. A shard's slot is freed as soon as its gather is done, which is what makes room for the
next reads. While following, the pool holds only shards of gathers in flight and of the next
gathers in order, so a gather that finds the pool full waits for the gathers in flight; only after a
divergence (or when one module needs more than the pool) are shards read ahead dropped, or read
into their own memory.
"""

from __future__ import annotations

from collections.abc import Callable

from ..offload.nvme import ShardTier
from ..partition.state import Residence
from ..partition.param import ZeroParameter
from ..planning.schedule import Schedule


def gather_order(schedule: Schedule) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The step's all-gathers in the order they are issued: (event index, parameter ids) of each
    action's demand fetch, then of its prefetch."""
    out = []
    for a in schedule.actions:
        if a.fetch:
            out.append((a.index, a.fetch))
        if a.prefetch:
            out.append((a.index, a.prefetch))
    return tuple(out)


class ReadAhead:
    """The shard tier's reads for the coordinator's gathers, ahead along a followed schedule."""

    def __init__(self, tier: ShardTier) -> None:
        self.tier = tier
        self._gathers: tuple[tuple[int, tuple[int, ...]], ...] = ()  # of the followed schedule
        self._ahead = 0  # the next entry of `_gathers` to read ahead ...
        self._ahead_at = 0  # ... and the next parameter in it

    def follow(self, schedule: Schedule, param_of: Callable[[int], ZeroParameter]) -> None:
        """A step follows ``schedule``: read ahead for its first gathers (if any shard is on the drive)."""
        self._gathers = gather_order(schedule) if self.tier.shards else ()
        self._ahead = self._ahead_at = 0
        if self._gathers:
            self.advance(-1, param_of)

    def stop(self) -> None:
        """The step ended or left its trace: drop what was read ahead."""
        self._gathers = ()
        self.tier.drop_ahead()

    def advance(self, i: int, param_of: Callable[[int], ZeroParameter]) -> None:
        """Read the shards of the gathers after event ``i``, in order, while the pool has room."""
        seq = self._gathers
        if not seq:
            return
        k, at = self._ahead, self._ahead_at
        while k < len(seq) and seq[k][0] <= i:  # gathers issued by now: no longer ahead
            k, at = k + 1, 0
        while k < len(seq):
            ids = seq[k][1]
            while at < len(ids):
                p = param_of(ids[at])
                sw = p._zero.swap
                if sw is not None:
                    if p._zero.residence is not Residence.DRIVE and p._zero.residence is not Residence.WRITING:
                        self._ahead, self._ahead_at = k, at
                        return  # still in memory for an earlier gather: wait until that one is done
                    if self.tier.read([p], ahead=True):
                        self._ahead, self._ahead_at = k, at
                        return  # the pool is full
                at += 1
            k, at = k + 1, 0
        self._ahead, self._ahead_at = k, at

    def readable(self, params: list[ZeroParameter], wait_in_flight: Callable[[], None]) -> None:
        """Make the shards of ``params`` readable for their gather (reading what is only on the
        drive); ``wait_in_flight`` waits for every gather in flight, which frees their pool slots."""
        tier = self.tier
        missed = tier.read(params)
        if missed:  # the pool is full: gathers in flight hold it; their shards go once they are done
            wait_in_flight()
            missed = tier.read(missed)
        if missed:  # still full: shards read ahead for later gathers (only after a divergence)
            tier.drop_ahead(keep=params)
            self._ahead = self._ahead_at = 0  # read them again later
            tier.read(missed, overflow=True)
        tier.wait(params)
