"""Gradient reductions through shared memory, for ranks on one machine (``reduce_scatter_impl="shm"``).

[Note: shared reductions]
A pairwise reduction (reduce.py `PairwiseReduce`) sends each peer its part of every gradient on
gloo, which costs both ranks 0.5-0.7 ms of CPU a MiB (benchmarks/bench_p2p_cost.py); the same
bytes through a file in ``/dev/shm`` cost a copy in and a read out, 0.05-0.15 ms a MiB each. So
each rank keeps an *outbox* there: one file with two slots. To reduce a bucket, a rank writes
every peer's part of it (that peer's rows of the gradients, zero padding, then this rank's presence
bits: exactly what the pairwise reduction would have sent) into a slot, then sends each peer a
16-byte *ready* message on gloo (the verification header, or zeros when verification is off).
Its own part goes into the result at once, so the gradients may go as soon as the rows are
written (the pairwise reduction keeps them until its sends complete). When its reduction is waited
for, a rank waits for every peer's ready message, then reads its part from each peer's slot
(``os.preadv``, no mapping of the peer's memory) and adds it, in rank order: own + lowest peer is
the pairwise reduction's lowest peer + own bit for bit, so results equal `PairwiseReduce`'s.

Slots alternate (reduction ``j`` uses slot ``j % 2``). A slot is free when this rank writes it
because a rank waits for its previous shared reduction before it issues the next: so when this
rank issues ``j``, it has received every peer's ready message for ``j - 1``, which each peer sent
only after waiting for ``j - 2``, the last reduction that read this slot. No acknowledgement
travels, and no deadlock: everything a peer waits for before its ready message for ``j - 1`` was
issued by this rank before ``j``.

When: only while the step's shared-memory window is open (shared.py [Note: shared shards]), which
every rank enters and leaves at the same barriers, so all ranks route each reduction the same way;
and only for buckets whose rows fit a slot (`SLOT_BYTES`); the others, and every reduction outside
the window (or after sharing turned off), travel pairwise. The route is part of the planned
request (its dtype carries `ROUTE`), so a rank that leaves the plan issues the same kind of void
stand-in as the reduction its peers issue. qgZ's coded messages always travel on the wire.

Memory: the outbox's pages are allocated as rows are first written and stay: at most two slots
of the largest rows written, ``2 * (world - 1) / world`` of the largest bucket that fits. Set-up
checks that ``/dev/shm`` has room for every rank's two slots (else every rank logs and reduces
pairwise); a later allocation that finds it full (``posix_fallocate``) raises a `ZeroStateError`
naming the way out, never a SIGBUS.
"""

from __future__ import annotations

import ctypes
import logging
import os
import uuid
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import ZeroStateError
from ..metrics import VERIFICATION
from .reduce import PairwiseReduce, ReduceRequest, flat_grads
from .shared import SHM_DIR, SharedShards, WindowState, close_fds, open_peers
from .tags import Kind, Tag
from .verifier import Verifier
from .verify import HEADER_BYTES, PayloadHeader, RequestShape
from .wire import PairwiseWork, Wire, label, piece
from .works import ReduceWork, WaitContext

logger = logging.getLogger(__name__)

SLOT_BYTES = 4 << 20
"""Bytes per outbox slot: a bucket whose rows for the peers are larger travels pairwise. Measured on
2 ranks (docs/performance.md, "Gradient reductions through shared memory"): with 1.5 MiB rows (the
3.7M GPT's Blocks) shared reductions took 0.96x the step of pairwise ones, with 3.5-4.7 MiB rows
(quarter-Block buckets of the 86.7M GPT) 0.976x; with 14 MiB rows (the 86.7M GPT's Blocks) they
were even (0.995x, CPU 1.007x) and held 15-27 MiB more at the peak: there the
three copies on the rank's own thread (rows in, own part, rows out) seem to cost what gloo's
threads spend beside it. 4 MiB lies between the two measured sizes; it was not tuned further."""

ROUTE = "@shm"
"""Appended to a planned reduction's dtype when it goes through the outboxes."""


