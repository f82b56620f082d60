"""comm/shared.py in one process: the arena layout, the window's state machine and its barriers, reads
of a peer's arena (two "ranks" as threads), and which gather transport ``allgather_impl`` resolves to."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from zero3.comm import shared as shm
from zero3.comm.communicator import _gather_impl
from zero3.comm.settings import CommSettings
from zero3.comm.shared import SharedShards, SlotSpec, WindowState, layout
from zero3.errors import ZeroConfigError, ZeroStateError

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.sampled_from(DTYPES)), max_size=30))
def test_slots_are_aligned_disjoint_in_order_and_inside_the_arena(sizes):
    specs = [SlotSpec(i, n, d) for i, (n, d) in enumerate(sizes)]
    offsets, total = layout(specs)
    end = 0
    for s in specs:
        off = offsets[s.id]
        assert off % shm.SLOT_ALIGN == 0 and off >= end
        end = off + s.nbytes
    assert end <= total and total >= shm.SLOT_ALIGN


class FakeBarrier:
    """Stands for the all-reduce (max) of the ranks' values: ``others`` are the other ranks' values."""

    def __init__(self, others: list[list[int]] | None = None) -> None:
        self.calls: list[str] = []
        self.others = others or []

    def __call__(self, values: list[int], label: str) -> list[int]:
        self.calls.append(label)
        rows = [values] + [o[: len(values)] for o in self.others]
        return [max(col) for col in zip(*rows)]


class P:
    """The little of a parameter the window reads: its record's id and shard."""

    def __init__(self, pid: int, shard: torch.Tensor) -> None:
        self._zero = type("Z", (), {"id": pid, "shard": shard})()


def _arena(specs, barrier) -> SharedShards:
    offsets, nbytes = layout(specs)
    return SharedShards(specs, torch.zeros(nbytes, dtype=torch.uint8), {}, barrier)


def test_the_window_opens_once_per_step_with_a_barrier_and_closes_with_another():
    specs = [SlotSpec(0, 10, torch.float32), SlotSpec(1, 7, torch.float32)]
    barrier = FakeBarrier(others=[[2, -2]])
    s = _arena(specs, barrier)
    ps = [P(sp.id, s.slot(sp)) for sp in specs]
    s.adopt(ps)
    assert not s.covers(ps) and not s.open()  # IDLE: between steps, no reads and no barrier
    assert barrier.calls == []
    s.arm()
    assert s.state is WindowState.ARMED and s.covers(ps)
    assert s.open() and s.open()  # the second gather of the step: no second barrier
    assert barrier.calls == ["shared-memory window opens"] and s.state is WindowState.OPEN
    s.close(aborted=False)
    assert barrier.calls[-1] == "shared-memory window closes" and s.state is WindowState.IDLE
    s.arm()
    s.close(aborted=False)  # armed, never opened: nothing was read, no barrier
    assert len(barrier.calls) == 2 and s.state is WindowState.IDLE
    s.arm()
    assert not s.close(aborted=True)  # aborted before any read: no barrier, and no peer got past the opening
    assert len(barrier.calls) == 2 and s.state is WindowState.IDLE
    s.pause()  # between steps: nothing to pause
    assert len(barrier.calls) == 2 and s.state is WindowState.IDLE
    s.arm()
    s.open()
    s.pause()  # a collective write inside the step: a barrier now, and the next read opens again
    assert barrier.calls[-1] == "shared-memory window pauses" and s.state is WindowState.ARMED
    assert s.open() and barrier.calls[-1] == "shared-memory window opens" and len(barrier.calls) == 5


