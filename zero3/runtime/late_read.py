"""A parameter read in a backward after its module's backward released it, gathered again there.

[Note: a parameter read after its module's backward]
A module closed by its gradients (hooks.py [Note: post-backward from the gradients]) is released when
the last of its parameters has its gradient. That fails for a backward node that reads a parameter it
does not take as a differentiable input: a custom ``autograd.Function`` whose backward reads
``ctx.module.weight`` (or a parameter kept on ``ctx``, or its ``.data``), or a backward hook reading
a weight whose module's backward is done (a weight-norm logger on the root, a backward pre-hook that
runs before any of zero3's). Such a node may run after the parameter's gradient, when the parameter
is released. Computing with a released parameter reaches its guard (partition/param.py `_guard`),
which hands the op to the context's ``late_read``: inside a
backward (a graph task running, no forward running, whatever zero3's step phase says: a user's hook
may run before any of zero3's, in a second backward too) it gathers every released parameter of
this engine among the op's arguments (one collective: every rank must make the same reads, as with
any gather; on one node the shared-memory gathers let a rank read alone, across nodes the ranks
diverge; another engine's parameters are gathered by that engine's own late read when the op
reaches them), runs the op, and releases them again. What the op returns is a copy where it would
be a view of a parameter (``w.detach()``, ``w.t()``), since the storage is emptied right after: a
read of it is torch's value, and it is an inference tensor, so that torch refuses a write into it
(which would not reach the parameter) and its use where autograd would save it. With grad mode on
and a result that requires grad (a gradient computed inside a hook), the result's graph saved the
weights: then nothing is copied and they stay gathered until the step ends. So a
logger reading every weight in turn holds one at a time, within ``max_live_parameters``. The module
owning a parameter read so is closed by ``_PostBackward`` from then on, which runs after every node
feeding its inputs' gradients. Refused: an in-place op on the parameter or ``out=`` it (the write
would be lost), and any read with the optimizer step in backward, which may have stepped the shard
already. Not covered: a node that saved a *view* of the weight made in the forward outside
autograd's tracking (``x @ w.detach()``) reads the emptied storage itself, with no guard on the way
(torch's "out of bounds for storage of size 0"); a leaf module runs such a module as torch's.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..errors import ZeroStateError
from ..partition.param import PartitionedParameter, ReleasedData, ZeroParameter, raw_data
from .coordinator import ParamCoordinator
from .init import is_inplace_op, unguarded
from .step import StepLifecycle

logger = logging.getLogger(__name__)


class LateReads:
    """The gather of parameters a backward reads after their module's backward (the Note above)."""

    def __init__(self, step: StepLifecycle, coordinator: ParamCoordinator, forward_stack: list,
                 step_in_backward: bool, owner_read: Callable[[ZeroParameter], None]) -> None:
        """``forward_stack``: the hooks' stack of running forward calls (not empty: a recompute, whose
        forward hooks gather); ``owner_read(p)``: tells the hooks that ``p``'s module must not be
        closed by its gradients again."""
        self._step = step
        self._coordinator = coordinator
        self._forward_stack = forward_stack
        self._step_in_backward = step_in_backward
        self._owner_read = owner_read
        self._announced: set[int] = set()

    def __call__(self, target: Any, func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """Run ``func`` with every released parameter among its arguments gathered (``target``: the
        first, the parameter or its ``.data``); ``(False, None)`` (the guard's error stands) outside a
        backward, inside a forward, or for a parameter this engine does not know."""
        if self._forward_stack or torch._C._current_graph_task_id() < 0:
            return False, None  # (any phase: a user hook may run before any of zero3's in a backward)
        params = self._params_in((args, kwargs))
        if not params:  # another engine's (its own late read takes them when the op reaches them)
            return False, None
        name = getattr(func, "__name__", "")
        if self._step_in_backward or is_inplace_op(name) or any(
                isinstance(t, (PartitionedParameter, ReleasedData)) for t in pytree.tree_leaves(kwargs.get("out"))):
            exc = ZeroStateError(
                f"parameter {params[0]._zero.summary()} is used by {name or func!r} in the backward after its module's "
                "backward ended (a custom autograd.Function reading module.weight, or a backward hook of another "
                "module), where zero3 gathers it again for reads only" + (
                    ": with offload_optimizer_step_in_backward its shard may be stepped already, so its value would "
                    "not be the forward's. Make the module that reads it a leaf module (zero3.set_leaf_modules), or "
                    "turn the step in backward off" if self._step_in_backward else
                    ": a write there would be lost. Change weights between steps, under "
                    "`with zero3.GatheredParameters(params, modifier_rank=0):`"))
            self._step.abort(exc, "backward")
            raise exc
        for p in params:
            self._owner_read(p)
            if p._zero.id not in self._announced:
                self._announced.add(p._zero.id)
                logger.info("zero3: %s is read in the backward after its module's backward ended; gathered again "
                            "for the read", p._zero.name)
        self._coordinator.keep_for_step(params)
        graph = False
        try:
            self._coordinator.fetch(params, label="a read in the backward after their modules' of "
                                                  + ", ".join(p._zero.name for p in params))
            result = func(*unguarded(args, self._coordinator), **unguarded(kwargs, self._coordinator))
            # With grad mode on (a gradient computed inside a hook) the result's graph saved the weights:
            # they stay gathered, as returned, until the step ends.
            graph = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                                    for t in pytree.tree_leaves(result))
            if not graph:
                storages = {raw_data(p).untyped_storage()._cdata for p in params}
                result = pytree.tree_map(lambda t: _copy(t) if isinstance(t, torch.Tensor) and
                                         t.untyped_storage()._cdata in storages else t, result)
        finally:
            if not graph:
                self._coordinator.keep_for_step(params, keep=False)
                self._coordinator.release(params)
        return True, result

    def _params_in(self, tree: Any) -> list[ZeroParameter]:
        """This engine's parameters behind the guarded tensors of ``tree`` (once each, in order)."""
        out: list[ZeroParameter] = []
        for t in pytree.tree_leaves(tree):
            if isinstance(t, (PartitionedParameter, ReleasedData)):
                p = self._coordinator.param_of(t._zero.id)  # ds_ids are per engine: check it is t's
                if p is not None and p._zero is t._zero and not any(q is p for q in out):
                    out.append(p)
        return out


def _copy(view: torch.Tensor) -> torch.Tensor:
    """A view of a parameter a late read returns, as a copy (its storage is emptied right after), made
    an inference tensor: torch refuses an in-place write into it outside inference mode, where the
    write into the view would have changed the weight."""
    with torch.inference_mode():
        return view.clone()


def weak_late_read(reads: LateReads) -> Callable[[Any, Any, tuple, dict], tuple[bool, Any]]:
    """What the context holds (`RuntimeContext.late_read`): a weak reference, since the reads' step
    lifecycle holds the context."""
    ref = weakref.ref(reads)

    def late_read(target: Any, func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        reads = ref()
        return (False, None) if reads is None else reads(target, func, args, kwargs)
    return late_read
