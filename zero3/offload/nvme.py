"""Offload to NVMe: the two tiers built on swap files (swapfile.py) and the buffer pool (pool.py):
`StorageTier` (any storage, swapped in place) and `ShardTier` (parameter shards, read ahead of
their all-gathers by the coordinator; loaded for the optimizer step, placement and Init).

[Note: swapping]
A tensor that lives on NVMe keeps its Python object, shape and dtype; only its storage holds 0
bytes (as a released parameter's does, partition/param.py [Note: parameter storage]) while its bytes sit in a
fixed region of a swap file. Optimizer state is keyed by the tensor object and views share its
storage, so both stay valid across any number of swaps. There are two ways back into memory:

- resize the tensor's own storage back and read in place (`StorageTier`; and `ShardTier.load` for
  the optimizer step and the rare paths: checkpoints, accessors, ``GatheredParameters``);
- for a parameter shard needed by an all-gather: read it into a span of the `BufferPool`
  (``offload_param_buffer_count`` reusable buffers of ``offload_param_buffer_size`` elements, into
  which shards are packed) and point the shard tensor at the span (``Tensor.set_``) until the
  gather is done, then at a fresh 0-byte storage again. The pool bounds what reading ahead holds,
  is allocated on first use (``offload_states`` frees it), and with ``offload_param_pin_memory`` on
  CUDA is the pinned host staging of the copy to the device.

Swap files, their O_DIRECT alignment and the IO threads: swapfile.py.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import torch

from ..errors import ZeroConfigError, ZeroStateError
from ..metrics import StepMetrics
from ..partition.param import ZeroParameter, residence_of
from ..partition.state import Residence, check_move
from .pool import BufferPool, PoolSpan
from .residence import ShardStore
from .swapfile import AsyncIO, SwapFile, aligned_nbytes, storage_view, uint8_view

logger = logging.getLogger(__name__)


# -- any storage, swapped in place --------------------------------------------------------------------
def _move(record: _Stored, new: Residence, what: str) -> None:
    check_move(what, record.state, new)
    record.state = new


@dataclass(eq=False)
class _Stored:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int
    state: Residence
    future: Future | None = None
    host: torch.Tensor | None = None  # the host copy of a device storage while it is moved
    spare: int | None = None  # the key's second region, written by a staged step


@dataclass(eq=False)
class _Staged:
    """What a staged step did to one key: the record before it (None: the key is new) and whether it
    was written (then its region flipped to the spare one)."""

    before: _Stored | None
    written: bool = False


class StorageTier:
    """Storages swapped to one file, by key: ``swap_out`` writes the bytes to the key's region and
    resizes the storage to 0; ``swap_in`` resizes it back and reads in place, so every tensor and
    view on the storage stays valid. Device (CUDA) storages go through a host copy.

    Between `stage` and `commit` / `rollback` each key is written to its spare region, so the
    region it was read from keeps the value from before: `rollback` points every key back at it and
    frees what is in memory, so nothing the staged step did remains (optim/agreed_step.py [Note: agreed
    optimizer step]). It costs a second region per key on the drive."""

    def __init__(self, io: AsyncIO, file: SwapFile) -> None:
        self.io = io
        self.file = file
        self._records: dict[Hashable, _Stored] = {}
        self._staged: dict[Hashable, _Staged] | None = None  # the keys a staged step touched

    def state(self, key: Hashable) -> Residence | None:
        rec = self._records.get(key)
        return rec.state if rec is not None else None

    @property
    def nvme_bytes(self) -> int:
        """Bytes whose only copy is on the drive (written, or being read back)."""
        return sum(r.nbytes for r in self._records.values()
                   if r.state in (Residence.WRITING, Residence.DRIVE, Residence.READING))

    def swap_out(self, key: Hashable, storage: torch.UntypedStorage) -> None:
        """Start writing ``storage`` to ``key``'s region; it holds 0 bytes once the write is done."""
        rec = self._records.get(key)
        self._touch(key)
        if rec is None or rec.storage is not storage:
            nbytes = storage.nbytes()
            rec = self._records[key] = _Stored(storage, nbytes, self.file.region(key, nbytes), residence_of(storage))
        self._settle(rec)
        if storage.nbytes() != rec.nbytes:
            raise ZeroStateError(f"swap {key!r}: the storage holds {storage.nbytes()} bytes, its region {rec.nbytes}")
        staged = self._staged.get(key) if self._staged is not None else None
        if staged is not None and staged.before is None and rec.spare is None:  # new: its next step's region now
            rec.spare = self.file.reserve(("spare", key), rec.nbytes)
        if staged is not None and staged.before is rec and not staged.written:  # keep the region read from
            if rec.spare is None:
                rec.spare = self.file.region(("spare", key), rec.nbytes)
            rec.offset, rec.spare = rec.spare, rec.offset
            staged.written = True
        if storage.device.type == "cpu":
            _move(rec, Residence.WRITING, f"swap {key!r}")
            rec.future = self.io.write(self.file, rec.offset, storage_view(storage), then=lambda: storage.resize_(0))
        else:  # the host copy is kept while the write runs: its only copy if the write fails (review 30X)
            host = storage_view(storage).to("cpu")  # before anything changes: a failure here leaves all as it was
            _move(rec, Residence.WRITING, f"swap {key!r}")
            rec.host = host
            storage.resize_(0)
            rec.future = self.io.write(self.file, rec.offset, host, then=lambda: setattr(rec, "host", None))

    def swap_in(self, key: Hashable) -> None:
        """Start reading ``key`` back into its storage (allocated now); `wait` before using it."""
        rec = self._records[key]
        self._touch(key)
        self._settle(rec)
        _move(rec, Residence.READING, f"swap {key!r}")
        if rec.storage.device.type == "cpu":
            rec.storage.resize_(rec.nbytes)
            rec.future = self.io.read(self.file, rec.offset, storage_view(rec.storage))
        else:
            rec.host = torch.empty(rec.nbytes, dtype=torch.uint8)
            rec.future = self.io.read(self.file, rec.offset, rec.host)

    def wait(self, keys: Iterable[Hashable] | None = None) -> None:
        """Finish the transfers of ``keys`` (default: all)."""
        for key in (self._records if keys is None else keys):
            rec = self._records.get(key)
            if rec is not None:
                self._settle(rec)

    def settle_all(self, raise_first: bool = False) -> list[BaseException]:
        """Finish every transfer, collecting the failures (a failed write leaves its storage in memory,
        a failed read leaves it on the drive: `_settle`); with ``raise_first``, raise the first once all
        are settled (`wait` raises at the first, leaving the others to raise at their next use)."""
        failed = []
        for rec in self._records.values():
            try:
                self._settle(rec)
            except BaseException as exc:  # noqa: BLE001 - returned (or raised) below
                failed.append(exc)
        if failed and raise_first:
            raise failed[0]
        return failed

    def holds(self, key: Hashable) -> bool:
        """Whether ``key``'s bytes are in memory now, without settling anything: a write that failed
        left them there (a device storage's get them back from the host copy when settled)."""
        rec = self._records.get(key)
        if rec is None:  # never swapped out (a move that failed before it): its bytes never left
            return True
        f = rec.future
        if rec.state is Residence.WRITING and f is not None and f.done() and f.exception() is not None:
            return True
        return rec.state.in_memory

    def stage(self) -> None:
        """Start a staged step: until `commit` or `rollback`, writes keep the regions read from."""
        assert self._staged is None, "a staged step is already open"
        self.wait()  # raises a failed earlier transfer before anything is staged
        self._staged = {}

    def _touch(self, key: Hashable) -> None:
        if self._staged is not None and key not in self._staged:
            rec = self._records.get(key)
            assert rec is None or rec.state is Residence.DRIVE, f"swap {key!r}: staged while {rec.state.name}"
            self._staged[key] = _Staged(rec)

    def commit(self) -> None:
        """End the staged step: what it wrote is the value of each key (its spare region is the old one).
        The step waited for its writes, so nothing here can fail."""
        self._staged = None

    def rollback(self) -> list[Hashable]:
        """Undo the staged step: every key it touched is on the drive with its value from before (a
        key that did not exist is forgotten). Returns the keys forgotten."""
        staged, self._staged = self._staged or {}, None
        forgotten = []
        for key, what in staged.items():
            rec = self._records[key]
            try:
                self._settle(rec)
            except Exception:  # noqa: BLE001 - the failure being rolled back (or one like it); reported by it
                pass
            rec.storage.resize_(0)
            if what.before is None:
                del self._records[key]
                forgotten.append(key)
                continue
            if what.before is not rec:  # a new storage took the key: the old record is the value
                self._records[key] = rec = what.before
                rec.storage.resize_(0)
            elif what.written:
                rec.offset, rec.spare = rec.spare, rec.offset
            if rec.state is not Residence.DRIVE:
                _move(rec, Residence.DRIVE, f"swap {key!r} (rolled back)")
        return forgotten

    def forget(self, key: Hashable) -> None:
        """``key`` is gone (a checkpoint load replaced the state that had it): free its storage and its
        record, so a later key of that name starts anew (in the same region)."""
        rec = self._records.pop(key, None)
        if rec is not None:
            self._settle(rec)
            rec.storage.resize_(0)

    def drop(self, key: Hashable) -> None:
        """Release ``key``'s storage without writing: the caller did not change it since it was read."""
        rec = self._records[key]
        self._settle(rec)
        if rec.state.in_memory:
            _move(rec, Residence.DRIVE, f"swap {key!r}")
            rec.storage.resize_(0)

    def _settle(self, rec: _Stored) -> None:
        if rec.future is None:
            return
        future, rec.future = rec.future, None
        try:
            future.result()
        except BaseException:
            if rec.state is Residence.WRITING and rec.host is not None:  # a device storage: its bytes back from the host copy
                rec.storage.resize_(rec.nbytes)
                storage_view(rec.storage).copy_(rec.host)
            rec.host = None
            if rec.state is Residence.READING:
                rec.storage.resize_(0)
            _move(rec, residence_of(rec.storage) if rec.state is Residence.WRITING else Residence.DRIVE, "swap")
            raise
        if rec.state is Residence.WRITING:
            rec.host = None
            _move(rec, Residence.DRIVE, "swap")
        elif rec.state is Residence.READING:
            if rec.host is not None:
                rec.storage.resize_(rec.nbytes)
                storage_view(rec.storage).copy_(rec.host)
                rec.host = None
            _move(rec, residence_of(rec.storage), "swap")


