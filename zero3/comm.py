"""Collectives over partitioned parameters, returning explicit handles.

[Note: streams and buffer lifetime]
On CUDA with ``overlap_comm``, copy-in, all-gather and copy-out run on one side stream, and an
event recorded there is what the compute stream waits on before the module runs. No
``record_stream``: before the side stream allocates anything it waits for the compute stream
(``side.wait_stream(compute)``), so a block freed by a release on the compute stream is never reused
by the side stream while compute kernels may still read it. Memory is therefore deterministic. On
CPU the collective is issued with ``async_op=True`` and waited in `GatherHandle.wait`, just before use.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .errors import ZeroDivergenceError
from .metrics import StepMetrics
from .param import ZeroParameter, alloc_full, mark_available, raw_data
from .state import ParamStatus

logger = logging.getLogger(__name__)

# torch 2.13 renamed the flat collectives; keep working on the older names (torch >= 2.4).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(eq=False)
class _Chunk:
    params: list[ZeroParameter]
    offsets: list[int]
    total: int  # sum of shard sizes
    out: torch.Tensor | None
    work: Any = None


@dataclass(eq=False)
class GatherHandle:
    """An issued all-gather of some parameters. ``wait()`` is idempotent and makes them AVAILABLE."""

    comm: "Communicator"
    chunks: list[_Chunk]
    event: Any = None
    done: bool = False
    prefetch: bool = False
    params: list[ZeroParameter] = field(default_factory=list)

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
        for p in self.params:
            mark_available(p)
        self.chunks = []
        self.event = None


class Communicator:
    """All-gathers and gradient reductions over one process group (``None``: single process)."""

    def __init__(self, group: Any, *, world_size: int, rank: int, overlap: bool, bucket_numel: int,
                 reduce_impl: str, metrics: StepMetrics, verify: bool | None = None) -> None:
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.overlap = overlap
        self.bucket_numel = max(1, bucket_numel)
        self.metrics = metrics
        backend = dist.get_backend(group) if (world_size > 1 and dist.is_initialized()) else "none"
        if reduce_impl == "auto":
            reduce_impl = "all_reduce" if backend == "gloo" else "reduce_scatter"
        self.reduce_impl = reduce_impl
        # Header checks cost a host round trip; on by default where collectives run on the CPU (gloo).
        self.verify = (backend == "gloo") if verify is None else verify
        # NCCL only moves CUDA tensors; the header then costs a device round trip (hence off by default).
        self._header_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
            else torch.device("cpu")
        self._seq = 0
        self._side_stream: Any = None

    # -- all-gather ------------------------------------------------------------------------------
    def all_gather(self, params: Sequence[ZeroParameter], *, prefetch: bool = False, tag: str = "",
                   count: bool = True) -> GatherHandle:
        """Issue one coalesced all-gather (split at ``allgather_bucket_size``) for ``params``.

        Every param must be NOT_AVAILABLE; they become INFLIGHT until the handle is waited on.
        """
        params = list(params)
        for p in params:
            p._zero.set_status(ParamStatus.INFLIGHT)
        handle = GatherHandle(comm=self, chunks=[], prefetch=prefetch, params=params)
        for p in params:
            p._zero.handle = handle
        numel = sum(p._zero.numel for p in params)
        if count:
            self.metrics.allgather_calls += 1
            self.metrics.allgather_numel += numel
            self.metrics.allgather_bytes += sum(p._zero.nbytes for p in params)
        if not params:
            return handle
        self.agree(f"all-gather for {tag or 'a user request'}", numel)
        device = raw_data(params[0]).device  # where the gathered tensor lives (shards may be on the CPU)
        use_stream = device.type == "cuda" and self.overlap
        if use_stream:
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=device)
            compute = torch.cuda.current_stream(device)
            self._side_stream.wait_stream(compute)
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

    def _chunks(self, params: list[ZeroParameter]) -> list[_Chunk]:
        chunks: list[_Chunk] = []
        cur: list[ZeroParameter] = []
        cur_numel = 0
        for p in params:
            if cur and cur_numel + p._zero.numel > self.bucket_numel:
                chunks.append(self._make_chunk(cur))
                cur, cur_numel = [], 0
            cur.append(p)
            cur_numel += p._zero.numel
        if cur:
            chunks.append(self._make_chunk(cur))
        return chunks

    @staticmethod
    def _make_chunk(params: list[ZeroParameter]) -> _Chunk:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p._zero.shard_numel
        return _Chunk(params=params, offsets=offsets, total=total, out=None)

    def _issue(self, chunk: _Chunk, *, async_op: bool) -> None:
        if self.world_size == 1:
            return
        first = chunk.params[0]._zero.shard
        # Shards may live on the CPU (remote_device) while compute runs elsewhere; gather where the
        # placeholder lives.
        device = raw_data(chunk.params[0]).device
        dtype = first.dtype
        if len(chunk.params) == 1:
            inp = chunk.params[0]._zero.shard.to(device=device, dtype=dtype)
        else:
            inp = torch.cat([p._zero.shard.to(device=device, dtype=dtype) for p in chunk.params])
        chunk.out = torch.empty(self.world_size * chunk.total, dtype=dtype, device=device)
        chunk.work = _all_gather_flat(chunk.out, inp, group=self.group, async_op=async_op)
        if not async_op:
            chunk.work = None

    def _copy_out(self, chunk: _Chunk) -> None:
        """Copy each parameter's columns of the rank-major output into its own storage."""
        for p, off in zip(chunk.params, chunk.offsets):
            z = p._zero
            full = alloc_full(p)
            if self.world_size == 1:
                full.view(-1).copy_(z.shard[: z.numel])
                continue
            assert chunk.out is not None
            cols = chunk.out.view(self.world_size, chunk.total)[:, off: off + z.shard_numel]
            full.view(-1).copy_(cols.reshape(-1)[: z.numel])
        chunk.out = None

    def agree(self, what: str, numel: int) -> None:
        """Check that every rank is about to issue the same collective; raise on all ranks if not.

        Ranks exchange a 3-integer header (sequence number, what the collective is for, its size)
        in one tiny all-gather. Mismatched data collectives would hang or corrupt; mismatched
        headers are seen by every rank at once, so every rank raises the same error.
        """
        if not self.verify or self.world_size == 1:
            return
        self._seq += 1
        mine = torch.tensor([self._seq, zlib.crc32(what.encode()), numel], dtype=torch.int64,
                            device=self._header_device)
        everyone = torch.empty(3 * self.world_size, dtype=torch.int64, device=self._header_device)
        _all_gather_flat(everyone, mine, group=self.group)
        rows = everyone.view(self.world_size, 3).cpu()
        if bool((rows == rows[0]).all()):
            return
        details: list[Any] = [None] * self.world_size
        dist.all_gather_object(details, (self._seq, what, numel), group=self.group)
        lines = "; ".join(f"rank {r}: collective #{s} {w} ({n:,} elements)" for r, (s, w, n) in enumerate(details))
        raise ZeroDivergenceError(
            f"ranks disagree on the next collective ({lines}). zero3 needs every rank to run the same "
            "modules in the same order with the same parameters (SPMD); make skipped branches run on every "
            "rank (e.g. with zero inputs) or mark the differing part so it is gathered as one unit.")

    # -- gradients -------------------------------------------------------------------------------
    def reduce_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """Average ``flat`` (``world * S`` elements, rank-major) over ranks; return this rank's S."""
        return self.start_reduce(flat)()

    def start_reduce(self, flat: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Issue the averaging reduction of ``flat``; the returned function waits for it and gives
        this rank's S elements. With ``overlap`` the collective runs while backward goes on (a gloo
        background thread, or NCCL's stream); ``flat`` stays alive until then."""
        self.metrics.reduce_calls += 1
        self.metrics.reduce_numel += flat.numel()
        s = flat.numel() // self.world_size
        if self.world_size == 1:
            return lambda: flat
        self.agree("gradient reduction", flat.numel())
        if self.reduce_impl == "all_reduce":
            out = flat.view(self.world_size, s)[self.rank]
            work = dist.all_reduce(flat, group=self.group, async_op=self.overlap)
        else:
            out = torch.empty(s, dtype=flat.dtype, device=flat.device)
            work = _reduce_scatter_flat(out, flat, group=self.group, async_op=self.overlap)

        def done() -> torch.Tensor:
            if work is not None:
                t0 = time.perf_counter()
                work.wait()
                self.metrics.wait_seconds += time.perf_counter() - t0
            del flat_ref[:]  # the input buffer may go now
            return out.div_(self.world_size)

        flat_ref = [flat]
        return done

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group)
        return t
