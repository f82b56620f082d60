"""The communicator: every collective zero3 issues goes through one `Communicator`.

Parameter gathers, gradient reductions, broadcasts, all-reduces, gathers to rank 0 and object
exchanges all pass here, so header verification, metrics, profiler labels and test doubles live in
one place, and the torch-version shims exist once. Each call names what it moves with a `Tag` (its
kind, a label for messages, and the parameter ids it carries). No other module of zero3 calls
``torch.distributed`` collectives (tests/unit/test_structure.py reads the source to keep it so).

[Note: streams and buffer lifetime]
On CUDA with ``overlap_comm``, copy-in, all-gather and copy-out run on one side stream, and an
event recorded there is what the compute stream waits on before the module runs. No
``record_stream``: before the side stream allocates anything it waits for the compute stream
(``side.wait_stream(compute)``), so a block freed by a release on the compute stream is never reused
by the side stream while compute kernels may still read it. Memory is therefore deterministic. On
CPU the collective is issued with ``async_op=True`` and waited in `GatherWork.wait`, just before use.
"""

from __future__ import annotations

import enum
import logging
import pickle
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ._safetensors import byte_view
from .errors import ZeroConfigError, ZeroDivergenceError
from .metrics import StepMetrics
from .param import ZeroParameter, alloc_full, raw_data

logger = logging.getLogger(__name__)

# torch 2.13 renamed the flat collectives; keep working on the older names (torch >= 2.4).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_info(group: Any) -> tuple[Any, int, int]:
    """(group, world_size, rank) for a process group, the default group, or no distributed at all."""
    if dist.is_available() and dist.is_initialized():
        g = group if group is not None else dist.group.WORLD
        return g, dist.get_world_size(g), dist.get_rank(g)
    if group is not None:
        raise ZeroConfigError("a process group was given but torch.distributed is not initialized")
    return None, 1, 0


def same_group(a: Any, b: Any) -> bool:
    """Whether two process groups hold the same ranks (None is the default group)."""
    if a is b or not (dist.is_available() and dist.is_initialized()):
        return True
    ga = a if a is not None else dist.group.WORLD
    gb = b if b is not None else dist.group.WORLD
    return dist.get_process_group_ranks(ga) == dist.get_process_group_ranks(gb)


class Kind(enum.Enum):
    """What a collective is for; part of every verification header."""

    PARAM_GATHER = "all-gather"
    GRAD_REDUCE = "gradient reduction"
    ALL_REDUCE = "all-reduce"
    BROADCAST = "broadcast"
    TENSOR_GATHER = "tensor all-gather"
    GATHER_TO_ROOT = "gather to rank 0"
    OBJECTS = "object exchange"


@dataclass(frozen=True, slots=True)
class Tag:
    """What a collective moves: its kind, a label for messages (``pre_forward blocks.3``,
    ``clip_grad_norm_``), and the ids of the parameters it carries."""

    kind: Kind
    label: str = ""
    ids: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"{self.kind.value} for {self.label or 'a user request'}"


@dataclass(eq=False)
class _Chunk:
    params: list[ZeroParameter]
    offsets: list[int]
    total: int  # sum of shard sizes
    out: torch.Tensor | None = None
    work: Any = None


@dataclass(eq=False)
class GatherWork:
    """An issued all-gather of parameter shards. ``wait()`` is idempotent; when it returns, every
    parameter's storage holds its full data (the caller then marks them AVAILABLE)."""

    comm: "Communicator"
    chunks: list[_Chunk] = field(default_factory=list)
    event: Any = None
    done: bool = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        t0 = time.perf_counter()
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        else:
            for chunk in self.chunks:
                if chunk.work is not None:
                    chunk.work.wait()
                self.comm._copy_out(chunk)
        self.comm.metrics.wait_seconds += time.perf_counter() - t0
        self.chunks = []
        self.event = None


@dataclass(eq=False)
class ReduceWork:
    """An issued averaging reduction of a rank-major flat buffer; ``wait()`` returns this rank's
    slice of the average (idempotent)."""

    comm: "Communicator"
    out: torch.Tensor
    work: Any = None
    flat: torch.Tensor | None = None  # the input, kept alive until the collective completed
    result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.result is None:
            if self.work is not None:
                t0 = time.perf_counter()
                self.work.wait()
                self.comm.metrics.wait_seconds += time.perf_counter() - t0
            self.flat = None
            self.result = self.out.div_(self.comm.world_size)
        return self.result


