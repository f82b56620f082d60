"""Issued gathers and reductions: what a caller holds until it needs the data, and what ``wait`` does.

Each way a gather can travel is its own small class (`ChunkedGather`, `StreamGather`,
`DirectGather`, `QuantizedGather`, `ReadyGather`), so ``wait`` never guesses its mode from which
fields happen to be set. Every one waits in the same order: verify (verifier.py), wait for the
wire, raise if its slot was void, put the data into the parameters' storage, cut hpZ secondaries;
then it drops the torch works it waited for, so none outlives the process group (exit_release.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, is_dataclass
from types import FunctionType
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..errors import ZeroStateError
from ..metrics import StepMetrics
from ..partition.param import ZeroParameter, alloc_full
from .failure import FailureMonitor
from .streams import wait_on_compute
from .tags import Tag
from .verifier import UnverifiedCollective, Verifier

if TYPE_CHECKING:
    from .codec import QuantizedCodec
    from .secondary import Secondary, SecondaryCutter


@dataclass(frozen=True, slots=True)
class WaitContext:
    """What a work needs when it is waited for: its communicator's verifier, failure monitor and metrics."""

    verifier: Verifier
    monitor: FailureMonitor
    metrics: StepMetrics


def copy_from_shards(params: Sequence[ZeroParameter]) -> None:
    """World size 1: each parameter's full data is its shard (no padding to cut), copied into its own
    storage in one batched copy, not one dispatch per parameter; no bucket buffer is needed."""
    torch._foreach_copy_([alloc_full(p) for p in params],
                         [p._zero.shard if p._zero.shard_numel == p._zero.numel else p._zero.shard[: p._zero.numel]
                          for p in params])


@dataclass(eq=False)
class GatherChunk:
    """One all-gather of a bucket of parameters: every rank's row holds its shards, then header room.
    ``span``: primary shards per piece (hpZ secondary slices: N consecutive shards, see sharding.py)."""

    params: list[ZeroParameter]
    offsets: list[int]
    total: int  # sum of piece sizes
    rows: list[torch.Tensor] | None = None  # every rank's piece (its shards, then header room), by rank
    work: Any = None
    span: int = 1

    @classmethod
    def of(cls, params: list[ZeroParameter], span: int = 1) -> GatherChunk:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += span * p._zero.shard_numel
        return cls(params=params, offsets=offsets, total=total, span=span)

    def copy_out(self, world_size: int, keep_header: bool = False) -> None:
        """Copy each parameter's piece of every rank's row into its own storage (one copy each)."""
        assert self.rows is not None and world_size > 1, "world size 1 copies from the shards (copy_from_shards)"
        for p, off in zip(self.params, self.offsets):
            z = p._zero
            full = alloc_full(p)
            s, n = self.span * z.shard_numel, z.numel
            for r, row in enumerate(self.rows):
                lo = r * s
                if lo >= n:
                    break
                hi = min(lo + s, n)
                full[lo:hi].copy_(row[off: off + hi - lo])
        # The headers are copied out of the rows: views would keep the whole gather buffer (world x
        # bucket) alive until the work is waited, beyond what the live budget counts.
        self.rows = [row[self.total:].clone() for row in self.rows] if keep_header else None


@dataclass(eq=False)
class GatherWork:
    """An issued all-gather of parameter shards. ``wait()`` is idempotent; when it returns, every
    parameter's storage holds its full, verified data (the caller then marks them AVAILABLE), and
    with a ``cutter`` (hpZ) ``secondaries`` holds each parameter's secondary slice."""

    ctx: WaitContext
    params: Sequence[ZeroParameter] = ()
    tag: Tag | None = None
    slot: UnverifiedCollective | None = None
    cutter: SecondaryCutter | None = None
    secondaries: dict[int, Secondary] = field(default_factory=dict)  # param record id -> its secondary slice
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        ctx = self.ctx
        t0 = time.perf_counter()
        if self.slot is not None:
            ctx.verifier.verify_through(self.slot)
        self._arrive(ctx)
        if self.slot is not None and self.slot.void:  # issued where another rank left the plan
            assert self.tag is not None
            ctx.verifier.voided(self.tag, self.slot.sizes)
        self.slot = None
        self._finish()
        if self.cutter is not None:
            self.secondaries = self._cut(self.cutter)
        ctx.metrics.wait_seconds += time.perf_counter() - t0
        self._release()

    def _arrive(self, ctx: WaitContext) -> None:
        """Wait for the wire."""

    def _finish(self) -> None:
        """Put what arrived into the parameters' storage."""

    def _cut(self, cutter: SecondaryCutter) -> dict[int, Secondary]:
        return cutter.from_storage(self.params)

    def _release(self) -> None:
        """Drop the buffers the data came in."""


