"""The recorded traces a coordinator follows, and where it is in the one it follows now.

A step is keyed by how it began (its first event and whether grad was on). Each key keeps the
distinct event orders seen under it, most recently used first, with the `Schedule` planned for
each; ``max_traces`` bounds all of them together (least recently used key's oldest order goes
first), so alternating control flow does not re-record every step. Which order the next step of a
key follows is predicted from what followed the previous step's order last time (an A, B, A, B
alternation hits every time); without a prediction, the most recently used order.

Pure data: no torch, no parameters (the coordinator, runtime/coordinator.py, freezes and acts).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .schedule import PlanConfig, Schedule, plan
from .trace import Event, Trace

logger = logging.getLogger(__name__)

Entry = tuple[Trace, Schedule]


def _uses(trace: Trace) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for j, e in enumerate(trace.events):
        if e.kind.is_pre:
            for pid in e.params:
                out.setdefault(pid, []).append(j)
    return out


@dataclass(eq=False)
class Following:
    """A step that follows a cached trace: the next event expected, and when each parameter is
    used next (what the live budget's evictions ask)."""

    trace: Trace
    schedule: Schedule
    cursor: int = 0
    next_uses: dict[int, list[int]] = field(default_factory=dict)  # param id -> PRE event indices

    @classmethod
    def of(cls, entry: Entry) -> Following:
        return cls(entry[0], entry[1], next_uses=_uses(entry[0]))

    @property
    def expected(self) -> Event | None:
        """The next event of the trace (None: past its end)."""
        events = self.trace.events
        return events[self.cursor] if self.cursor < len(events) else None

    @property
    def completed(self) -> bool:
        return self.cursor == len(self.trace.events)

    def next_use(self, pid: int) -> int | None:
        """Index of the next PRE event using param ``pid`` (None: never again in this trace)."""
        for j in self.next_uses.get(pid, ()):
            if j >= self.cursor:
                return j
        return None


class TraceCache:
    """Cached traces and schedules by step key, least recently used evicted (see the module docstring)."""

    def __init__(self, max_traces: int) -> None:
        self.max_traces = max_traces
        self._traces: OrderedDict[str, list[Entry]] = OrderedDict()
        self._versions = 0
        self._last_seen: dict[str, int] = {}  # key -> version of the trace the last such step had
        self._successor: dict[tuple[str, int | None], int] = {}  # (key, previous version) -> next
        self.record_count = 0  # traces recorded (new orders)

    def predict(self, key: str) -> Entry | None:
        """The trace a step of ``key`` will most likely follow (None: none cached)."""
        candidates = self._traces.get(key) or []
        wanted = self._successor.get((key, self._last_seen.get(key)))
        return next((e for e in candidates if e[0].version == wanted), None) or \
            (candidates[0] if candidates else None)

    def keep(self, key: str, events: tuple[Event, ...], completed: Entry | None,
             freeze: Callable[[int], Trace], config: PlanConfig) -> Entry | None:
        """A step of ``key`` ended with ``events``; ``completed``: the trace it followed to the end
        without a divergence. Reuse the cached trace with these events, or freeze a new one
        (``freeze(version)``) and plan it. Returns the new entry (None: one was reused)."""
        if completed is not None:
            self._touch(key, completed)
            return None
        for entry in self._traces.get(key, []):
            if entry[0].events == events:
                self._touch(key, entry)
                return None
        self._versions += 1
        trace = freeze(self._versions)
        entry = (trace, plan(trace, config))
        self._traces.setdefault(key, []).insert(0, entry)
        self._traces.move_to_end(key, last=False)
        self._seen(key, trace.version)
        self._evict()
        self.record_count += 1
        logger.info("zero3: recorded trace %r v%d (%d events); planned peak live %d %s, %d all-gathers",
                    key, trace.version, len(events), entry[1].stats.peak_live, config.unit,
                    entry[1].stats.num_allgathers)
        return entry

    def _seen(self, key: str, version: int) -> None:
        self._successor[(key, self._last_seen.get(key))] = version
        self._last_seen[key] = version

    def _touch(self, key: str, entry: Entry) -> None:
        self._seen(key, entry[0].version)
        entries = self._traces[key]
        entries.remove(entry)
        entries.insert(0, entry)
        self._traces.move_to_end(key, last=False)

    def _evict(self) -> None:
        total = sum(len(v) for v in self._traces.values())
        while total > self.max_traces:
            last_key = next(reversed(self._traces))
            self._traces[last_key].pop()
            if not self._traces[last_key]:
                del self._traces[last_key]
            total -= 1
