"""Gradient reduction: full gradients in, averaged gradient shards out, in buckets.

A parameter's full gradient arrives once autograd has accumulated it (hooks.py); it is queued in the
current bucket and the bucket is reduced when it holds ``reduce_bucket_size`` elements or when the
backward ends. Each rank adds its slice of the average into ``shard.grad``, so micro-batches
accumulate into the shard and the full gradient is freed right after its reduction.
"""

from __future__ import annotations

import torch

from .comm import Communicator
from .param import ZeroParameter


class GradientReducer:
    def __init__(self, comm: Communicator, bucket_numel: int) -> None:
        self.comm = comm
        self.bucket_numel = max(1, bucket_numel)
        self._bucket: list[tuple[ZeroParameter, torch.Tensor]] = []
        self._numel = 0

    @property
    def pending(self) -> int:
        return len(self._bucket)

    def add(self, p: ZeroParameter, grad: torch.Tensor) -> None:
        self._bucket.append((p, grad))
        self._numel += p._zero.numel
        if self._numel >= self.bucket_numel:
            self.flush()

    def flush(self) -> None:
        if not self._bucket:
            return
        bucket, self._bucket, self._numel = self._bucket, [], 0
        world = self.comm.world_size
        total = sum(p._zero.shard_numel for p, _ in bucket)
        g0 = bucket[0][1]
        dtype = bucket[0][0]._zero.shard.dtype
        flat = torch.zeros(world, total, dtype=dtype, device=g0.device)
        off = 0
        for p, g in bucket:
            z = p._zero
            s = z.shard_numel
            src = g.reshape(-1).to(dtype)
            if z.numel == s * world:
                flat[:, off: off + s].copy_(src.view(world, s))
            else:
                padded = torch.zeros(s * world, dtype=dtype, device=g.device)
                padded[: z.numel].copy_(src)
                flat[:, off: off + s].copy_(padded.view(world, s))
            off += s
        out = self.comm.reduce_flat(flat.view(-1))
        off = 0
        for p, _ in bucket:
            z = p._zero
            s = z.shard_numel
            piece = out[off: off + s].to(device=z.shard.device, dtype=z.shard.dtype)
            if z.shard.grad is None:
                z.shard.grad = piece.clone()
            else:
                z.shard.grad.add_(piece)
            off += s
