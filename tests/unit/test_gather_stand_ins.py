"""A rank that leaves the agreed plan issues void stand-ins for the planned gathers (comm/verify.py
[Note: verified collectives]); a peer that has not left yet issues the real ones in the same slots,
so each stand-in must post exactly the messages of the request it replaces. Checked on a recording
wire: no process group, every message the transport would post is captured instead."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings, strategies as st

from zero3.comm.gather import PairwiseGather
from zero3.comm.tags import Kind, Tag
from zero3.comm.verify import PayloadHeader, RequestShape, bitcast_elements
from zero3.comm.wire import PairwiseWork, Wire


class _Counter:
    def count(self, *args, **kwargs) -> None:
        pass

    def peers(self, *args, **kwargs) -> None:
        pass


@dataclass
class _RecordingWire(Wire):
    """Posts nothing: each batch of messages is recorded as (op, elements, dtype, peer, tag)."""

    def __post_init__(self) -> None:
        self.batches: list[list[tuple]] = []

    def p2p(self, op, t, peer, tag):
        return (op.__name__, t.numel(), t.dtype, peer, tag)

    def send_recv(self, ops, tag, then=None):
        self.batches.append(list(ops))
        return PairwiseWork([], then)


def _wire(world: int, rank: int) -> _RecordingWire:
    return _RecordingWire(group=None, world_size=world, rank=rank, device=torch.device("cpu"), monitor=None,
                          counter=_Counter())


@settings(max_examples=60, deadline=None)
@given(world=st.integers(2, 5), data=st.data(), totals=st.lists(st.integers(1, 5000), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_a_bucketed_gathers_stand_in_posts_the_messages_of_the_real_request(world, data, totals, dtype):
    rank = data.draw(st.integers(0, world - 1))
    hdr = bitcast_elements(dtype)
    header = PayloadHeader(3, 7, 0x1234, 0)
    real, stand_in = _wire(world, rank), _wire(world, rank)
    for total in totals:  # what ParamGatherer._chunked posts: one row per bucket, the header at its end
        PairwiseGather(real).rows(torch.zeros(total + hdr, dtype=dtype), True, None, Kind.PARAM_GATHER, hdr)
    shape = RequestShape(Kind.PARAM_GATHER.value, tuple(totals), str(dtype), False, rows=True)
    PairwiseGather(stand_in).dummy(shape, header, Tag(Kind.PARAM_GATHER, "a planned gather"))
    assert stand_in.batches == real.batches
    assert stand_in._p2p_tag == real._p2p_tag  # the tags of later messages stay in step too


def test_pairwise_tags_stay_clear_of_a_users_small_tags_and_wrap_within_int32():
    wire = _wire(2, 0)
    assert [wire.next_tag() for _ in range(3)] == [2**30 + 1, 2**30 + 2, 2**30 + 3]  # were 1, 2, 3 (probe 32N)
    wire._p2p_tag = 2**30 - 2
    assert [wire.next_tag() for _ in range(3)] == [2**31 - 1, 2**30, 2**30 + 1]  # gloo's tags are int32 >= 0
