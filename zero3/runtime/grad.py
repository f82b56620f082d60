"""Gradient reduction: full gradients in, averaged gradient shards out, in buckets.

A parameter's full gradient arrives once autograd has accumulated it (hooks.py); it is queued in the
current bucket and the bucket's reduction is issued when it holds ``reduce_bucket_size`` elements
(and before a gradient that would take it past that: a reduction takes at most that many elements,
or one larger parameter alone), when a module's backward ends with at least ``boundary_numel`` elements queued, and when the
backward ends, which waits for all of them (asynchronously with ``overlap_comm``, so a reduction
runs while backward goes on; at most one is in flight).

Why the module boundary: DeepSpeed's default bucket (5e8 elements) is larger than most models, so
by bucket size alone every full gradient would be held until backward ends and reduced in one
exposed collective at the end. The boundary is the prefetch bucket as configured at initialize (the
granularity the user chose for gathers; the reduce bucket when that is 0, as under ``memory_budget``,
which sizes the reduce bucket itself), so reductions are as coarse as the gathers and start while the earlier modules'
backward runs (on the 86.7M GPT of bench_step.py, one Block: 140 MiB less peak RSS per rank and
the reduction wait at the end of backward 174 -> 38 ms, docs/performance.md). ``reduce_bucket_size``
stays the most elements one reduction takes. The bucket's gradients are cast to
``reduce_dtype`` and copied into one flat rank-major buffer; the full gradients are dropped as soon as the reduction is
issued (with ``overlap_comm`` while it runs; without, once it completed). Each rank adds its slice
of the average into the gradient of ``ZeroParam.train_tensor``: the fp32 master shard where masters
are separate (mixed precision, or the optimizer offloaded while the shards are not), else the shard. So
micro-batches accumulate into that gradient in its precision.

With ``gradient_accumulation_steps = N > 1`` each micro-batch's reduced slice is divided by N before
it is accumulated (the gradients are scaled, not the loss: docs/mixed_precision.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..comm.communicator import Communicator, GradPiece, Kind, ReduceWork, Tag
from ..comm.works import held_storages
from ..errors import ZeroStateError
from ..partition.param import ZeroParameter, raw_data


class GradientReducer:
    def __init__(self, comm: Communicator, bucket_numel: int, *, reduce_dtype: torch.dtype | None = None,
                 accumulation_steps: int = 1, boundary_numel: int = 0) -> None:
        self.comm = comm
        self.bucket_numel = max(1, bucket_numel)
        self.boundary_numel = boundary_numel if boundary_numel > 0 else self.bucket_numel
        self.reduce_dtype = reduce_dtype
        self.accumulation_steps = accumulation_steps
        self._bucket: list[tuple[ZeroParameter, torch.Tensor | None, bool]] = []
        self._numel = 0
        self._queued_bytes = 0  # the full gradients' storages in the bucket (StepMetrics.reduce_held_bytes)
        self._held_bytes = 0  # the storages the reduction in flight holds (`held_storages`)
        self._in_flight: tuple[ReduceWork, list[tuple[ZeroParameter, int]], int] | None = None
        self.on_landed: Callable[[ZeroParameter], None] | None = None
        """Called after a parameter's reduced gradient is added into its shard's gradient (the
        optimizer step in backward, optim/backward_step.py); None: nobody listens."""
        self.on_sent: Callable[[list[ZeroParameter]], None] | None = None
        """Called when a bucket's reduction is issued, with its parameters: from then on a peer may
        land their reduced gradients and (the step in backward with shared shards) write their shards."""
        self._summed: frozenset[int] = frozenset()
        self._model_parallel: Communicator | None = None
        self.landed = 0
        """Reduced gradients added into the shards since ``engine.step()`` last reset it: whether a backward
        reached a trainable parameter (the same on every rank: a reduction lands on all of them)."""
        self.arrivals: list[int] | None = None
        """When a list (memory_budget, until it chooses): the elements of each gradient piece handed over
        this step, in order (a leaf module's unit as one), the order `choose_split` predicts reductions from."""
        self.held_cap: int | None = None
        """memory_budget's account of one bucket (comm/reduce.py `hold_bytes`), in bytes: a gradient is
        queued beside the reduction in flight only while the two hold at most this, else that reduction
        lands first (None: no cap, the two overlap as the bucket size allows)."""

    def sum_over_model_parallel(self, params: list[ZeroParameter], comm: Communicator) -> None:
        """Megatron's sequence parallelism: ``params`` (marked ``sequence_parallel``: LayerNorms, a
        row-parallel bias) are the same on every tensor-parallel rank, but each rank ran them on its own
        slice of the sequence, so each holds part of their gradient. Each such gradient is summed over
        the model-parallel group (``comm``) before the data-parallel reduction, as Megatron's step
        sums them; the parameters stay equal across that group."""
        self._summed = frozenset(p._zero.id for p in params)
        self._model_parallel = comm if self._summed else None

    def _sum_sequence_parallel(self, p: ZeroParameter, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The sum of ``p``'s gradient over the model-parallel ranks. In a leaf module's unit a rank may
        have none (its tokens took another route): it adds zeros, and a count of the ranks that had one
        goes with the sum, so a parameter none of them used keeps no gradient. The sum is taken in the
        wider of the gradient's dtype and ``reduce_dtype``: bf16 gradients summed in bf16 lost up to 3.9e-3
        relative (probe 28A), and so did fp32 ones under a bf16 ``communication_data_type`` (review 28X)."""
        assert self._model_parallel is not None
        dtype = p._zero.shard.dtype  # in reduce_dtype, never below the gradient's (fp32 with bf16 communication)
        flat = torch.zeros(p._zero.numel + 1, dtype=torch.promote_types(dtype, self.reduce_dtype or dtype),
                           device=raw_data(p).device if grad is None else grad.device)
        if grad is not None:  # a copy: the autograd gradient may be a tensor the user holds
            flat[:-1].copy_(grad.detach().reshape(-1))
            flat[-1] = 1
        self._model_parallel.all_reduce(flat, Tag(Kind.ALL_REDUCE, f"sequence-parallel gradient {p._zero.name}",
                                                  (p._zero.id,)))
        return flat[:-1].view(p._zero.shape) if float(flat[-1]) > 0 else None

    def add(self, p: ZeroParameter, grad: torch.Tensor) -> None:
        if grad.numel() != p._zero.numel or grad.layout is not _STRIDED:
            _refuse_resized(p, grad)
        if self._summed and p._zero.id in self._summed:
            summed = self._sum_sequence_parallel(p, grad)
            assert summed is not None  # this rank has a gradient
            grad = summed
        if self.comm.world_size == 1:  # the average over one rank is the gradient: no bucket, no copy
            self._accumulate(p, grad.reshape(-1))
            return
        grad = _own_storage(grad)
        if self.arrivals is not None:
            self.arrivals.append(p._zero.numel)
        self._make_room(p._zero.numel)
        self._fit(grad.untyped_storage().nbytes())
        self._bucket.append((p, grad, False))
        self._numel += p._zero.numel
        self._queue(grad)
        if self._numel >= self.bucket_numel:
            self.flush()

    def add_unit(self, grads: list[tuple[ZeroParameter, torch.Tensor | None]]) -> None:
        """Reduce several parameters as one unit, whichever of them got a gradient on this rank (a
        leaf module: every rank's bucket holds all of them, in this order). A parameter with no
        gradient on any rank keeps none (a presence count is reduced with the unit)."""
        for p, g in grads:
            if g is not None and (g.numel() != p._zero.numel or g.layout is not _STRIDED):
                _refuse_resized(p, g)
        if self._summed:
            grads = [(p, self._sum_sequence_parallel(p, g) if p._zero.id in self._summed else g) for p, g in grads]
        if self.comm.world_size == 1:
            for p, g in grads:
                if g is not None:
                    self._accumulate(p, g.reshape(-1))
            return
        grads = [(p, g if g is None else _own_storage(g)) for p, g in grads]
        numel = sum(p._zero.numel for p, _ in grads)
        if self.arrivals is not None:
            self.arrivals.append(numel)
        self._make_room(numel)
        self._fit(sum(g.untyped_storage().nbytes() for _, g in grads if g is not None))
        for p, g in grads:
            self._bucket.append((p, g, True))
            self._numel += p._zero.numel
            if g is not None:
                self._queue(g)
        if self._numel >= self.bucket_numel:
            self.flush()

    def _make_room(self, numel: int) -> None:
        """Issue what is queued when ``numel`` more would take the bucket past ``reduce_bucket_size``:
        a reduction takes at most that many elements, or one parameter (a leaf module's unit) that is
        larger by itself. The same on every rank: the gradients arrive in the same order."""
        if self._numel and self._numel + numel > self.bucket_numel:
            self.flush()

    def resize(self, bucket_numel: int, held_cap: int | None) -> None:
        """memory_budget's bucket chosen after the first training step (between steps: nothing queued):
        ``bucket_numel`` elements a reduction, issued at a module's end too once reached, held within
        ``held_cap`` bytes."""
        assert not self._bucket and self._in_flight is None, "the reduce bucket changes between steps only"
        self.bucket_numel = self.boundary_numel = max(1, bucket_numel)
        self.held_cap = held_cap
        self.arrivals = None  # chosen: no longer recorded

    def _fit(self, incoming: int) -> None:
        """Under ``held_cap``: land the reduction in flight when it and the queued gradients, with
        ``incoming`` bytes more, would hold more than the cap. Below it the next bucket fills while
        the last one reduces (landing before every new bucket cost 4% of the small GPT's step:
        docs/performance.md, round 40)."""
        if self.held_cap is not None and self._in_flight is not None and \
                self._held_bytes + self._queued_bytes + incoming > self.held_cap:
            self._land()

    def module_done(self) -> None:
        """A module's backward ended: with the step in backward, land the reduction in flight if
        gradients were queued since it was issued; then issue what is queued if it reaches
        ``boundary_numel``.

        Why land early there: until it lands, a reduction holds its input (the full gradients, or
        their flat copy) and keeps its parameters' sub-groups from stepping, which is what frees
        their gradient shards. A module that produced gradients gave it that module's backward to
        finish in. Without the step in backward it waits for the next issue instead: one bucket of
        compute to hide behind (measured on the 86.7M GPT at batch 1, docs/performance.md: landing
        early everywhere cost 7% of the step for 26 MiB of peak RSS)."""
        if self.on_landed is not None and self._in_flight is not None and self._numel > 0:
            self._land()
        if self._numel >= self.boundary_numel:
            self.flush()

    def finish(self) -> None:
        """Reduce what is queued and wait for every reduction: the gradient shards are complete."""
        self.flush()
        self._land()

    def discard(self) -> None:
        """An aborted step: wait for the reduction in flight (its peers issued it too) without using
        it, and drop the queued gradients."""
        if self._in_flight is not None:
            work, _, _ = self._in_flight
            self._in_flight = None
            self._hold(-self._held_bytes)
            self._held_bytes = 0
            work.wait()
        self._bucket, self._numel = [], 0
        self._hold(-self._queued_bytes)
        self._queued_bytes = 0

    def flush(self) -> None:
        """Issue the reduction of the current bucket (after landing the previous one: at most one
        reduction is in flight, so memory stays at two buckets)."""
        self._land()
        if not self._bucket:
            return
        bucket, self._bucket, self._numel = self._bucket, [], 0
        total = sum(p._zero.shard_numel for p, _, _ in bucket)
        dtype = self.reduce_dtype or bucket[0][0]._zero.shard.dtype
        if dtype is not _FP64 and any(p._zero.shard.dtype is _FP64 for p, _, _ in bucket):
            dtype = _FP64  # an fp64 model's gradients lose nothing on the wire, as with DDP
        pieces = [GradPiece(p._zero.numel, p._zero.shard_numel, g, maybe) for p, g, maybe in bucket]
        params: list[tuple[ZeroParameter, int]] = []
        col = total
        for p, _, maybe in bucket:
            params.append((p, col if maybe else -1))
            col += maybe
        tag = Tag(Kind.GRAD_REDUCE, "gradients", tuple(p._zero.id for p, _ in params))
        work = self.comm.reduce_grads(pieces, dtype, raw_data(bucket[0][0]).device, tag)
        held = held_storages(work)
        at_issue = held_storages([g for _, g, _ in bucket]) | held  # the peak: the queued gradients and
        self._hold(sum(at_issue.values()) - self._queued_bytes)     # the reduction's buffers at once
        del bucket, pieces  # the full gradients go as soon as the reduction no longer needs them
        self._queued_bytes = 0
        self._held_bytes = sum(held.values())  # with what it still reads of them
        self._hold(self._held_bytes - sum(at_issue.values()))
        self._in_flight = (work, params, total)
        if self.on_sent is not None:
            self.on_sent([p for p, _ in params])

    def _land(self) -> None:
        """Wait for the reduction in flight and add each rank's slice into the gradient shards."""
        if self._in_flight is None:
            return
        work, params, _ = self._in_flight
        self._in_flight = None
        self._hold(-self._held_bytes)  # what it held becomes the gradient shards' (or goes) as it lands
        self._held_bytes = 0
        out = work.wait()
        if out.data_ptr() != out.untyped_storage().data_ptr() or out.numel() * out.element_size() != \
                out.untyped_storage().nbytes():
            out = out.clone()  # a slice of the whole rank-major buffer: keep only this rank's part alive
        off = 0
        for p, col in params:
            s = p._zero.shard_numel
            if col < 0 or float(out[col]) != 0:  # col: the presence count of a leaf unit's parameter
                self._accumulate(p, out[off: off + s])
            off += s

    def _queue(self, grad: torch.Tensor) -> None:
        nbytes = grad.untyped_storage().nbytes()
        self._queued_bytes += nbytes
        self._hold(nbytes)

    def _hold(self, nbytes: int) -> None:
        """The reducer's gauge moves by ``nbytes``: queued gradients (``_queued_bytes``) and the reduction
        in flight's buffers."""
        if nbytes:
            self.comm.metrics.add_reduce_held(nbytes)

    def _accumulate(self, p: ZeroParameter, piece: torch.Tensor) -> None:
        """Add ``piece`` (this rank's averaged gradient slice, or at world size 1 the gradient) into
        the gradient of ``p``'s train tensor; the first one of a step is kept without a copy."""
        target = p._zero.train_tensor
        self.landed += 1
        if self.accumulation_steps > 1:  # in the precision the gradient accumulates in
            piece = piece.to(dtype=target.dtype) / self.accumulation_steps
        if target.grad is None:
            same = piece.dtype == target.dtype and piece.device == target.device
            target.grad = piece if same else piece.to(device=target.device, dtype=target.dtype)
        else:
            target.grad.add_(piece.to(device=target.device, dtype=target.dtype))
        if self.on_landed is not None:
            self.on_landed(p)


_STRIDED, _FP64 = torch.strided, torch.float64


def _own_storage(grad: torch.Tensor) -> torch.Tensor:
    """``grad``, or a copy of it where it is a view of a larger storage (a parameter concatenated with
    an activation, weights fused by ``torch.cat``: autograd hands each a slice of one gradient), so the
    bucket holds what it counts and the larger storage may go once autograd drops it (review 39R1: a
    1 KiB gradient kept a 129 KiB storage queued, 2.6x memory_budget)."""
    if grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():
        return grad.clone()
    return grad


def _refuse_resized(p: ZeroParameter, grad: torch.Tensor) -> None:
    """A gradient of another size than the parameter's: its data was replaced by a tensor of another
    shape (``p.data = t``) after ``initialize``. Its shards, optimizer state and buckets have the old
    size, so reducing the gradient would misplace every element after it; refused before any is.
    Or a sparse gradient (``F.embedding(..., sparse=True)`` in a module's own forward; zero3 reduces
    dense shards), refused the same way."""
    if grad.layout is not _STRIDED:
        raise ZeroStateError(
            f"{p._zero.name} got a {grad.layout} gradient (a sparse=True embedding lookup, torch.sparse ops "
            "on the weight): zero3 reduces dense gradient shards. Use dense gradients (sparse=False); this "
            "backward reduced nothing of it")
    raise ZeroStateError(
        f"{p._zero.name} got a gradient of shape {tuple(grad.shape)} (its shape is {tuple(p._zero.shape)}): its "
        f"data was replaced by a tensor of shape {tuple(raw_data(p).shape)} after zero3.initialize, and its shards, "
        "optimizer state and gradient buckets have the old size. Write values of its own shape "
        "(p.data.copy_(t)), or resize before zero3.initialize inside "
        "`with zero3.GatheredParameters([p], modifier_rank=0):`; this backward reduced nothing of it")