class SharedOutbox:
    """This rank's outbox (two slots of `SLOT_BYTES`, mapped) and read descriptors of its peers'."""

    def __init__(self, arena: torch.Tensor, own_fd: int, peers: dict[int, int], slot_bytes: int) -> None:
        self.arena = arena  # uint8, 2 * slot_bytes, this rank's file mapped shared
        self.slot_bytes = slot_bytes
        self._fds = dict(peers)  # group rank -> read-only descriptor of its outbox
        self._fds[-1] = own_fd  # this rank's, for posix_fallocate; closed with the others
        self._finalizer = weakref.finalize(self, close_fds, self._fds)
        self._allocated = [0, 0]  # bytes of each slot whose pages exist

    @classmethod
    def create(cls, rank: int, exchange: Callable[[Any], list[Any]],
               slot_bytes: int | None = None) -> SharedOutbox | None:
        """A collective: every rank makes its outbox (a sparse file: pages come with the first rows
        written), opens every peer's, and unlinks its own. None on every rank when one could not.
        ``slot_bytes``: `SLOT_BYTES` (read now, so a test can move it) unless given."""
        slot_bytes = SLOT_BYTES if slot_bytes is None else slot_bytes
        path = os.path.join(SHM_DIR, f"zero3-outbox-{os.getpid()}-{uuid.uuid4().hex}")
        arena, own_fd, fds, made, failed = None, -1, {}, False, "set-up did not finish"
        try:
            error = None
            try:
                own_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                made = True
                os.ftruncate(own_fd, 2 * slot_bytes)
                arena = torch.from_file(path, shared=True, size=2 * slot_bytes, dtype=torch.uint8)
            except (OSError, RuntimeError) as exc:
                error = f"rank {rank}: {type(exc).__name__}: {exc}"
            paths = exchange((error, path))
            error = next((e for e, _ in paths if e is not None), None)
            if error is None:  # pages come later, as rows are written: is there room for every rank's two slots?
                st = os.statvfs(SHM_DIR)
                if st.f_bavail * st.f_frsize < len(paths) * 2 * slot_bytes:
                    error = (f"{SHM_DIR} has {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free, less than "
                             f"{len(paths) * 2 * slot_bytes / 2**20:.0f} MiB for {len(paths)} outboxes")
            fds, failed = open_peers(rank, [p for _, p in paths], error, exchange)
        finally:
            if made:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if failed is not None or arena is None:
            if own_fd >= 0:
                os.close(own_fd)
            logger.warning("zero3: shared-memory reductions off (%s); gradient reductions travel on the wire", failed)
            return None
        logger.info("zero3: shared-memory reductions: an outbox of 2 slots of %.0f MiB per rank in %s (pages "
                    "allocated as rows are written)", slot_bytes / 2**20, SHM_DIR)
        return cls(arena, own_fd, fds, slot_bytes)

    def rows(self, slot: int, count: int, row: int, dtype: torch.dtype) -> torch.Tensor:
        """Slot ``slot`` as ``count`` rows of ``row`` elements, its pages allocated first."""
        nbytes = count * row * dtype.itemsize
        assert nbytes <= self.slot_bytes
        if nbytes > self._allocated[slot]:
            try:  # ENOSPC here, not a SIGBUS at the write
                os.posix_fallocate(self._fds[-1], slot * self.slot_bytes, nbytes)
            except OSError as exc:
                raise ZeroStateError(f"shared-memory reduction: no room in {SHM_DIR} for {nbytes:,} bytes of "
                                     f"gradient rows ({exc}); free some, or set reduce_scatter_impl='p2p'") from exc
            self._allocated[slot] = nbytes
        base = slot * self.slot_bytes
        return self.arena[base: base + nbytes].view(dtype).view(count, row)

    def read(self, peer: int, slot: int, offset: int, into: torch.Tensor) -> None:
        """``into.numel()`` elements from byte ``offset`` of peer ``peer``'s slot ``slot`` into ``into``."""
        nbytes = into.numel() * into.element_size()
        buf = (ctypes.c_char * nbytes).from_address(into.data_ptr())
        got = os.preadv(self._fds[peer], [buf], slot * self.slot_bytes + offset)
        if got != nbytes:
            raise ZeroStateError(f"shared-memory reduction: read {got} of {nbytes} bytes of rank {peer}'s outbox")

    def release(self) -> None:
        """Close every descriptor (at exit)."""
        close_fds(self._fds)


