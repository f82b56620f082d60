"""The prefetch policy of generation mode (``engine.generation()``): decode loops without a trace.

A decode loop runs the same forward once per token, and nothing ends a step between them, so there
is no recorded trace to plan from. Two facts stand in for it:
- the modules repeat in a cycle, so the later a parameter was last used, the later it is used next:
  its last use is its next use for `schedule.eviction_order` (the one eviction policy, Belady), and
  the most recently used goes first when the live cap forces a release;
- the cycle itself is learnt from the PRE events of one forward, and the event after the current
  one is prefetched along it.

Pure data over parameter ids: the coordinator (runtime/coordinator.py) gathers and releases.
"""

from __future__ import annotations

from collections.abc import Sequence


class GenerationPrefetch:
    """Last uses and the learnt cycle of PRE events of one generation session."""

    def __init__(self) -> None:
        self._clock = 0
        self._last_use: dict[int, int] = {}  # param id -> clock of its last use
        self._cycle: list[tuple[int, ...]] = []  # the PRE events of one forward, in order
        self._at = 0  # where in that cycle the next PRE event should be

    def use(self, ids: Sequence[int]) -> None:
        """A PRE event uses ``ids`` now."""
        self._clock += 1
        for pid in ids:
            self._last_use[pid] = self._clock

    def next_use(self, pid: int) -> int:
        """Stands in for the next use of ``pid`` (see the module docstring)."""
        return self._last_use.get(pid, 0)

    def advance(self, ids: Sequence[int]) -> tuple[int, ...] | None:
        """Learn the cycle from the PRE event that used ``ids``; return the ids of the event expected
        next (None while the cycle has fewer than two events)."""
        ids = tuple(ids)
        cycle, at = self._cycle, self._at
        if at < len(cycle) and cycle[at] == ids:
            at += 1
        elif cycle and cycle[0] == ids:
            at = 1  # a new forward began
        else:
            del cycle[at:]  # a new order: record it from here
            cycle.append(ids)
            at = len(cycle)
        self._at = at
        return cycle[at % len(cycle)] if len(cycle) > 1 else None
