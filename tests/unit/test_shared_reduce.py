"""Shared-memory reductions (comm/shared_reduce.py) in one process: which transport ``auto`` picks and
which explicit choices are refused; the outbox's slots; and the sums: own part plus each peer's row
in rank order equals the pairwise reduction's sums bit for bit, for any world size, sizes, padding
and missing gradients (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from zero3.comm.communicator import _reduce_impl
from zero3.comm.reduce import GradPiece
from zero3.comm.settings import CommSettings
from zero3.comm.shared_reduce import SharedOutbox, _peer_row
from zero3.comm.wire import piece
from zero3.errors import ZeroConfigError


@pytest.mark.parametrize("impl,backend,gather,qgz,want", [
    ("auto", "gloo", "shm", 0, "shm"),
    ("auto", "gloo", "p2p", 0, "p2p"),
    ("auto", "gloo", "shm", 8, "p2p"),  # qgZ's coded messages go on the wire
    ("auto", "nccl", "all_gather", 0, "reduce_scatter"),
    ("shm", "gloo", "shm", 0, "shm"),
    ("p2p", "gloo", "shm", 0, "p2p"),
])
def test_auto_picks_shared_reductions_beside_shared_gathers(impl, backend, gather, qgz, want):
    assert _reduce_impl(CommSettings(reduce_impl=impl, quantize_gradients=qgz), backend, gather) == want


@pytest.mark.parametrize("gather,qgz,match", [
    ("p2p", 0, r"reduce_scatter_impl='shm'.*allgather_impl resolves to 'p2p'"),
    ("all_gather", 0, r"allgather_impl resolves to 'all_gather'"),
    ("shm", 8, r"zero_quantized_gradients"),
])
def test_explicit_shm_where_it_cannot_work_is_refused(gather, qgz, match):
    with pytest.raises(ZeroConfigError, match=match):
        _reduce_impl(CommSettings(reduce_impl="shm", quantize_gradients=qgz), "gloo", gather)


def test_outbox_slots_hold_rows_apart():
    """Two slots at fixed offsets; a peer reads a row at its byte offset (here the peer is this
    process's own outbox, opened as rank 1's)."""
    box = SharedOutbox.create(0, lambda obj: [obj, obj], slot_bytes=4096)
    assert box is not None
    try:
        a = box.rows(0, 2, 100, torch.float32)
        b = box.rows(1, 1, 50, torch.float64)
        a.copy_(torch.arange(200, dtype=torch.float32).view(2, 100))
        b.copy_(-torch.arange(50, dtype=torch.float64).view(1, 50))
        got = torch.empty(100, dtype=torch.float32)
        box.read(1, 0, 100 * 4, got)
        assert torch.equal(got, torch.arange(100, 200, dtype=torch.float32))
        back = torch.empty(50, dtype=torch.float64)
        box.read(1, 1, 0, back)
        assert torch.equal(back, -torch.arange(50, dtype=torch.float64))
    finally:
        box.release()


@st.composite
def _buckets(draw):
    world = draw(st.integers(2, 5))
    numels = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    counted = draw(st.lists(st.booleans(), min_size=len(numels), max_size=len(numels)))
    has = draw(st.lists(st.lists(st.booleans(), min_size=len(numels), max_size=len(numels)),
                        min_size=world, max_size=world))
    seed = draw(st.integers(0, 2**31 - 1))
    return world, numels, counted, has, seed


@given(_buckets())
def test_shared_sums_equal_pairwise_sums_bit_for_bit(bucket):
    world, numels, counted, has, seed = bucket
    gen = torch.Generator().manual_seed(seed)
    pieces = [GradPiece(n, -(-n // world), None, c) for n, c in zip(numels, counted)]
    total = sum(p.shard_numel for p in pieces)
    row = total + sum(counted)
    grads = [[torch.randn(n, generator=gen) * 10 ** float(torch.randint(-3, 4, (1,), generator=gen))
              if has[q][i] else None for i, n in enumerate(numels)] for q in range(world)]
    presence = [torch.tensor([1.0 if grads[q][i] is not None else 0.0 for i, c in enumerate(counted) if c])
                for q in range(world)]
    for r in range(world):
        # the shared reduction: own part, then every peer's row for r, in rank order
        out = torch.empty(row)
        _peer_row(out, pieces, grads[r], presence[r], r, total)
        for q in range(world):
            if q != r:
                part = torch.empty(row)
                _peer_row(part, pieces, grads[q], presence[q], r, total)
                out.add_(part)
        # PairwiseReduce: the lowest other rank's message, plus own, plus the others in rank order
        first = 1 if r == 0 else 0
        ref = torch.empty(row)
        _peer_row(ref, pieces, grads[first], presence[first], r, total)
        off = 0
        for p, g in zip(pieces, grads[r]):
            lo, hi = piece(p.numel, p.shard_numel, r)
            if g is not None and hi > lo:
                ref[off: off + hi - lo].add_(g[lo:hi])
            off += p.shard_numel
        if presence[r].numel():
            ref[total:].add_(presence[r])
        for q in range(world):
            if q not in (r, first):
                part = torch.empty(row)
                _peer_row(part, pieces, grads[q], presence[q], r, total)
                ref.add_(part)
        assert torch.equal(out, ref)
        # and it is the sum it should be: each rank's piece r of every gradient, zero padded
        off = 0
        for i, p in enumerate(pieces):
            lo, hi = piece(p.numel, p.shard_numel, r)
            want = torch.zeros(p.shard_numel, dtype=torch.float64)
            size = torch.zeros(p.shard_numel, dtype=torch.float64)  # what fp32 rounding scales with
            for q in range(world):
                if grads[q][i] is not None and hi > lo:
                    want[: hi - lo] += grads[q][i][lo:hi].double()
                    size[: hi - lo] += grads[q][i][lo:hi].double().abs()
            err = (out[off: off + p.shard_numel].double() - want).abs()
            assert bool((err <= 1e-6 * size * world).all()), (err, size)
            off += p.shard_numel
