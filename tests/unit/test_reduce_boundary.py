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