def test_a_step_aborted_while_reading_moves_the_shards_out_so_later_writes_miss_what_peers_read():
    """No barrier closes an aborted step, so a peer may still be reading: the shards leave the arena
    (same tensors, same values) and later writes land in memory of their own, not in the slots."""
    from zero3.config import ZeroConfig
    from zero3.offload.policy import PlacementPolicy
    from zero3.offload.residence import ShardStore
    from zero3.partition.state import Residence

    specs = [SlotSpec(0, 10, torch.float32), SlotSpec(1, 7, torch.float32)]
    barrier = FakeBarrier(others=[[2, -2]])
    s = _arena(specs, barrier)
    ps = [P(sp.id, s.slot(sp)) for sp in specs]
    for p, v in zip(ps, (1.0, 2.0)):
        p._zero.shard.fill_(v)
        p._zero.residence = Residence.HOST
    s.adopt(ps)
    s.arm()
    s.open()
    assert s.close(aborted=True) and barrier.calls == ["shared-memory window opens"]  # no closing barrier
    shards = [p._zero.shard for p in ps]
    arena = s.arena
    s.evacuate(ShardStore(PlacementPolicy.from_config(ZeroConfig())).own_memory)
    assert s.state is WindowState.OFF and not s.covers(ps) and s.params == []
    assert all(p._zero.shard is t for p, t in zip(ps, shards))  # the same tensors ...
    assert ps[0]._zero.shard.eq(1.0).all() and ps[1]._zero.shard.eq(2.0).all()  # ... with their values
    for p in ps:
        p._zero.shard.fill_(9.0)  # a write after the abort (a checkpoint load, say)
    peer_view = [arena[s.offsets[sp.id]: s.offsets[sp.id] + sp.nbytes].view(torch.float32) for sp in specs]
    assert peer_view[0].eq(1.0).all() and peer_view[1].eq(2.0).all()  # what a late peer reads is untouched


def test_a_shard_outside_its_slot_is_not_read_and_ranks_that_disagree_turn_the_window_off():
    specs = [SlotSpec(0, 10, torch.float32), SlotSpec(1, 7, torch.float32)]
    s = _arena(specs, FakeBarrier(others=[[1, -1]]))  # the other rank holds 1 shard in its arena
    ps = [P(sp.id, s.slot(sp)) for sp in specs]
    s.adopt(ps)
    s.arm()
    moved = P(1, torch.zeros(7))
    assert not s.covers([moved]) and s.covers(ps[:1])
    assert not s.open()  # 2 here, 1 there: off on both (both see the same max and min)
    assert s.state is WindowState.OFF and not s.covers(ps)
    s.arm()
    s.close(aborted=False)
    assert s.state is WindowState.OFF
    with pytest.raises(ZeroStateError, match="illegal change OFF -> OPEN"):
        s._enter(WindowState.OPEN)


