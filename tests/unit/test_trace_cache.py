"""Unit tests for the pure pieces the coordinator delegates to: the trace cache and its successor
prediction (planning/trace_cache.py), and generation mode's prefetch policy (planning/generation.py)."""

from __future__ import annotations

import pytest

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from zero3.planning.generation import GenerationPrefetch
from zero3.planning.schedule import PlanConfig
from zero3.planning.trace import Event, EventKind, ParamInfo, TraceRecorder, trace_from_json, trace_to_json
from zero3.planning.trace_cache import HISTORY, LONG_EVENTS, StepTraces

PF, QF = EventKind.PRE_FORWARD, EventKind.POST_FORWARD
INFOS = {i: ParamInfo(i, f"w{i}", 10, 40) for i in range(3)}
CONFIG = PlanConfig(max_live=100, max_reuse_distance=0, prefetch_bucket_size=0)


def _step(steps: StepTraces, modules: list[tuple[str, int]]) -> int | None:
    """Run one step of ``modules``; returns the version of the trace it followed (None: none)."""
    followed = steps.begin("pre_forward:<root>:grad")
    version = followed.trace.version if followed is not None else None
    for name, pid in modules:
        for kind in (PF, QF):
            steps.observe(kind, name, (pid,), step=0)
    steps.end(False, lambda: INFOS, CONFIG)
    return version


def test_alternating_orders_are_recorded_once_each_and_predicted() -> None:
    steps = StepTraces(max_traces=4)
    a, b = [("a", 0), ("b", 1)], [("b", 1), ("a", 0)]
    followed = [_step(steps, order) for order in (a, b, a, b, a, b)]
    assert steps.cache.record_count == 2
    assert followed == [None, 1, 2, 2, 1, 2]  # from the fourth step on, each successor is predicted
    assert not steps.diverged


def test_orders_that_come_back_every_third_or_fifth_step_are_predicted() -> None:
    """One successor per order never settled on A, B, B, A, B, B (after B comes B or A): 2 of every 3
    steps left their trace for good (probe 32Q: an eval with grad on joining every third step, or a
    block skipped every third step). The longest matching run of past orders predicts them."""
    a, b = [("a", 0), ("b", 1)], [("b", 1), ("a", 0)]
    for period in (3, 5):
        steps = StepTraces(max_traces=4)
        left = []
        for i in range(8 * period):
            _step(steps, a if i % period == 0 else b)
            left.append(steps.diverged)
        assert steps.cache.record_count == 2
        assert not any(left[3 * period:]), (period, left)


@pytest.mark.parametrize("every", [None, 14, 20, 30])
def test_a_rare_or_one_off_order_costs_no_more_steps_than_one_successor_per_order(every) -> None:
    """Review 32RD: with the longest match alone, A..A B A^k kept forecasting B for about 12 steps after a
    one-off B (the point before B matched k A's, the latest A k-1), and an order every 14-30 steps left
    its trace 9-13 steps a period. Now: the B step and the two after it, as one successor per order
    gave (B itself cannot be foreseen; after it, the step it last preceded; then A again), and no more
    once a period fits the window."""
    a, b = [("a", 0), ("b", 1)], [("b", 1), ("a", 0)]
    odd = [50] if every is None else [i for i in range(120) if i % every == every - 1]
    steps = StepTraces(max_traces=4)
    left = []
    for i in range(120):
        _step(steps, b if i in odd else a)
        if steps.diverged:
            left.append(i)
    t = odd[-1] if every is None else odd[-2]  # the last odd step with a whole period after it
    assert set(i for i in left if t <= i < t + (every or 70)) <= {t, t + 1, t + 2}, left


