"""Gradient reduction: full gradients in, averaged gradient shards out, in buckets.

A parameter's full gradient arrives once autograd has accumulated it (hooks.py); it is queued in the
current bucket and the bucket's reduction is issued when it holds ``reduce_bucket_size`` elements
(asynchronously with ``overlap_comm``, so it runs while backward goes on; at most one is in flight)
and when the backward ends, which waits for all of them. The bucket's gradients are cast to
``reduce_dtype`` and copied into one flat rank-major buffer; the full gradients are dropped right
then, before the collective runs. Each rank adds its slice of the average into the gradient of
``ZeroParam.train_tensor``: the fp32 master shard under mixed precision, else the shard itself. So
micro-batches accumulate into that gradient in its precision.

With ``gradient_accumulation_steps = N > 1`` each micro-batch's reduced slice is divided by N before
it is accumulated (the gradients are scaled, not the loss: docs/mixed_precision.md).
"""

from __future__ import annotations

import torch

from .comm import Communicator, Kind, ReduceWork, Tag
from .param import ZeroParameter


class GradientReducer:
    def __init__(self, comm: Communicator, bucket_numel: int, *, reduce_dtype: torch.dtype | None = None,
                 accumulation_steps: int = 1) -> None:
        self.comm = comm
        self.bucket_numel = max(1, bucket_numel)
        self.reduce_dtype = reduce_dtype
        self.accumulation_steps = accumulation_steps
        self._bucket: list[tuple[ZeroParameter, torch.Tensor]] = []
        self._numel = 0
        self._in_flight: tuple[ReduceWork, list[ZeroParameter]] | None = None

    def add(self, p: ZeroParameter, grad: torch.Tensor) -> None:
        self._bucket.append((p, grad))
        self._numel += p._zero.numel
        if self._numel >= self.bucket_numel:
            self.flush()

    def finish(self) -> None:
        """Reduce what is queued and wait for every reduction: the gradient shards are complete."""
        self.flush()
        self._land()

    def discard(self) -> None:
        """An aborted step: wait for the reduction in flight (its peers issued it too) without using
        it, and drop the queued gradients."""
        if self._in_flight is not None:
            work, _ = self._in_flight
            self._in_flight = None
            work.wait()
        self._bucket, self._numel = [], 0

    def flush(self) -> None:
        """Issue the reduction of the current bucket (after landing the previous one: at most one
        reduction is in flight, so memory stays at two buckets)."""
        self._land()
        if not self._bucket:
            return
        bucket, self._bucket, self._numel = self._bucket, [], 0
        world = self.comm.world_size
        total = sum(p._zero.shard_numel for p, _ in bucket)
        g0 = bucket[0][1]
        dtype = self.reduce_dtype or bucket[0][0]._zero.shard.dtype
        flat = torch.zeros(world, total, dtype=dtype, device=g0.device)
        off = 0
        params = []
        for p, g in bucket:
            z = p._zero
            s = z.shard_numel
            src = g.reshape(-1)
            if z.numel == s * world:
                flat[:, off: off + s].copy_(src.view(world, s))
            else:
                padded = torch.zeros(s * world, dtype=dtype, device=g.device)
                padded[: z.numel].copy_(src)
                flat[:, off: off + s].copy_(padded.view(world, s))
            off += s
            params.append(p)
        del bucket, g0, g, src  # the full gradients are freed here, before the collective
        tag = Tag(Kind.GRAD_REDUCE, "gradients", tuple(p._zero.id for p in params))
        self._in_flight = (self.comm.reduce(flat.view(-1), tag), params)

    def _land(self) -> None:
        """Wait for the reduction in flight and add each rank's slice into the gradient shards."""
        if self._in_flight is None:
            return
        work, params = self._in_flight
        self._in_flight = None
        out = work.wait()
        off = 0
        for p in params:
            s = p._zero.shard_numel
            target = p._zero.train_tensor
            piece = out[off: off + s]
            if self.accumulation_steps > 1:  # in the precision the gradient accumulates in
                piece = piece.to(dtype=target.dtype) / self.accumulation_steps
            if target.grad is None:
                target.grad = piece.to(device=target.device, dtype=target.dtype, copy=True)
            else:
                target.grad.add_(piece.to(device=target.device, dtype=target.dtype))
            off += s
