"""Hold a parameter instead of gathering it again: the planner's last pass over a `Schedule`.

[Note: holds]
The planner (schedule.py) releases a param when a visit closes and its reuse distance is over
`max_reuse_distance`; its prefetch walk may then gather the same param again before that next use,
a few events later. Between the release and that prefetch the param only costs live size. So when
holding it across the gap keeps the live size within the schedule's own peak (and `max_live`) at
every event of the gap, the release and the prefetch are both dropped: the param is *held*
(`Decision.HELD_INSTEAD_OF_REGATHER`). The schedule then does one collective less, or a smaller one.
The live size after every event is the old one plus what is held across it, and the peak of
gathered parameters does not change.

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
from collections.abc import Mapping

from .actions import Action, Decision, PlanStats, Reason, Schedule
from .trace import ParamInfo, Trace

__all__ = ["hold_regathers"]


def hold_regathers(trace: Trace, schedule: Schedule) -> Schedule:
    """`schedule` with every release that a later gather undoes turned into a hold, where the live
    cap allows it; see [Note: holds]. Stats are adjusted to what the new schedule executes."""
    cfg = schedule.config
    infos: Mapping[int, ParamInfo] = trace.params
    size = {p: (i.nbytes if cfg.unit == "bytes" else i.numel) for p, i in infos.items() if not i.persistent}
    acts = list(schedule.actions)
    n = len(acts)
    # The live size after each event (after its prefetch: the most an event holds), in the config's
    # unit, in elements and in bytes; and how many evictions the schedule makes up to each event.
    after = [[0] * n, [0] * n, [0] * n]
    evictions = [0] * (n + 1)
    gathered_at: dict[int, list[int]] = {}
    live: set[int] = set()
    evicting = (Decision.EVICTED_FOR_BUDGET, Decision.PREFETCH_WASTED)
    for a in acts:
        live.difference_update(a.release)
        live.update(a.fetch)
        live.update(a.prefetch)
        for p in (*a.fetch, *a.prefetch):
            gathered_at.setdefault(p, []).append(a.index)
        after[0][a.index] = sum(size[p] for p in live)
        after[1][a.index] = sum(infos[p].numel for p in live)
        after[2][a.index] = sum(infos[p].nbytes for p in live)
        evictions[a.index + 1] = evictions[a.index] + any(r.decision in evicting for r in a.reasons)

    stats = dataclasses.asdict(schedule.stats)
    changed: dict[int, dict[str, list]] = {}

    def edit(i: int) -> dict[str, list]:
        if i not in changed:
            a = acts[i]
            changed[i] = {"release": list(a.release), "fetch": list(a.fetch), "prefetch": list(a.prefetch),
                          "keep": list(a.keep), "reasons": list(a.reasons)}
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
        if max(after[0][i:k], default=0) + s > bound:
            continue
        for t in range(i, k):
            after[0][t] += s
            after[1][t] += infos[p].numel
            after[2][t] += infos[p].nbytes
        e = edit(i)
        e["release"].remove(p)
        e["keep"].append(p)
        e["reasons"] = [x for x in e["reasons"] if x.param != p]
        e["reasons"].append(Reason(param=p, decision=Decision.HELD_INSTEAD_OF_REGATHER, size=s,
                                   live=max(after[0][i:k], default=s), limit=bound, next_use=j,
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
        acts[i] = Action(acts[i].index, acts[i].kind, acts[i].module, tuple(e["release"]), tuple(e["fetch"]),
                         tuple(e["prefetch"]), tuple(e["keep"]), tuple(e["reasons"]))
    for key, profile in (("peak_live", after[0]), ("peak_live_numel", after[1]), ("peak_live_bytes", after[2])):
        stats[key] = max(stats[key], max(profile, default=0))
    return dataclasses.replace(schedule, actions=tuple(acts), stats=PlanStats(**stats))
