"""``optimizer.step()`` on the user's optimizer object is ``engine.step()``.

zero3 re-points the optimizer given to ``initialize`` at the shards (or their fp32 masters), and a
plain torch loop keeps calling ``optimizer.step()`` on it. The optimizer's own step alone would
update the shards but skip what ``engine.step()`` does around it: re-gather the persistent
parameters (kept gathered, so a forward after it would compute with the old weights), copy the fp32
masters into bf16/fp16 shards, unscale and agree on overflow (fp16), clip (``gradient_clipping``),
stream sub-groups from NVMe, agree on the step, advance the schedule zero3 drives. So the object's
``step`` is routed to the engine's; zero3 calls the class's ``step`` (`torch_step`), hooks included.
``torch.amp.GradScaler`` is refused at that step: it decides on overflow from this rank's shards.

Its ``zero_grad`` is routed to ``engine.zero_grad()`` for the same reason: torch's would drop the
gradient shards, which under ``gradient_accumulation_steps`` > 1 hold the window's sum so far, so the
habitual ``optimizer.zero_grad()`` after every ``engine.step()`` would leave the window's step only its
last micro-batch (probe 30A). DeepSpeed's stage 3 empties the client optimizer's param groups outside
its step, so the same call drops nothing there; ``engine.zero_grad()`` keeps the window's gradients.
After ``remove_hooks`` it is torch's own again, unless a new engine manages the model's parameters:
then it is refused, since the new engine may step the same tensors (in fp32 at world size 1 it does),
and torch's would drop that engine's gradients (review 30Y).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch

from ..errors import ZeroConfigError, ZeroStateError


def route(optimizer: torch.optim.Optimizer | None, engine: Any) -> None:
    """Make ``optimizer.step()`` call ``engine.step()`` (an `Engine`); nothing without an optimizer."""
    if optimizer is None:
        return

    def step(self: torch.optim.Optimizer, closure: Any = None) -> None:
        if closure is not None:
            raise ZeroConfigError(
                f"{type(self).__name__}.step(closure): zero3 does not take a closure (it would run forward and "
                "backward again inside the step, e.g. LBFGS); call loss.backward() and then optimizer.step()")
        if getattr(self, "found_inf", None) is not None:  # set by torch.amp.GradScaler.step (below)
            del self.found_inf, self.grad_scale  # type: ignore[attr-defined]
            raise ZeroConfigError(
                "torch.amp.GradScaler over a zero3 optimizer: its overflow check reads only this rank's "
                "gradient shards, so the ranks could skip different steps and keep different loss scales. "
                "Use the config's fp16 section (loss scaling whose overflow check every rank agrees on; "
                "DeepSpeed's \"fp16\": {\"enabled\": true}) with engine.backward(loss), or bf16, which needs no "
                "scaler; nothing was stepped")
        if not engine.context.attached:
            engine.step()  # refused by name: this engine's hooks were removed
        if not engine.is_gradient_accumulation_boundary():
            raise ZeroStateError(
                f"{type(self).__name__}.step() at {engine.context.window_position()}, where engine.step() only "
                "counts the micro-batch, but optimizer.step() means to step now. Call engine.step() after every "
                "micro-batch's backward (it "
                "steps at the window's last), or set gradient_accumulation_steps to 1 and accumulate in the loop "
                "(gradients add up in the shards until the step); nothing was counted")
        self._opt_called = True  # type: ignore[attr-defined]  # the order check of torch's LR schedulers
        engine.step()

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        if not engine.context.attached:
            if any(p._zero.ctx is not engine.context and getattr(p._zero.ctx, "attached", False) for p in engine.params):
                raise ZeroStateError(  # its tensors may be the new engine's shards (review 30Y: it dropped its gradients)
                    f"{type(self).__name__}.zero_grad() of the optimizer of an engine whose hooks were removed, while "
                    "a new engine manages the model's parameters: call the new engine's zero_grad() (or its optimizer's)")
            type(self).zero_grad(self, set_to_none)  # no engine steps these tensors now: torch's own
            return
        engine.zero_grad()  # dropping to None or to zeros: the next backward starts from nothing either way

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # a scheduler built later does not re-wrap it
    step.__doc__ = "engine.step(): zero3's step over the shards (optim/routed_step.py)."
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    zero_grad.__doc__ = "engine.zero_grad(): keeps an accumulation window's gradients (optim/routed_step.py)."
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]
    sharded = engine.context.optimizer  # the PartitionedOptimizer: deepspeed.initialize returns it
    if sharded is not None:
        sharded.user_step = optimizer.step
        sharded.user_zero_grad = engine.zero_grad
    # torch.amp.GradScaler then calls step() on every rank, with its local overflow flag set on the
    # optimizer, instead of skipping it on the ranks whose shards overflowed: refused above, on all.
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]


def torch_step(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's own step (its class's, with torch's step hooks), not the routed one."""
    optimizer._opt_called = True  # type: ignore[attr-defined]  # what a scheduler's wrapper of step() would mark
    type(optimizer).step(optimizer)


def own_scheduler(scheduler: Any) -> Callable[[], Any]:
    """``scheduler`` is stepped by ``engine.step()`` (given to ``initialize`` or built from the config):
    its ``step()`` called by the user as well would advance it twice per optimizer step, silently
    (DeepSpeed's engine steps it too, and a torch loop's ``scheduler.step()`` after
    ``optimizer.step()`` is the habit). That call now raises; the returned callable is the step
    ``engine.step()`` takes. The refusal is a subclass's ``step`` (the object's class is swapped), not
    an attribute: a scheduler's ``state_dict()`` is its ``__dict__``, which goes into checkpoints."""
    base = type(scheduler)
    guarded = _GUARDED.get(base)
    if guarded is None:
        guarded = _GUARDED[base] = type(base.__name__, (base,), {
            "step": _refuse_step, "__module__": base.__module__, "__qualname__": base.__qualname__})
    scheduler.__class__ = guarded
    return functools.partial(base.step, scheduler)


_GUARDED: dict[type, type] = {}


def release_scheduler(ctx: Any, scheduler: Any) -> None:
    """``engine.lr_scheduler = None``: ``engine.step()`` stops stepping the scheduler it had, whose own
    ``step()`` works again (the caller steps it now). Another value is refused: a scheduler is given to
    ``zero3.initialize``, which checks it against the optimizer."""
    if scheduler is ctx.lr_scheduler:
        return
    if scheduler is not None:
        raise ZeroConfigError(f"engine.lr_scheduler = {type(scheduler).__name__}: only None may be set (engine.step() "
                              "then stops stepping the scheduler, which you step yourself); pass a scheduler to "
                              "zero3.initialize(lr_scheduler=...) instead")
    old = ctx.lr_scheduler
    if type(old) in _GUARDED.values():
        old.__class__ = type(old).__mro__[1]  # its own class again, with its own step()
    ctx.lr_scheduler = ctx.lr_scheduler_step = None


def _refuse_step(self: Any, *args: Any, **kwargs: Any) -> None:
    raise ZeroStateError(
        f"{type(self).__name__}.step(): this scheduler is stepped by engine.step() (and optimizer.step(), "
        "which is engine.step()) after every optimizer step, since it was given to zero3.initialize or "
        "built from the config's 'scheduler' section; stepping it here as well would advance it twice. "
        "Drop this call, or keep the scheduler out of zero3.initialize and step it yourself")
