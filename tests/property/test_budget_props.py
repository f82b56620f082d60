"""Invariants of the memory_budget planner (planning/budget.py) on random traces.

The chosen plan's peak never exceeds the room; a larger budget never predicts more exposed
communication; a room smaller than one module's gathered bytes is refused naming that module.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import traces

from zero3.errors import ZeroConfigError
from zero3.planning.budget import choose_schedule, exposed_bytes
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


@given(traces, rooms, rooms)
def test_larger_budget_never_exposes_more(trace: Trace, a: int, b: int) -> None:
    floor = _floor(trace)
    small, large = sorted((floor + a, floor + b))
    assert choose_schedule(trace, large).exposed_bytes <= choose_schedule(trace, small).exposed_bytes


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
