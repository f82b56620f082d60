"""comm/verify.py `PlanCache`: what it keeps stays bounded by its capacity, whatever the epochs, and
its prediction is a plan it holds, the one that followed last time where that is still held."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from zero3.comm.verify import PlanCache, RequestShape, plan_digest


def _plan(i: int) -> list[RequestShape]:
    return [RequestShape("all-gather", (i,), "float32", False)]


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 6),
       epochs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30)), min_size=1, max_size=120))
def test_the_cache_stays_within_its_capacity_and_predicts_only_plans_it_holds(capacity, epochs):
    """Each epoch: a key (its first request) and a plan. The successors of evicted plans used to stay
    (an entry per distinct epoch: 20,000 after 20,000, probe 37C); now what was learnt of a plan goes
    when it is evicted, as the trace cache's successors do."""
    cache = PlanCache(capacity)
    lru: list[tuple[int, int]] = []  # an independent model: (key, plan), least recently recorded first
    followed: dict[tuple[int, int], int] = {}  # (key, plan before) -> plan after, among plans held since
    last: dict[int, int] = {}
    for key, i in epochs:
        before = last.get(key)
        cache.record((key, True), _plan(i))
        if (key, i) in lru:
            lru.remove((key, i))
        lru.append((key, i))
        if before is not None:
            followed[(key, before)] = i
        last[key] = i
        while len(lru) > capacity:
            k, gone = lru.pop(0)
            followed = {(k2, b): a for (k2, b), a in followed.items() if k2 != k or gone not in (b, a)}
            if last.get(k) == gone:
                del last[k]
        assert {(k[0], d) for k, d in cache._plans} == {(k, plan_digest(_plan(j))) for k, j in lru}
        assert len(cache._successor) <= 2 * capacity and len(cache._last) <= capacity  # one from each plan, one from none
        choice = cache.choose((key, True))
        nxt = followed.get((key, i))
        assert choice is not None and choice[1] == plan_digest(_plan(i if nxt is None else nxt)), \
            "what followed this plan last time, or else the plan just recorded"