def test_the_least_recently_used_trace_goes_beyond_max_traces() -> None:
    steps = StepTraces(max_traces=1)
    _step(steps, [("a", 0)])
    _step(steps, [("b", 1)])
    assert steps.cache.record_count == 2
    assert steps.cache.predict("pre_forward:<root>:grad")[0].version == 2
    assert _step(steps, [("a", 0)]) == 2 and steps.diverged  # v1 is gone: recorded again, as v3
    assert steps.cache.record_count == 3


def test_a_step_that_follows_records_the_same_events_however_it_ends() -> None:
    """A followed step appends nothing while it matches; its events are still what it ran: the
    followed prefix plus what came after it left the trace, or the prefix alone if it ended early."""
    steps = StepTraces(max_traces=8)
    a, b = [("a", 0), ("b", 1), ("c", 2)], [("a", 0), ("c", 2), ("b", 1)]
    _step(steps, a)
    assert _step(steps, a) == 1 and steps.cache.record_count == 1  # followed to the end: nothing new
    assert _step(steps, b) == 1 and steps.diverged  # left v1 at its third event
    assert steps.last[0].events == tuple(Event(kind, name, (pid,)) for name, pid in b for kind in (PF, QF))
    assert steps.last[0].version == 2
    assert _step(steps, b[:1]) == 2 and not steps.diverged  # ended after the first module of v2
    assert [(e.kind, e.module) for e in steps.last[0].events] == [(PF, "a"), (QF, "a")]
    assert steps.cache.record_count == 3


