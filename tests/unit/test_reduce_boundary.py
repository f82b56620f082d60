"""When the gradient reducer issues its queued gradients (runtime/grad.py): at a module's end once
they reach the prefetch bucket, whatever DeepSpeed's larger reduce bucket says."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero3 import ZeroConfig
from zero3.runtime.context import _prefetch_numel
from zero3.metrics import StepMetrics
from zero3.runtime.grad import GradientReducer


def _reducer(bucket: int, boundary: int) -> tuple[GradientReducer, list[int]]:
    reducer = GradientReducer(SimpleNamespace(world_size=2, metrics=StepMetrics()), bucket, boundary_numel=boundary)
    issued: list[int] = []

    def flush() -> None:  # what was queued when a reduction was issued
        issued.append(reducer._numel)
        reducer._bucket, reducer._numel = [], 0

    reducer.flush = flush  # type: ignore[method-assign]
    return reducer, issued


def _param(numel: int) -> SimpleNamespace:
    return SimpleNamespace(_zero=SimpleNamespace(numel=numel))


def test_module_end_issues_once_the_queue_reaches_the_boundary() -> None:
    reducer, issued = _reducer(bucket=10**9, boundary=100)
    reducer.add(_param(60), torch.zeros(60))
    reducer.module_done()
    assert issued == []  # 60 < 100: keep collecting
    reducer.add(_param(60), torch.zeros(60))
    assert issued == []  # the bucket (1e9) is far from full
    reducer.module_done()
    assert issued == [120]


def test_a_full_bucket_still_issues_mid_module() -> None:
    reducer, issued = _reducer(bucket=50, boundary=100)
    reducer.add(_param(60), torch.zeros(60))
    assert issued == [60]


def test_without_a_boundary_only_the_bucket_issues() -> None:
    reducer, issued = _reducer(bucket=1000, boundary=0)
    for _ in range(5):
        reducer.add(_param(150), torch.zeros(150))
        reducer.module_done()
    assert issued == []
    reducer.add(_param(300), torch.zeros(300))
    assert issued == [750]  # issued before the gradient that would take it past 1000 (1050 before)


def test_boundary_is_the_prefetch_bucket_in_elements() -> None:
    assert _prefetch_numel(ZeroConfig(prefetch_bucket_size=1000)) == 1000
    assert _prefetch_numel(ZeroConfig(prefetch_bucket_size=0)) == 0
    # bytes mode: the byte knob over the element size, or 4 bytes per element of the element knob
    assert _prefetch_numel(ZeroConfig(max_live_bytes=10**6, prefetch_bucket_bytes=4000, dtype="bf16")) == 2000
    assert _prefetch_numel(ZeroConfig(max_live_bytes=10**6, prefetch_bucket_size=1000)) == 1000
    assert _prefetch_numel(ZeroConfig(max_live_bytes=10**6, prefetch_bucket_size=1000, dtype="bf16")) == 2000


@settings(max_examples=200, deadline=None)
@given(bucket=st.integers(1, 500), boundary=st.integers(0, 800),
       events=st.lists(st.one_of(st.tuples(st.just("add"), st.integers(1, 700)),
                                 st.tuples(st.just("unit"), st.lists(st.integers(1, 300), min_size=1, max_size=4)),
                                 st.tuples(st.just("end"), st.just(0))), max_size=40))
def test_a_reduction_takes_at_most_the_bucket_or_one_larger_piece_alone(bucket, boundary, events) -> None:
    """``reduce_bucket_size`` is the most elements one reduction takes (docs/config.md): before, the
    bucket was tested after appending, so 1,088 queued elements plus an 8,192-element gradient went
    as one reduction of 9,280 under a bucket of 1,500 (memory_budget's account was exceeded by 20%)."""
    reducer, issued = _reducer(bucket=bucket, boundary=boundary)
    pieces: list[int] = []  # the size of what was added in one call
    for kind, arg in events:
        if kind == "add":
            reducer.add(_param(arg), torch.zeros(arg))
            pieces.append(arg)
        elif kind == "unit":
            reducer.add_unit([(_param(n), torch.zeros(n)) for n in arg])
            pieces.append(sum(arg))
        else:
            reducer.module_done()
    reducer.flush()
    assert sum(issued) == sum(pieces)  # nothing lost or counted twice
    assert all(n <= bucket or n in pieces for n in issued), (issued, pieces)
    assert all(n <= max([bucket, *pieces]) for n in issued)


def _capped(bucket: int, cap: int, held_per_element: int) -> tuple[GradientReducer, list[tuple[str, int]]]:
    """A reducer whose issue puts a stand-in reduction in flight holding ``held_per_element`` bytes per
    element it took, and whose landing only records it: the overlap rule without a process group."""
    reducer = GradientReducer(SimpleNamespace(world_size=2, metrics=StepMetrics()), bucket)
    reducer.held_cap = cap
    log: list[tuple[str, int]] = []

    def land() -> None:
        if reducer._in_flight is not None:
            log.append(("land", reducer._held_bytes + reducer._queued_bytes))
            reducer._hold(-reducer._held_bytes)
            reducer._in_flight, reducer._held_bytes = None, 0

    def flush() -> None:
        land()
        if reducer._bucket:
            numel = reducer._numel
            reducer._hold(-reducer._queued_bytes)
            reducer._bucket, reducer._numel, reducer._queued_bytes = [], 0, 0
            reducer._held_bytes = held_per_element * numel
            reducer._hold(reducer._held_bytes)
            reducer._in_flight = (None, [], numel)  # type: ignore[assignment]
            log.append(("issue", numel))

    reducer._land = land  # type: ignore[method-assign]
    reducer.flush = flush  # type: ignore[method-assign]
    return reducer, log


@settings(max_examples=200, deadline=None)
@given(bucket=st.integers(1, 300), cap_over=st.integers(0, 3000), held=st.integers(0, 12),
       sizes=st.lists(st.integers(1, 400), max_size=30))
def test_a_capped_reducer_overlaps_only_within_its_cap(bucket, cap_over, held, sizes) -> None:
    """memory_budget's cap on what the reducer holds (grad.py `held_cap`): a gradient is queued beside the
    reduction in flight exactly when the two, with it, stay within the cap; otherwise that reduction lands
    first. Before round 40 it landed before every new bucket, whatever room was left (4% of a step)."""
    cap = 4 * bucket + cap_over
    reducer, log = _capped(bucket, cap, held)
    fit = reducer._fit

    def checked_fit(incoming: int) -> None:  # lands exactly when the cap would be passed
        before = len(log)
        state = (reducer._in_flight is not None, reducer._held_bytes + reducer._queued_bytes + incoming)
        fit(incoming)
        assert (len(log) > before) == (state[0] and state[1] > cap), (state, cap)

    reducer._fit = checked_fit  # type: ignore[method-assign]
    for n in sizes:
        reducer.add(_param(n), torch.zeros(n))
        if reducer._in_flight is not None and reducer._queued_bytes:  # both at once: within the cap
            assert reducer._held_bytes + reducer._queued_bytes <= cap, log
    assert reducer.comm.metrics.reduce_held_bytes == reducer._queued_bytes + reducer._held_bytes


def test_the_next_bucket_fills_beside_the_reduction_in_flight_up_to_the_cap() -> None:
    reducer, log = _capped(bucket=100, cap=700, held_per_element=4)
    reducer.add(_param(100), torch.zeros(100))  # a full bucket: issued, holding 400 bytes
    reducer.add(_param(50), torch.zeros(50))  # 400 + 200 <= 700: queued beside it
    assert log == [("issue", 100)]
    reducer.add(_param(30), torch.zeros(30))  # 400 + 200 + 120 > 700: it lands first
    assert log == [("issue", 100), ("land", 600)]
    assert reducer._queued_bytes == 320 and reducer._in_flight is None
