"""What the engine's public calls check before they act, and DeepSpeed's small procedures around
them: a detached engine refused by name, ``lr_kwargs`` checked before a step, ``zero_grad`` inside an
accumulation window, the ``steps_per_print`` progress line, ``offload_states``' checks, the tensors
``master_shard`` and ``optimizer_state`` hand out. Functions of an `zero3.engine.Engine` (passed in;
this module does not import it)."""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch

from ..comm.communicator import Kind, Tag
from ..config.sections import warn_once
from ..errors import ConcurrentForwardError, ZeroConfigError, ZeroStateError
from ..metrics import StepMetrics
from ..offload.states import StatesOffload
from .refusals import EAGER, STOP_RECOMPUTATION, eval_frame_callback, refuse_compiled_call
from .thread_claim import release_forward

logger = logging.getLogger("zero3.engine")  # the engine's logger: its progress and timer lines keep their name


MID_STEP = ("{what} must be called between steps (after engine.step()); a step is in its {phase}: finish it with "
            "engine.backward(loss) and engine.step(), or, after a forward with gradients whose backward will not "
            "run, run two forwards under torch.no_grad(): the first joins the step (an evaluation between a "
            "forward and its backward), the second ends it")


def end_forward_without_backward(engine: Any, what: str) -> None:
    """A forward with gradients whose backward never came (its loss was not finite and the loop went
    on; the loss function raised) leaves the step open, with parameters kept gathered for that
    backward. ``what`` (a checkpoint load, DeepSpeed's recovery from such a loss) replaces every
    shard, so that backward cannot run on the old values any more (it raises, as torch's does after a
    load: the load bumps the parameters' version counters): the step ends here, keeping no trace
    of it, even when the load then fails or refuses (inside ``GatheredParameters``). Inside a
    backward nothing changes (the load refuses)."""
    if engine.hooks.step.end_forward_only():
        logger.info("zero3: %s after a forward whose backward did not run: that step ended here", what)


def check_lr_kwargs(engine: Any, lr_kwargs: Any) -> None:
    """``lr_kwargs`` the scheduler's ``step`` takes, checked before the optimizer steps (a TypeError
    from the scheduler after it would leave the step half done)."""
    if lr_kwargs is None:
        return
    sched = engine.context.lr_scheduler_step
    if not isinstance(lr_kwargs, dict):
        raise ZeroConfigError(f"engine.step(lr_kwargs={lr_kwargs!r}): a dict of keywords for the engine's lr "
                              "scheduler's step()")
    if sched is None:  # DeepSpeed passes them to its scheduler only: Megatron-DeepSpeed sends them every step
        if lr_kwargs:
            warn_once(f"zero3: engine.step(lr_kwargs={sorted(lr_kwargs)}) without an lr scheduler in the engine: "
                      "there is nothing to pass them to (DeepSpeed ignores them too)")
        return
    try:
        inspect.signature(sched).bind(**lr_kwargs)
    except (TypeError, ValueError) as exc:
        raise ZeroConfigError(f"engine.step(lr_kwargs={lr_kwargs!r}): the lr scheduler's step() does not take them "
                              f"({exc}); nothing was stepped") from None


def require_gradients(engine: Any) -> None:
    """Refuse ``engine.step()`` (with an optimizer and a trainable parameter) when no gradient reached
    the model since the last ``engine.step()``: no backward reduced one into the shards (none ran, or
    it reached no trainable parameter: ``torch.autograd.grad`` over the inputs alone) and none was set
    through ``safe_set_full_grad``/``safe_set_local_grad``. Nothing changes then: no step, no
    ``global_steps`` or scheduler advance. A reduction lands on every rank, so only gradients set
    without a backward are agreed (a collective then): on every rank, or the step is refused on all."""
    ctx = engine.context
    if ctx.optimizer is None or engine._backward_ran() or not any(p.requires_grad for p in engine.params):
        return
    set_on = ctx.comm.exchange_objects(ctx.grads_set, Tag(Kind.OBJECTS, "engine.step() gradients set"))
    if all(set_on):
        return
    if any(set_on):
        have = [r for r, s in enumerate(set_on) if s]
        lack = [r for r, s in enumerate(set_on) if not s]
        raise ZeroStateError(
            f"engine.step(): gradients were set (safe_set_full_grad / safe_set_local_grad) without a backward on "
            f"ranks {have} but not on ranks {lack}: set them on every rank before engine.step() (the step is one "
            "collective); nothing was stepped")
    raise ZeroStateError(
        f"engine.step(): no backward reached the model since the last engine.step() (micro-batch {ctx.micro_steps}): "
        "none ran, or none gave a trainable parameter a gradient (torch.autograd.grad(loss, inputs) gives them "
        "none), and no safe_set_full_grad / safe_set_local_grad set one. Call engine.backward(loss) (or "
        "loss.backward()) first, over a loss that depends on its trainable parameters, or set the gradients on "
        "every rank; nothing was stepped")


