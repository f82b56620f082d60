"""What the gradient reducer is counted as holding: `held_storages` (the census behind its gauge,
comm/works.py) and `hold_bytes` (memory_budget's account of a bucket, comm/reduce.py). The gauge
against the account, on each transport, is in tests/multiproc/test_memory_budget_multirank.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero3.comm.reduce import GradPiece, hold_bytes
from zero3.comm.wire import PairwiseWork
from zero3.comm.works import held_storages


def test_views_count_once_and_closures_and_works_are_followed():
    base, other, grad = torch.zeros(100), torch.zeros(10, dtype=torch.float64), torch.ones(7)
    work = PairwiseWork([])
    work.keep = [base[:10], base[50:]]  # two views of one storage
    work.then = (lambda: other.sum() + grad.sum())  # a closure over two tensors
    found = held_storages(work)
    assert sorted(found.values()) == [28, 80, 400]
    piece = GradPiece(7, 4, grad)
    assert held_storages({"a": (piece, None)}, [base]) == {grad.untyped_storage().data_ptr(): 28,
                                                           base.untyped_storage().data_ptr(): 400}


def test_objects_of_other_kinds_are_not_followed():
    class Transport:  # a closure's `self`: a transport, codec or communicator, never walked into
        def __init__(self) -> None:
            self.big = torch.zeros(1000)

    t, out = Transport(), torch.zeros(3)
    assert held_storages(lambda: (t, out)) == {out.untyped_storage().data_ptr(): 12}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.lists(st.tuples(st.integers(0, 63), st.integers(1, 64)),
                                                        max_size=3)), min_size=1, max_size=6))
def test_the_census_is_the_sum_of_distinct_storages(spec):
    tensors, held = [], []
    for n, views in spec:
        t = torch.zeros(n)
        tensors.append(t)
        held.append(t)
        held.extend(t[min(a, n - 1): min(a, n - 1) + b] for a, b in views)
    assert sum(held_storages(held).values()) == 4 * sum(t.numel() for t in tensors)


@pytest.mark.parametrize("impl", ["reduce_scatter", "all_reduce", "p2p", "shm"])
@settings(max_examples=30, deadline=None)
@given(world=st.integers(1, 9), numel=st.integers(0, 10**7), pieces=st.integers(1, 500),
       g=st.sampled_from([2, 4]), r=st.sampled_from([2, 4]), holes=st.booleans(), verify=st.booleans(),
       quantized=st.sampled_from([None, (8, 512), (4, 256)]))
def test_the_account_holds_the_gradients_and_grows_with_the_bucket(impl, world, numel, pieces, g, r, holes, verify,
                                                                     quantized):
    """Monotone in the bucket's elements (memory_budget searches the largest bucket within its share by
    bisection), nothing at world size 1, and at least the gradients and this rank's result otherwise."""
    kw = dict(holes=holes, verify=verify, quantized=quantized)
    held = hold_bytes(impl, world, numel, pieces, g, r, **kw)
    assert hold_bytes(impl, world, numel + 1 + numel // 3, pieces, g, r, **kw) >= held
    if world == 1:
        assert held == 0
    else:
        assert held >= numel * g + -(-numel // world) * (4 if quantized else r)


def test_an_unresolved_transport_is_refused():
    with pytest.raises(ValueError, match="reduce_impl 'auto'"):
        hold_bytes("auto", 2, 10, 1, 4, 4)
