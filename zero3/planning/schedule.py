"""Plan the gathers, prefetches and releases of one recorded step; a pure function of the trace.

`plan(trace, config)` walks the trace once, simulating exactly what the runtime will hold, and
returns a frozen `Schedule` with one `Action` per event. The coordinator executes the actions
verbatim; `replay` re-executes a schedule independently and recounts its stats.

[Note: schedule semantics]
Sizes are `ParamInfo.numel` or `.nbytes` (`PlanConfig.unit`). Persistent params are ignored
everywhere. A param is *live* from the issue of its gather until its release; *pinned* while an
open visit (see trace.py [Note: visits]) uses it. Pinned params are never released.

- PRE event i, params P: (1) if live + size(P not live) > max_live, evict unpinned live params
  outside P, furthest next use first (Belady; no next use is furthest; ties: lower id first)
  until it fits or none are left, so an overflow leaves only what open visits need;
  (2) demand-fetch P's non-live params as one collective; (3) prefetch.
- POST event closing visit v: each param of v no other open visit pins is kept when its reuse
  distance is <= max_reuse_distance, else released. If live still exceeds max_live afterwards
  (the closing visit had overflowed the cap), evict as in (1) with nothing incoming, so the cap
  holds again the moment no open visit needs more. Then prefetch.
- Reuse distance of p after event i: the summed size of the PRE events strictly between i and
  p's next use j (each event counted fully, each param once per event); no next use = infinite.
- End of trace: release everything still live.
- Last pass (hold.py [Note: holds]): a release after use whose param is prefetched again before
  its next use becomes a hold when live stays within the plan's peak and nothing is evicted
  until that use; the prefetch is dropped.

[Note: prefetch look-ahead]
After every event at which at most half of ``prefetch_bucket_size`` is pending (below that the
walk waits, so buckets go out whole), walk the upcoming PRE events in order and collect params that are not live
and not yet collected, appending while pending + bucket + size <= prefetch_bucket_size and
live + bucket + size <= max_live, stopping at the first param that does not fit. The walk also
stops *before* PRE event k when size(pinned now, union the params of every PRE event up to and
including k) > max_live: nothing is prefetched for event k unless all of that fits at once. That
bound guarantees a prefetched param is never evicted before its use: at any eviction before its
use, every live param whose next use is later (or never) is evicted first, and what remains fits
inside that union, so the eviction stops before reaching it. `PlanStats.wasted_prefetches` is
therefore 0 for every plan; the PREFETCH_WASTED paths remain so that evictions of prefetched
params stay possible and are accounted honestly in replayed or hand-edited schedules. (The
live-cap condition alone already keeps everything before event k inside live + bucket, so the
bound only binds inside an event: it never prefetches part of a module that cannot fit whole.)
"""

from __future__ import annotations

import bisect
import heapq
import logging
import math
from collections.abc import Callable, Iterable, Iterator

from .actions import Action, Decision, PlanConfig, PlanStats, Reason, Schedule
from .hold import hold_regathers
from .trace import Trace

logger = logging.getLogger(__name__)

__all__ = [
    "Action",
    "Decision",
    "PlanConfig",
    "PlanStats",
    "Reason",
    "Schedule",
    "plan",
    "eviction_order",
    "replay",
]


def eviction_order(candidates: Iterable[int], next_use: Callable[[int], int | None]) -> list[int]:
    """The one eviction policy (Belady): furthest next use first, no next use (None) furthest of
    all, ties by lower id. The planner uses it with the trace it plans; the coordinator uses it for
    demand fetches off the plan, where nothing's next use is known (then: lowest id first)."""

    def key(p: int) -> tuple[float, int]:
        j = next_use(p)
        return (-math.inf if j is None else -j, p)

    return sorted(candidates, key=key)