def zero_grad_window(engine: Any) -> None:
    """``engine.zero_grad()``. After ``engine.step()`` in the middle of an accumulation window it keeps
    the window's gradients: DeepSpeed's engine clears only ``param.grad`` there, so a loop that calls
    it before every micro-batch accumulates. After a backward that ``engine.step()`` has not closed
    it drops that micro-batch's gradients (torch's skip-a-batch habit) when it is the window's first;
    after a later one the gradient shards hold the window's sum, which cannot be split: refused.
    While `set_gradient_accumulation_boundary` is set (DeepSpeed's manual windows, whose loops may call
    ``engine.step()`` only at a window's end) it keeps the window's gradients whenever, as DeepSpeed's."""
    require_hooks(engine, "engine.zero_grad()")  # another engine may hold the model's gradients now
    ctx = engine.context
    if ctx.optimizer is not None and ctx.optimizer.stepped_in_backward():
        raise ZeroStateError("engine.zero_grad() after the backward that ends a window under "
                             "offload_optimizer_step_in_backward: the optimizer stepped inside that backward, so its "
                             "gradients were used already; call engine.step()")
    if ctx.boundary_override is not None:
        if engine._backward_ran():
            warn_once("zero3: engine.zero_grad() while set_gradient_accumulation_boundary "
                      "is set keeps the window's gradients, the last backward's included, as DeepSpeed's does (it "
                      "clears only param.grad): it drops no micro-batch (without the override it drops a window's "
                      "first)")
        return
    if ctx.window_micro:
        if engine._backward_ran():
            raise ZeroStateError(
                f"engine.zero_grad() after the backward of {ctx.window_position()} of an accumulation window: its "
                "gradients are summed with the window's earlier ones and cannot be dropped alone; call "
                "engine.step() (the window goes on), or zero_grad before a window's first backward")
        return
    for p in engine.params:
        p._zero.train_tensor.grad = None
    if ctx.optimizer is not None:
        ctx.optimizer.drop_grads()
    ctx.window_backwards = 0


def require_hooks(engine: Any, what: str) -> None:
    """Refuse ``what`` on an engine whose hooks were removed: nothing would gather its parameters or
    reduce their gradients any more."""
    if not engine.context.attached:
        raise ZeroStateError(f"{what} after engine.remove_hooks(): this engine no longer manages the model (nothing "
                             "gathers its parameters or reduces their gradients); call zero3.initialize(model, ...) "
                             "again for a new engine")


def begin_forward(engine: Any) -> None:
    """``engine(...)``: refused after ``remove_hooks``, and inside a torch.compile'd call (dynamo traced
    the engine and read the model's partitioned parameters before any module hook could refuse)."""
    require_hooks(engine, "engine.forward()")
    if eval_frame_callback() not in EAGER:
        refuse_compiled_call()


def abort_forward(engine: Any, exc: BaseException) -> None:
    """``engine(...)`` raised: the step is aborted, unless the call was refused because another
    thread's forward runs (hooks.py [Note: one thread]): that forward's step goes on; or torch's
    checkpoint stopped its recompute of ``engine(x)`` early, no failure (the backward needing the
    parameters it gathered failed on empty storage, probe 37A; the root's hook knew this already)."""
    if not isinstance(exc, (ConcurrentForwardError, STOP_RECOMPUTATION)):
        engine.hooks.step.abort(exc, "forward")
        release_forward(engine.hooks)