def _create_both(specs_of) -> list:
    """`SharedShards.create` on two "ranks" run as threads named rank0 and rank1 (the exchange: a
    shared list and a barrier); ``specs_of(rank)``: that rank's specs."""
    box: list = [None, None]
    sync = threading.Barrier(2)
    out: list = [None, None]

    def make(rank):
        def exchange(obj):
            box[rank] = obj
            sync.wait()
            got = list(box)
            sync.wait()
            return got
        out[rank] = SharedShards.create(rank, specs_of(rank), exchange, FakeBarrier())

    threads = [threading.Thread(target=make, args=(r,), name=f"rank{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_a_rank_reads_its_peers_slots_and_no_arena_file_is_left_behind():
    specs = [SlotSpec(3, 5, torch.float32), SlotSpec(8, 4, torch.bfloat16)]
    values = [[torch.arange(5.0), torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)],
              [torch.arange(5.0) * -1, torch.tensor([5.0, 6.0, 7.0, 8.0], dtype=torch.bfloat16)]]
    before = set(os.listdir(shm.SHM_DIR))
    a, b = _create_both(lambda rank: specs)
    assert a is not None and b is not None
    for s, vals in zip((a, b), values):
        for sp, v in zip(specs, vals):
            s.slot(sp).copy_(v)
    assert set(os.listdir(shm.SHM_DIR)) == before  # unlinked once every rank opened its peers'
    got = torch.empty(5)
    a.read(1, 3, got)
    assert torch.equal(got, values[1][0])
    part = torch.empty(3, dtype=torch.bfloat16)  # the first elements of a slot
    b.read(0, 8, part)
    assert torch.equal(part, values[0][1][:3])
    b.slot(specs[0]).fill_(7.0)  # a write is seen by the next read: the same pages
    a.read(1, 3, got)
    assert torch.equal(got, torch.full((5,), 7.0))
    a.turn_off()
    b.turn_off()
    assert a.state is WindowState.OFF and a.arena.numel() == 0


def test_ranks_with_different_shards_share_nothing():
    before = set(os.listdir(shm.SHM_DIR))
    assert _create_both(lambda rank: [SlotSpec(0, 5 + rank, torch.float32)]) == [None, None]
    assert set(os.listdir(shm.SHM_DIR)) == before


def test_no_room_in_shared_memory_on_one_rank_means_no_arena_on_any(monkeypatch):
    real = os.posix_fallocate

    def full(fd, off, n):  # what tmpfs says when /dev/shm is too small (Docker's 64 MiB default)
        if threading.current_thread().name == "rank1":
            raise OSError(28, "No space left on device")
        return real(fd, off, n)

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = set(os.listdir(shm.SHM_DIR))
    assert _create_both(lambda rank: [SlotSpec(0, 5, torch.float32)]) == [None, None]
    assert set(os.listdir(shm.SHM_DIR)) == before


@pytest.mark.parametrize("impl, backend, nodes, extra, want", [
    ("auto", "gloo", (0, 0), {}, "shm"),
    ("auto", "gloo", (0, 1), {}, "p2p"),  # two nodes: no shared memory between them
    ("auto", "gloo", (0, 0), {"quantize_weights": True}, "p2p"),  # qwZ asks for int8 on the wire
    ("auto", "gloo", (0, 0, 1, 1), {"hpz_partition_size": 2}, "p2p"),
    ("auto", "nccl", (0, 0), {}, "all_gather"),
    ("p2p", "gloo", (0, 0), {}, "p2p"),
    ("shm", "gloo", (0, 0), {}, "shm"),
    ("all_gather", "gloo", (0, 0), {}, "all_gather"),
])
def test_allgather_impl_resolves_to_shared_memory_only_where_every_rank_shares_a_node(impl, backend, nodes, extra,
                                                                                      want):
    assert _gather_impl(CommSettings(allgather_impl=impl, **extra), backend, nodes) == want


@pytest.mark.parametrize("backend, nodes, extra, match", [
    ("gloo", (0, 1), {}, r"needs every rank on one node, but the ranks' nodes are \[0, 1\]"),
    ("nccl", (0, 0), {}, "the nccl backend moves device tensors"),
    ("gloo", (0, 0), {"quantize_weights": True}, "choose one"),
    ("gloo", (0, 0), {"hpz_partition_size": 2}, "zero_hpz_partition_size=2 asks for a secondary copy"),
])
def test_an_explicit_shm_where_it_cannot_work_is_refused(backend, nodes, extra, match):
    with pytest.raises(ZeroConfigError, match=match):
        _gather_impl(CommSettings(allgather_impl="shm", **extra), backend, nodes)


def test_without_shared_memory_on_this_host_auto_keeps_the_wire_and_shm_is_refused(monkeypatch):
    import zero3.comm.communicator as communicator
    monkeypatch.setattr(communicator, "shared_memory_available", lambda: False)
    assert _gather_impl(CommSettings(), "gloo", (0, 0)) == "p2p"
    with pytest.raises(ZeroConfigError, match="needs Linux's /dev/shm"):
        _gather_impl(CommSettings(allgather_impl="shm"), "gloo", (0, 0))


def test_dropping_an_arena_closes_the_peers_files_it_held():
    import gc
    a, b = _create_both(lambda rank: [SlotSpec(0, 5, torch.float32)])
    fd = a._fds[1]
    os.fstat(fd)
    del a
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
    b.release()
    assert b._fds == {}


def test_a_closing_barrier_that_fails_moves_the_shards_out_too():
    """A peer that aborted never joins the closing barrier, which then raises here: this rank may
    still be read by that peer's late reads, so its shards leave the arena before the error goes on."""
    from zero3.config import ZeroConfig
    from zero3.errors import ZeroCommunicationError
    from zero3.offload.policy import PlacementPolicy
    from zero3.offload.residence import ShardStore
    from zero3.partition.state import Residence
    from zero3.runtime.step import close_window

    class PeerGone(FakeBarrier):
        def __call__(self, values, label):
            if label.endswith("closes"):
                raise ZeroCommunicationError("rank 1 raised RuntimeError in its forward")
            return super().__call__(values, label)

    specs = [SlotSpec(0, 10, torch.float32)]
    s = _arena(specs, PeerGone(others=[[1, -1]]))
    ps = [P(0, s.slot(specs[0]))]
    ps[0]._zero.residence = Residence.HOST
    s.adopt(ps)
    comm = type("Comm", (), {"shared": s, "step_ended": lambda self, aborted: s.close(aborted)})()
    store = ShardStore(PlacementPolicy.from_config(ZeroConfig()))
    s.arm()
    assert s.open()
    with pytest.raises(ZeroCommunicationError, match="rank 1 raised"):
        close_window(comm, store, aborted=False)
    assert s.state is WindowState.OFF and not s.bound(ps[0])
    # and the usual ends: a clean close keeps sharing, an aborted open window moves out
    s2 = _arena(specs, FakeBarrier(others=[[1, -1]]))
    q = [P(0, s2.slot(specs[0]))]
    q[0]._zero.residence = Residence.HOST
    s2.adopt(q)
    comm2 = type("Comm", (), {"shared": s2, "step_ended": lambda self, aborted: s2.close(aborted)})()
    s2.arm()
    s2.open()
    close_window(comm2, store, aborted=False)
    assert s2.state is WindowState.IDLE and s2.bound(q[0])
    s2.arm()
    s2.open()
    close_window(comm2, store, aborted=True)
    assert s2.state is WindowState.OFF and not s2.bound(q[0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["arm", "open", "close", "abort", "pause", "off"]), max_size=30))
