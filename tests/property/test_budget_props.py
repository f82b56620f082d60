"""Invariants of the memory_budget planner (planning/budget.py) on random traces.

The chosen plan's peak never exceeds the room; it exposes no more than any plan of the fixed grid
that fits (so a larger budget never predicts more exposed communication than the fixed grid's best
under a smaller one); a room smaller than one module's gathered bytes is refused naming that module.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import traces

from zero3.errors import ZeroConfigError
from zero3.planning.budget import (Calibration, _fewest_bucket, candidates, choose_schedule, choose_split, exposed_bytes,
                                  gradient_pieces, reductions)
from zero3.planning.schedule import PlanConfig, plan
from zero3.planning.trace import Trace


def _module_bytes(trace: Trace) -> list[tuple[int, str]]:
    infos = trace.params
    return [(sum(infos[p].nbytes for p in ev.params if not infos[p].persistent), ev.module or "<root>")
            for ev in trace.events if ev.kind.is_pre]


def _floor(trace: Trace) -> int:
    """The least peak any plan has: only what open visits need (`choose_schedule`'s floor)."""
    return plan(trace, PlanConfig(max_live=0, max_reuse_distance=0, prefetch_bucket_size=0, unit="bytes")) \
        .stats.peak_live_bytes


rooms = st.one_of(st.integers(0, 4000), st.just(10**13))


@given(traces, rooms)
def test_chosen_peak_within_room(trace: Trace, extra: int) -> None:
    room = _floor(trace) + extra
    choice = choose_schedule(trace, room)
    schedule = plan(trace, choice.config)
    assert schedule.stats.peak_live_bytes == choice.peak_bytes <= room
    assert exposed_bytes(trace, schedule) == choice.exposed_bytes
    assert choice.feasible >= 1 and choice.reasons


def _best_fixed(trace: Trace, room: int) -> int:
    """The least exposure over the room-independent grid's plans that fit ``room``."""
    best = None
    for config in candidates(trace):
        schedule = plan(trace, config)
        if schedule.stats.peak_live_bytes <= room:
            e = exposed_bytes(trace, schedule)
            best = e if best is None else min(best, e)
    return best if best is not None else 2**63


@given(traces, rooms, rooms)
def test_larger_budget_never_exposes_more_than_the_fixed_grid(trace: Trace, a: int, b: int) -> None:
    floor = _floor(trace)
    small, large = sorted((floor + a, floor + b))
    chosen = choose_schedule(trace, large).exposed_bytes
    assert chosen <= _best_fixed(trace, large) <= _best_fixed(trace, small)
    below = choose_schedule(trace, small)
    c = below.config
    # Only a plan built on the smaller room's own size (not in the larger room's grid) may beat it.
    assert chosen <= below.exposed_bytes or small in (c.max_live, c.prefetch_bucket_size, c.max_reuse_distance)


@given(traces, st.integers(1, 10**6))
def test_room_below_a_module_is_refused_naming_it(trace: Trace, short: int) -> None:
    sizes = _module_bytes(trace)
    assume(sizes and max(sizes)[0] > 0)
    largest, _ = max(sizes)
    room = max(0, largest - short)
    with pytest.raises(ZeroConfigError) as info:
        choose_schedule(trace, room)
    message = str(info.value)
    assert any(repr(name) in message for size, name in sizes if size == largest)
    assert f"{largest:,} bytes" in message


# -- the reduce bucket chosen with the schedule (`choose_split`) -------------------------------------

pieces_lists = st.lists(st.integers(0, 5000), min_size=1, max_size=30)  # 0: an empty parameter, queued all the same


@given(pieces_lists, st.integers(1, 20000))
def test_the_predicted_reductions_are_the_reducers(pieces: list[int], bucket: int) -> None:
    """`reductions` counts what runtime/grad.py's reducer issues for the same gradients in the same
    order: the number of reductions and the last one's size (a consistency check of the planner's
    model against the reducer's rule, not a measurement)."""
    from types import SimpleNamespace

    import torch

    from zero3.metrics import StepMetrics
    from zero3.runtime.grad import GradientReducer

    reducer = GradientReducer(SimpleNamespace(world_size=2, metrics=StepMetrics()), bucket)
    issued: list[int] = []

    def flush() -> None:  # as grad.py's: a bucket with anything in it is issued, an empty parameter too
        if reducer._bucket:
            issued.append(reducer._numel)
        reducer._bucket, reducer._numel = [], 0

    reducer.flush = flush  # type: ignore[method-assign]
    for n in pieces:
        reducer.add(SimpleNamespace(_zero=SimpleNamespace(numel=n)), torch.zeros(n))
    reducer.flush()
    assert reductions(pieces, bucket) == (len(issued), issued[-1])


@given(pieces_lists, st.integers(1, 3000), st.integers(0, 40000))
def test_each_count_of_reductions_gets_its_smallest_and_largest_bucket(pieces: list[int], lo: int, span: int) -> None:
    hi = lo + span
    out = _fewest_bucket(pieces, lo, hi)
    counts = {reductions(pieces, b)[0] for b in out}
    assert counts == {reductions(pieces, b)[0] for b in range(lo, hi + 1, max(1, span // 200))} | counts  # none missed
    for bucket in out:
        assert lo <= bucket <= hi
        count, _ = reductions(pieces, bucket)
        smallest = bucket == lo or reductions(pieces, bucket - 1)[0] > count  # one less takes more reductions
        largest = bucket == hi or reductions(pieces, bucket + 1)[0] < count  # one more takes fewer
        assert smallest or largest


def _hold(per_element: int):
    return lambda n: per_element * n


@given(traces, st.integers(0, 6), st.integers(0, 10**6), st.sampled_from([Calibration(), Calibration(0.0, 1.0),
                                                                       Calibration(1.0, 0.0), Calibration(1e-9, 5e-8)]))
def test_the_split_keeps_the_bucket_and_the_gathered_peak_within_what_is_left(
        trace: Trace, per_element: int, extra: int, calibration: Calibration) -> None:
    """The chosen bucket's hold and the chosen plan's gathered peak fit ``avail`` together (the account
    the runtime's gauges are held to), the bucket takes the largest piece whole, and where a bucket holds
    nothing (world size 1) the choice is `choose_schedule`'s in the whole room with the first bucket."""
    pieces = gradient_pieces(trace)
    largest = max([1, *pieces])  # the runtime's bucket is never below one element
    hold = _hold(per_element)
    avail = _floor(trace) + hold(largest) + extra
    split = choose_split(trace, avail, hold, largest, largest, calibration=calibration)
    schedule = plan(trace, split.config)
    assert schedule.stats.peak_live_bytes == split.peak_bytes <= split.room
    assert split.room + split.reduce_bucket_bytes <= avail and split.reduce_bucket_bytes == hold(split.reduce_bucket_size)
    assert split.reduce_bucket_size >= largest
    if per_element == 0:
        alone = choose_schedule(trace, avail)
        assert (split.config, split.reduce_bucket_size, split.reductions) == (alone.config, largest, 0)
    else:
        assert split.reductions == reductions(pieces, split.reduce_bucket_size)[0]


@given(traces, st.integers(1, 6))
def test_a_split_with_no_room_for_one_module_is_refused(trace: Trace, per_element: int) -> None:
    pieces = gradient_pieces(trace)
    floor = _floor(trace)
    assume(floor > 0 and pieces)
    largest = max(pieces)
    with pytest.raises(ZeroConfigError):
        choose_split(trace, floor - 1 + per_element * largest, _hold(per_element), largest, largest)
