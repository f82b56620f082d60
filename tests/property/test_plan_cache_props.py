"""comm/verify.py `PlanCache`: what it keeps stays bounded by its capacity, whatever the epochs, and
its prediction is a plan it holds, the one that followed last time where that is still held."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from zero3.comm.verify import SUCCESSORS_PER_PLAN, PlanCache, RequestShape, plan_digest


def _plan(i: int) -> list[RequestShape]:
    return [RequestShape("all-gather", (i,), "float32", False)]


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 6),
       epochs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30)), min_size=1, max_size=120))
def test_the_cache_stays_within_its_capacity_and_predicts_what_followed_last_time(capacity, epochs):
    """Each epoch: a key (its first request) and a plan. The successors learnt from epochs that never
    came back used to stay (an entry per distinct epoch: 20,000 after 20,000, probe 37C)."""
    cache = PlanCache(capacity)
    lru: list[tuple[int, int]] = []  # an independent model: (key, plan), least recently recorded first
    followed: dict[tuple[int, int], int] = {}  # (key, plan before or -1) -> plan after, for plans held
    last: dict[int, int] = {}
    for key, i in epochs:
        followed[(key, last.get(key, -1))] = i
        last[key] = i
        cache.record((key, True), _plan(i))
        if (key, i) in lru:
            lru.remove((key, i))
        lru.append((key, i))
        while len(lru) > capacity:
            k, gone = lru.pop(0)
            followed = {f: a for f, a in followed.items() if (f[0], a) != (k, gone)}
            if last.get(k) == gone:
                del last[k]
        assert {(k[0], d) for k, d in cache._plans} == {(k, plan_digest(_plan(j))) for k, j in lru}
        assert len(cache._successor) <= SUCCESSORS_PER_PLAN * capacity and len(cache._last) <= capacity
        choice = cache.choose((key, True))
        nxt = followed.get((key, i))
        assert choice is not None and (key, choice[1]) in {(k, plan_digest(_plan(j))) for k, j in lru}
        if len(followed) <= SUCCESSORS_PER_PLAN * capacity:  # else the oldest learnt may have gone
            assert choice[1] == plan_digest(_plan(i if nxt is None else nxt)), \
                "what followed this plan last time, or else the plan just recorded"


def test_a_new_order_every_epoch_leaves_a_bounded_cache_and_a_rare_order_still_predicts_its_successor():
    """20,000 distinct epochs: at most SUCCESSORS_PER_PLAN entries per plan. A X1 A X2 ... A X12 at
    capacity 10: after each X comes A, which the cache proposes once it has seen the pattern (review
    37R2: pruning what followed an evicted X made it propose X again, 0 of 12)."""
    cache = PlanCache(10)
    for i in range(1, 20001):
        cache.record((0, True), _plan(i))
    assert len(cache._plans) == 10 and len(cache._successor) <= SUCCESSORS_PER_PLAN * 10
    cache = PlanCache(10)
    hits = 0
    for cycle in range(3):
        for x in range(1, 13):
            cache.record((0, True), _plan(0))
            cache.record((0, True), _plan(100 + x))
            hits += cycle == 2 and cache.choose((0, True))[1] == plan_digest(_plan(0))
    assert hits == 12