def test_reads_happen_only_between_an_opening_barrier_and_a_closing_one_or_an_evacuation(ops):
    """Any sequence of window calls: reads (`covers`) are allowed only while ARMED or OPEN, each entry
    into OPEN is an opening barrier, each way out of OPEN is a barrier (close, pause) or an aborted
    close that tells the caller to move the shards out; a window that was turned off stays off."""
    specs = [SlotSpec(0, 4, torch.float32)]
    barrier = FakeBarrier(others=[[1, -1]])
    s = _arena(specs, barrier)
    ps = [P(0, s.slot(specs[0]))]
    s.adopt(ps)
    opened = 0
    for op in ops:
        before, calls = s.state, len(barrier.calls)
        if op == "arm":
            s.arm()
        elif op == "open":
            s.open()
        elif op == "close":
            assert s.close(aborted=False) is False
        elif op == "abort":
            left_open = s.close(aborted=True)
            assert left_open == (before is WindowState.OPEN)
            if left_open:
                s.turn_off()  # what close_window does (evacuate, without shards to move here)
        elif op == "pause":
            s.pause()
        else:
            s.turn_off()
        new = barrier.calls[calls:]
        if s.state is WindowState.OPEN and before is not WindowState.OPEN:
            opened += 1
            assert new == ["shared-memory window opens"]
        if before is WindowState.OPEN and s.state in (WindowState.IDLE, WindowState.ARMED):
            assert len(new) == 1 and new[0] in ("shared-memory window closes", "shared-memory window pauses")
        if before is WindowState.OFF:
            assert s.state is WindowState.OFF and new == []
        if s.state in (WindowState.IDLE, WindowState.OFF):
            assert not s.covers(ps)
    assert barrier.calls.count("shared-memory window opens") == opened