class SharedReduce(PairwiseReduce):
    """``shm``: pairwise reductions whose parts travel through the outboxes ([Note: shared reductions])
    while the step's shared-memory window is open; pairwise messages otherwise."""

    def __init__(self, wire: Wire, verifier: Verifier, ctx: WaitContext, overlap: bool, verify: bool) -> None:
        super().__init__(wire, verifier, ctx, overlap, verify)
        self.metrics = ctx.metrics
        self.outbox: SharedOutbox | None = None
        self.window: SharedShards | None = None
        self._issued = 0  # shared reductions (and their void stand-ins) issued: the next one's slot
        self._last: PairwiseWork | None = None  # the previous one, waited before the next is issued

    def share(self, outbox: SharedOutbox, window: SharedShards) -> None:
        self.outbox, self.window = outbox, window

    def step_aborted(self) -> None:
        """Sharing is off for good then (or was not open in that step): hold no work."""
        self._last = None

    def release(self) -> None:
        self._last = None
        if self.outbox is not None:
            self.outbox.release()
            self.outbox = None

    def _shared(self, row: int, dtype: torch.dtype) -> bool:
        """Whether a reduction of ``row`` elements per peer goes through the outboxes now."""
        box, window = self.outbox, self.window
        return (box is not None and window is not None and window.state is WindowState.OPEN
                and (self.wire.world_size - 1) * row * dtype.itemsize <= box.slot_bytes)

    def reduce(self, req: ReduceRequest) -> ReduceWork:
        total, counted = req.total, req.counted
        row = total + counted
        if not self._shared(row, req.dtype):
            return super().reduce(req)
        w, r = self.wire.world_size, self.wire.rank
        pieces, dtype, device = req.pieces, req.dtype, req.device
        shape = RequestShape(Kind.GRAD_REDUCE.value, tuple(p.numel for p in pieces) + (counted,), f"{dtype}{ROUTE}",
                             False)
        header = self.verifier.planned(req.tag, shape)
        slot = self._next_slot(req.tag)
        grads, presence = flat_grads(pieces, dtype, device)
        assert self.outbox is not None
        out = torch.empty(row, dtype=dtype, device=device)
        with label("zero3::shared_reduce"):
            rows = self.outbox.rows(slot, w - 1, row, dtype)
            for q in range(w):
                if q != r:
                    _peer_row(rows[q if q < r else q - 1], pieces, grads, presence, q, total)
            _peer_row(out, pieces, grads, presence, r, total)  # this rank's own part: the gradients may go now
        del grads
        work = self._ready(header, req.tag)

        def total_up() -> None:
            # PairwiseReduce's sums: (lowest other rank + own) + the others in rank order; own + lowest
            # is the same sum bit for bit (a + b == b + a).
            box = self.outbox
            assert box is not None
            nbytes = row * dtype.itemsize
            part = torch.empty(row, dtype=dtype, device=device)
            for q in range(w):
                if q != r:
                    box.read(q, slot, (r if r < q else r - 1) * nbytes, part)
                    out.add_(part)
            self.metrics.shared_reduce_bytes += (w - 1) * nbytes

        work.then = total_up
        rw = self.work(req, out, row, None, work)
        if header is not None:
            rw.slot = self.verifier.register(shape, [work], work.headers)
        if not self.overlap:
            self.wire.monitor.wait(work, req.tag)
        return rw

    def dummy(self, shape: RequestShape, header: PayloadHeader, tag: Tag) -> list[Any]:
        """A void stand-in: through the outboxes when the planned reduction went there (its rows are
        not written; the peers' results are void), else as `PairwiseReduce`'s."""
        if not shape.dtype.endswith(ROUTE):
            return super().dummy(shape, header, tag)
        self._next_slot(tag)
        return [self._ready(header, tag)]

    def _next_slot(self, tag: Tag | None) -> int:
        """Wait for the previous shared reduction (so the slot about to be written is read by no one,
        see the Note); the slot of the next."""
        last, self._last = self._last, None
        if last is not None:
            self.wire.monitor.wait(last, tag)
        slot = self._issued % 2
        self._issued += 1
        return slot

    def _ready(self, header: PayloadHeader | None, tag: Tag | None) -> PairwiseWork:
        """Post the ready messages: this rank's header (or zeros) to every peer, each peer's from it."""
        wire = self.wire
        w, r = wire.world_size, wire.rank
        t = wire.next_tag()
        raw = header.to_bytes() if header is not None else bytes(HEADER_BYTES)
        own = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(wire.device)
        got = {q: torch.empty(HEADER_BYTES, dtype=torch.uint8, device=wire.device) for q in range(w) if q != r}
        ops = []
        for q in got:
            ops += [wire.p2p(dist.isend, own, q, t), wire.p2p(dist.irecv, got[q], q, t)]
            wire.counter.count(VERIFICATION if header is not None else Kind.GRAD_REDUCE, q, HEADER_BYTES, True)
        work = wire.send_recv(ops, tag)
        work.keep = [own]
        work.headers = lambda: [header if q == r else PayloadHeader.from_bytes(bytes(got[q].cpu().tolist()))
                                for q in range(w)]
        self._last = work
        return work


def _peer_row(row: torch.Tensor, pieces: Any, grads: list[torch.Tensor | None], presence: torch.Tensor, q: int,
              total: int) -> None:
    """Peer ``q``'s part of every gradient (zeros where there is none, and in its padding), then
    this rank's presence bits: what a pairwise reduction sends ``q``."""
    off = 0
    for p, g in zip(pieces, grads):
        lo, hi = piece(p.numel, p.shard_numel, q)
        n = max(hi - lo, 0)
        if g is not None and n:
            row[off: off + n].copy_(g[lo:hi])
        else:
            n = 0
        if n < p.shard_numel:
            row[off + n: off + p.shard_numel].zero_()
        off += p.shard_numel
    if presence.numel():
        row[total:].copy_(presence)