def end_micro_batch(engine: Any, boundary: bool, stepped: bool) -> None:
    """``engine.step()``'s bookkeeping after the optimizer (``stepped``: it changed the shards): the
    micro-batch and, at a ``boundary``, the window and the global step end (a skipped step counts, as in
    DeepSpeed); the persistent parameters are gathered again; the step's metrics are kept and logged."""
    ctx = engine.context
    ctx.micro_steps += 1
    ctx.window_micro = 0 if boundary else ctx.window_micro + 1
    if boundary:
        ctx.window_backwards = 0
        if ctx.optimizer is None:  # nothing steps the shards, but the refresh gathers them again
            ctx.take_persistent_writes()
            for p in engine.params:  # as step_shards drops them: the next backward starts a new sum
                p._zero.train_tensor.grad = None
        ctx.coordinator.refresh_persistent()
        ctx.global_steps += 1
        ctx.global_samples += ctx.samples_per_step()
    ctx.step_applied = stepped
    ctx.grads_set = False
    if ctx.reducer is not None:
        ctx.reducer.landed = 0
    engine.hooks.step.end_epochs()
    ctx.count_swap_io()
    engine.last_step_metrics = copy.copy(ctx.metrics)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("zero3::step %s", engine.last_step_metrics.as_dict())
    if boundary and ctx.global_steps % engine.config.training.steps_per_print == 0:
        log_progress(engine, engine.last_step_metrics)
    ctx.metrics.reset(ctx.global_steps)


def log_progress(engine: Any, m: StepMetrics) -> None:
    """Every ``steps_per_print`` optimizer steps, as DeepSpeed's engine reports them: on rank 0 the
    step, the skipped (fp16 overflow) steps, the learning rates and, under fp16, the loss scale;
    with ``wall_clock_breakdown``, on every rank, the step's timers."""
    ctx = engine.context
    if ctx.comm.rank == 0 and logger.isEnabledFor(logging.INFO):
        scale = f", loss_scale={engine.loss_scale:g}" if engine.loss_scaler is not None else ""
        logger.info("zero3: step=%d, skipped=%d, lr=%s%s", ctx.global_steps, engine.skipped_steps, engine.get_lr(),
                    scale)
    if engine.config.training.wall_clock_breakdown:
        logger.info("zero3::timers step %d | forward %.1f ms | backward %.1f ms | gather wait %.1f ms | "
                    "reduction wait %.1f ms | header exchanges %.1f ms | optimizer %.1f ms", ctx.global_steps,
                    1e3 * m.forward_seconds, 1e3 * m.backward_seconds, 1e3 * m.wait_seconds,
                    1e3 * m.reduce_wait_seconds, 1e3 * m.header_seconds, 1e3 * m.optimizer_seconds)


def take_persistent_writes(persistent: Any, resident: Any = None) -> None:
    """Before the optimizer step: in-place writes to persistent parameters since their last gather go
    into their shards, so the step keeps them (persistent.py `take_writes`); said once per name."""
    for name in persistent.take_writes(resident):
        if name not in _TAKEN:
            _TAKEN.add(name)
            logger.info("zero3: %s was written in place since it was gathered (it is persistent, so kept gathered); "
                        "the write is taken into its shards before the optimizer step. Every rank must write the "
                        "same values (GatheredParameters(params, modifier_rank=0) writes rank 0's)", name)


_TAKEN: set[str] = set()


def offload_engine_states(engine: Any, include: Any, device: str, pin_memory: bool, non_blocking: bool,
                          nvme_path: str | None) -> int:
    """`Engine.offload_states` (its docstring says what) between steps: refused inside generation mode
    or ``GatheredParameters``, before anything moves."""
    if engine.coordinator.generating:
        raise ZeroStateError("engine.offload_states() inside engine.generation(): leave generation mode first")
    held = [p._zero.name for p in engine.params if p._zero.user_pins > 0]
    if held:
        raise ZeroStateError(f"engine.offload_states(): parameters {held[:5]} are held by GatheredParameters "
                             "(or param.all_gather()); close those first")
    ctx = engine.context
    ctx.finish_gradients()
    if ctx.offloaded is None:
        ctx.offloaded = StatesOffload(ctx)
    return ctx.offloaded.offload(include, device, pin_memory, non_blocking, nvme_path)


def in_memory(engine: Any, what: str, kinds: tuple[str, ...], tensors: Iterable[Any]) -> None:
    """``what`` hands out the tensors the optimizer steps on: refused while their kind is offloaded
    (``offload_states``), or while their bytes are on NVMe between steps (their storage is empty then,
    and a read would crash the process)."""
    engine.context.require_states(what, kinds)
    if any(isinstance(t, torch.Tensor) and t.numel() and not t.untyped_storage().nbytes() for t in tensors):
        raise ZeroStateError(f"{what}: these tensors live on NVMe between steps (offload_optimizer or offload_param "
                             "with device nvme), so there are no bytes here to read; use "
                             "zero3.safe_get_local_fp32_param(p) or zero3.safe_get_local_optimizer_state(p, key) (and "
                             "their safe_set_ forms), which read them in and write them back")
