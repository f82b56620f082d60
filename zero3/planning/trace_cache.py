"""The running step's trace: what it recorded, the cached trace it follows, and the cache of traces.

[Note: following a trace]
Each event is compared with the next event of the followed trace (kind, module, parameter ids). On
a match the coordinator runs the planned action: releases, then the demand fetch (what is not
already gathered or in flight), then the prefetch bucket. On a mismatch nothing raises: the
divergence is logged once, the coordinator releases every gathered parameter no running module
needs (what was prefetched for nothing included), and fetches on demand until the step ends. The
step is still recorded; if its order is new it becomes another cached trace.

A new order more than `LONG_FACTOR` times as long as every order its key has cached (and longer than
`LONG_EVENTS`) is planned only when it comes again among its key's last `LONG_SEEN` such orders:
planning costs about as much per event as the hooks that recorded it, and such an order is most
often one that will not come again (a loop of forwards with grad on and no backward joins the next
step's trace: probe 32Q measured the first step after 100 of them at 38-73x a steady step, most of
it planning). A key's first order is always planned (a single long step is what
`zero3.plan.record_trace` records), and so is one within `LONG_FACTOR` of an order its key has
cached (an RNN's length buckets, once one of them is; review 34RA: a cap by length alone left
alternating long orders unplanned for good, and review 34RB: so did remembering one long order).
Left (review 34RC): a cycle of more than `LONG_SEEN` long orders after a short first one is never
planned, and once a long order is cached, later ones within `LONG_FACTOR` of it (evaluations of
similar lengths joining training steps) are planned as they come.

A step is keyed by how it began (its first event and whether grad was on). Each key keeps the
distinct event orders seen under it, most recently used first, with the `Schedule` planned for
each; ``max_traces`` bounds all of them together (least recently used key's oldest order goes
first), so alternating control flow does not re-record every step. Which order the next step of a
key follows is predicted from what followed the last order's latest occurrence, or, in the key's
last ``HISTORY`` orders, from a point whose run of orders matches the most recent run clearly longer
(`_continuation`): an A, B, A, B alternation hits every time, and so does A, B, B, A, B, B (one
successor per order alone mispredicted 2 of every 3 steps there, probe 32Q, as after B comes B or
A); without a prediction, the most recently used order.

Pure data: no torch, no parameters (the coordinator, runtime/coordinator.py, acts on the plan).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .schedule import PlanConfig, Schedule, plan
from .trace import Event, EventKind, ParamInfo, Trace, TraceRecorder
from .trace import logger as trace_logger

logger = logging.getLogger(__name__)

Entry = tuple[Trace, Schedule]

HISTORY = 24
"""Orders remembered per key for the prediction: a pattern of period up to about half of it settles."""

_MARGIN = 2
"""How much longer an older point's match must be than the latest occurrence's to be followed (`_continuation`)."""

LONG_EVENTS, LONG_FACTOR, LONG_SEEN = 1024, 4, 8
"""A new order of more events than ``LONG_EVENTS`` and than ``LONG_FACTOR`` times its key's longest
cached order is planned when it comes again among the key's last ``LONG_SEEN`` such orders (module
docstring)."""


@dataclass(eq=False)
class Following:
    """A step that follows a cached trace: the next event expected, and when each parameter is
    used next (what the live budget's evictions ask)."""

    trace: Trace
    schedule: Schedule
    cursor: int = 0

    @classmethod
    def of(cls, entry: Entry) -> Following:
        return cls(entry[0], entry[1])

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
        for j in self.trace.uses.get(pid, ()):
            if j >= self.cursor:
                return j
        return None


class TraceCache:
    """Cached traces and schedules by step key, least recently used evicted (see the module docstring)."""

    def __init__(self, max_traces: int) -> None:
        self.max_traces = max_traces
        self._traces: OrderedDict[str, list[Entry]] = OrderedDict()
        self._versions = 0
        self._history: dict[str, list[int]] = {}  # key -> versions of its last steps' traces, oldest first
        self._successor: dict[tuple[str, int], int] = {}  # (key, version) -> the version after it last time
        self.record_count = 0  # traces recorded (new orders)
        self._long: dict[str, list[int]] = {}  # key -> hashes of its last long orders not planned (a
        # collision only plans an order at its first step)
        self.long_count = 0  # long orders seen once and not planned
        self.evictions = 0  # times traces were dropped over max_traces

    def predict(self, key: str) -> Entry | None:
        """The trace a step of ``key`` will most likely follow (None: none cached)."""
        candidates = self._traces.get(key) or []
        history = self._history.get(key, [])
        wanted = _continuation(history)
        if wanted is None and history:  # its last occurrence is older than the window
            wanted = self._successor.get((key, history[-1]))
        return next((e for e in candidates if e[0].version == wanted), None) or \
            (candidates[0] if candidates else None)

    def keep(self, key: str, events: tuple[Event, ...], completed: Entry | None,
             freeze: Callable[[int], Trace], config: PlanConfig) -> Entry | None:
        """A step of ``key`` ended with ``events``; ``completed``: the trace it followed to the end
        without a divergence. Reuse the cached trace with these events, or freeze a new one
        (``freeze(version)``) and plan it, a much longer one only when it comes again (module
        docstring). Returns the new entry (None: one was reused, or none planned)."""
        if completed is not None:
            self._touch(key, completed)
            return None
        for entry in self._traces.get(key, []):
            if entry[0].events == events:
                self._touch(key, entry)
                return None
        cached = self._traces.get(key)
        if cached and len(events) > max(LONG_EVENTS, LONG_FACTOR * max(len(e[0].events) for e in cached)):
            seen = self._long.setdefault(key, [])
            if (digest := hash(events)) not in seen:
                seen.append(digest)
                del seen[:-LONG_SEEN]
                self.long_count += 1
                logger.info("zero3: a step of %r ran %d events, over %d times its longest planned order: not "
                            "planned unless this order comes again (forwards with grad on and no backward join the "
                            "next step's trace: run evaluation under torch.no_grad())", key, len(events), LONG_FACTOR)
                return None
            seen.remove(digest)
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

    def replan(self, config: PlanConfig) -> None:
        """Plan every cached trace again with ``config`` (new budgets: ``memory_budget``'s choice)."""
        for key, entries in self._traces.items():
            self._traces[key] = [(trace, plan(trace, config)) for trace, _ in entries]

    def find(self, trace: Trace) -> Entry | None:
        """The cached entry of ``trace`` (None: evicted)."""
        return next((e for e in self._traces.get(trace.key, []) if e[0] is trace), None)

    def _seen(self, key: str, version: int) -> None:
        history = self._history.setdefault(key, [])
        if history:
            self._successor[(key, history[-1])] = version
        history.append(version)
        del history[:-HISTORY]

    def _touch(self, key: str, entry: Entry) -> None:
        self._seen(key, entry[0].version)
        entries = self._traces[key]
        entries.remove(entry)
        entries.insert(0, entry)
        self._traces.move_to_end(key, last=False)

    def cached(self) -> set[tuple[str, int]]:
        """The (key, version) of every cached trace."""
        return {(key, e[0].version) for key, entries in self._traces.items() for e in entries}

    def _evict(self) -> None:
        """Drop the least recently used traces over ``max_traces``, and what was learnt of them: a
        version is never seen again (an order that comes back is recorded with a new one), so keeping
        their successors grew by one entry a step while more orders than ``max_traces`` alternated
        (probe 26D: 1,695 after 2,000 steps of 24 orders)."""
        total = sum(len(v) for v in self._traces.values())
        if total <= self.max_traces:
            return
        if not self.evictions:
            logger.warning("zero3: steps ran in more orders than max_traces=%d keeps: from now on an order that comes "
                           "back after its trace was dropped is recorded again, and its step fetches on demand from "
                           "where it leaves the trace it was predicted to follow (logged at INFO while traces keep being "
                           "dropped). Raise max_traces if the orders are few", self.max_traces)
        self.evictions += 1
        while total > self.max_traces:
            last_key = next(reversed(self._traces))
            self._traces[last_key].pop()
            if not self._traces[last_key]:
                del self._traces[last_key]
                self._history.pop(last_key, None)
                self._long.pop(last_key, None)
            total -= 1
        live = self.cached()
        for key, history in self._history.items():
            history[:] = [v for v in history if (key, v) in live]
        self._successor = {k: v for k, v in self._successor.items() if k in live and (k[0], v) in live}


def _continuation(history: list[int]) -> int | None:
    """The version that followed the last version's latest earlier occurrence (the one-successor rule),
    unless an older point's run of versions up to it matches the run up to the end at least
    `_MARGIN` longer: then what followed the longest such point (latest on ties). None: the last
    version never came before.

    The margin keeps a one-off order from being predicted again: in A..A B A^k the point before B
    matches k A's and the latest A only k-1 (the B stops it), so a plain longest match forecast B for
    about 12 steps where the one-successor rule missed 2 (review 32RD); a periodic order's point a
    period back matches the whole window, far more than the latest occurrence does."""
    n = len(history)
    best = recent = None
    best_len = recent_len = 0
    for j in range(n - 2, -1, -1):
        if best_len >= j + 1:  # no earlier point can match longer
            break
        m = 0
        while m <= j and history[j - m] == history[n - 1 - m]:
            m += 1
        if m and recent is None:
            recent, recent_len = history[j + 1], m
        if m > best_len:
            best, best_len = history[j + 1], m
    return best if best_len >= recent_len + _MARGIN else recent


class StepTraces:
    """The running step's recording and the trace it follows, over a `TraceCache`."""

    def __init__(self, max_traces: int) -> None:
        self.cache = TraceCache(max_traces)
        self._recorder = TraceRecorder()
        self.key: str | None = None  # the running step's key (None: between steps)
        self.following: Following | None = None
        self.diverged = False  # the running (or the last) step left its trace
        self._debug = False  # whether the trace's DEBUG lines are on, read once per step (`begin`)
        self._announced: set[tuple[str, int, int]] = set()
        self._steps = 0  # steps begun
        self._evicted_at = -10**9  # the step whose trace last made the cache drop one (thrashing)
        self.last: Entry | None = None  # the trace and schedule of the last step that had one

    def begin(self, key: str) -> Following | None:
        """A step of ``key`` begins: follow the trace the cache predicts for it, if any."""
        self.key = key
        self._steps += 1
        self.diverged = False
        self._debug = trace_logger.isEnabledFor(logging.DEBUG)
        chosen = self.cache.predict(key)
        self.following = None if chosen is None else Following.of(chosen)
        if chosen is not None:
            self.last = chosen
        return self.following

    def observe(self, kind: EventKind, module: str, ids: tuple[int, ...], step: int) -> int | None:
        """Record one hook event of the running step, and return its index in the followed trace when
        it is the one expected (the cursor moves past it); None when no trace is followed, or the step
        leaves it here (logged once). One call per hook event: this is the hook path.

        While the step follows its trace, what it recorded is the trace's first ``cursor`` events, so
        nothing is appended: the recorder gets that prefix when the step leaves the trace or ends.
        """
        following = self.following
        if following is None:
            self._recorder.record(kind, module, ids)
            return None
        i = following.cursor
        events = following.trace.events  # `Following.expected`, inline: this runs for every hook event
        expected = events[i] if i < len(events) else None
        if expected is not None and expected.kind is kind and expected.module == module and expected.params == ids:
            following.cursor += 1
            if self._debug:
                TraceRecorder.log(expected)
            return i
        self._recorder.extend(events[:i])
        self._recorder.record(kind, module, ids)
        trace = following.trace
        if (trace.key, trace.version, i) not in self._announced:
            self._announced.add((trace.key, trace.version, i))
            want = "the end of the trace" if expected is None else \
                f"{expected.kind.value} {expected.module or '<root>'!r}"
            got = f"{kind.value} {module or '<root>'!r}"
            if expected is not None and expected.kind is kind and expected.module == module:
                # the same module with other parameters: most often one it read from another module in
                # the last forward (an external parameter, gathered with it from then on)
                want += f" with parameters (ds_id) {list(expected.params)}"
                got += f" with {list(ids)}"
            thrashing = self._steps - self._evicted_at <= self.cache.max_traces  # said once at the first eviction
            logger.log(logging.INFO if thrashing else logging.WARNING,
                       "zero3: step %d left trace %r v%d at event %d: expected %s, got %s; fetching on "
                       "demand for the rest of the step", step, trace.key, trace.version, i, want, got)
        self.following = None
        self.diverged = True
        return None

    def end(self, aborted: bool, params: Callable[[], Mapping[int, ParamInfo]], config: PlanConfig) -> None:
        """The step ended: unless ``aborted``, keep its trace (the one it followed, a cached one with
        the same events, or a new one over ``params()``, planned with ``config``)."""
        key, self.key = self.key, None
        followed, self.following = self.following, None
        if followed is not None:  # it never left its trace: what it recorded is the part it followed
            self._recorder.extend(followed.trace.events[:followed.cursor])
        events = self._recorder.events
        try:
            if key is not None and not aborted and events:
                completed = (followed.trace, followed.schedule) \
                    if followed is not None and not self.diverged and followed.completed else None
                evictions = self.cache.evictions
                entry = self.cache.keep(key, events, completed, lambda v: self._recorder.freeze(key, v, params()),
                                        config)
                if entry is not None:
                    self.last = entry
                    live = self.cache.cached()  # what is announced of an evicted trace is never read again
                    self._announced = {a for a in self._announced if (a[0], a[1]) in live}
                    if self.cache.evictions != evictions:
                        self._evicted_at = self._steps
        finally:
            self._recorder.clear()

    def replan(self, config: PlanConfig) -> None:
        """Between steps: plan every cached trace again with ``config`` (`TraceCache.replan`)."""
        self.cache.replan(config)
        if self.last is not None:
            self.last = self.cache.find(self.last[0]) or self.last

    def explain(self, target: tuple[str, object], config: PlanConfig) -> list[str]:
        """Why the last planned step gathered, kept and released what it did (``engine.explain``)."""
        kind, value = target
        if self.last is None:
            return ["no step has been recorded yet: outside generation mode every fetch so far was on demand, "
                    "released right after use"]
        schedule = self.last[1]
        header = [f"trace {schedule.trace_key!r} v{schedule.trace_version}, budgets {config}"]
        if self.diverged:
            header.append("note: the last step left this trace and fetched on demand after the divergence")
        if kind == "param":
            return header + schedule.explain(param_id=value)  # type: ignore[arg-type]
        if kind == "module":
            return header + schedule.explain(module=value)  # type: ignore[arg-type]
        if kind == "params":  # a module's parameters, wherever their decisions were taken
            return header + schedule.explain(param_ids=value)  # type: ignore[arg-type]
        return header + schedule.explain()
