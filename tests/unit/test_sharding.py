"""Partition math (zero3.partition.sharding): property tests over shapes, dtypes and world sizes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero3.partition import sharding

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool]

shapes = st.lists(st.integers(min_value=0, max_value=7), min_size=0, max_size=3).map(tuple)
dtypes = st.sampled_from(DTYPES)
worlds = st.integers(min_value=1, max_value=8)
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with no zeros, so a zero in the wrong place (padding leaking) is visible."""
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool() | (torch.rand(shape, generator=g) < 0.8)
    if dtype.is_floating_point:
        x = torch.rand(shape, generator=g) + 0.5
        sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
        return (x * sign).to(dtype)
    return torch.randint(1, 1000, shape, generator=g).to(dtype)


def _sentinel(dtype: torch.dtype):
    return True if dtype is torch.bool else 7


@settings(deadline=None, max_examples=200)
@given(shape=shapes, dtype=dtypes, world=worlds, seed=seeds)
def test_shard_then_unshard_restores_the_tensor_exactly(shape, dtype, world, seed):
    full = _tensor(shape, dtype, seed)
    shards = [sharding.shard_tensor(full, world, r) for r in range(world)]
    back = sharding.unshard(shards, full.shape)
    assert back.shape == full.shape
    assert back.dtype == full.dtype
    assert torch.equal(back, full)


@settings(deadline=None, max_examples=200)
@given(shape=shapes, dtype=dtypes, world=worlds, seed=seeds)
def test_every_shard_is_1d_with_size_ceil_numel_over_world(shape, dtype, world, seed):
    full = _tensor(shape, dtype, seed)
    expected = math.ceil(full.numel() / world)
    assert sharding.shard_numel(full.numel(), world) == expected
    assert sharding.padded_numel(full.numel(), world) == expected * world
    for r in range(world):
        s = sharding.shard_tensor(full, world, r)
        assert s.dim() == 1
        assert s.numel() == expected
        assert s.dtype == dtype


@settings(deadline=None, max_examples=200)
@given(numel=st.integers(min_value=0, max_value=400), world=worlds)
def test_shard_ranges_cover_every_element_exactly_once(numel, world):
    seen = [0] * numel
    s = sharding.shard_numel(numel, world)
    prev_end = 0
    for r in range(world):
        start, end = sharding.shard_range(numel, world, r)
        assert 0 <= start <= end <= numel
        assert end - start <= s
        assert start == prev_end  # contiguous, rank order
        prev_end = end
        for i in range(start, end):
            seen[i] += 1
    assert prev_end == numel
    assert seen == [1] * numel


@settings(deadline=None, max_examples=200)
@given(shape=shapes, dtype=dtypes, world=worlds, seed=seeds)
def test_shard_holds_its_range_then_zero_padding(shape, dtype, world, seed):
    full = _tensor(shape, dtype, seed)
    flat = full.reshape(-1)
    for r in range(world):
        shard = sharding.shard_tensor(full, world, r)
        start, end = sharding.shard_range(full.numel(), world, r)
        n = end - start
        assert torch.equal(shard[:n], flat[start:end])
        pad = shard[n:]
        assert torch.equal(pad, torch.zeros_like(pad))


@settings(deadline=None, max_examples=200)
@given(shape=shapes, dtype=dtypes, world=worlds, seed=seeds)
def test_padding_never_appears_in_the_unshard_result(shape, dtype, world, seed):
    full = _tensor(shape, dtype, seed)
    shards = []
    for r in range(world):
        shard = sharding.shard_tensor(full, world, r)
        start, end = sharding.shard_range(full.numel(), world, r)
        shard[end - start:] = _sentinel(dtype)  # poison the padding
        shards.append(shard)
    assert torch.equal(sharding.unshard(shards, full.shape), full)


@settings(deadline=None, max_examples=100)
@given(shape=shapes, world=worlds, seed=seeds)
def test_shard_is_a_copy_not_a_view(shape, world, seed):
    full = _tensor(shape, torch.float32, seed)
    before = full.clone()
    for r in range(world):
        shard = sharding.shard_tensor(full, world, r)
        shard.fill_(123.0)
    assert torch.equal(full, before)


def test_zero_dim_tensor_goes_to_rank_0_and_the_rest_is_padding():
    full = torch.tensor(3.5)
    shards = [sharding.shard_tensor(full, 3, r) for r in range(3)]
    assert [s.tolist() for s in shards] == [[3.5], [0.0], [0.0]]
    back = sharding.unshard(shards, ())
    assert back.shape == torch.Size([]) and back.item() == 3.5


def test_odd_numel_split_matches_hand_computation():
    full = torch.arange(1, 11, dtype=torch.int64)  # 10 elements over 4 ranks: 3 each, 2 padding
    shards = [sharding.shard_tensor(full, 4, r) for r in range(4)]
    assert [s.tolist() for s in shards] == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 0, 0]]
    assert [sharding.shard_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_ranks_past_the_data_own_an_empty_range():
    # 2 elements over 8 ranks: shard size 1; ranks 2..7 hold only padding.
    assert [sharding.shard_range(2, 8, r) for r in range(8)] == [(0, 1), (1, 2)] + [(2, 2)] * 6


@pytest.mark.parametrize("world", [0, -1, -8])
def test_bad_world_size_is_rejected(world):
    with pytest.raises(ValueError, match=rf"world_size must be >= 1, got {world}"):
        sharding.shard_numel(10, world)
    with pytest.raises(ValueError, match=rf"world_size must be >= 1, got {world}"):
        sharding.shard_range(10, world, 0)
    with pytest.raises(ValueError, match=rf"world_size must be >= 1, got {world}"):
        sharding.shard_tensor(torch.zeros(10), world, 0)


@pytest.mark.parametrize("world,rank", [(4, 4), (4, -1), (1, 1), (8, 100)])
def test_bad_rank_is_rejected(world, rank):
    with pytest.raises(ValueError, match=rf"rank must be in \[0, {world}\), got {rank}"):
        sharding.shard_range(10, world, rank)
    with pytest.raises(ValueError, match=rf"rank must be in \[0, {world}\), got {rank}"):
        sharding.shard_tensor(torch.zeros(10), world, rank)


def test_negative_numel_is_rejected():
    with pytest.raises(ValueError, match="numel must be >= 0, got -1"):
        sharding.shard_numel(-1, 2)


def test_unshard_rejects_shards_of_different_sizes():
    with pytest.raises(ValueError, match=r"same size, got sizes \[2, 3\]"):
        sharding.unshard([torch.zeros(3), torch.zeros(2)], (5,))


def test_unshard_rejects_shards_of_the_wrong_size_for_the_shape():
    with pytest.raises(ValueError, match="shard size 2 does not match 3 for numel 5"):
        sharding.unshard([torch.zeros(2), torch.zeros(2)], (5,))