class _Planner:
    """Single-use simulation state behind `plan`; see the module [Note: schedule semantics]."""

    def __init__(self, trace: Trace, config: PlanConfig) -> None:
        self.trace = trace
        self.config = config
        use_bytes = config.unit == "bytes"
        infos = trace.params.values()
        self.size = {i.id: (i.nbytes if use_bytes else i.numel) for i in infos if not i.persistent}
        self.numel = {i.id: i.numel for i in infos}
        self.nbytes = {i.id: i.nbytes for i in infos}
        self.min_size = min(self.size.values(), default=0)
        events = trace.events
        self.pre_params = [tuple(p for p in ev.params if p in self.size) if ev.kind.is_pre else () for ev in events]
        self.visit_params = [tuple(p for p in v.params if p in self.size) for v in trace.visits]
        self.pre_indices = [i for i, ev in enumerate(events) if ev.kind.is_pre]
        self.cum = [0]
        for ps in self.pre_params:
            self.cum.append(self.cum[-1] + sum(self.size[p] for p in ps))
        self.uses: dict[int, list[int]] = {p: [] for p in self.size}
        for i, ps in enumerate(self.pre_params):
            for p in ps:
                self.uses[p].append(i)
        self.live: dict[int, None] = {}
        # the params not live that a later PRE event uses, as (-last use, id), stale entries popped lazily:
        # the walk of `_prefetch` stops after the last event that can still give it a param
        # the whole model fits under the cap: the look-ahead visits only events that can give it a param
        self.sparse_walk = sum(self.size.values()) <= config.max_live
        # the params not live that a later PRE event uses, keyed for the walk (`_absent_key`); stale
        # entries (live, or past their use) are popped lazily
        self.absent = [(self._absent_key(p, uses[0]), p) for p, uses in self.uses.items() if uses]
        heapq.heapify(self.absent)
        self.live_size = self.live_numel = self.live_bytes = 0
        self.pending: set[int] = set()
        self.pending_size = 0
        self.pins: dict[int, int] = {}
        self.pinned_size = 0
        self.stats: dict[str, int] = dict.fromkeys(PlanStats.__dataclass_fields__, 0)
        self.stats["persistent_numel"] = sum(i.numel for i in infos if i.persistent)
        self.stats["persistent_bytes"] = sum(i.nbytes for i in infos if i.persistent)

    def next_use(self, p: int, i: int) -> int | None:
        uses = self.uses[p]
        k = bisect.bisect_right(uses, i)
        return uses[k] if k < len(uses) else None

    def distance(self, p: int, i: int) -> tuple[int | None, int | None]:
        j = self.next_use(p, i)
        return j, (None if j is None else self.cum[j] - self.cum[i + 1])

    def _add_live(self, params: Iterable[int]) -> None:
        for p in params:
            self.live[p] = None
            self.live_size += self.size[p]
            self.live_numel += self.numel[p]
            self.live_bytes += self.nbytes[p]
            self.stats["allgather_numel"] += self.numel[p]
            self.stats["allgather_bytes"] += self.nbytes[p]
        self.stats["num_allgathers"] += 1
        for key, value in (
            ("peak_live", self.live_size),
            ("peak_live_numel", self.live_numel),
            ("peak_live_bytes", self.live_bytes),
        ):
            self.stats[key] = max(self.stats[key], value)

    def _reason(
        self,
        p: int,
        decision: Decision,
        limit: int,
        *,
        next_use: int | None = None,
        distance: int | None = None,
        need: int = 0,
        pending: int = 0,
    ) -> Reason:
        size, live = self.size[p], self.live_size
        return Reason(
            param=p,
            decision=decision,
            size=size,
            live=live,
            limit=limit,
            next_use=next_use,
            distance=distance,
            need=need,
            pending=pending,
        )

    def _release(
        self,
        p: int,
        decision: Decision,
        i: int,
        out: list[int],
        reasons: list[Reason],
        limit: int,
        need: int = 0,
        distance: int | None = None,
    ) -> None:
        """Free p; a prefetched param freed before use turns the decision into PREFETCH_WASTED."""
        if p in self.pending:
            self.pending.discard(p)
            self.pending_size -= self.size[p]
            self.stats["wasted_prefetches"] += 1
            decision = Decision.PREFETCH_WASTED
        j = self.next_use(p, i)
        reasons.append(self._reason(p, decision, limit, next_use=j, distance=distance, need=need))
        del self.live[p]
        self.live_size -= self.size[p]
        self.live_numel -= self.numel[p]
        self.live_bytes -= self.nbytes[p]
        if j is not None:
            heapq.heappush(self.absent, (self._absent_key(p, j), p))
        out.append(p)

    def _pin(self, params: Iterable[int], delta: int) -> None:
        for p in params:
            before = self.pins.get(p, 0)
            self.pins[p] = before + delta
            if (before == 0) != (before + delta == 0):
                self.pinned_size += self.size[p] if delta > 0 else -self.size[p]

    def _evict(self, i: int, incoming: tuple[int, ...], need: int, out: list[int], reasons: list[Reason]) -> None:
        """Belady: free unpinned live params outside `incoming`, furthest next use first."""
        limit = self.config.max_live
        if self.live_size + need <= limit:
            return
        skip = set(incoming)
        candidates = eviction_order((p for p in self.live if not self.pins.get(p) and p not in skip),
                                    lambda p: self.next_use(p, i))
        for p in candidates:
            if self.live_size + need <= limit:
                break
            self._release(p, Decision.EVICTED_FOR_BUDGET, i, out, reasons, limit, need=need)

    def _absent_key(self, p: int, next_use: int) -> int:
        """A param not live in `absent`: by next use for the sparse walk, else by last use, latest first
        (`_horizon`)."""
        return next_use if self.sparse_walk else -self.uses[p][-1]

    def _horizon(self, i: int) -> int:
        """The last PRE event after ``i`` that uses a param not live now; -1 if none. Past it the
        look-ahead cannot collect anything, so it stops there: without that bound, once anything was
        released every event walked to the trace's end (quadratic: 5 s for 8,194 events, probe 31L)."""
        heap = self.absent
        while heap and (-heap[0][0] <= i or heap[0][1] in self.live):
            heapq.heappop(heap)  # used no more after i, or live (pushed again when released)
        return -heap[0][0] if heap else -1

    def _events_to_walk(self, i: int) -> Iterator[int]:
        """The PRE events after ``i`` the look-ahead visits, in order. When every param fits under the
        cap at once, the window bound of [Note: prefetch look-ahead] can never stop the walk, so only
        the events that use a param not live are visited (the others could collect nothing): with a
        small ``max_reuse_distance`` a released param comes back near the trace's end, and walking every
        event up to it made planning quadratic (7 s for 8,194 events, review 31RA). Otherwise every
        event up to `_horizon`."""
        if not self.sparse_walk:
            horizon = self._horizon(i)
            pre_indices = self.pre_indices
            for x in range(bisect.bisect_right(pre_indices, i), len(pre_indices)):
                if pre_indices[x] > horizon:
                    return
                yield pre_indices[x]
            return
        heap, seen, last = self.absent, [], -1
        try:
            while heap:
                j, p = heapq.heappop(heap)
                if j <= i or p in self.live:
                    continue  # stale for good: pushed again when p is released
                seen.append((j, p))
                if j != last:
                    last = j
                    yield j
        finally:  # put back what the walk read (those it collected are live then: stale, dropped later)
            for entry in seen:
                heapq.heappush(heap, entry)

    def _prefetch(self, i: int, reasons: list[Reason]) -> tuple[int, ...]:
        """Collect one bucket after event i; see [Note: prefetch look-ahead]."""
        cap, room = self.config.max_live, self.config.prefetch_bucket_size
        if room == 0 or len(self.live) == len(self.size):
            return ()
        if self.pending_size > room // 2:
            return ()  # refill only below the low-water mark: fewer, larger collectives
        bucket: list[tuple[int, int]] = []
        bucket_size = 0
        collected: set[int] = set()
        window: set[int] = set()
        window_size = self.pinned_size
        walk = self._events_to_walk(i)
        for k in walk:
            params = self.pre_params[k]
            for p in params:
                if p not in window and not self.pins.get(p):
                    window.add(p)
                    window_size += self.size[p]
            if window_size > cap:
                break
            fits = True
            for p in params:
                if p in self.live or p in collected:
                    continue
                s = self.size[p]
                if self.pending_size + bucket_size + s > room or self.live_size + bucket_size + s > cap:
                    fits = False
                    break
                bucket.append((p, k))
                collected.add(p)
                bucket_size += s
            if not fits:
                break
            headroom = min(room - self.pending_size, cap - self.live_size) - bucket_size
            if headroom < self.min_size:
                break  # nothing more can fit, so the walk would stop at the next candidate anyway
        walk.close()  # its entries back in the heap before anything turns live
        if not bucket:
            return ()
        pending = self.pending_size
        for p, k in bucket:
            pending += self.size[p]
            reasons.append(self._reason(p, Decision.PREFETCH, room, next_use=k, pending=pending))
        ids = tuple(p for p, _ in bucket)
        self._add_live(ids)
        self.pending.update(ids)
        self.pending_size = pending
        self.stats["num_prefetched_params"] += len(ids)
        return ids

    def _pre(self, i: int, release: list[int], reasons: list[Reason]) -> tuple[int, ...]:
        """Evict for the budget, open the visit, demand-fetch what is missing; return the fetch."""
        params = self.pre_params[i]
        fetch = tuple(p for p in params if p not in self.live)
        need = sum(self.size[p] for p in fetch)
        self._evict(i, params, need, release, reasons)
        self._pin(params, +1)
        for p in params:
            if p in self.pending:
                self.pending.discard(p)
                self.pending_size -= self.size[p]
                self.stats["prefetch_hits"] += 1
        if fetch:
            reasons += [self._reason(p, Decision.DEMAND_FETCH, self.config.max_live, need=need) for p in fetch]
            self._add_live(fetch)
            self.stats["num_demand_fetches"] += len(fetch)
        return fetch

    def _post(self, i: int, release: list[int], reasons: list[Reason]) -> list[int]:
        """Close the visit; keep or release its params by reuse distance, then restore the cap."""
        limit = self.config.max_reuse_distance
        params = self.visit_params[self.trace.event_visit[i]]
        self._pin(params, -1)
        keep: list[int] = []
        for p in params:
            if self.pins[p]:
                continue
            assert p in self.live, f"pinned param {p} not live at event {i}"
            j, dist = self.distance(p, i)
            if dist is not None and dist <= limit:
                keep.append(p)
                reasons.append(self._reason(p, Decision.KEPT_REUSE, limit, next_use=j, distance=dist))
            else:
                self._release(p, Decision.RELEASED_AFTER_USE, i, release, reasons, limit, distance=dist)
        evicted_from = len(release)
        self._evict(i, (), 0, release, reasons)
        evicted = set(release[evicted_from:])
        if evicted:  # a keep the cap overrides is reported once, as the eviction
            keep = [p for p in keep if p not in evicted]
            reasons[:] = [r for r in reasons if not (r.decision is Decision.KEPT_REUSE and r.param in evicted)]
        return keep

    def run(self) -> Schedule:
        cfg = self.config
        actions: list[Action] = []
        for i, ev in enumerate(self.trace.events):
            release: list[int] = []
            reasons: list[Reason] = []
            fetch: tuple[int, ...] = ()
            keep: list[int] = []
            if ev.kind.is_pre:
                fetch = self._pre(i, release, reasons)
            else:
                keep = self._post(i, release, reasons)
            prefetch = self._prefetch(i, reasons)
            actions.append(Action(i, ev.kind, ev.module, tuple(release), fetch, prefetch, tuple(keep), tuple(reasons)))
        end: list[int] = []
        end_reasons: list[Reason] = []
        n = len(self.trace.events)
        for p in sorted(self.live):
            self._release(p, Decision.RELEASED_END_OF_STEP, n, end, end_reasons, limit=cfg.max_live)
        stats = PlanStats(**self.stats)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("zero3::plan (%s v%d) %d events: %s", self.trace.key, self.trace.version, n, stats)
        names = tuple(sorted((p, info.name) for p, info in self.trace.params.items()))
        return Schedule(
            self.trace.key, self.trace.version, cfg, tuple(actions), tuple(end), stats, tuple(end_reasons), names
        )


