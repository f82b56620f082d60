"""The buffer pool that NVMe parameter shards are read into ahead of their all-gathers (nvme.py
[Note: swapping])."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .swapfile import aligned_empty, aligned_nbytes


@dataclass(eq=False)
class PoolSpan:
    """A piece of a pool buffer: ``data`` is its (aligned, rounded-up) bytes."""

    buffer: int
    data: torch.Tensor


class BufferPool:
    """``count`` reusable buffers of ``nbytes`` each, `ALIGN`-aligned (pinned on request with CUDA)
    and allocated on first use. Spans are packed into the open buffer in the order they are asked
    for; a buffer is refilled from its start once every span in it was freed, so a first-in
    first-out stream of shards (the order of a step's gathers) fills the pool."""

    def __init__(self, count: int, nbytes: int, pin: bool = False) -> None:
        self.count = count
        self.nbytes = aligned_nbytes(nbytes)
        self.pin = pin
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._live = [0] * count  # spans handed out and not freed, per buffer
        self._top = [0] * count  # first free byte, per buffer
        self._open = 0
        self.in_use = 0  # bytes in live spans

    @property
    def capacity(self) -> int:
        return self.count * self.nbytes

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)

    def alloc(self, nbytes: int) -> PoolSpan | None:
        """A span of at least ``nbytes``, or None when no buffer has room for it now."""
        need = aligned_nbytes(nbytes)
        if need > self.nbytes:
            return None
        b = self._open
        if self._live[b] == 0:
            self._top[b] = 0
        if self._top[b] + need > self.nbytes:
            empty = [i for i in range(self.count) if self._live[i] == 0 and i != b]
            if not empty:
                return None
            b = self._open = min(empty, key=lambda i: self._buffers[i] is None)  # reuse allocated buffers first
            self._top[b] = 0
        buf = self._buffers[b]
        if buf is None:
            buf = self._buffers[b] = aligned_empty(self.nbytes, self.pin)
        start = self._top[b]
        self._top[b] = start + need
        self._live[b] += 1
        self.in_use += need
        return PoolSpan(b, buf[start: start + need])

    def free(self, span: PoolSpan) -> None:
        assert self._live[span.buffer] > 0, "pool span freed twice"
        self._live[span.buffer] -= 1
        self.in_use -= span.data.numel()

    def release_memory(self) -> int:
        """Give back the buffers no span uses (they are allocated again when needed); the bytes freed."""
        freed = 0
        for i, b in enumerate(self._buffers):
            if b is not None and self._live[i] == 0:
                freed += b.numel()
                self._buffers[i] = None
        return freed
