"""Gradient reductions: the averaging reduction of a bucket of gradients, on one of three wires
chosen once per communicator (`reduce_transport`: reduce_scatter, all_reduce, p2p; ``shm`` goes
through shared memory instead, shared_reduce.py, chosen in communicator.py), or quantized (qgZ,
`QuantizedReduction`).

Each transport counts its bytes where it puts them on the wire and issues its own void stand-in
(``dummy``) for a planned reduction a rank leaves the plan at ([Note: verified collectives]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..metrics import VERIFICATION
from .codec import QuantizedCodec, wire_bytes
from .tags import Kind, Tag
from .verifier import Verifier
from .verify import HEADER_BYTES, PayloadHeader, RequestShape, header_as, header_values, headers_from_values
from .wire import HEADER_VALUES, PairwiseWork, Wire, label, piece, reduce_scatter_flat
from .works import ReduceWork, WaitContext


@dataclass(frozen=True, slots=True)
class GradPiece:
    """One parameter's full gradient in a reduction (None: zeros). ``counted``: reduce a presence count
    with it (how many ranks had a gradient at all: leaf units, see runtime/grad.py)."""

    numel: int
    shard_numel: int
    grad: torch.Tensor | None
    counted: bool = False


@dataclass(eq=False)
class ReduceBuffer:
    """A flat rank-major gradient buffer: fill ``rows`` (``(world, S)``), then reduce it."""

    flat: torch.Tensor  # what goes on the wire (rows, plus header room when verifying)
    rows: torch.Tensor
    shard_numel: int


@dataclass(frozen=True, slots=True)
class ReduceRequest:
    """One bucket: its pieces, their shard elements (``total``) and presence counts (``counted``)."""

    pieces: Sequence[GradPiece]
    dtype: torch.dtype
    device: torch.device
    tag: Tag

    @property
    def total(self) -> int:
        return sum(p.shard_numel for p in self.pieces)

    @property
    def counted(self) -> int:
        return sum(1 for p in self.pieces if p.counted)


class ReduceTransport:
    """How one communicator reduces gradients (chosen once, at construction)."""

    def __init__(self, wire: Wire, verifier: Verifier, ctx: WaitContext, overlap: bool, verify: bool) -> None:
        self.wire = wire
        self.verifier = verifier
        self.ctx = ctx
        self.overlap = overlap
        self.verify = verify

    def reduce(self, req: ReduceRequest) -> ReduceWork:
        raise NotImplementedError

    def step_aborted(self) -> None:
        """A step was aborted: drop anything held for the next reduction (none here)."""

    def release(self) -> None:
        """At exit: let go of what the transport holds beside the process group (none here)."""

    def exchange_payloads(self, payloads: dict[int, torch.Tensor], tag: Tag | None, header_bytes: int
                          ) -> tuple[PairwiseWork, dict[int, torch.Tensor]]:
        """Send ``payloads[q]`` (the same size for every q, its last ``header_bytes`` a header) to each
        other rank q and receive each one's payload for this rank."""
        raise NotImplementedError

    def dummy(self, shape: RequestShape, header: PayloadHeader, tag: Tag) -> list[Any]:
        """A void stand-in for a planned reduction of ``shape``."""
        if shape.dtype.startswith("quantized"):
            w = self.wire
            payload = torch.zeros(shape.sizes[0] + HEADER_BYTES, dtype=torch.uint8, device=w.device)
            payload[shape.sizes[0]:].copy_(header_as(torch.uint8, header, w.device))
            return [self.exchange_payloads({q: payload for q in range(w.world_size)}, tag, HEADER_BYTES)[0]]
        return [self._dummy_exact(shape, header, tag, getattr(torch, shape.dtype.removeprefix("torch."), torch.uint8))]

    def _dummy_exact(self, shape: RequestShape, header: PayloadHeader, tag: Tag, dtype: torch.dtype) -> Any:
        raise NotImplementedError

    def work(self, req: ReduceRequest, out: torch.Tensor, shard_numel: int, keep: Any, work: Any) -> ReduceWork:
        """What the caller waits for: ``out``'s first ``shard_numel`` elements, averaged; ``keep`` lives until then."""
        return ReduceWork(ctx=self.ctx, world_size=self.wire.world_size, out=out, shard_numel=shard_numel, keep=keep,
                          tag=req.tag, work=work)


