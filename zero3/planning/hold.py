"""Hold a parameter instead of gathering it again: the planner's last pass over a `Schedule`.

[Note: holds]
The planner (schedule.py) releases a param when a visit closes and its reuse distance is over
`max_reuse_distance`; its prefetch walk may then gather the same param again before that next use,
a few events later. Between the release and that prefetch the param only costs live size. So when
holding it across the gap keeps the live size within the schedule's own peak (and `max_live`) at
every event of the gap, the release and the prefetch are both dropped: the param is *held*
(`Decision.HELD_INSTEAD_OF_REGATHER`). The schedule then does one collective less, or a smaller one.
The live size after every event is the old one plus what is held across it, and the peak of
gathered parameters in the plan's unit (elements or bytes) does not change (the other unit's peak
may rise).

Where this lands in the example GPT under a lean budget: the last Block's weights, released one by
one in forward and prefetched again for backward while the head runs. A model whose every
parameter was live at once somewhere in the plan is gathered once per step instead of twice.

Only a release that a *prefetch* undoes is turned into a hold: with no prefetch, the user asked for
nothing to be gathered ahead of use, and a demand fetch at the use stays. A hold is taken only where
the schedule evicts nothing from the release to the param's next use: an eviction there was
decided without the held param in the live set, and Belady would have evicted the held one first
if its next use is the furthest. Holds are taken shortest gap first (the most saved for the least
held), each seeing the live sizes the earlier ones raised. `max_reuse_distance` still decides
every other release; `prefetch_bucket_size` still bounds what is in flight (a held param is not).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping

from .actions import Action, Decision, PlanStats, Reason, Schedule
from .trace import ParamInfo, Trace

__all__ = ["hold_regathers"]


def hold_regathers(trace: Trace, schedule: Schedule) -> Schedule:
    """`schedule` with every release that a later prefetch undoes turned into a hold, where the
    schedule's own peak allows it; see [Note: holds]. Stats are adjusted to what the new schedule
    executes."""
    cfg = schedule.config
    infos: Mapping[int, ParamInfo] = trace.params
    size = {p: (i.nbytes if cfg.unit == "bytes" else i.numel) for p, i in infos.items() if not i.persistent}
    acts = list(schedule.actions)
    n = len(acts)
    # The live size after each event (after its prefetch: the most an event holds), in the config's
    # unit; and how many evictions the schedule makes up to each event.
    after = [0] * n
    evictions = [0] * (n + 1)
    gathered_at: dict[int, list[int]] = {}
    live_size = 0
    evicting = (Decision.EVICTED_FOR_BUDGET, Decision.PREFETCH_WASTED)
    for a in acts:
        live_size += sum(size[p] for p in (*a.fetch, *a.prefetch)) - sum(size[p] for p in a.release)
        for p in (*a.fetch, *a.prefetch):
            gathered_at.setdefault(p, []).append(a.index)
        after[a.index] = live_size
        evictions[a.index + 1] = evictions[a.index] + any(r.decision in evicting for r in a.reasons)
    live_after = RangeMax(after)

    stats = dataclasses.asdict(schedule.stats)
    changed: dict[int, dict[str, list]] = {}  # event -> the fields a hold edits, as lists

    def edit(i: int) -> dict[str, list]:
        if i not in changed:
            a = acts[i]
            changed[i] = {"release": list(a.release), "prefetch": list(a.prefetch), "keep": list(a.keep),
                          "reasons": list(a.reasons)}
        return changed[i]

    # Candidates: a release after use whose param the schedule prefetches again before its next use.
    # (One gathered again on demand, at its use, was released as `max_reuse_distance` asks; with no
    # prefetch the user asked for nothing to be gathered ahead, so nothing is held for it either.)
    candidates = []
    for a in schedule.actions:
        if a.kind.is_pre or not a.release:
            continue
        for r in a.reasons:
            if r.decision is not Decision.RELEASED_AFTER_USE or r.next_use is None:
                continue
            gathers = gathered_at.get(r.param, [])
            g = bisect.bisect_left(gathers, a.index)  # a prefetch at the release's own event comes after it
            if g < len(gathers) and gathers[g] <= r.next_use and r.param in acts[gathers[g]].prefetch:
                candidates.append((gathers[g] - a.index, a.index, r, gathers[g]))
    # Shortest gaps first: the most collective saved for the least held; each hold sees the live sizes
    # the ones before it raised. The bound is the schedule's own peak, so no hold raises it.
    bound = min(cfg.max_live, schedule.stats.peak_live)
    for _, i, r, k in sorted(candidates, key=lambda c: (c[0], c[1], c[2].param)):
        p, j = r.param, r.next_use
        if evictions[j + 1] != evictions[i]:
            continue
        s = size[p]
        most = live_after.max(i, k)
        if most + s > bound:
            continue
        live_after.add(i, k, s)
        e = edit(i)
        e["release"].remove(p)
        e["keep"].append(p)
        e["reasons"] = [x for x in e["reasons"] if x.param != p]
        e["reasons"].append(Reason(param=p, decision=Decision.HELD_INSTEAD_OF_REGATHER, size=s,
                                   live=max(most, 0) + s, limit=bound, next_use=j,
                                   distance=r.distance, regather=k))
        e = edit(k)
        e["prefetch"].remove(p)
        e["reasons"] = [x for x in e["reasons"] if not (x.param == p and x.decision is Decision.PREFETCH)]
        stats["allgather_numel"] -= infos[p].numel
        stats["allgather_bytes"] -= infos[p].nbytes
        stats["num_prefetched_params"] -= 1
        stats["prefetch_hits"] -= 1
        if not e["prefetch"]:
            stats["num_allgathers"] -= 1
    if not changed:
        return schedule
    for i, e in changed.items():
        acts[i] = dataclasses.replace(acts[i], **{name: tuple(value) for name, value in e.items()})
    stats["peak_live"] = max(stats["peak_live"], live_after.max(0, n))
    for key, of in (("peak_live_numel", lambda p: infos[p].numel), ("peak_live_bytes", lambda p: infos[p].nbytes)):
        stats[key] = max(stats[key], _peak_after(acts, of))
    return dataclasses.replace(schedule, actions=tuple(acts), stats=PlanStats(**stats))


def _peak_after(acts: list[Action], of: Callable[[int], int]) -> int:
    """The most live after any event of ``acts`` (the edited schedule), counting each param as ``of``."""
    live = peak = 0
    for a in acts:
        live += sum(of(p) for p in (*a.fetch, *a.prefetch)) - sum(of(p) for p in a.release)
        peak = max(peak, live)
    return peak


class RangeMax:
    """A list of numbers with range add and range max in O(log n) (a segment tree whose nodes keep
    their own pending add): each hold asks for the most live across its gap and then raises it."""

    _LOW = -(1 << 62)

    def __init__(self, values: list[int]) -> None:
        size = 1
        while size < len(values):
            size *= 2
        self.size = size
        self.top = [self._LOW] * (2 * size)  # the max of a node's range, its own add included
        self.pending = [0] * (2 * size)  # added to a node's whole range, not yet in its children
        self.top[size: size + len(values)] = values
        for node in range(size - 1, 0, -1):
            self.top[node] = max(self.top[2 * node], self.top[2 * node + 1])

    def max(self, lo: int, hi: int) -> int:
        """The largest value in [lo, hi) (the lowest possible value when the range is empty)."""
        return self._max(1, 0, self.size, lo, hi) if hi > lo else self._LOW

    def add(self, lo: int, hi: int, value: int) -> None:
        """Add ``value`` to every element of [lo, hi)."""
        self._add(1, 0, self.size, lo, hi, value)

    def _max(self, node: int, a: int, b: int, lo: int, hi: int) -> int:
        if hi <= a or b <= lo:
            return self._LOW
        if lo <= a and b <= hi:
            return self.top[node]
        mid = (a + b) // 2
        return self.pending[node] + max(self._max(2 * node, a, mid, lo, hi), self._max(2 * node + 1, mid, b, lo, hi))

    def _add(self, node: int, a: int, b: int, lo: int, hi: int, value: int) -> None:
        if hi <= a or b <= lo:
            return
        if lo <= a and b <= hi:
            self.top[node] += value
            self.pending[node] += value
            return
        mid = (a + b) // 2
        self._add(2 * node, a, mid, lo, hi, value)
        self._add(2 * node + 1, mid, b, lo, hi, value)
        self.top[node] = self.pending[node] + max(self.top[2 * node], self.top[2 * node + 1])