def plan(trace: Trace, config: PlanConfig, *, holds: bool = True) -> Schedule:
    """Plan fetches, prefetches, keeps and releases for every event of `trace` under `config`.

    Deterministic and pure; runs in O(events x look-ahead) time, where a look-ahead ends at the
    bucket's or the cap's limit or after the last event that uses a param not live, and visits only
    the events that use one when the whole model fits under ``max_live``: about linear then (a small
    ``max_reuse_distance`` too); quadratic still where the cap binds and released params come back
    much later (a cap below the model's size on a deep model, review 31RA). See the module notes for the
    exact semantics the runtime must execute. ``holds=False`` skips the last pass (hold.py
    [Note: holds]), to show what it saved.
    """
    schedule = _Planner(trace, config).run()
    return hold_regathers(trace, schedule) if holds else schedule


def _fail(i: int | str, msg: str) -> None:
    raise ValueError(f"schedule replay: event {i}: {msg}")


def replay(trace: Trace, schedule: Schedule) -> PlanStats:
    """Execute `schedule` on `trace` from scratch, as the runtime would, and recount its stats.

    Independent of the planner's bookkeeping; usable by the runtime in debug mode and by tests.
    Checks that the schedule matches the trace, every PRE event's params are live when it runs,
    nothing pinned or not live is released, nothing live is gathered again, the live cap holds
    unless the open visits alone exceed it (then only they are live and nothing is prefetched),
    pending prefetch stays within prefetch_bucket_size, and everything is released at the end.

    Raises:
        ValueError: the first violation, naming the event.
    """
    cfg = schedule.config
    if (schedule.trace_key, schedule.trace_version) != (trace.key, trace.version):
        _fail(
            "-",
            f"schedule is for trace {schedule.trace_key!r} v{schedule.trace_version}, "
            f"not {trace.key!r} v{trace.version}",
        )
    if len(schedule.actions) != len(trace.events):
        _fail("-", f"{len(schedule.actions)} actions for {len(trace.events)} events")
    infos = trace.params
    size = {p: (i.nbytes if cfg.unit == "bytes" else i.numel) for p, i in infos.items() if not i.persistent}
    live: set[int] = set()
    pending: set[int] = set()
    open_visits: dict[int, frozenset[int]] = {}
    s: dict[str, int] = dict.fromkeys(PlanStats.__dataclass_fields__, 0)
    s["persistent_numel"] = sum(i.numel for i in infos.values() if i.persistent)
    s["persistent_bytes"] = sum(i.nbytes for i in infos.values() if i.persistent)

    def total(ps: Iterable[int]) -> int:
        return sum(size[p] for p in ps)

    def gather(i: int, ps: tuple[int, ...]) -> None:
        for p in ps:
            if p not in size or p in live:
                _fail(i, f"gathers param {p}, which is persistent, unknown or already live")
        live.update(ps)
        s["num_allgathers"] += 1
        s["allgather_numel"] += sum(infos[p].numel for p in ps)
        s["allgather_bytes"] += sum(infos[p].nbytes for p in ps)
        s["peak_live"] = max(s["peak_live"], total(live))
        s["peak_live_numel"] = max(s["peak_live_numel"], sum(infos[p].numel for p in live))
        s["peak_live_bytes"] = max(s["peak_live_bytes"], sum(infos[p].nbytes for p in live))

    def free(i: int | str, ps: Iterable[int], protected: set[int]) -> None:
        for p in ps:
            if p not in live or p in protected:
                _fail(i, f"releases param {p}, which is not live or is needed by an open visit")
            live.discard(p)
            if p in pending:
                pending.discard(p)
                s["wasted_prefetches"] += 1

    for i, (ev, act) in enumerate(zip(trace.events, schedule.actions, strict=True)):
        if (act.index, act.kind, act.module) != (i, ev.kind, ev.module):
            _fail(i, f"action is for event {act.index} {act.kind.name} {act.module!r}")
        visit = trace.event_visit[i]
        params = frozenset(p for p in trace.visits[visit].params if p in size)
        pinned = set().union(*open_visits.values())
        if ev.kind.is_pre:
            free(i, act.release, pinned | params)
            if act.fetch != tuple(sorted(params - live)):
                _fail(i, f"fetch {act.fetch} != params not live {sorted(params - live)}")
            for p in params & pending:
                pending.discard(p)
                s["prefetch_hits"] += 1
            if act.fetch:
                gather(i, act.fetch)
                s["num_demand_fetches"] += len(act.fetch)
            open_visits[visit] = params
        else:
            del open_visits[visit]
            if act.fetch:
                _fail(i, f"POST event fetches {act.fetch}")
            free(i, act.release, set().union(*open_visits.values()))
            if not set(act.keep) <= live:
                _fail(i, f"keeps {act.keep}, which are not all live")
        needed = set().union(*open_visits.values())
        over = total(live) > cfg.max_live
        if over and (live != needed or total(needed) <= cfg.max_live):
            _fail(i, f"live {total(live)} > max_live {cfg.max_live} but the open visits need only {total(needed)}")
        if act.prefetch:
            if over or cfg.prefetch_bucket_size == 0:
                _fail(i, f"prefetches {act.prefetch} with live over budget or prefetch disabled")
            gather(i, act.prefetch)
            pending.update(act.prefetch)
            s["num_prefetched_params"] += len(act.prefetch)
            if total(live) > cfg.max_live or total(pending) > cfg.prefetch_bucket_size:
                _fail(i, f"prefetch {act.prefetch} exceeds max_live or prefetch_bucket_size")
    if set(schedule.end_release) != live or len(schedule.end_release) != len(live):
        _fail("end", f"end_release {schedule.end_release} != still live {sorted(live)}")
    free("end", schedule.end_release, set())
    return PlanStats(**s)