# -- parameter shards (read ahead by the coordinator) ---------------------------------------------------
@dataclass(eq=False)
class ShardSwap:
    """An NVMe-tier parameter shard (``ZeroParam.swap``): its region and why it is in memory (where
    its bytes are now is ``ZeroParam.residence``). Its region always holds the current value unless
    it is in memory with ``loads`` (a writer may be changing it; the last `ShardTier.unload` writes
    it back)."""

    file: SwapFile
    offset: int
    nbytes: int
    span: PoolSpan | None = None  # the pool span it was read into (None: its own storage)
    future: Future | None = None
    ahead: bool = False  # read ahead of its gather and not used yet
    loads: int = 0  # open `ShardTier.load` calls
    spare: int | None = None  # its second region, written by a staged step


class ShardTier:
    """Parameter shards on NVMe: written once when placed, read into pool spans for all-gathers
    (ahead of them when the coordinator follows a trace), loaded into their own storage for the
    optimizer step and the rare paths. See [Note: swapping]. The coordinator (through runtime/read_ahead.py)
    calls the gather side (`read`, `wait`, `done`, `drop_ahead`; the optimizer's streamed step also
    waits on its reads); the optimizer and context call `load`, `unload`, `store` and `read_copy`
    between steps, placement and Init `offload`, `keep` and `flush`. Every move of a shard's bytes goes through
    ``shard_store`` (residence.py [Note: shard residence]); this class does the IO and the pool.
    `stage` / `commit` / `rollback` work as `StorageTier`'s: a staged step writes each shard to its
    spare region, so a rollback finds the value from before in the region it was read from."""

    def __init__(self, io: AsyncIO, file: SwapFile, pool: BufferPool, metrics: StepMetrics, store: ShardStore) -> None:
        self.io = io
        self.shard_store = store
        self.file = file
        self.pool = pool
        self.metrics = metrics
        self.shards: dict[int, ZeroParameter] = {}  # ZeroParam.id -> the ZeroParameter, for every shard on the tier
        self._placing: list[tuple[ZeroParameter, int]] = []  # shards being written by `offload`, oldest first
        self._placing_bytes = 0
        self._overflow_warned = False
        self._staged: dict[int, bool] | None = None  # ZeroParam.id -> written, for the shards a staged step touched

    # -- placement -------------------------------------------------------------------------------------
    def offload(self, p: ZeroParameter) -> None:
        """Move ``p``'s shard (in memory) to the drive: write it, then free its memory."""
        z = p._zero
        if z.swap is not None:
            self.shards[z.id] = p  # already there (written by zero3.Init): adopt it
            return
        self.shard_store.own_cpu_storage(p)
        nbytes = z.shard.numel() * z.shard.element_size()
        if aligned_nbytes(nbytes) > self.pool.nbytes:
            raise ZeroConfigError(
                f"the shard of {z.name} ({z.shard_numel} elements, {nbytes} bytes) does not fit in one buffer of the "
                f"parameter pool ({self.pool.nbytes} bytes: offload_param_buffer_size elements of the config dtype); "
                f"set offload_param_buffer_size >= {z.shard_numel}")
        z.swap = ShardSwap(self.file, self.file.region(("shard", z.id), nbytes), nbytes)
        self.shards[z.id] = p
        self._write(p)
        self._behind(p, nbytes)

    def _behind(self, p: ZeroParameter, nbytes: int) -> None:
        """Bound the memory of writes issued without waiting (placement, `store`): past the limit,
        wait for the oldest."""
        self._placing.append((p, nbytes))
        self._placing_bytes += nbytes
        limit = max(self.pool.capacity, 64 << 20)
        while self._placing_bytes > limit:
            q, n = self._placing.pop(0)
            self._placing_bytes -= n
            if q._zero.swap is not None:
                self._settle(q)

    def keep(self, p: ZeroParameter) -> None:
        """Bring ``p``'s shard into its own memory for good (it leaves the tier)."""
        z = p._zero
        if z.swap is None:
            return
        self.load([p])
        z.swap = None
        self.shards.pop(z.id, None)

    def flush(self) -> None:
        """Wait for every write in flight."""
        self._placing.clear()
        self._placing_bytes = 0
        for p in list(self.shards.values()):
            sw = p._zero.swap
            if sw is not None and p._zero.residence is Residence.WRITING:
                self._settle(p)

    def settle_all(self) -> list[BaseException]:
        """Finish every transfer, collecting the failures instead of raising the first (`_settle` leaves
        each shard where its bytes are)."""
        failed = []
        for p in list(self.shards.values()):
            if p._zero.swap is not None:
                try:
                    self._settle(p)
                except BaseException as exc:  # noqa: BLE001 - returned to the caller
                    failed.append(exc)
        return failed

    @property
    def nvme_bytes(self) -> int:
        """Bytes of the shards on this tier (their regions hold them, whatever is also in memory)."""
        return sum(p._zero.swap.nbytes for p in self.shards.values() if p._zero.swap is not None)

    # -- the gather path (coordinator) ---------------------------------------------------------------
    def read(self, params: Sequence[ZeroParameter], *, ahead: bool = False, overflow: bool = False) -> list[ZeroParameter]:
        """Start reading the shards of ``params`` that are only on the drive into pool spans; returns
        those that got no span. ``ahead``: for a later gather (`drop_ahead` may release them);
        ``overflow``: read what does not fit into the shard's own storage instead."""
        missed: list[ZeroParameter] = []
        for p in params:
            sw = p._zero.swap
            if sw is None:
                continue
            if not ahead:
                sw.ahead = False
            if p._zero.residence is Residence.WRITING:
                self._settle(p)
            if p._zero.residence is not Residence.DRIVE:
                continue
            span = self.pool.alloc(sw.nbytes)
            if span is None and not overflow:
                missed.append(p)
                continue
            self._read(p, span)
            sw.ahead = ahead
            if ahead:
                self.metrics.nvme_reads_ahead += 1
            elif span is None:
                self._warn_overflow(p)
        return missed

    def wait(self, params: Sequence[ZeroParameter]) -> None:
        """Wait for the transfers of ``params``' shards: after a read they are readable."""
        t0 = time.perf_counter()
        for p in params:
            if p._zero.swap is not None:
                self._settle(p)
        self.metrics.nvme_wait_seconds += time.perf_counter() - t0

    def done(self, params: Iterable[ZeroParameter]) -> None:
        """The gather of ``params`` is complete: free the memory of their shards (unless loaded)."""
        for p in params:
            sw = p._zero.swap
            if sw is None:
                continue
            sw.ahead = False  # used: no longer a read-ahead `drop_ahead` may take back
            if p._zero.residence.in_memory and not sw.loads:
                self._drop(p)

    def drop_ahead(self, keep: Iterable[ZeroParameter] = ()) -> None:
        """Release every shard read ahead and not used yet (but those of ``keep``)."""
        kept = {q._zero.id for q in keep}
        for p in list(self.shards.values()):
            sw = p._zero.swap
            if sw is not None and sw.ahead and p._zero.id not in kept:
                self._settle(p)
                sw.ahead = False
                if not sw.loads:
                    self._drop(p)

    # -- whole shards in their own memory (optimizer step, rare paths) --------------------------------
    def load(self, params: Sequence[ZeroParameter], wait: bool = True, read: bool = True) -> None:
        """Bring ``params``' shards into their own storage and keep them there until `unload`
        (``wait=False``: the reads are only started; `wait` for them; ``read=False``: the caller
        overwrites the whole shard, so only its memory is allocated)."""
        todo = []
        for p in params:
            sw = p._zero.swap
            if sw is None:
                continue
            self._settle(p)
            sw.loads += 1
            where = p._zero.residence
            if where.in_memory and sw.span is not None:  # read ahead into the pool: move it
                span, sw.span = sw.span, None
                sw.ahead = False
                self.shard_store.copy_out_of_span(p)
                self.pool.free(span)
            elif where is Residence.DRIVE and not read:
                self.shard_store.allocate(p, sw.nbytes)
            elif where is Residence.DRIVE:
                self._read(p, None)
                todo.append(p)
        if wait:
            for p in todo:
                self._settle(p)

    def unload(self, params: Sequence[ZeroParameter], write: bool) -> None:
        """End a `load`: the last one writes the shard back when ``write`` (asynchronously; its
        memory is freed when the write is done), else drops it."""
        for p in params:
            sw = p._zero.swap
            if sw is None:
                continue
            assert sw.loads > 0, f"{p._zero.name}: unload without load"
            sw.loads -= 1
            if sw.loads:
                continue
            if write:
                self._write(p)
                self._behind(p, sw.nbytes)
            else:
                self._drop(p)

    def store(self, p: ZeroParameter, values: torch.Tensor) -> None:
        """Write ``values`` (a full padded shard in the shard's dtype) as ``p``'s shard, without
        reading the old one (the optimizer's cast of the fp32 masters)."""
        sw = p._zero.swap
        assert sw is not None and not sw.loads, f"{p._zero.name}: store needs an unloaded tier shard"
        self._settle(p)
        if p._zero.residence.in_memory:
            sw.ahead = False
            self._drop(p)
        data = uint8_view(values.detach().to("cpu", p._zero.shard.dtype, copy=True))  # the caller may free ``values``
        assert data.numel() == sw.nbytes, f"{p._zero.name}: {data.numel()} bytes stored into a {sw.nbytes}-byte shard"
        self.shard_store.move(p, Residence.WRITING)
        self._keep_region(p)
        sw.future = self.io.write(sw.file, sw.offset, data)
        self._behind(p, sw.nbytes)

    def read_copy(self, p: ZeroParameter) -> torch.Tensor:
        """A new tensor holding ``p``'s shard (read from the drive unless in memory)."""
        sw = p._zero.swap
        if sw is None:
            return p._zero.shard
        self._settle(p)
        if p._zero.residence.in_memory:
            return p._zero.shard.detach().clone()
        out = torch.empty_like(p._zero.shard, device="cpu")
        self.io.read(sw.file, sw.offset, uint8_view(out)).result()
        return out

    # -- a staged step ----------------------------------------------------------------------------------
    def stage(self) -> None:
        """Start a staged step: until `commit` or `rollback`, writes keep the regions read from."""
        assert self._staged is None, "a staged step is already open"
        self.flush()  # raises a failed earlier write before anything is staged
        self._staged = {}

    def _keep_region(self, p: ZeroParameter) -> None:
        """In a staged step, the first write of ``p``'s shard goes to its spare region."""
        if self._staged is None or self._staged.get(p._zero.id):
            return
        sw = p._zero.swap
        if sw.spare is None:  # in the shard's own file: one zero3.Init wrote is not this tier's
            sw.spare = sw.file.region(("spare", "shard", p._zero.id), sw.nbytes)
        sw.offset, sw.spare = sw.spare, sw.offset
        self._staged[p._zero.id] = True

    def commit(self) -> None:
        """End the staged step: what it wrote is each shard's value (the step waited for its writes)."""
        self._staged = None

    def rollback(self) -> None:
        """Undo the staged step: every shard it touched is on the drive with its value from before."""
        staged, self._staged = self._staged or {}, None
        for zid, written in staged.items():
            p = self.shards[zid]
            sw = p._zero.swap
            try:
                self._settle(p)
            except Exception:  # noqa: BLE001 - the failure being rolled back (or one like it); reported by it
                pass
            sw.loads, sw.ahead = 0, False
            if written:
                sw.offset, sw.spare = sw.spare, sw.offset
            if p._zero.residence.in_memory:
                self._free_bytes(p, Residence.DRIVE)
        self._placing = [(q, n) for q, n in self._placing if q._zero.id not in staged]
        self._placing_bytes = sum(n for _, n in self._placing)

    # -- moves ----------------------------------------------------------------------------------------
    def _read(self, p: ZeroParameter, span: PoolSpan | None) -> None:
        sw = p._zero.swap
        shard = p._zero.shard
        if span is not None:
            self.shard_store.point(p, span.data[: sw.nbytes].view(shard.dtype))
            data = span.data[: sw.nbytes]
        else:
            self.shard_store.allocate(p, sw.nbytes, Residence.READING)
            data = uint8_view(shard)
        sw.span = span
        if self._staged is not None:
            self._staged.setdefault(p._zero.id, False)
        sw.future = self.io.read(sw.file, sw.offset, data)

    def _write(self, p: ZeroParameter) -> None:
        sw = p._zero.swap
        assert sw.span is None, f"{p._zero.name}: only a shard in its own storage is written"
        data, release = self.shard_store.begin_write(p)
        self._keep_region(p)
        sw.future = self.io.write(sw.file, sw.offset, data, then=release)

    def _drop(self, p: ZeroParameter) -> None:
        """A clean in-memory shard: forget the bytes (the region holds them)."""
        self._free_bytes(p, Residence.DRIVE)

    def _free_bytes(self, p: ZeroParameter, to: Residence) -> None:
        """Give back the memory of a shard's bytes (its pool span, or its own storage); they are ``to``."""
        sw = p._zero.swap
        span, sw.span = sw.span, None
        if span is not None:
            self.pool.free(span)
        self.shard_store.free(p, to, from_span=span is not None)

    def _settle(self, p: ZeroParameter) -> None:
        sw = p._zero.swap
        if sw.future is None:
            return
        future, sw.future = sw.future, None
        try:
            future.result()
        except BaseException:  # the bytes stay where they were: a failed write in memory, a failed read on the drive
            if p._zero.residence is Residence.READING:
                self._free_bytes(p, Residence.DRIVE)
                sw.ahead = False
            elif p._zero.shard.untyped_storage().nbytes() > 0:
                self.shard_store.move(p)  # a failed write: still in memory
            else:
                self.shard_store.move(p, Residence.DRIVE)  # a failed `store`: lost
            raise
        self.shard_store.move(p, Residence.DRIVE if p._zero.residence is Residence.WRITING else None)

    def _warn_overflow(self, p: ZeroParameter) -> None:
        if not self._overflow_warned:
            self._overflow_warned = True
            logger.warning("zero3: the parameter buffer pool (%d x %d bytes) is full while %s is needed; its shard "
                           "and any others that do not fit are read into their own memory (raise "
                           "offload_param_buffer_count or offload_param_buffer_size to avoid it)",
                           self.pool.count, self.pool.nbytes, p._zero.name)

