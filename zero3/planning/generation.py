"""The gather policy of generation mode (``engine.generation()``): decode loops without a trace.

A decode loop runs the same forward once per token, and nothing ends a step between them, so there
is no recorded trace to plan from. The cycle of PRE events is learnt from one forward instead
(`GenerationPrefetch`) and, once it is known, planned (`plan_decode`).

[Note: decode plans]
While the cycle is being learnt (the first forward), every module's parameters are gathered on
demand and kept: the later a parameter was last used, the later it is used next, so its last use
stands in for its next use in `schedule.eviction_order` (Belady), and the event after the current
one in the cycle is prefetched. With ``prefetch_bucket_size`` 0 this goes on for the whole session.
When the whole model fits the cap (`GenerationPrefetch.whole`), the coordinator instead gathers all
of it at the first module of that forward, in one gather: nothing will be released until the mode
ends, and one gather costs one collective's latency where one per module costs dozens (on the wire,
the first forward of a 4 x 256 GPT took 56 ms one module at a time and 19 ms so; bench_generation.py
``--gather p2p``).

Once a forward begins again, the cycle is planned when it does not fit the live cap. A cyclic
pattern is the worst case of a recency policy: every module evicts one that the next token needs
first, and each is gathered again alone, one latency-bound collective per module. The plan instead
keeps a fixed *resident* part gathered for the whole session and *streams* the rest in a few
buckets per token. The streamed part is a window of consecutive events; each bucket is one gather
of the parameters of consecutive events in it, issued at the first of them, and at a bucket's start
every streamed parameter of the buckets before it is released. A bucket holds at most
``prefetch_bucket_size`` and at most the room the resident part leaves under the cap, so the live
size stays within the cap; the next bucket is issued ahead with each one where both fit, and the
first bucket at the start of a token, beside the resident part. A parameter used by several events
(tied weights) is never cut between buckets.

Which window is streamed is a trade-off between bytes and collectives: the more stays resident, the
less room for buckets, the more of them per token. Each candidate is costed as its streamed size
plus `GATHER_COST_BYTES` per bucket (a collective's fixed cost, as bytes on the wire) and the
cheapest is chosen: a small model regathers more than what does not fit, in few gathers; a large one
about what does not fit. Every rank plans the same cycle the same way, so their gathers stay in
step. If a forward leaves the cycle, the plan is dropped and the cycle learnt again. Every module
still fetches its own parameters on demand, so a plan only decides how early and in how many
collectives they come, never whether they are there.

Pure data over parameter ids: the coordinator (runtime/coordinator.py) gathers and releases.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .schedule import PlanConfig

GATHER_COST_BYTES = 1 << 20
"""What one more gather costs, as bytes on the wire (a 4-byte element each where budgets count
elements): gloo on 2 local ranks moves about 1 MiB in the fixed cost of a collective
(bench_generation.py: per-module gathers against whole-model ones)."""


@dataclass(frozen=True)
class DecodePlan:
    """A planned decode cycle (see [Note: decode plans])."""

    resident: frozenset[int]
    """Parameter ids kept gathered for the whole session."""
    buckets: tuple[tuple[int, tuple[int, ...]], ...]
    """The streamed buckets in cycle order: (the event that first uses it, its parameter ids)."""


@dataclass(frozen=True)
class GenerationAction:
    """What the coordinator does at one PRE event besides fetching the module's own parameters."""

    keep: frozenset[int] | None = None
    """Release every live parameter not in it (None: release nothing)."""
    gather: tuple[int, ...] = ()
    """Fetch these with the module's parameters, in one collective."""
    prefetch: tuple[int, ...] = ()
    """Issue a gather of these ahead of use, where the cap has room."""