class Communicator:
    """Collectives over one process group (``None`` with world size 1: every call is local).

    Args:
        group, world_size, rank: the group and this rank's place in it (`group_info`).
        overlap: issue parameter gathers and reductions asynchronously (side stream on CUDA).
        bucket_numel: largest number of elements one parameter all-gather moves.
        reduce_impl: ``reduce_scatter``, ``all_reduce`` (then slice) or ``auto`` (all-reduce on gloo).
        metrics: the step counters to update.
        verify: exchange a header before each collective (see `agree`); None: on for gloo.
    """

    def __init__(self, group: Any, *, world_size: int, rank: int, metrics: StepMetrics, overlap: bool = True,
                 bucket_numel: int = 1 << 62, reduce_impl: str = "auto", verify: bool | None = None) -> None:
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.overlap = overlap
        self.bucket_numel = max(1, bucket_numel)
        self.metrics = metrics
        self.backend = dist.get_backend(group) if (world_size > 1 and dist.is_initialized()) else "none"
        if reduce_impl == "auto":
            reduce_impl = "all_reduce" if self.backend == "gloo" else "reduce_scatter"
        self.reduce_impl = reduce_impl
        # Header checks cost a host round trip; on by default where collectives run on the CPU (gloo).
        self.verify = (self.backend == "gloo") if verify is None else verify
        # NCCL moves only CUDA tensors: small tensors (headers, flags) live there.
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")
        self._seq = 0
        self._side_stream: Any = None

    def global_rank(self, group_rank: int) -> int:
        """The default-group rank of ``group_rank`` in this communicator's group."""
        if self.group is None or self.world_size == 1:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- verification ----------------------------------------------------------------------------
    def agree(self, tag: Tag, numel: int) -> None:
        """Check that every rank is about to issue the same collective; raise on all ranks if not.

        Ranks exchange a 4-integer header (sequence number, kind, a hash of the carried parameter
        ids, size) in one tiny all-gather. Mismatched data collectives would hang or corrupt;
        mismatched headers are seen by every rank at once, so every rank raises the same error.
        """
        if not self.verify or self.world_size == 1:
            return
        self._seq += 1
        ids = zlib.crc32(repr(tag.ids).encode()) if tag.ids else 0
        mine = torch.tensor([self._seq, zlib.crc32(tag.kind.value.encode()), ids, numel], dtype=torch.int64,
                            device=self.device)
        everyone = torch.empty(4 * self.world_size, dtype=torch.int64, device=self.device)
        _all_gather_flat(everyone, mine, group=self.group)
        rows = everyone.view(self.world_size, 4).cpu()
        if bool((rows == rows[0]).all()):
            return
        details = self._objects((self._seq, tag.describe(), numel))
        lines = "; ".join(f"rank {r}: collective #{s} {w} ({n:,} elements)" for r, (s, w, n) in enumerate(details))
        raise ZeroDivergenceError(
            f"ranks disagree on the next collective ({lines}). zero3 needs every rank to run the same "
            "modules in the same order with the same parameters (SPMD); make skipped branches run on every "
            "rank (e.g. with zero inputs) or mark the differing part so it is gathered as one unit.")

    # -- parameter all-gather --------------------------------------------------------------------
    def all_gather_params(self, params: Sequence[ZeroParameter], tag: Tag, count: bool = True) -> GatherWork:
        """Issue the all-gather of ``params``' shards into their own storage (split at ``bucket_numel``).

        The caller owns the parameters' status (NOT_AVAILABLE -> INFLIGHT -> AVAILABLE); this only
        moves bytes. Their storage is allocated when the data is copied out. ``count``: add it to
        the step's gather metrics (persistent refreshes are counted apart).
        """
        handle = GatherWork(comm=self)
        if not params:
            return handle
        numel = sum(p._zero.numel for p in params)
        if count:
            m = self.metrics
            m.allgather_calls += 1
            m.allgather_numel += numel
            m.allgather_bytes += sum(p._zero.nbytes for p in params)
        self.agree(tag, numel)
        device = raw_data(params[0]).device  # where the gathered tensor lives (shards may be on the CPU)
        use_stream = device.type == "cuda" and self.overlap
        if use_stream:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=device)
            self._side_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._side_stream):
                for chunk in self._chunks(params):
                    self._issue(chunk, async_op=False)
                    self._copy_out(chunk)
                handle.event = torch.cuda.Event()
                handle.event.record(self._side_stream)
        else:
            async_op = self.overlap and self.world_size > 1
            for chunk in self._chunks(params):
                self._issue(chunk, async_op=async_op)
                handle.chunks.append(chunk)
        return handle

    def _chunks(self, params: Sequence[ZeroParameter]) -> list[_Chunk]:
        chunks: list[_Chunk] = []
        cur: list[ZeroParameter] = []
        cur_numel = 0
        for p in params:
            if cur and cur_numel + p._zero.numel > self.bucket_numel:
                chunks.append(_make_chunk(cur))
                cur, cur_numel = [], 0
            cur.append(p)
            cur_numel += p._zero.numel
        if cur:
            chunks.append(_make_chunk(cur))
        return chunks

    def _issue(self, chunk: _Chunk, *, async_op: bool) -> None:
        if self.world_size == 1:
            return
        first = chunk.params[0]._zero.shard
        device = raw_data(chunk.params[0]).device
        dtype = first.dtype
        if len(chunk.params) == 1:
            inp = first.to(device=device, dtype=dtype)
        else:
            inp = torch.cat([p._zero.shard.to(device=device, dtype=dtype) for p in chunk.params])
        chunk.out = torch.empty(self.world_size * chunk.total, dtype=dtype, device=device)
        with _label("zero3::all_gather"):
            work = _all_gather_flat(chunk.out, inp, group=self.group, async_op=async_op)
        chunk.work = work if async_op else None

    def _copy_out(self, chunk: _Chunk) -> None:
        """Copy each parameter's columns of the rank-major output into its own storage."""
        for p, off in zip(chunk.params, chunk.offsets):
            z = p._zero
            full = alloc_full(p)
            if self.world_size == 1:
                full.copy_(z.shard[: z.numel])
                continue
            assert chunk.out is not None
            cols = chunk.out.view(self.world_size, chunk.total)[:, off: off + z.shard_numel]
            full.copy_(cols.reshape(-1)[: z.numel])
        chunk.out = None

    # -- gradient reduction ----------------------------------------------------------------------
    def reduce(self, flat: torch.Tensor, tag: Tag) -> ReduceWork:
        """Issue the averaging reduction of ``flat`` (``world * S`` elements, rank-major); the
        returned work's ``wait()`` gives this rank's S elements. With ``overlap`` the collective
        runs while backward goes on (a gloo background thread, or NCCL's stream)."""
        self.metrics.reduce_calls += 1
        self.metrics.reduce_numel += flat.numel()
        s = flat.numel() // self.world_size
        if self.world_size == 1:
            return ReduceWork(comm=self, out=flat)
        self.agree(tag, flat.numel())
        with _label("zero3::reduce"):
            if self.reduce_impl == "all_reduce":
                out = flat.view(self.world_size, s)[self.rank]
                work = dist.all_reduce(flat, group=self.group, async_op=self.overlap)
            else:
                out = torch.empty(s, dtype=flat.dtype, device=flat.device)
                work = _reduce_scatter_flat(out, flat, group=self.group, async_op=self.overlap)
        return ReduceWork(comm=self, out=out, work=work, flat=flat)

    # -- small blocking collectives --------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, tag: Tag, op: str = "sum") -> torch.Tensor:
        """Reduce ``t`` in place over the ranks (``op``: ``sum`` or ``max``); returns ``t``."""
        if self.world_size > 1:
            self.agree(tag, t.numel())
            reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            with _label("zero3::all_reduce"):
                dist.all_reduce(t, op=reduce_op, group=self.group)
        return t

    def broadcast(self, t: torch.Tensor, src: int, tag: Tag) -> torch.Tensor:
        """Broadcast ``t`` in place from group rank ``src``; returns ``t``."""
        if self.world_size > 1:
            self.agree(tag, t.numel())
            with _label("zero3::broadcast"):
                dist.broadcast(t, src=self.global_rank(src), group=self.group)
        return t

    def all_gather_tensor(self, t: torch.Tensor, tag: Tag) -> torch.Tensor:
        """Every rank's ``t`` (same size everywhere), stacked: shape ``(world, t.numel())``."""
        flat = t.reshape(-1).contiguous()
        if self.world_size == 1:
            return flat.view(1, -1)
        self.agree(tag, flat.numel())
        out = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        with _label("zero3::all_gather_tensor"):
            _all_gather_flat(out, flat, group=self.group)
        return out.view(self.world_size, -1)

    def gather_to_rank0(self, t: torch.Tensor, tag: Tag) -> torch.Tensor | None:
        """Every rank's ``t`` stacked on group rank 0 (``(world, t.numel())``); None elsewhere."""
        flat = t.reshape(-1).contiguous()
        if self.world_size == 1:
            return flat.view(1, -1)
        self.agree(tag, flat.numel())
        dst = self.global_rank(0)
        with _label("zero3::gather"):
            if self.rank == 0:
                rows = torch.empty(self.world_size, flat.numel(), dtype=flat.dtype, device=flat.device)
                dist.gather(flat, list(rows.unbind(0)), dst=dst, group=self.group)
                return rows
            dist.gather(flat, None, dst=dst, group=self.group)
        return None

    def exchange_objects(self, obj: Any, tag: Tag) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (needs no numpy, unlike torch's object
        collectives)."""
        if self.world_size == 1:
            return [obj]
        self.agree(tag, 0)
        return self._objects(obj)

    def _objects(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=self.device)
        _all_gather_flat(sizes, torch.tensor([len(data)], dtype=torch.int64, device=self.device),
                         group=self.group)
        sizes = sizes.cpu()
        longest = max(1, int(sizes.max()))
        mine = torch.zeros(longest, dtype=torch.uint8)
        byte_view(mine)[: len(data)] = data
        rows = torch.empty(self.world_size * longest, dtype=torch.uint8, device=self.device)
        _all_gather_flat(rows, mine.to(self.device), group=self.group)
        rows = rows.view(self.world_size, longest).cpu()
        return [pickle.loads(bytes(byte_view(rows[r])[: int(sizes[r])])) for r in range(self.world_size)]

    def agree_on_errors(self, payload: Any, error: BaseException | None, tag: Tag) -> list[Any]:
        """All-gather ``payload`` and raise on every rank if any rank had an ``error``.

        Every rank raises the error of the lowest failing rank (its own exception object where that
        is itself), so all of them fail the same way and none waits in a later collective.
        """
        if self.world_size == 1:
            if error is not None:
                raise error
            return [payload]
        described = None if error is None else (type(error).__name__, str(error))
        items = self.exchange_objects((payload, described), tag)
        for r, (_, desc) in enumerate(items):
            if desc is not None:
                if r == self.rank and error is not None:
                    raise error
                raise _rebuild_error(r, *desc)
        return [p for p, _ in items]


def _make_chunk(params: list[ZeroParameter]) -> _Chunk:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p._zero.shard_numel
    return _Chunk(params=params, offsets=offsets, total=total)


def _rebuild_error(rank: int, kind: str, message: str) -> BaseException:
    """Another rank's error, as an exception of the same type where that type is known."""
    import builtins

    from . import errors

    known = getattr(errors, kind, None) or getattr(builtins, kind, None)
    if isinstance(known, type) and issubclass(known, Exception):
        return known(f"{message} [raised on rank {rank}]")
    return RuntimeError(f"rank {rank} failed with {kind}: {message}")


class _label:
    """``torch.profiler.record_function(name)`` when a profiler runs; free otherwise."""

    __slots__ = ("name", "cm")

    def __init__(self, name: str) -> None:
        self.name = name
        self.cm: Any = None

    def __enter__(self) -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            self.cm = torch.profiler.record_function(self.name)
            self.cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.cm is not None:
            self.cm.__exit__(*exc)

