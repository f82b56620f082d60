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
from zero3.planning.budget import candidates, choose_schedule, exposed_bytes
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
