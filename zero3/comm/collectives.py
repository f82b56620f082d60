"""The small collectives: all-reduce, step agreement, broadcast, tensor all-gather, gather to rank 0
and object exchange. Each is verified like the others (verifier.py): the all-reduce carries its
header in extra elements, the rest start with the blocking header exchange. Each counts the bytes
it receives where it issues its collective."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .tags import Kind, Tag
from .verifier import Verifier
from .verify import PayloadHeader, RequestShape, header_values, headers_from_values
from .wire import HEADER_VALUES, Wire, all_gather_flat, label

DIGEST = 4
"""Values in a digest (`SmallCollectives.all_gather_digest`)."""


class SmallCollectives:
    """One communicator's small collectives (world size 1: local, nothing on the wire)."""

    def __init__(self, wire: Wire, verifier: Verifier, verify: bool) -> None:
        self.wire = wire
        self.verifier = verifier
        self.verify = verify

    def all_reduce(self, t: torch.Tensor, tag: Tag, op: str = "sum") -> torch.Tensor:
        """Reduce ``t`` in place over the ranks (``op``: ``sum`` or ``max``); returns ``t``."""
        wire = self.wire
        w = wire.world_size
        if w == 1:
            return t
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        h = HEADER_VALUES * w if self.verify else 0
        n = t.numel()
        shape = RequestShape(Kind.ALL_REDUCE.value, (n + h,), str(t.dtype), False)
        header = self.verifier.planned(tag, shape)
        payload = torch.zeros(n + h, dtype=t.dtype, device=self._wire_device(t))
        payload[:n].copy_(t.reshape(-1))
        if header is not None:
            payload[n:].view(w, HEADER_VALUES)[wire.rank].copy_(header_values(header, t.dtype, payload.device))
        with label("zero3::all_reduce"):
            work = self._all_reduce(payload, reduce_op, tag, h)
        if header is not None:
            slot = self.verifier.register(shape, [work],
                                          lambda: headers_from_values(payload[n:].view(w, HEADER_VALUES)))
            self.verifier.verify_through(slot)
            if slot.void:
                self.verifier.voided(tag, shape.sizes)
        else:
            wire.monitor.wait(work, tag)
        t.copy_(payload[:n].view_as(t))
        return t

    def dummy_all_reduce(self, shape: RequestShape, header: PayloadHeader, tag: Tag) -> list[Any]:
        """A void stand-in for a planned all-reduce: one flat all-reduce of zeros of the planned size."""
        dtype = getattr(torch, shape.dtype.removeprefix("torch."), torch.uint8)
        flat = torch.zeros(shape.sizes[0], dtype=dtype, device=self.wire.device)
        return [self._all_reduce(flat, dist.ReduceOp.SUM, tag, HEADER_VALUES * self.wire.world_size)]

    def _all_reduce(self, flat: torch.Tensor, op: Any, tag: Tag, h: int) -> Any:
        """Issue the all-reduce of ``flat`` (its last ``h`` elements headers); count what arrives."""
        wire = self.wire
        work = wire.monitor.blocking(lambda: dist.all_reduce(flat, op=op, group=wire.group, async_op=True), tag)
        wire.counter.peers(Kind.ALL_REDUCE, (flat.numel() - h) * flat.element_size(), h * flat.element_size())
        return work

    def agree(self, tag: Tag) -> None:
        """Every rank reached this point and every collective before it was verified (a blocking
        header exchange). The engine calls it before the optimizer changes any shard."""
        if not self.verify:
            return
        self.verifier.route(tag, RequestShape(Kind.AGREE.value, (0,), "int64", True))

    def broadcast(self, t: torch.Tensor, src: int, tag: Tag) -> torch.Tensor:
        """Broadcast ``t`` in place from group rank ``src``; returns ``t``."""
        wire = self.wire
        if wire.world_size > 1:
            self._header_first(tag, t)
            x = t.to(self._wire_device(t))
            with label("zero3::broadcast"):
                wire.monitor.blocking(lambda: dist.broadcast(x, src=wire.global_rank(src), group=wire.group), tag)
            if x is not t:
                t.copy_(x)
            if wire.rank != src:
                wire.counter.count(Kind.BROADCAST, src, t.numel() * t.element_size(), False)
        return t

    def all_gather_tensor(self, t: torch.Tensor, tag: Tag) -> torch.Tensor:
        """Every rank's ``t`` (same size everywhere), stacked: shape ``(world, t.numel())``."""
        wire = self.wire
        flat = t.reshape(-1).contiguous()
        if wire.world_size == 1:
            return flat.view(1, -1)
        self._header_first(tag, flat)
        flat = flat.to(self._wire_device(flat))
        out = torch.empty(wire.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        with label("zero3::all_gather_tensor"):
            wire.monitor.blocking(lambda: all_gather_flat(out, flat, group=wire.group), tag)
        wire.counter.peers(Kind.TENSOR_GATHER, flat.numel() * flat.element_size())
        return out.view(wire.world_size, -1)

    def all_gather_digest(self, t: torch.Tensor, tag: Tag) -> torch.Tensor:
        """`Communicator.all_gather_digest`: ``t`` must hold exactly `DIGEST` int64 values."""
        wire = self.wire
        if t.numel() != DIGEST or t.dtype != torch.int64:
            raise ValueError(f"a digest is {DIGEST} int64 values, got {t.numel()} {t.dtype}")
        flat = t.reshape(-1).contiguous()
        if wire.world_size == 1:
            return flat.view(1, -1)
        flat = flat.to(self._wire_device(flat))
        out = torch.empty(wire.world_size * DIGEST, dtype=torch.int64, device=flat.device)
        wire.monitor.blocking(lambda: all_gather_flat(out, flat, group=wire.group), tag)
        wire.counter.peers(Kind.TENSOR_GATHER, DIGEST * 8)
        return out.view(wire.world_size, -1)

    def gather_to_rank0(self, t: torch.Tensor, tag: Tag) -> torch.Tensor | None:
        """Every rank's ``t`` stacked on group rank 0 (``(world, t.numel())``); None elsewhere."""
        wire = self.wire
        flat = t.reshape(-1).contiguous()
        if wire.world_size == 1:
            return flat.view(1, -1)
        self._header_first(tag, flat)
        flat = flat.to(self._wire_device(flat))
        dst = wire.global_rank(0)
        with label("zero3::gather"):
            if flat.device.type == "cpu":
                return self._gather_pairwise(flat, tag)
            if wire.rank == 0:
                rows = torch.empty(wire.world_size, flat.numel(), dtype=flat.dtype, device=flat.device)
                wire.monitor.blocking(lambda: dist.gather(flat, list(rows.unbind(0)), dst=dst, group=wire.group), tag)
                wire.counter.peers(Kind.GATHER_TO_ROOT, flat.numel() * flat.element_size())
                return rows
            wire.monitor.blocking(lambda: dist.gather(flat, None, dst=dst, group=wire.group), tag)
        return None

    def _gather_pairwise(self, flat: torch.Tensor, tag: Tag) -> torch.Tensor | None:
        """`gather_to_rank0` as one message from each rank, received straight into its row. gloo's
        ``gather`` receives into a temporary buffer of every row and then copies, so rank 0 held
        the gathered tensor twice (a consolidated save held two copies of its largest tensor)."""
        wire = self.wire
        t = wire.next_tag()
        if wire.rank != 0:
            wire.monitor.wait(wire.send_recv([wire.p2p(dist.isend, flat, 0, t)], tag), tag)
            return None
        rows = torch.empty(wire.world_size, flat.numel(), dtype=flat.dtype, device=flat.device)
        rows[0].copy_(flat)
        wire.monitor.wait(wire.send_recv([wire.p2p(dist.irecv, rows[q], q, t) for q in range(1, wire.world_size)],
                                         tag), tag)
        wire.counter.peers(Kind.GATHER_TO_ROOT, flat.numel() * flat.element_size(), pairwise=True)
        return rows

    def exchange_objects(self, obj: Any, tag: Tag) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (needs no numpy, unlike torch's object
        collectives)."""
        if self.wire.world_size == 1:
            return [obj]
        self._header_first(tag, torch.empty(0))
        return self.wire.objects(obj, Kind.OBJECTS)

    def _wire_device(self, t: torch.Tensor) -> torch.device:
        """Where ``t`` must be for this group's backend: NCCL moves only CUDA tensors, so a CPU one (an
        offloaded master or shard, a norm of CPU gradients, a CPU-built weight) goes to the wire's
        device; gloo takes tensors where they are. Results stay there: callers move them on."""
        d = self.wire.device
        return d if d.type != "cpu" and t.device != d and t.device.type != "meta" else t.device

    def _header_first(self, tag: Tag, t: torch.Tensor) -> None:
        """Route a request whose first wire collective is the blocking header exchange."""
        self.verifier.route(tag, RequestShape(tag.kind.value, (t.numel(),), str(t.dtype), True))
