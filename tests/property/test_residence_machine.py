"""Stateful test of shard residence (offload/residence.py `ShardStore`, the table in partition/state.py).

Some shards live on a real NVMe tier (a swap file in a temporary directory, a small buffer pool),
the others in host memory. Rules drive the tier's public moves (read into the pool or own memory,
wait, done, load and unload with or without a change, store new values, drop what was read ahead),
rebind in-memory shards, take and give back storages as offload_states does, and try illegal
moves, rebinds and gathers, which must raise and change nothing. A model holds every shard's
values; after every rule the invariants check the bytes against it wherever they are.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import nn

from zero3.errors import ZeroStateError
from zero3.metrics import StepMetrics
from zero3.offload.nvme import ShardTier
from zero3.offload.pool import BufferPool
from zero3.offload.swapfile import ALIGN, AsyncIO, SwapFile, storage_view
from zero3.offload.policy import PlacementPolicy
from zero3.offload.residence import ShardStore
from zero3.partition import param as zparam
from zero3.partition.param import partition
from zero3.partition.state import MEMORY, ParamStatus, Residence, legal_move


def _snapshot(p):
    """What a refused move must leave alone (the storage only when no IO thread may be freeing it)."""
    z = p._zero
    storage = z.shard.untyped_storage()
    if z.residence in (Residence.WRITING, Residence.READING):
        return z.residence, z.shard, z.dtype, None, None, None, z.status
    data = z.shard.clone() if storage.nbytes() else None
    return z.residence, z.shard, z.dtype, storage.data_ptr(), storage.nbytes(), data, z.status


class ResidenceMachine(RuleBasedStateMachine):
    @initialize(sizes=st.lists(st.integers(1, 700), min_size=2, max_size=5), data=st.data(), seed=st.integers(0, 2**16))
    def setup(self, sizes, data, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.dir = tempfile.mkdtemp(prefix="zero3-residence-")
        self.store = ShardStore(PlacementPolicy())
        pool = BufferPool(2, 2 * ALIGN)
        self.tier = ShardTier(AsyncIO(1), SwapFile(self.dir, "test"), pool, StepMetrics(), self.store)
        self.params = []
        self.model: list[torch.Tensor] = []
        self.loads: list[int] = []
        self.dirty: list[bool] = []  # changed in memory since loaded
        self.taken: dict[int, torch.Tensor] = {}  # index -> host copy of a shard offload_states took
        for i, n in enumerate(sizes):
            p = partition(nn.Parameter(torch.randn(n, generator=self.gen)), name=f"p{i}", world_size=1, rank=0,
                          group=None)
            self.params.append(p)
            self.model.append(p._zero.shard.clone())
            self.loads.append(0)
            self.dirty.append(False)
            if data.draw(st.booleans(), label=f"p{i} on the drive"):
                self.tier.offload(p)
        self.tier.flush()

    def teardown(self):
        shutil.rmtree(getattr(self, "dir", ""), ignore_errors=True)

    def _on_tier(self, i):
        return self.params[i]._zero.swap is not None

    def _free(self, i):
        """Not loaded and not taken by offload_states."""
        return self.loads[i] == 0 and self.params[i]._zero.residence is not Residence.STATES_OUT

    # -- the drive tier's moves --------------------------------------------------------------------
    @rule(data=st.data(), ahead=st.booleans())
    def read(self, data, ahead):
        i = data.draw(st.integers(0, len(self.params) - 1))
        if self._on_tier(i) and self._free(i):
            self.tier.read([self.params[i]], ahead=ahead, overflow=True)

    @rule(data=st.data())
    def wait(self, data):
        i = data.draw(st.integers(0, len(self.params) - 1))
        if self._on_tier(i):
            self.tier.wait([self.params[i]])

    @rule(data=st.data())
    def done(self, data):
        i = data.draw(st.integers(0, len(self.params) - 1))
        if self._on_tier(i) and self._free(i):
            self.tier.wait([self.params[i]])
            self.tier.done([self.params[i]])

    @rule(data=st.data())
    def load(self, data):
        i = data.draw(st.integers(0, len(self.params) - 1))
        if self._on_tier(i) and self.params[i]._zero.residence is not Residence.STATES_OUT:
            self.tier.load([self.params[i]])
            self.loads[i] += 1

    @rule(data=st.data(), change=st.booleans())
    def unload(self, data, change):
        i = data.draw(st.integers(0, len(self.params) - 1))
        if not self.loads[i] or self.params[i]._zero.residence is Residence.STATES_OUT:
            return
        if change:
            with torch.no_grad():
                self.params[i]._zero.shard.add_(1.0)
            self.model[i] += 1.0
        self.dirty[i] = self.dirty[i] or change
        self.tier.unload([self.params[i]], write=self.dirty[i])
        self.loads[i] -= 1
        if not self.loads[i]:
            self.dirty[i] = False

    @rule(data=st.data())
    def store_values(self, data):
        i = data.draw(st.integers(0, len(self.params) - 1))
        if self._on_tier(i) and self._free(i):
            values = torch.randn(self.params[i]._zero.shard_numel, generator=self.gen)
            self.tier.store(self.params[i], values)
            self.model[i] = values.clone()

    @rule()
    def drop_ahead(self):
        self.tier.drop_ahead()

    # -- memory to memory, offload_states ----------------------------------------------------------
    @rule(data=st.data())
    def rebind_copy(self, data):
        i = data.draw(st.integers(0, len(self.params) - 1))
        if not self._on_tier(i) and self.params[i]._zero.residence.in_memory:
            self.store.rebind(self.params[i], self.params[i]._zero.shard.clone())

    @rule(data=st.data())
    def take(self, data):
        i = data.draw(st.integers(0, len(self.params) - 1))
        p = self.params[i]
        if self._on_tier(i) or not p._zero.residence.in_memory:
            return
        storage = p._zero.shard.untyped_storage()

        def move_out():
            self.taken[i] = storage_view(storage).clone()  # the bytes offload_states keeps
            storage.resize_(0)

        self.store.take([p], move_out)

    @rule(data=st.data())
    def give_back(self, data):
        if not self.taken:
            return
        i = data.draw(st.sampled_from(sorted(self.taken)))
        p = self.params[i]
        host = self.taken.pop(i)
        storage = p._zero.shard.untyped_storage()
        storage.resize_(host.numel())
        storage_view(storage).copy_(host)
        self.store.give_back([p])

    # -- what must be refused, leaving everything as it was ----------------------------------------
    @rule(data=st.data(), to=st.sampled_from(list(Residence)))
    def illegal_move(self, data, to):
        i = data.draw(st.integers(0, len(self.params) - 1))
        p = self.params[i]
        if legal_move(p._zero.residence, to):
            return
        before = _snapshot(p)
        with pytest.raises(ZeroStateError, match="illegal residence change"):
            self.store.move(p, to)
        self._same(p, before)

    @rule(data=st.data())
    def refused_rebind_take_and_gather(self, data):
        i = data.draw(st.integers(0, len(self.params) - 1))
        p = self.params[i]
        if p._zero.residence in MEMORY:
            return
        before = _snapshot(p)
        with pytest.raises(ZeroStateError):
            self.store.rebind(p, torch.zeros(p._zero.shard_numel))
        self._same(p, before)
        with pytest.raises(ZeroStateError, match="not in memory"):
            zparam.begin_gather(p, None)
        self._same(p, before)
        moved = []
        with pytest.raises(ZeroStateError, match="illegal residence change"):
            self.store.take([self.params[0], p] if i else [p], lambda: moved.append(True))
        assert not moved
        self._same(p, before)

    def _same(self, p, before):
        after = _snapshot(p)
        assert after[:5] == before[:5] and after[6] is before[6], (before[:5], after[:5])
        assert (before[5] is None) == (after[5] is None) and (before[5] is None or torch.equal(before[5], after[5]))

    # -- invariants -------------------------------------------------------------------------------------
    @invariant()
    def bytes_are_where_the_residence_says(self):
        for i, p in enumerate(self.params):
            z = p._zero
            assert z.status is ParamStatus.NOT_AVAILABLE
            nbytes = z.shard.untyped_storage().nbytes()
            if z.residence.in_memory:
                assert nbytes > 0 and torch.equal(z.shard, self.model[i]), z.name
            elif z.residence is Residence.DRIVE:
                assert nbytes == 0 and torch.equal(self.tier.read_copy(p), self.model[i]), z.name
            elif z.residence is Residence.STATES_OUT:
                assert nbytes == 0 and i in self.taken, z.name
            if self.loads[i]:
                assert z.residence in (Residence.READING, *MEMORY), z.name


ResidenceMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
TestResidenceMachine = ResidenceMachine.TestCase


def test_a_shard_read_ahead_and_used_is_not_dropped_again(tmp_path):
    """Found by the machine above: read ahead, waited, its gather done (the shard dropped back to the
    drive), then `drop_ahead` tried to drop it a second time (DRIVE -> DRIVE)."""
    store = ShardStore(PlacementPolicy())
    tier = ShardTier(AsyncIO(1), SwapFile(str(tmp_path), "test"), BufferPool(2, 2 * ALIGN), StepMetrics(), store)
    p = partition(nn.Parameter(torch.randn(5)), name="p0", world_size=1, rank=0, group=None)
    before = p._zero.shard.clone()
    tier.offload(p)
    tier.flush()
    tier.read([p], ahead=True, overflow=True)
    tier.wait([p])
    tier.done([p])
    tier.drop_ahead()
    assert p._zero.residence is Residence.DRIVE
    tier.read([p])
    tier.wait([p])
    assert torch.equal(p._zero.shard, before)