def test_a_much_longer_new_order_is_planned_only_when_it_comes_again() -> None:
    """Probe 32Q: a loop of forwards with grad on and no backward joins the next step's trace, and
    planning it cost the first step after 100 of them 38-73x a steady step. A new order over
    LONG_FACTOR times its key's cached ones (and over LONG_EVENTS) is planned when it comes again among
    the key's last LONG_SEEN such orders; meanwhile the next short step follows the order it followed before."""
    a = [("a", 0), ("b", 1), ("c", 2)]
    long = a * (LONG_EVENTS // 6 + 1)  # 2 events per module call
    steps = StepTraces(max_traces=4)
    _step(steps, a)
    assert steps.cache.record_count == 1 and steps.last[0].version == 1
    assert _step(steps, long) == 1 and steps.diverged  # left v1 where it ended
    assert steps.cache.record_count == 1 and steps.cache.long_count == 1 and steps.last[0].version == 1
    assert _step(steps, a) == 1 and not steps.diverged  # the short order is followed, as before
    assert _step(steps, long) == 1 and steps.cache.record_count == 2  # it came again: planned now, as v2
    assert steps.last[0].version == 2 and len(steps.last[0].events) == 2 * len(long)
    assert _step(steps, long) == 2 and not steps.diverged  # and followed from then on
    assert steps.cache.long_count == 1
    _step(steps, long + a)  # within LONG_FACTOR of v2: planned at once
    assert steps.cache.record_count == 3 and steps.cache.long_count == 1


def test_long_orders_are_planned_when_they_are_a_key_s_first_or_alike_in_length() -> None:
    """Review 34RA: with a cap by length alone, a single long step (what zero3.plan.record_trace
    records) had no plan, and long orders of about one length alternating (an RNN's length buckets)
    were never planned. A key's first order is planned, and so is one within LONG_FACTOR of its own."""
    a = [("a", 0), ("b", 1), ("c", 2)] * (LONG_EVENTS // 3)
    b = a + [("c", 2)]
    steps = StepTraces(max_traces=4)
    followed = [_step(steps, order) for order in (a, b, a, b, a, b)]
    assert steps.cache.record_count == 2 and steps.cache.long_count == 0
    assert followed[3:] == [2, 1, 2] and not steps.diverged
    # Review 34RB: after a short first order, two long ones alternating replaced each other as the one
    # remembered and neither was ever planned; each is planned when it comes again.
    steps = StepTraces(max_traces=4)
    followed = [_step(steps, order) for order in [a[:30]] + [a, b] * 4]
    assert steps.cache.record_count == 3 and steps.cache.long_count == 2
    assert followed[6:] == [3, 2, 3] and not steps.diverged


def test_trace_uses_are_the_opening_events_of_each_param() -> None:
    rec = TraceRecorder()
    for kind, name, pid in ((PF, "a", 0), (QF, "a", 0), (PF, "b", 1), (EventKind.PRE_BACKWARD, "a", 0)):
        rec.record(kind, name, (pid,))
    trace = rec.freeze("k", 1, INFOS)
    assert dict(trace.uses) == {0: (0, 3), 1: (2,)}


def test_trace_json_round_trips() -> None:
    rec = TraceRecorder()
    rec.record(PF, "a", (0, 2))
    rec.record(QF, "a", (0, 2))
    trace = rec.freeze("k", 3, INFOS)
    assert trace_from_json(trace_to_json(trace)) == trace


def test_generation_prefetches_the_next_event_of_the_learnt_cycle() -> None:
    policy = GenerationPrefetch()
    assert policy.advance((0,)) is None  # one event: no cycle yet
    assert policy.advance((1,)) == (0,)  # 0, 1: after 1 comes 0 again
    assert policy.advance((0,)) == (1,)  # a new forward began
    assert policy.advance((2,)) == (0,)  # a new order from here: 0, 2
    policy.use((0,))
    policy.use((1,))
    assert policy.next_use(1) > policy.next_use(0) > policy.next_use(2) == 0


@settings(max_examples=60, deadline=None)
@given(max_traces=st.integers(1, 4), orders=st.lists(st.integers(0, 5), min_size=1, max_size=60))
def test_what_the_cache_learns_stays_bounded_by_the_traces_it_keeps(max_traces: int, orders: list[int]) -> None:
    """More step orders than ``max_traces`` re-record every step under new versions: the successors
    and the announced divergences of evicted versions go with them (probe 26D: both grew by one
    entry a step, 1,695 after 2,000 steps of 24 orders)."""
    modules = [("a", 0), ("b", 1), ("c", 2)]
    perms = [[modules[i] for i in p] for p in itertools.permutations(range(3))]  # 6 orders
    steps = StepTraces(max_traces=max_traces)
    recorded = []
    for o in orders:
        _step(steps, perms[o])
        recorded.append(steps.cache.record_count)
        live = {(key, e[0].version) for key, entries in steps.cache._traces.items() for e in entries}
        assert len(live) <= max_traces
        for key, history in steps.cache._history.items():
            assert len(history) <= HISTORY and all((key, version) in live for version in history)
        assert all((key, version) in live for key, version, _ in steps._announced)
    if len(orders) > 1 and orders[-1] == orders[-2]:
        assert recorded[-1] == recorded[-2]  # an order just seen is still cached: not recorded again


def test_divergences_while_the_cache_thrashes_log_at_info_and_warn_again_once_it_settles(caplog):
    """With more orders than max_traces each step left its trace and logged a WARNING (1,764 in 2,000
    steps, probe 26D). The first eviction warns once, naming max_traces; divergences while traces keep
    being dropped log at INFO; a divergence after the cache has settled warns again (review 26Y)."""
    steps = StepTraces(max_traces=1)
    a, b = [("a", 0), ("b", 1)], [("b", 1), ("a", 0)]

    def levels(orders: list) -> list[str]:
        caplog.clear()
        with caplog.at_level("INFO", logger="zero3.planning.trace_cache"):
            for order in orders:
                _step(steps, order)
        return [r.levelname + (" max_traces" if "max_traces" in r.getMessage() else "")
                for r in caplog.records if "left trace" in r.getMessage() or "max_traces" in r.getMessage()]

    assert levels([a, b, a, b, a]) == ["WARNING", "WARNING max_traces", "INFO", "INFO", "INFO"]
    assert levels([a, a, a]) == []  # settled: followed to the end
    assert levels([b]) == ["WARNING"]  # a new divergence after that is said as before