class LocalReduce(ReduceTransport):
    """World size 1: the gradients, laid out like a reduction's result."""

    def reduce(self, req: ReduceRequest) -> ReduceWork:
        s = req.total + req.counted
        flat = torch.zeros(s, dtype=req.dtype, device=req.device)
        _fill_rows(req, flat.view(1, -1), 1)
        return ReduceWork(ctx=self.ctx, world_size=1, out=flat, shard_numel=s, keep=flat)


class FlatReduce(ReduceTransport):
    """A collective over one flat rank-major buffer (`ReduceBuffer`): header room, when verifying,
    holds every rank's header as small integers (only the sender's row is non-zero)."""

    def reduce(self, req: ReduceRequest) -> ReduceWork:
        w, r = self.wire.world_size, self.wire.rank
        s = req.total + req.counted
        h = HEADER_VALUES * w if self.verify else 0
        buf = self._buffer(s, h, req.dtype, req.device)
        _fill_rows(req, buf.rows, w)
        flat = buf.flat
        shape = RequestShape(Kind.GRAD_REDUCE.value, (flat.numel(),), str(flat.dtype), False)
        header = self.verifier.planned(req.tag, shape)
        if header is not None:
            self._header_rows(flat, s, h)[r].copy_(header_values(header, flat.dtype, flat.device))
        with label("zero3::reduce"):
            out, hdr_rows = self._output(flat, s, h)
            work = self._wire(flat, out, self.overlap, req.tag, h)
        rw = self.work(req, out, s, buf, work)
        if header is not None:
            assert hdr_rows is not None
            rw.slot = self.verifier.register(shape, [work] if work is not None else [],
                                             lambda: headers_from_values(hdr_rows))
        return rw

    def _dummy_exact(self, shape: RequestShape, header: PayloadHeader, tag: Tag, dtype: torch.dtype) -> Any:
        """The same wire as a real reduction of the planned size."""
        w = self.wire
        flat = torch.zeros(shape.sizes[0], dtype=dtype, device=w.device)
        out = torch.empty(shape.sizes[0] // w.world_size, dtype=dtype, device=w.device)
        return self._wire(flat, out, True, tag, HEADER_VALUES * w.world_size)

    def _buffer(self, s: int, h: int, dtype: torch.dtype, device: torch.device) -> ReduceBuffer:
        raise NotImplementedError

    def _header_rows(self, flat: torch.Tensor, s: int, h: int) -> torch.Tensor:
        """Where this rank writes its header: one row of ``HEADER_VALUES`` per rank."""
        raise NotImplementedError

    def _output(self, flat: torch.Tensor, s: int, h: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(where this rank's result lands, every rank's header rows after the reduction)."""
        raise NotImplementedError

    def _wire(self, flat: torch.Tensor, out: torch.Tensor, async_op: bool, tag: Tag | None, h: int) -> Any:
        raise NotImplementedError

    def exchange_payloads(self, payloads: dict[int, torch.Tensor], tag: Tag | None, header_bytes: int
                          ) -> tuple[PairwiseWork, dict[int, torch.Tensor]]:
        """One all-to-all."""
        w, r = self.wire.world_size, self.wire.rank
        n = payloads[r].numel()
        self.wire.counter.peers(Kind.GRAD_REDUCE, n - header_bytes, header_bytes, False)
        send = torch.stack([payloads[q] for q in range(w)]).view(-1)
        recv = torch.empty(w * n, dtype=torch.uint8, device=self.wire.device)
        handle = self.wire.monitor.blocking(
            lambda: dist.all_to_all_single(recv, send, group=self.wire.group, async_op=True), tag)
        work = PairwiseWork([handle])
        work.keep = [send]
        return work, {q: recv[q * n:(q + 1) * n] for q in range(w) if q != r}


class ReduceScatterReduce(FlatReduce):
    """``reduce_scatter``: buffer ``(world, S + H)``, each rank's chunk followed by header room."""

    def _buffer(self, s: int, h: int, dtype: torch.dtype, device: torch.device) -> ReduceBuffer:
        flat = torch.zeros(self.wire.world_size, s + h, dtype=dtype, device=device)
        return ReduceBuffer(flat=flat.view(-1), rows=flat[:, :s], shard_numel=s)

    def _header_rows(self, flat: torch.Tensor, s: int, h: int) -> torch.Tensor:
        w = self.wire.world_size
        return flat.view(w, s + h)[:, s:].reshape(w, w, HEADER_VALUES).transpose(0, 1)

    def _output(self, flat: torch.Tensor, s: int, h: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = torch.empty(s + h, dtype=flat.dtype, device=flat.device)
        return out, (out[s:].view(self.wire.world_size, HEADER_VALUES) if h else None)

    def _wire(self, flat: torch.Tensor, out: torch.Tensor, async_op: bool, tag: Tag | None, h: int) -> Any:
        """Sum every rank's ``flat`` (chunk r is for rank r), leaving this rank's summed chunk in ``out``."""
        w = self.wire
        size = flat.element_size()
        w.counter.peers(Kind.GRAD_REDUCE, (flat.numel() // w.world_size - h) * size, h * size, False)
        work = w.monitor.blocking(lambda: reduce_scatter_flat(out, flat, group=w.group, async_op=True), tag)
        if not async_op:
            w.monitor.wait(work, tag)
            return None
        return work


class AllReduceReduce(FlatReduce):
    """``all_reduce``: buffer ``world * S + H``, summed whole in place; this rank's slice is its result."""

    def _buffer(self, s: int, h: int, dtype: torch.dtype, device: torch.device) -> ReduceBuffer:
        w = self.wire.world_size
        flat = torch.zeros(w * s + h, dtype=dtype, device=device)
        return ReduceBuffer(flat=flat, rows=flat[: w * s].view(w, s), shard_numel=s)

    def _header_rows(self, flat: torch.Tensor, s: int, h: int) -> torch.Tensor:
        w = self.wire.world_size
        return flat[w * s:].view(w, HEADER_VALUES)

    def _output(self, flat: torch.Tensor, s: int, h: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        w, r = self.wire.world_size, self.wire.rank
        return flat[r * s:(r + 1) * s], (flat[w * s:].view(w, HEADER_VALUES) if h else None)

    def _wire(self, flat: torch.Tensor, out: torch.Tensor, async_op: bool, tag: Tag | None, h: int) -> Any:
        w = self.wire
        size = flat.element_size()
        w.counter.peers(Kind.GRAD_REDUCE, (flat.numel() - h) * size, h * size, False)
        work = w.monitor.blocking(lambda: dist.all_reduce(flat, group=w.group, async_op=True), tag)
        if not async_op:
            w.monitor.wait(work, tag)
            return None
        return work


class PairwiseReduce(ReduceTransport):
    """``p2p``: each rank sends every other rank that rank's part of each gradient straight from the
    gradient (no copy into a flat buffer) and sums what it receives."""

    def reduce(self, req: ReduceRequest) -> ReduceWork:
        w, r = self.wire.world_size, self.wire.rank
        pieces, dtype, device, total, counted = req.pieces, req.dtype, req.device, req.total, req.counted
        sizes = tuple(p.numel for p in pieces) + (counted,)
        shape = RequestShape(Kind.GRAD_REDUCE.value, sizes, str(dtype), False)
        header = self.verifier.planned(req.tag, shape)
        # The first peer's message lands straight in the result (two ranks: no other buffer, and
        # this rank's own part is added on arrival, with no copy). a + b == b + a exactly, and with
        # more ranks every element's sum runs in the same order, so results repeat bit for bit.
        out = torch.empty(total + counted, dtype=dtype, device=device)
        grads, presence = flat_grads(pieces, dtype, device)
        first = 1 if r == 0 else 0
        work, received = self._exchange_grads(pieces, grads, presence, header, dtype, device, req.tag, first_into=out)

        def total_up() -> None:
            off = 0
            for p, g in zip(pieces, grads):
                lo, hi = piece(p.numel, p.shard_numel, r)
                if g is not None and hi > lo:
                    out[off: off + hi - lo].add_(g[lo:hi])
                off += p.shard_numel
            if counted:
                out[total:].add_(presence)
            for q in range(w):
                if q not in (r, first):
                    out.add_(received[q])

        work.then = total_up
        rw = self.work(req, out, total + counted, out, work)
        if header is not None:
            rw.slot = self.verifier.register(shape, [work], work.headers)
        if not self.overlap:
            self.wire.monitor.wait(work, req.tag)
        return rw

    def _dummy_exact(self, shape: RequestShape, header: PayloadHeader, tag: Tag, dtype: torch.dtype) -> Any:
        """A direct reduction's messages, of zeros."""
        w = self.wire
        pieces = [GradPiece(n, -(-n // w.world_size), None) for n in shape.sizes[:-1]]
        presence = torch.zeros(shape.sizes[-1], dtype=dtype, device=w.device)
        return self._exchange_grads(pieces, [None] * len(pieces), presence, header, dtype, w.device, tag)[0]

    def _exchange_grads(self, pieces: Sequence[GradPiece], grads: Sequence[torch.Tensor | None],
                        presence: torch.Tensor, header: PayloadHeader | None, dtype: torch.dtype,
                        device: torch.device, tag: Tag | None, first_into: torch.Tensor | None = None
                        ) -> tuple[PairwiseWork, dict[int, torch.Tensor]]:
        """Post a direct reduction's messages: to each peer, its part of every gradient (zeros where
        there is none) and this rank's presence bits; from each peer, its part of this rank's range
        into a buffer laid out like the result (``first_into`` for the lowest other rank), its
        padding zeroed. Then the header, if any."""
        wire = self.wire
        w, r = wire.world_size, wire.rank
        total = sum(p.shard_numel for p in pieces)
        t = wire.next_tag()
        ops, keep = [], list(grads)
        zeros = (torch.zeros(max((p.shard_numel for p in pieces), default=0), dtype=dtype, device=device)
                 if any(g is None for g in grads) else None)
        received: dict[int, torch.Tensor] = {}
        got: dict[int, torch.Tensor] = {}
        size = torch.empty((), dtype=dtype).element_size()
        mine = sum(hi - lo for lo, hi in (piece(p.numel, p.shard_numel, r) for p in pieces)) + presence.numel()
        lowest = min(p for p in range(w) if p != r)
        for q in range(w):
            if q == r:
                continue
            wire.counter.count(Kind.GRAD_REDUCE, q, mine * size, True)
            if header is not None:
                wire.counter.count(VERIFICATION, q, HEADER_BYTES, True)
            into = first_into if first_into is not None and q == lowest else None
            received[q] = into if into is not None else torch.empty(total + presence.numel(), dtype=dtype,
                                                                    device=device)
            off = 0
            for p, g in zip(pieces, grads):
                qlo, qhi = piece(p.numel, p.shard_numel, q)
                if qhi > qlo:
                    src = g[qlo:qhi] if g is not None else zeros[: qhi - qlo]
                    ops.append(wire.p2p(dist.isend, src, q, t))
                lo, hi = piece(p.numel, p.shard_numel, r)
                if hi > lo:
                    ops.append(wire.p2p(dist.irecv, received[q][off: off + hi - lo], q, t))
                if hi - lo < p.shard_numel:  # this rank's padding: nothing arrives there
                    received[q][off + max(hi - lo, 0): off + p.shard_numel].zero_()
                off += p.shard_numel
            if presence.numel():
                ops += [wire.p2p(dist.isend, presence, q, t), wire.p2p(dist.irecv, received[q][total:], q, t)]
            if header is not None:
                own = torch.frombuffer(bytearray(header.to_bytes()), dtype=torch.uint8).to(device)
                got[q] = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device)
                ops += [wire.p2p(dist.isend, own, q, t), wire.p2p(dist.irecv, got[q], q, t)]
                keep.append(own)
        work = wire.send_recv(ops, tag)
        work.keep = keep  # the gradients stay alive until their sends completed
        work.headers = lambda: [header if q == r else PayloadHeader.from_bytes(bytes(got[q].cpu().tolist()))
                                for q in range(w)]
        return work, received

    def exchange_payloads(self, payloads: dict[int, torch.Tensor], tag: Tag | None, header_bytes: int
                          ) -> tuple[PairwiseWork, dict[int, torch.Tensor]]:
        """Pairwise messages."""
        wire = self.wire
        w, r = wire.world_size, wire.rank
        n = payloads[r].numel()
        wire.counter.peers(Kind.GRAD_REDUCE, n - header_bytes, header_bytes, True)
        t = wire.next_tag()
        received = {q: torch.empty(n, dtype=torch.uint8, device=wire.device) for q in range(w) if q != r}
        ops = [op for q in received for op in (wire.p2p(dist.isend, payloads[q], q, t),
                                               wire.p2p(dist.irecv, received[q], q, t))]
        work = wire.send_recv(ops, tag)
        work.keep = list(payloads.values())
        return work, received


class QuantizedReduction:
    """qgZ: each rank sends every other rank that rank's part of each gradient as int8 (or int4)
    blocks with scales; the receiver dequantizes every message before adding it to its own exact
    part, in fp32, so the error is one rounding per message and never compounds. The reduced shard
    stays fp32. The messages travel on the communicator's reduce transport."""

    def __init__(self, transport: ReduceTransport, codec: QuantizedCodec) -> None:
        self.transport = transport
        self.codec = codec

    def reduce(self, req: ReduceRequest) -> ReduceWork:
        tr, codec = self.transport, self.codec
        wire, verifier = tr.wire, tr.verifier
        w, r, bits = wire.world_size, wire.rank, codec.grad_bits
        pieces, device, total, counted = req.pieces, req.device, req.total, req.counted
        layout = codec.grad_layout([p.shard_numel for p in pieces])
        size = codec.size(layout) + 4 * counted
        shape = RequestShape(Kind.GRAD_REDUCE.value, (size,), f"quantized{bits}", False)
        header = verifier.planned(req.tag, shape)
        out = torch.zeros(total + counted, dtype=torch.float32, device=device)
        grads, bits_present = flat_grads(pieces, torch.float32, device)
        payloads: dict[int, torch.Tensor] = {}
        for q in range(w):
            payload = torch.zeros(size + (HEADER_BYTES if tr.verify else 0), dtype=torch.uint8, device=wire.device)
            off, col = 0, 0
            for p, g, (sh, v, nb) in zip(pieces, grads, layout):
                lo, hi = piece(p.numel, sh, q)
                if q == r:  # this rank's own part: exact, never on the wire
                    if g is not None and hi > lo:
                        out[col: col + hi - lo].copy_(g[lo:hi])
                elif g is not None and hi > lo:
                    part = torch.zeros(sh, dtype=torch.float32, device=device)
                    part[: hi - lo].copy_(g[lo:hi])
                    codec.encode_part(part, payload, off, v, nb)
                off += v + 4 * nb
                col += sh
            if counted:
                payload[off: off + 4 * counted].copy_(bits_present.view(torch.uint8))
            if header is not None:
                payload[size:].copy_(header_as(torch.uint8, header, wire.device))
            payloads[q] = payload
        if counted:
            out[total:] = bits_present
        work, received = tr.exchange_payloads(payloads, req.tag, HEADER_BYTES if tr.verify else 0)

        def total_up() -> None:  # every message dequantized, then added in fp32, in rank order
            for q in range(w):
                if q == r:
                    continue
                off = codec.add_row(received[q], layout, out)
                if counted:
                    out[total:].add_(received[q][off: off + 4 * counted].view(torch.float32))

        work.then = total_up
        rw = tr.work(req, out, total + counted, out, work)
        if header is not None:
            rw.slot = verifier.register(shape, [work], lambda: [
                header if q == r else PayloadHeader.from_bytes(bytes(received[q][-HEADER_BYTES:].cpu().tolist()))
                for q in range(w)])
        if not tr.overlap:
            wire.monitor.wait(work, req.tag)
        return rw


def flat_grads(pieces: Sequence[GradPiece], dtype: torch.dtype, device: torch.device
               ) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Each piece's gradient flat in ``dtype`` (None where there is none), and this rank's presence
    bits (1 or 0) of the counted pieces."""
    grads = [p.grad.reshape(-1).to(dtype) if p.grad is not None else None for p in pieces]
    presence = torch.tensor([1.0 if g is not None else 0.0 for p, g in zip(pieces, grads) if p.counted],
                            dtype=dtype, device=device)
    return grads, presence


def _fill_rows(req: ReduceRequest, rows: torch.Tensor, w: int) -> None:
    """Lay the bucket's gradients out rank-major in ``rows`` (``(world, S)``), then the presence columns."""
    off, col = 0, req.total
    for p in req.pieces:
        s = p.shard_numel
        if p.grad is not None:
            src = p.grad.reshape(-1)
            if p.numel == s * w:
                rows[:, off: off + s].copy_(src.view(w, s))
            else:  # the last ranks' pieces are padded with zeros
                for r in range(w):
                    lo, hi = piece(p.numel, s, r)
                    if hi > lo:
                        rows[r, off: off + hi - lo].copy_(src[lo:hi])
        if p.counted:
            if p.grad is not None:
                rows[:, col].fill_(1)  # every rank's slice learns that this rank had a gradient
            col += 1
        off += s


def reduce_transport(impl: str, wire: Wire, verifier: Verifier, ctx: WaitContext, overlap: bool,
                     verify: bool) -> ReduceTransport:
    """The transport for a resolved ``reduce_impl`` (world size 1: `LocalReduce`)."""
    cls: type[ReduceTransport]
    if wire.world_size == 1:
        cls = LocalReduce
    else:
        cls = {"p2p": PairwiseReduce, "all_reduce": AllReduceReduce, "reduce_scatter": ReduceScatterReduce}[impl]
    return cls(wire, verifier, ctx, overlap, verify)


def hold_bytes(impl: str, world: int, numel: int, pieces: int, grad_itemsize: int, itemsize: int, *,
               holes: bool = False, verify: bool = True, quantized: tuple[int, int] | None = None,
               backend: str = "gloo") -> int:
    """The most one bucket of ``numel`` gradient elements, in at most ``pieces`` parameters, holds at
    once from its gradients' hand-over to its reduction's landing: the gradients (``grad_itemsize``
    bytes each) and the buffers of the resolved ``impl``'s reduction (``itemsize``: its dtype's), as
    `GradientReducer`'s gauge counts them (StepMetrics.reduce_held_bytes); under memory_budget the
    reducer queues the next bucket beside the reduction in flight only within this (grad.py `held_cap`). ``holes``: a piece may have no
    gradient (leaf units); ``quantized``: qgZ's (bits, block). World size 1 holds nothing: each
    gradient goes straight into its shard's. Pure: the budget planner and ``zero3.plan`` use it
    without a process group; tests/multiproc/test_memory_budget_multirank.py holds the gauge to it on
    each transport.

    What each holds, with S the shard elements per rank (each piece padded to the world, one presence
    count per piece) and H the verification header room:
    - reduce_scatter: the gradients, the flat rank-major copy (world x (S + H)) and the result (S + H),
      and on gloo its own copy of the flat input, held until the landing (review 39R2);
    - all_reduce: the gradients and the flat copy (world x S + H), whose slice is the result;
      both with the header values' scratch (2 H);
    - p2p and shm (whose buckets too large for a slot go pairwise; a slot of the fixed outbox arena is
      not counted): the gradients (and a copy in the reduction's dtype when it differs), the result,
      which the lowest peer's message lands in, a receive buffer per other peer, zeros for a missing
      piece, and the headers;
    - qgZ: the gradients (and an fp32 copy), the fp32 result, at most three messages per peer
      (the payloads, and what the exchange copies them into and receives), and the quantization's
      fp32 temporaries of one part at a time (the part, padded to the block, its scaled and rounded
      copies: four of at most S elements and a block, review 39R1).
    The gauge samples the reducer when a gradient is handed over, a reduction is issued and it lands;
    transients inside a reduction (qgZ's, and a cast of the gradients to the reduction's dtype, which
    the `converted` term counts) are in this account only.
    """
    if world <= 1:
        return 0
    s = -(-(numel + pieces * (world - 1)) // world) + pieces
    grads = numel * grad_itemsize
    if quantized is not None:
        bits, block = quantized
        message = wire_bytes(s, block, bits) + 12 * pieces + HEADER_BYTES  # per piece: rounding, a block, a count
        temporaries = 4 * (s + block) * 4  # four fp32 copies of one part, padded up to a whole block
        return grads + (numel * 4 if grad_itemsize != 4 else 0) + s * 4 + 3 * world * message + temporaries
    h = HEADER_VALUES * world if verify else 0
    scratch = 2 * h * itemsize  # the header values written into the buffer and read back
    if impl == "reduce_scatter":
        copies = world + 1 + (world if backend == "gloo" else 0)
        return grads + copies * (s + h) * itemsize + scratch
    if impl == "all_reduce":
        return grads + (world * s + h) * itemsize + scratch
    if impl in ("p2p", "shm"):
        converted = numel * itemsize if itemsize != grad_itemsize else 0
        return grads + converted + (world - 1 + holes) * s * itemsize + 2 * world * HEADER_BYTES
    raise ValueError(f"reduce_impl {impl!r}: one of reduce_scatter, all_reduce, p2p, shm (resolved, not auto)")

