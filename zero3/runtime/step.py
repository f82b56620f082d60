"""The lifecycle of a step: its phase (`StepPhase`), and the one end and the one abort of it.

A step begins with the first forward (or backward) the hooks see. Whoever ends it (the end of the
backward, an inference forward returning (not the first inside a training step, which joins it:
hooks.py [Note: a no_grad forward inside a step]), ``engine.step()``, an exception in forward or backward,
the hooks being removed in the middle of it) ends it through `StepLifecycle`, which does every part
in one order: the hooks forget their open calls (and, at the end of a backward, reduce the leaf
modules' gradients); the gradient reducer finishes (or, aborted, drops what is queued); the
coordinator releases everything (but what generation mode keeps gathered) and keeps the step's trace (aborted: drops it); the phase is IDLE.
An inference forward is a whole epoch of the data-parallel communicators and ends it (a resident
decode forward in generation mode, which communicates nothing, is no step: hooks.py [Note:
resident decode forwards]); an aborted
step abandons the epoch of every communicator, the model-parallel one included, and tells the other
ranks why. ``engine.step()`` ends the epochs of a training step (`end_epochs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum, auto

import torch

from ..comm.communicator import Communicator
from ..errors import ZeroError, ZeroStateError
from ..offload.residence import ShardStore
from ..partition.param import guard_pending_grads, unguard_pending_grads
from .context import RuntimeContext


class StepPhase(Enum):
    """Where the model is in a training step, as the hooks see it (hooks.py).

    - IDLE: between steps. Only persistent parameters, those held by ``GatheredParameters`` and, in
      generation mode, what it keeps gathered between forwards are gathered; no module visit is open and no gradient is pending.
    - FORWARD: at least one forward ran since the step began (several may run before a backward);
      gathered parameters are those of running modules, prefetches and reuse keeps.
    - BACKWARD: a backward is running (forwards may run inside it: activation-checkpoint recompute);
      gradients are being reduced into shards.
    A step returns to IDLE when its backward ends, when an inference forward (no grad) returns (the
    first one between a training forward and its backward joins that step instead), when
    ``engine.step()`` runs, or when it is aborted (an exception in forward or backward, or the hooks
    removed).
    """

    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


_PHASES = {
    (StepPhase.IDLE, StepPhase.FORWARD),
    (StepPhase.IDLE, StepPhase.BACKWARD),  # a backward through a graph built before the step began
    (StepPhase.FORWARD, StepPhase.BACKWARD),
    (StepPhase.FORWARD, StepPhase.IDLE),
    (StepPhase.BACKWARD, StepPhase.IDLE),
}


def check_phase(old: StepPhase, new: StepPhase) -> None:
    if old is not new and (old, new) not in _PHASES:
        raise ZeroStateError(f"illegal step phase change {old.name} -> {new.name}")


def close_window(comm: Communicator, store: ShardStore, aborted: bool) -> None:
    """Close the step's shared-memory window (comm/shared.py [Note: shared shards]). When a peer may
    still be reading this rank's arena (the step aborted with the window open, or the closing
    barrier failed because a peer aborted), the rank's shards first move into memory of their own
    and sharing turns off, so nothing this rank writes later lands where a peer reads."""
    left_open = False
    try:
        left_open = comm.step_ended(aborted)
    except BaseException:
        left_open = True
        raise
    finally:
        if left_open and comm.shared is not None:
            comm.shared.evacuate(store.own_memory)


class StepLifecycle:
    """The phase of the running step, and its one end (`end`) and one abort (`abort`)."""

    def __init__(self, ctx: RuntimeContext, close_calls: Callable[[bool, StepPhase], None]) -> None:
        """``close_calls(aborted, phase)``: the hooks' part of an end, run first."""
        assert ctx.reducer is not None, "a step lifecycle needs a context with a gradient reducer"
        self.ctx = ctx
        self.phase = StepPhase.IDLE
        self._close_calls = close_calls
        self._backward_t0 = 0.0  # when the running backward began
        self._waits_at_begin = (0.0, 0.0)  # the gather and reduction waits counted when the running step began
        self._aborted = False  # the last step was aborted and no other began since
        self.guard_grads()  # from initialize on, as between steps

    def enter(self, phase: StepPhase) -> None:
        """Move to ``phase`` (checked against the table of legal changes); times the backward. A
        forward that begins a step first gathers again the persistent copies a local setter left
        stale (`RuntimeContext.refresh_stale_persistent`)."""
        if phase is not self.phase:
            check_phase(self.phase, phase)
            if self.phase is StepPhase.IDLE:
                if phase is StepPhase.FORWARD:  # before it begins: a divergence there leaves nothing begun
                    self.ctx.refresh_stale_persistent()
                self._aborted = False  # a new step begins
                self._waits_at_begin = (self.ctx.metrics.wait_seconds, self.ctx.metrics.reduce_wait_seconds)
                if self.ctx.reducer is not None and self.ctx.reducer.arrivals is not None:
                    self.ctx.reducer.arrivals.clear()  # this step's gradient pieces only
                self.ctx.comm.step_began()
                if self.ctx.guarded_grads:  # guarded between steps (here and by GatheredParameters)
                    unguard_pending_grads(self.ctx.guarded_grads.values())
                    self.ctx.guarded_grads = {}
            if phase is StepPhase.BACKWARD:
                self._backward_t0 = time.perf_counter()
            elif self.phase is StepPhase.BACKWARD:
                self.ctx.metrics.backward_seconds += time.perf_counter() - self._backward_t0
            self.phase = phase
            self.ctx.step_open = phase is not StepPhase.IDLE

    def guard_grads(self) -> None:
        """Between steps, guard ``.grad`` of every gathered trainable parameter (the next step takes it
        back): a gradient assigned then, which the optimizer would not see, is refused (probe 35B)."""
        if self.phase is StepPhase.IDLE:
            self.ctx.guarded_grads.update(guard_pending_grads(self.ctx.params))

    @property
    def open(self) -> bool:
        """A step is running (some hook saw it begin, or the coordinator recorded an event of it)."""
        return self.phase is not StepPhase.IDLE or self.ctx.coordinator.in_step

    def end(self, keep_trace: bool = True, inference: bool = False) -> None:
        """The step finished: complete the gradient shards, release everything, cache the trace (unless
        not ``keep_trace``: a step cut short, whose events the next steps would not follow). ``inference``:
        a forward in grad mode that no backward can reach (a frozen model's) ends as one under no_grad,
        its communicators' epoch with it (review 37R3: the verifier's log grew by its requests per forward)."""
        self._end(aborted=False, reason=None, keep_trace=keep_trace, inference=inference)

    def end_forward_only(self) -> bool:
        """End a step that is in its forward outside any backward (one whose backward will not run),
        keeping no trace of it; True when it did."""
        if self.phase is StepPhase.FORWARD and torch._C._current_graph_task_id() < 0:
            self.end(keep_trace=False)
            return True
        return False

    def abort(self, exc: BaseException, where: str) -> None:
        """A forward or backward raised ``exc``: end the step aborted and tell the other ranks. Once
        per step: the root module's post-forward hook aborts as the exception leaves the model, and
        ``engine.forward`` asks again when it catches it.

        [Note: a backward that raised]
        ``engine.backward`` aborts a backward that raises. A bare ``loss.backward()`` that raises part
        way (a NaN check in an autograd function, a failing hook) never runs the callback zero3 queues
        for a backward's end: the step stays in BACKWARD, the gradients of the modules already done
        queued in the reducer, unreduced, and the next backward reduced them with its own (the skip-a-
        batch loop then stepped on them). The next forward of any of its modules, outside a backward, aborts
        that step first (hooks.py `_pre_forward`). An aborted backward drops the gradients it queued;
        those it reduced already (how many depends on the bucket sizes) are dropped with the
        gradient shards when it was a window's first micro-batch, so the failed micro-batch leaves
        nothing, as after torch's skip-a-batch loop (catch, ``optimizer.zero_grad()``, go on). After a
        window's earlier backward ended (``window_backwards``: whether or not ``engine.step()`` followed
        it) they stay, summed with the earlier ones (no split is possible; ``engine.zero_grad()``
        refuses there). An ``engine.step()`` right after a bare backward that
        raised steps on all of its gradients, as torch's ``optimizer.step()`` would."""
        if self._aborted:
            return
        if isinstance(exc, ZeroError) and not isinstance(exc, ZeroStateError):
            reason = f"raised {type(exc).__name__} in its {where} (step {self.ctx.global_steps})"
        else:
            reason = f"raised {type(exc).__name__}: {str(exc)[:200]} in its {where} (step {self.ctx.global_steps})"
        self._end(aborted=True, reason=reason)

    def close(self) -> None:
        """The hooks are being removed: a running step ends aborted; between steps only what the
        coordinator still holds (generation mode) is released."""
        if self.open:
            self._end(aborted=True, reason=f"removed its hooks in the middle of step {self.ctx.global_steps}")
        else:
            self.ctx.coordinator.end_step(aborted=True)
        unguard_pending_grads(self.ctx.guarded_grads.values())
        self.ctx.guarded_grads = {}

    def end_epochs(self) -> None:
        """``engine.step()``: the epoch of every communicator ends with the optimizer step."""
        for comm in self._epoch_comms():
            comm.end_epoch()

    def _epoch_comms(self) -> list[Communicator]:
        mp = self.ctx.model_parallel
        return self.ctx.data_comms + ([mp.comm] if mp is not None else [])

    def _drop_backward(self, backward: bool) -> None:
        """A step that ends aborted, or whose end raised: drop the gradients it queued, and, for a window's
        first backward, the shards' ([Note: a backward that raised]; probe 35B: a refusal at a backward's
        end left them queued, summed into the next backward's, past ``engine.zero_grad()``)."""
        ctx = self.ctx
        try:
            ctx.reducer.discard()
        except ZeroError:
            pass  # the step is gone anyway; the first error is what the caller sees
        opt = ctx.optimizer
        if backward and opt is not None and not opt.stepping_in_backward() and ctx.window_backwards == 0:
            opt.drop_grads()

    def _end(self, aborted: bool, reason: str | None, keep_trace: bool = True, inference: bool = False) -> None:
        """The one end of a step. Normally: complete the gradient shards, release everything, cache
        the step's trace. Aborted: drop queued gradients and the half-recorded step instead, and
        abandon every communicator's epoch (``reason`` for the other ranks). Either way the phase is
        IDLE afterwards."""
        ctx = self.ctx
        reducer = ctx.reducer
        assert reducer is not None
        inference = self.phase is StepPhase.FORWARD and (inference or not torch.is_grad_enabled())
        backward = self.phase is StepPhase.BACKWARD
        self._aborted = aborted
        failed = True  # until the end's own work is done: a failure there closes the window as an abort
        try:
            self._close_calls(aborted, self.phase)
            if aborted:
                self._drop_backward(backward)
            else:
                reducer.finish()
            failed = False
        except BaseException:  # the end itself raised (a refusal as a leaf's unit lands): nothing of it stays
            self._drop_backward(backward)
            if ctx.optimizer is not None and ctx.optimizer.backward_step is not None:
                ctx.optimizer.backward_step.aborted()
            raise
        finally:
            ctx.coordinator.end_step(aborted=aborted or failed, keep_trace=keep_trace)  # no trace of a failed one
            # after the step's last gather, before anything writes a shard; when the reduction raised (a
            # divergence every rank saw), not through the closing barrier, which the others never reach
            # (probe 30G: this rank waited out collective_timeout, then closed the group)
            close_window(ctx.comm, ctx.store, aborted or failed)
            self.enter(StepPhase.IDLE)
            # between steps, whatever ended this one (review 35R1: after an inference forward or an end
            # that raised, a kept-gathered parameter's gradient written here was taken and ignored); not
            # between the forwards of engine.generation(), whose kept weights it would turn twice per token
            if not (inference and ctx.coordinator.generating):
                self.guard_grads()
            if aborted:
                for comm in self._epoch_comms():
                    comm.abandon_epoch(reason)
            elif inference:
                for comm in ctx.data_comms:
                    comm.end_epoch()  # an inference forward is a whole epoch: nothing else follows it
        if backward and not aborted:
            ctx.window_backwards += 1
        backward_step = ctx.optimizer.backward_step if ctx.optimizer is not None else None
        if backward_step is not None:  # after everything is released: it reads and writes the drive
            if aborted:
                backward_step.aborted()
            elif not inference:
                backward_step.backward_ended()
        if not aborted:  # memory_budget, between steps; weighed by this step's own waits (not an eval's before it)
            waits = (ctx.metrics.wait_seconds - self._waits_at_begin[0],
                     ctx.metrics.reduce_wait_seconds - self._waits_at_begin[1])
            if (choice := ctx.coordinator.choose_budget(waits, reducer.arrivals)) is not None:
                reducer.resize(choice.reduce_bucket_size, choice.reduce_bucket_bytes)