def plan_decode(cycle: Sequence[tuple[int, ...]], size: Mapping[int, int], cap: int, bucket_limit: int,
                gather_cost: int) -> DecodePlan | None:
    """The cheapest plan of ``cycle`` (the PRE events of one forward) under the live ``cap``; None
    when the cycle fits or no plan does. ``size``: of every parameter that counts against the cap
    (others are ignored); ``bucket_limit``: the largest bucket (``prefetch_bucket_size``);
    ``gather_cost``: one collective's fixed cost in the unit of ``size``.

    The streamed window is ``[r, t)``: the parameters first used at or after ``r`` and last used
    before ``t``; the others are resident. For each ``r`` and each room ``cap // k`` left to the
    buckets, the window is the shortest that leaves the resident part within the cap less that room."""
    events = [tuple(p for p in dict.fromkeys(ev) if p in size) for ev in cycle]
    n = len(events)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, ev in enumerate(events):
        for p in ev:
            first.setdefault(p, i)
            last[p] = i
    total = sum(size[p] for p in first)
    if total <= cap:
        return None
    ending: list[list[int]] = [[] for _ in range(n)]  # the parameters last used at each event
    for p, i in last.items():
        ending[i].append(p)
    best: tuple[int, int, int, tuple[tuple[int, tuple[int, ...]], ...]] | None = None  # cost, r, t, buckets
    for r in range(n):
        streamed = [0]  # streamed[j]: the size streamed with the window [r, r + j)
        for t in range(r, n):
            streamed.append(streamed[-1] + sum(size[p] for p in ending[t] if first[p] >= r))
        ends = {bisect.bisect_left(streamed, total - cap + cap // k) for k in range(1, 17)}  # it never decreases
        for j in sorted(j for j in ends if j < len(streamed)):
            limit = min(cap - (total - streamed[j]), bucket_limit)
            if limit <= 0:
                continue
            if best is not None and streamed[j] + gather_cost * -(-streamed[j] // limit) >= best[0]:
                continue  # not cheaper even in the fewest buckets
            buckets = _pack(events, r, r + j, first, last, size, limit)
            if buckets is not None:
                cost = streamed[j] + gather_cost * len(buckets)
                if best is None or cost < best[0]:
                    best = (cost, r, r + j, buckets)
    if best is None:
        return None
    _, r, t, buckets = best
    return DecodePlan(frozenset(p for p in first if not r <= first[p] <= last[p] < t), buckets)


def _pack(events: Sequence[tuple[int, ...]], r: int, t: int, first: Mapping[int, int], last: Mapping[int, int],
          size: Mapping[int, int], limit: int) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """The streamed parameters of the window ``[r, t)`` (`plan_decode`), packed greedily into buckets
    of at most ``limit``, never cut between two uses of one parameter; None when a part that cannot
    be cut is larger than ``limit``."""
    buckets: list[tuple[int, tuple[int, ...]]] = []
    bucket: list[int] = []
    segment: list[int] = []  # the streamed parameters since the last place a cut is allowed
    bucket_size = segment_size = 0
    bucket_start = segment_start = open_until = -1  # their first events; the last use of the segment's
    for i in range(r, t + 1):
        if i > open_until and segment:  # a cut is allowed before event i
            if segment_size > limit:
                return None
            if bucket and bucket_size + segment_size > limit:
                buckets.append((bucket_start, tuple(bucket)))
                bucket, bucket_size = [], 0
            if not bucket:
                bucket_start = segment_start
            bucket += segment
            bucket_size += segment_size
            segment, segment_size = [], 0
        if i == t:
            break
        for p in events[i]:
            if first[p] == i and last[p] < t:  # first used here, and streamed
                if not segment:
                    segment_start = i
                segment.append(p)
                segment_size += size[p]
                open_until = max(open_until, last[p])
    if bucket:
        buckets.append((bucket_start, tuple(bucket)))
    return tuple(buckets)


class GenerationPrefetch:
    """The learnt cycle of PRE events of one generation session, its plan once known, and the last
    uses that stand in for next uses meanwhile (see [Note: decode plans])."""

    def __init__(self, size: Mapping[int, int] | None = None, config: PlanConfig | None = None) -> None:
        """``size``: of the parameters that count against the live cap, in ``config``'s unit; without
        them (or with ``prefetch_bucket_size`` 0) the cycle is learnt and never planned."""
        self._clock = 0
        self._last_use: dict[int, int] = {}  # param id -> clock of its last use
        self._cycle: list[tuple[int, ...]] = []  # the PRE events of one forward, in order
        self._at = 0  # where in that cycle the next PRE event should be
        self._begins: bool | None = None  # True: a forward began, no PRE event yet; False: inside it; None: never told
        self._outside = False  # told that the forward ended: a module called on its own is no part of the cycle
        self._size = size if config is not None and config.prefetch_bucket_size > 0 else None
        self._config = config
        self.whole = len(size) if size is not None and config is not None and \
            sum(size.values()) <= config.max_live else None
        """How many parameters are the whole model when it fits the live cap at once (then, once all
        are gathered, nothing is ever released or gathered again); None when it does not."""
        self.resident = False
        """Set by the coordinator: every one of those ``whole`` parameters is gathered, as the last
        forward left them, and none was released since."""
        self.plan: DecodePlan | None = None  # None: not planned (yet), or the cycle fits, or no plan does
        self._planned = False  # the learnt cycle was planned
        self._actions: dict[int, GenerationAction] = {}  # event index -> action, under `plan`

    def use(self, ids: Sequence[int]) -> None:
        """A PRE event uses ``ids`` now."""
        self._clock += 1
        for pid in ids:
            self._last_use[pid] = self._clock

    def next_use(self, pid: int) -> int:
        """Stands in for the next use of ``pid`` (see the module docstring)."""
        return self._last_use.get(pid, 0)

    def forward_boundary(self, began: bool) -> None:
        """The model's forward begins (its root's pre-forward hook: the next PRE event starts the
        cycle) or ends (events until the next begins, of submodules called on their own, are no part
        of it). Without this, an event with the cycle's first ids is taken for a new forward, which a
        module reusing the first one's parameters mid-forward (a head tied to the input embedding)
        would be: the cycle was cut there at every forward, and never planned."""
        if began:
            self._begins = True
        self._outside = not began

    def advance(self, ids: Sequence[int]) -> tuple[int, ...] | None:
        """Learn the cycle from the PRE event that used ``ids``; return the ids of the event expected
        next (None while the cycle has fewer than two events)."""
        ids = tuple(ids)
        cycle, at = self._cycle, self._at
        begins = self._begins  # True: a forward begins here; False: it began earlier; None: never told
        if begins:
            self._begins = False
            if not (cycle and cycle[0] == ids):
                at = 0  # another first module: the cycle is learnt again from its start
        if not begins and at < len(cycle) and cycle[at] == ids:
            at += 1
        elif cycle and cycle[0] == ids and begins is not False:  # untold: the first ids mark a new forward
            if at == len(cycle) and not self._planned and self._size is not None:
                self._make_plan(self._size)  # one whole forward seen: plan it
            at = 1  # a new forward began
        else:
            del cycle[at:]  # a new order: record it from here
            cycle.append(ids)
            at = len(cycle)
            self.plan, self._planned, self._actions = None, False, {}
        self._at = at
        return cycle[at % len(cycle)] if len(cycle) > 1 else None

    def explain(self) -> list[str]:
        """What the mode does now, for ``engine.explain()``."""
        if self.whole is not None:
            return ["generation mode: the whole model fits the live cap: gathered in one gather, kept until the mode "
                    "ends (" + ("all gathered now: forwards gather nothing)" if self.resident else "not all gathered yet)")]
        if self.plan is not None:
            return [f"generation mode: a decode plan over a cycle of {len(self._cycle)} module calls: "
                    f"{len(self.plan.resident)} parameters stay gathered, the rest in {len(self.plan.buckets)} "
                    "gathers per token"]
        why = ("no decode plan without a prefetch bucket" if self._size is None else "no decode plan fits the live "
               "cap" if self._planned else f"learning the decode cycle ({len(self._cycle)} module calls so far)")
        return ["generation mode: " + why +
                ": each module's parameters are gathered when it runs and kept while the live cap allows, the "
                "least recently used released first"]

    def step(self, ids: Sequence[int]) -> GenerationAction:
        """A PRE event uses ``ids``: what to do besides fetching them."""
        self.use(ids)
        if self._outside:
            return GenerationAction()
        upcoming = self.advance(ids)
        if self.plan is not None:
            return self._actions.get(self._at - 1, GenerationAction())
        return GenerationAction(prefetch=upcoming or ())

    def _make_plan(self, size: Mapping[int, int]) -> None:
        self._planned = True
        config = self._config
        assert config is not None
        cost = GATHER_COST_BYTES if config.unit == "bytes" else GATHER_COST_BYTES // 4
        plan = plan_decode(self._cycle, size, config.max_live, config.prefetch_bucket_size, cost)
        if plan is None:  # everything fits, or nothing does: keep what was gathered, as while learning
            return
        self.plan = plan
        room = config.max_live - sum(size[p] for p in plan.resident)
        buckets = plan.buckets
        ahead = [b + 1 < len(buckets) and
                 sum(size[p] for p in buckets[b][1] + buckets[b + 1][1]) <= room for b in range(len(buckets))]
        actions: dict[int, GenerationAction] = {}
        if buckets[0][0] > 0:  # a token starts with resident events: the last bucket goes
            first = buckets[0][1]
            actions[0] = GenerationAction(keep=plan.resident | frozenset(first), prefetch=first)
        for b, (start, ids) in enumerate(buckets):
            following = buckets[b + 1][1] if ahead[b] else ()
            actions[start] = GenerationAction(keep=plan.resident | frozenset(ids) | frozenset(following),
                                              gather=ids, prefetch=following)
        self._actions = actions