class ReadyGather(GatherWork):
    """Nothing to wait for: no parameters, a world-size-1 copy or a shared-memory read, done when issued."""


@dataclass(eq=False)
class ChunkedGather(GatherWork):
    """All-gathers of buckets into rows, copied out into storage on wait."""

    chunks: list[GatherChunk] = field(default_factory=list)
    world_size: int = 1

    def _arrive(self, ctx: WaitContext) -> None:
        for chunk in self.chunks:
            if chunk.work is not None:
                ctx.monitor.wait(chunk.work, self.tag)

    def _finish(self) -> None:
        for chunk in self.chunks:
            chunk.copy_out(self.world_size)

    def _release(self) -> None:
        self.chunks = []


@dataclass(eq=False)
class StreamGather(GatherWork):
    """Gathered and copied out on the CUDA side stream; the compute stream waits for its event
    ([Note: streams and buffer lifetime] in streams.py)."""

    event: Any = None

    def _arrive(self, ctx: WaitContext) -> None:
        wait_on_compute(self.event)

    def _release(self) -> None:
        self.event = None


@dataclass(eq=False)
class DirectGather(GatherWork):
    """Pairwise messages received straight into the parameters' storage."""

    work: Any = None

    def _arrive(self, ctx: WaitContext) -> None:
        ctx.monitor.wait(self.work, self.tag)

    def _release(self) -> None:
        self.work = None


@dataclass(eq=False)
class QuantizedGather(DirectGather):
    """qwZ rows (every rank's quantized pieces), dequantized into storage on wait. ``span``: primary
    shards per row piece (N for an hpZ secondary gather, else 1)."""

    rows: list[torch.Tensor] | None = None
    layout: list[tuple[int, int, int]] = field(default_factory=list)
    codec: QuantizedCodec | None = None
    span: int = 1

    def _finish(self) -> None:
        assert self.codec is not None and self.rows is not None
        self.codec.decode_rows(self.params, self.rows, self.layout, self.span)

    def _cut(self, cutter: SecondaryCutter) -> dict[int, Secondary]:
        assert self.rows is not None
        return cutter.from_rows(self.params, self.rows, self.layout)

    def _release(self) -> None:
        self.rows = None
        self.work = None


@dataclass(eq=False)
class ReduceWork:
    """An issued averaging reduction; ``wait()`` returns this rank's ``shard_numel`` elements (idempotent)."""

    ctx: WaitContext
    world_size: int
    out: torch.Tensor
    shard_numel: int
    keep: Any = None  # the input, alive until the reduction is done
    tag: Tag | None = None
    work: Any = None
    slot: UnverifiedCollective | None = None
    result: torch.Tensor | None = None
    failed: bool = False

    def wait(self) -> torch.Tensor:
        if self.result is None:
            if self.failed:
                raise ZeroStateError(f"{self.tag.describe() if self.tag else 'a reduction'} failed earlier "
                                     "(see the first error)")
            self.failed = True  # until it succeeds: a failed wait issues nothing the second time
            ctx = self.ctx
            t0 = time.perf_counter()
            if self.slot is not None:
                ctx.verifier.verify_through(self.slot)
            elif self.work is not None:
                ctx.monitor.wait(self.work, self.tag)
            if self.slot is not None and self.slot.void:
                assert self.tag is not None
                ctx.verifier.voided(self.tag, self.slot.sizes)
            ctx.metrics.reduce_wait_seconds += time.perf_counter() - t0
            self.result = self.out[: self.shard_numel].div_(self.world_size)
            self.keep = self.work = self.slot = None  # the input may go now; no finished work is held (exit_release.py)
            self.failed = False
        return self.result


def held_storages(*roots: Any) -> dict[int, int]:
    """The storages (data pointer -> bytes) of the tensors ``roots`` hold: through lists, tuples,
    dicts, the fields of the works and buffers a reduction is made of, and the closures a pairwise
    work runs when it lands (its ``then``). Nothing else is followed (a transport, a codec, a process
    group's opaque work: whatever tensor those hold, a followed field holds too). A view of a counted
    storage adds nothing. The gradient reducer's gauge (StepMetrics.reduce_held_bytes) is built on it."""
    found: dict[int, int] = {}
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
            continue
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, FunctionType):
            todo.extend(c.cell_contents for c in x.__closure__ or () if _filled(c))
        elif type(x).__name__ in _HOLDERS:  # a dataclass with slots has no vars()
            todo.extend([getattr(x, f.name) for f in fields(x)] if is_dataclass(x) else vars(x).values())
    return found


_HOLDERS = frozenset({"ReduceWork", "PairwiseWork", "ReduceBuffer", "GradPiece"})
"""The objects of a reduction whose fields `held_storages` follows (by name: they live in modules that
import this one)."""


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return False
    return True
