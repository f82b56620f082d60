"""Parameter all-gathers: where a gather is issued, on the gather transport chosen once per communicator.

A gather of parameter shards goes one of five ways: a local copy (world size 1), reads of the
peers' shared-memory arenas (``shm``, `SharedShards`), int8 blocks with
scales (qwZ, `QuantizedCodec`: training-path gathers only, as the caller says), pairwise pieces straight into the parameters' storage
(`PairwiseGather` where it can), or buckets of at most ``bucket_numel`` elements gathered into rows
and copied out (on the CUDA side stream with ``overlap_comm``). Each returns its own kind of
`GatherWork` (works.py). hpZ secondary gathers (`all_gather_secondary`) run on the secondary
group's communicator. The transport counts the bytes (counter.py) where it puts them on the wire.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..metrics import StepMetrics
from ..partition import sharding
from ..partition.param import ZeroParameter, alloc_full, raw_data
from .codec import Layout, QuantizedCodec
from .secondary import Secondary, SecondaryCutter
from .shared import SharedShards
from .streams import SideStream
from .tags import Kind, Tag
from .verifier import Verifier
from .verify import (
    HEADER_BYTES,
    PayloadHeader,
    RequestShape,
    bitcast_elements,
    header_as,
    headers_from,
)
from . import wire as _wire
from .wire import META, PairwiseWork, Wire, all_gather_flat, label, piece
from .works import (
    ChunkedGather,
    copy_from_shards,
    DirectGather,
    GatherChunk,
    GatherWork,
    QuantizedGather,
    ReadyGather,
    StreamGather,
    WaitContext,
)


class GatherTransport:
    """How one communicator moves a gather's bytes (chosen once, at construction). ``pairwise``: it
    sends pairwise messages (hpZ's secondary gathers then go as pieces straight into storage)."""

    pairwise = False

    def __init__(self, wire: Wire) -> None:
        self.wire = wire

    def direct(self, params: Sequence[ZeroParameter]) -> bool:
        """Whether ``params`` can be gathered as pairwise pieces straight into their storage."""
        return False

    def rows(self, inp: torch.Tensor, async_op: bool, tag: Tag | None, kind: Kind,
             header_numel: int) -> tuple[list[torch.Tensor], Any]:
        """Every rank's ``inp`` (the same size everywhere), as one row per rank; and the work to wait
        for (None when done). The last ``header_numel`` elements of each row are counted as
        verification, the rest as ``kind``."""
        raise NotImplementedError

    def dummy(self, shape: RequestShape, header: PayloadHeader, tag: Tag) -> list[Any]:
        """A void stand-in for a planned gather of ``shape`` (see [Note: verified collectives]), on the
        same messages as the real one: quantized rows, bucketed rows (one per size, the header at
        each row's end), or a direct gather's pieces."""
        w = self.wire
        if shape.dtype == "quantized":
            payload = torch.zeros(shape.sizes[0] + HEADER_BYTES, dtype=torch.uint8, device=w.device)
            payload[shape.sizes[0]:].copy_(header_as(torch.uint8, header, w.device))
            return [self.rows(payload, True, tag, Kind(shape.kind), HEADER_BYTES)[1]]
        dtype = getattr(torch, shape.dtype.removeprefix("torch."), torch.uint8)
        if shape.rows:
            hdr = bitcast_elements(dtype)
            return [self.rows(torch.cat([torch.zeros(total, dtype=dtype, device=w.device),
                                         header_as(dtype, header, w.device)]), True, tag, Kind(shape.kind), hdr)[1]
                    for total in shape.sizes]
        return [_dummy_pieces(w, shape, header, tag, dtype)]


class CollectiveGather(GatherTransport):
    """``allgather_impl="all_gather"``: one flat all-gather per bucket."""

    def rows(self, inp: torch.Tensor, async_op: bool, tag: Tag | None, kind: Kind,
             header_numel: int) -> tuple[list[torch.Tensor], Any]:
        w = self.wire
        n, size = inp.numel(), inp.element_size()
        w.counter.peers(kind, (n - header_numel) * size, header_numel * size, False)
        out = torch.empty(w.world_size * n, dtype=inp.dtype, device=inp.device)
        work = w.monitor.blocking(lambda: all_gather_flat(out, inp, group=w.group, async_op=async_op), tag)
        return list(out.view(w.world_size, n).unbind(0)), (work if async_op else None)


class PairwiseGather(GatherTransport):
    """``allgather_impl="p2p"``: each rank sends its piece to every other rank and receives theirs (the
    same bytes as a ring all-gather, without gloo's extra copies); parameters whose shard and storage
    agree in device and dtype, and that average at least ``wire.DIRECT_MIN_BYTES``, receive their
    pieces straight into storage (others go as one row per peer). Meta tensors (a model built
    on the meta device) have no backend for messages: they take the collective path, whose meta
    kernels move nothing, as there is nothing."""

    pairwise = True

    def __init__(self, wire: Wire) -> None:
        super().__init__(wire)
        self._meta = CollectiveGather(wire)

    def direct(self, params: Sequence[ZeroParameter]) -> bool:
        """Pieces straight into storage when shard and storage agree and the parameters are large
        enough on average (`wire.DIRECT_MIN_BYTES`); otherwise the bucket travels as one row per peer."""
        if not all(p._zero.shard.device == raw_data(p).device != META and p._zero.shard.dtype == raw_data(p).dtype
                   for p in params):
            return False
        nbytes = sum(p._zero.numel for p in params) * params[0]._zero.shard.element_size()
        return nbytes >= _wire.DIRECT_MIN_BYTES * len(params)

    def rows(self, inp: torch.Tensor, async_op: bool, tag: Tag | None, kind: Kind,
             header_numel: int) -> tuple[list[torch.Tensor], Any]:
        if inp.device == META:
            return self._meta.rows(inp, async_op, tag, kind, header_numel)
        w = self.wire
        n, size = inp.numel(), inp.element_size()
        w.counter.peers(kind, (n - header_numel) * size, header_numel * size, True)
        rows: list[torch.Tensor] = []
        ops = []
        t = w.next_tag()
        for peer in range(w.world_size):
            if peer == w.rank:
                rows.append(inp)
                continue
            buf = torch.empty(n, dtype=inp.dtype, device=inp.device)
            rows.append(buf)
            ops += [w.p2p(dist.isend, inp, peer, t), w.p2p(dist.irecv, buf, peer, t)]
        work = w.send_recv(ops, tag)
        if not async_op:
            w.monitor.wait(work, tag)
            return rows, None
        return rows, work


def _dummy_pieces(w: Wire, shape: RequestShape, header: PayloadHeader, tag: Tag, dtype: torch.dtype) -> Any:
    """A direct gather's messages (pieces of ``span`` primary shards), of zeros, into scratch."""
    span, world = shape.span, w.world_size
    pieces = [torch.zeros(span * -(-n // (span * world)), dtype=dtype, device=w.device) for n in shape.sizes]
    scratch = [torch.empty(n, dtype=dtype, device=w.device) for n in shape.sizes]
    return w.exchange_pieces(Kind(shape.kind), pieces, scratch, shape.sizes, header, tag, span)


def gather_transport(impl: str, wire: Wire) -> GatherTransport:
    """The transport for a resolved ``allgather_impl`` (``shm``: pairwise for what its arenas do not hold)."""
    return PairwiseGather(wire) if impl in ("p2p", "shm") else CollectiveGather(wire)


class ParamGatherer:
    """Issues one communicator's parameter gathers (``all_gather_params``) and, on an hpZ secondary
    group's communicator, the gathers from secondary slices (``all_gather_secondary``)."""

    def __init__(self, wire: Wire, transport: GatherTransport, verifier: Verifier, ctx: WaitContext,
                 metrics: StepMetrics, *, overlap: bool, bucket_numel: int, verify: bool,
                 codec: QuantizedCodec | None, secondary_span: int) -> None:
        self.wire = wire
        self.transport = transport
        self.verifier = verifier
        self.ctx = ctx
        self.metrics = metrics
        self.overlap = overlap
        self.bucket_numel = bucket_numel
        self.verify = verify
        self.codec = codec  # qwZ (None: exact values)
        self.secondary_span = secondary_span
        self.side = SideStream()
        self.shared: SharedShards | None = None  # same-node arenas ([Note: shared shards]); set by the communicator

    def _count(self, params: Sequence[ZeroParameter]) -> None:
        numel = nbytes = 0
        for p in params:
            z = p._zero
            numel += z.numel
            nbytes += z.nbytes
        m = self.metrics
        m.allgather_calls += 1
        m.allgather_numel += numel
        m.allgather_bytes += nbytes

    def all_gather_params(self, params: Sequence[ZeroParameter], tag: Tag, count: bool,
                          cutter: SecondaryCutter | None, quantize: bool) -> GatherWork:
        """Issue the all-gather of ``params``' shards into their own storage (`Communicator.all_gather_params`);
        qwZ codes it only when the caller asks (``quantize``: a training-path gather)."""
        if not params:
            return ReadyGather(self.ctx, params, tag, cutter=cutter, done=True)
        if count:
            self._count(params)
        if self.wire.world_size == 1:
            return self._local(params, tag)
        shared = self.shared
        if shared is not None and cutter is None and shared.covers(params) and shared.open():
            return self._from_arenas(shared, params, tag)
        if quantize and self.codec is not None and all(p._zero.shard.is_floating_point() for p in params):
            return self._quantized(params, tag, cutter)
        if self.transport.direct(params):
            return self._direct(params, tag, cutter)
        return self._chunked(params, tag, cutter)

    def _local(self, params: Sequence[ZeroParameter], tag: Tag) -> GatherWork:
        """World size 1: the "gather" is a copy from the shard (host to device when offloaded)."""
        device = raw_data(params[0]).device
        if device.type == "cuda" and self.overlap:
            with torch.cuda.stream(self.side.enter(device)):
                copy_from_shards(params)
                event = self.side.record()
            return StreamGather(self.ctx, params, tag, event=event)
        copy_from_shards(params)
        return ReadyGather(self.ctx, params, tag, done=True)

    def _from_arenas(self, shared: SharedShards, params: Sequence[ZeroParameter], tag: Tag) -> GatherWork:
        """Every peer's piece read from its arena straight into the parameter's storage, this rank's
        copied from its shard ([Note: shared shards]): done when issued, nothing to verify, nothing
        on the wire (counted in ``metrics.shared_read_bytes``, not ``recv_bytes``)."""
        w = self.wire
        rank, world = w.rank, w.world_size
        read = 0  # not wire bytes: `recv_bytes` leaves them out
        with label("zero3::shared_gather"):
            for p in params:
                z = p._zero
                full = alloc_full(p)
                n, s = z.numel, z.shard_numel
                for q in range(world):
                    lo, hi = piece(n, s, q)
                    if hi <= lo:
                        break
                    if q == rank:
                        full[lo:hi].copy_(z.shard[: hi - lo])
                        continue
                    shared.read(q, z.id, full[lo:hi])
                    read += (hi - lo) * full.element_size()
        self.metrics.shared_read_bytes += read
        return ReadyGather(self.ctx, params, tag, done=True)

    def _chunked(self, params: Sequence[ZeroParameter], tag: Tag, cutter: SecondaryCutter | None) -> GatherWork:
        """Buckets gathered into rows (the header bit-cast at each row's end), copied out on wait."""
        chunks = self._chunks(params)
        dtype = params[0]._zero.shard.dtype
        hdr = bitcast_elements(dtype) if self.verify else 0
        shape = RequestShape(Kind.PARAM_GATHER.value, tuple(c.total for c in chunks), str(dtype),
                             _header_apart(self.verify, hdr), rows=True)
        header = self.verifier.planned(tag, shape)
        device = raw_data(params[0]).device  # where the gathered tensor lives (shards may be on the CPU)
        handle: GatherWork
        event = None
        if device.type == "cuda" and self.overlap:
            with torch.cuda.stream(self.side.enter(device)):
                for chunk in chunks:
                    self._issue(chunk, hdr, header, async_op=False)
                    chunk.copy_out(self.wire.world_size, keep_header=header is not None)
                event = self.side.record()
            handle = StreamGather(self.ctx, params, tag, cutter=cutter, event=event)
        else:
            for chunk in chunks:
                self._issue(chunk, hdr, header, async_op=self.overlap)
            handle = ChunkedGather(self.ctx, params, tag, cutter=cutter, chunks=chunks,
                                   world_size=self.wire.world_size)
        if header is not None:
            handle.slot = self.verifier.register(shape, [c.work for c in chunks if c.work is not None],
                                                 lambda: _chunk_headers(chunks, self.wire.world_size, hdr, event))
        return handle

    def _issue(self, chunk: GatherChunk, hdr: int, header: PayloadHeader | None, *, async_op: bool) -> None:
        device = raw_data(chunk.params[0]).device
        dtype = chunk.params[0]._zero.shard.dtype
        pieces = [p._zero.shard.to(device=device, dtype=dtype) for p in chunk.params]
        if hdr:
            pieces.append(header_as(dtype, header, device) if header is not None
                          else torch.zeros(hdr, dtype=dtype, device=device))
        inp = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        with label("zero3::all_gather"):
            chunk.rows, chunk.work = self.transport.rows(inp, async_op, None, Kind.PARAM_GATHER, hdr)

    def _chunks(self, params: Sequence[ZeroParameter]) -> list[GatherChunk]:
        chunks: list[GatherChunk] = []
        cur: list[ZeroParameter] = []
        cur_numel = 0
        for p in params:
            if cur and cur_numel + p._zero.numel > self.bucket_numel:
                chunks.append(GatherChunk.of(cur))
                cur, cur_numel = [], 0
            cur.append(p)
            cur_numel += p._zero.numel
        if cur:
            chunks.append(GatherChunk.of(cur))
        return chunks

    def _direct(self, params: Sequence[ZeroParameter], tag: Tag, cutter: SecondaryCutter | None) -> GatherWork:
        """Each rank sends its real piece of every parameter to every other rank, received straight
        into the parameter's storage: no copy in, no copy out (the [Note: verified collectives]
        header travels as one more 16-byte message per peer)."""
        dtype = params[0]._zero.shard.dtype
        shape = RequestShape(Kind.PARAM_GATHER.value, tuple(p._zero.numel for p in params), str(dtype), False)
        header = self.verifier.planned(tag, shape)
        fulls = []
        for p in params:
            full = alloc_full(p)
            lo, hi = piece(p._zero.numel, p._zero.shard_numel, self.wire.rank)
            if hi > lo:
                full[lo:hi].copy_(p._zero.shard[: hi - lo])
            fulls.append(full)
        work = self.wire.exchange_pieces(Kind.PARAM_GATHER, [p._zero.shard for p in params], fulls, shape.sizes,
                                         header, tag)
        return self._direct_work(params, tag, cutter, shape, header, work)

    def _direct_work(self, params: Sequence[ZeroParameter], tag: Tag, cutter: SecondaryCutter | None,
                     shape: RequestShape, header: PayloadHeader | None, work: PairwiseWork) -> GatherWork:
        handle = DirectGather(self.ctx, params, tag, cutter=cutter, work=work)
        if header is not None:
            handle.slot = self.verifier.register(shape, [work], work.headers)
        return handle

    def _quantized(self, params: Sequence[ZeroParameter], tag: Tag, cutter: SecondaryCutter | None) -> GatherWork:
        """qwZ: every rank's shards travel as int8 blocks with fp32 scales (about a quarter of fp32's
        bytes); each rank's gathered weight is the dequantized value of every piece, its own included,
        so every rank computes with the same weights. Shards, masters and the optimizer stay exact."""
        assert self.codec is not None
        layout = self.codec.shard_layout([p._zero.shard_numel for p in params])
        size = self.codec.size(layout)
        shape = RequestShape(Kind.PARAM_GATHER.value, (size,), "quantized", False)
        header = self.verifier.planned(tag, shape)
        payload = torch.zeros(size + (HEADER_BYTES if self.verify else 0), dtype=torch.uint8, device=self.wire.device)
        self.codec.encode_shards([p._zero.shard for p in params], layout, payload)
        return self._gather_payload(shape, params, payload, layout, header, tag, cutter, 1)

    def _gather_payload(self, shape: RequestShape, params: Sequence[ZeroParameter], payload: torch.Tensor,
                        layout: Layout, header: PayloadHeader | None, tag: Tag, cutter: SecondaryCutter | None,
                        span: int) -> GatherWork:
        """All-gather a quantized ``payload`` (its size, then the header room when verifying); the
        work's ``wait()`` dequantizes every row into the parameters."""
        size, device = shape.sizes[0], self.wire.device
        if self.verify:
            payload[size:].copy_(header_as(torch.uint8, header, device) if header is not None
                                 else torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=device))
        rows, work = self.transport.rows(payload, True, tag, Kind(shape.kind), HEADER_BYTES if self.verify else 0)
        handle = QuantizedGather(self.ctx, params, tag, cutter=cutter, work=work if work is not None else
                                 PairwiseWork([]), rows=rows, layout=layout, codec=self.codec, span=span)
        if header is not None:
            handle.slot = self.verifier.register(
                shape, [handle.work], lambda: headers_from(torch.stack([row[-HEADER_BYTES:] for row in rows])))
        return handle

    # -- hpZ: the gathers inside a secondary group -----------------------------------------------
    def all_gather_secondary(self, params: Sequence[ZeroParameter], tag: Tag) -> GatherWork:
        """Gather ``params`` from the secondary slices this group's ranks keep (`Communicator.all_gather_secondary`)."""
        sec_tag = Tag(Kind.SECONDARY_GATHER, tag.label, tag.ids)
        if not params:
            return ReadyGather(self.ctx, params, sec_tag, done=True)
        self._count(params)
        kind, span, w = Kind.SECONDARY_GATHER, self.secondary_span, self.wire.world_size
        secondaries: list[Secondary] = [p._zero.secondary for p in params]
        if secondaries[0].quantized:
            assert self.codec is not None
            layout = self.codec.shard_layout([p._zero.shard_numel for p in params])
            size = span * self.codec.size(layout)
            shape = RequestShape(kind.value, (size,), "quantized", False)
            header = self.verifier.planned(sec_tag, shape)
            payload = torch.empty(size + (HEADER_BYTES if self.verify else 0), dtype=torch.uint8,
                                  device=self.wire.device)
            off = 0
            for sec in secondaries:
                payload[off: off + sec.nbytes].copy_(sec.data)
                off += sec.nbytes
            return self._gather_payload(shape, params, payload, layout, header, sec_tag, None, span)
        if not self.transport.pairwise:
            return self._secondary_rows(params, secondaries, sec_tag)
        dtype = secondaries[0].data.dtype
        shape = RequestShape(kind.value, tuple(p._zero.numel for p in params), str(dtype), False, span)
        header = self.verifier.planned(sec_tag, shape)
        fulls = []
        for p, sec in zip(params, secondaries):
            full = alloc_full(p)
            lo, hi = sharding.secondary_range(p._zero.numel, span * w, w, self.wire.rank)
            if hi > lo:
                full[lo:hi].copy_(sec.data[: hi - lo])
            fulls.append(full)
        work = self.wire.exchange_pieces(kind, [sec.data for sec in secondaries], fulls, shape.sizes, header,
                                         sec_tag, span)
        return self._direct_work(params, sec_tag, None, shape, header, work)

    def _secondary_rows(self, params: Sequence[ZeroParameter], secondaries: list[Secondary], tag: Tag) -> GatherWork:
        """The backend's all-gather (``allgather_impl="all_gather"``, NCCL's choice): every rank's
        padded slices, then the header, in one row per rank, copied out into storage on wait."""
        chunk = GatherChunk.of(list(params), self.secondary_span)
        data = secondaries[0].data
        hdr = bitcast_elements(data.dtype) if self.verify else 0
        shape = RequestShape(Kind.SECONDARY_GATHER.value, (chunk.total,), str(data.dtype),
                             _header_apart(self.verify, hdr), rows=True)
        header = self.verifier.planned(tag, shape)
        pieces = [sec.data for sec in secondaries]
        if hdr:
            pieces.append(header_as(data.dtype, header, data.device) if header is not None
                          else torch.zeros(hdr, dtype=data.dtype, device=data.device))
        with label("zero3::all_gather"):
            chunk.rows, chunk.work = self.transport.rows(torch.cat(pieces), True, None, Kind.SECONDARY_GATHER, hdr)
        world = self.wire.world_size
        handle = ChunkedGather(self.ctx, params, tag, chunks=[chunk], world_size=world)
        if header is not None:
            handle.slot = self.verifier.register(shape, [chunk.work], lambda: _chunk_headers([chunk], world, hdr, None))
        return handle


def _chunk_headers(chunks: list[GatherChunk], world: int, hdr: int, event: Any) -> list[PayloadHeader | None]:
    """Every rank's header of a planned chunked gather: the first chunk's, and every chunk must carry it."""
    if event is not None:
        event.synchronize()
    found: list[PayloadHeader | None] | None = None
    for chunk in chunks:
        assert chunk.rows is not None
        headers = headers_from(torch.stack([row[-hdr:] for row in chunk.rows]))
        if found is None:
            found = headers
        elif headers != found:
            return [None] * world
    return found or [None] * world


def _header_apart(verify: bool, hdr: int) -> bool:
    """A row gather whose dtype cannot carry the header bit for bit (bool) is verified by a blocking header
    exchange before it: a planned one expected the header in the rows and read 16 bytes never sent (the
    first step of a model with a persistent bool parameter raised a shape error, probe 37F)."""
    return verify and hdr == 0
