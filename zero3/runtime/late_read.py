"""A parameter read in a backward after its module's backward released it, gathered again there.

[Note: a parameter read after its module's backward]
A module closed by its gradients (hooks.py [Note: post-backward from the gradients]) is released when
the last of its parameters has its gradient. That fails for a backward node that reads a parameter it
does not take as a differentiable input: a custom ``autograd.Function`` whose backward reads
``ctx.module.weight`` (or a parameter kept on ``ctx``, or its ``.data``), or a backward hook of
another module reading it (a weight-norm logger on the root). Such a node may run after the
parameter's gradient, when the parameter is released. Computing with a released parameter reaches
its guard (partition/param.py `_guard`), which hands the op to the context's ``late_read``: inside a
backward (no forward running) it gathers the parameter again, every rank at the same node (the ranks
run the same graph), and runs the op. The module owning it is closed by ``_PostBackward`` from then
on, which runs after every node feeding its inputs' gradients. The parameter is released again as
soon as nothing but itself holds its storage: right after the op, unless the op returned a view of
it (``weight.diagonal()``, ``weight.detach()``), and then at the next late read once that view is
gone (torch's count of the storage's users), or when the step ends. So a logger reading every
weight in turn holds one at a time, within ``max_live_parameters``. Refused: an in-place op (its
write would be lost) and any read with the optimizer step in backward, which may have stepped the
shard already. Not covered: a node that saved a *view* of the weight made in the forward outside
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
from .init import is_inplace_op
from .step import StepLifecycle, StepPhase

logger = logging.getLogger(__name__)
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # how many hold a storage (torch's, private)


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
        self._held: list[tuple[ZeroParameter, int | None]] = []  # gathered by a late read, a view still out; the
        # number of holders of its storage right after the gather (zero3's own, and nodes' saved views)

    def __call__(self, target: Any, func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """Run ``func`` on the gathered parameter behind ``target`` (the parameter or its ``.data``);
        ``(False, None)`` (the guard's error stands) outside a backward, inside a forward, for an
        in-place op, or for a parameter this engine does not know."""
        p = target if isinstance(target, PartitionedParameter) else self._coordinator.param_of(target._zero.id)
        if p is None or self._step.phase is not StepPhase.BACKWARD or self._forward_stack \
                or torch._C._current_graph_task_id() < 0 or is_inplace_op(getattr(func, "__name__", "")):
            return False, None
        if self._step_in_backward:
            exc = ZeroStateError(
                f"parameter {p._zero.summary()} is read in the backward after its module's backward ended (a "
                "custom autograd.Function reading module.weight, or a backward hook of another module): with "
                "offload_optimizer_step_in_backward its shard may be stepped already, so its value would not be the "
                "forward's. Make the module that reads it a leaf module (zero3.set_leaf_modules), or turn the step "
                "in backward off")
            self._step.abort(exc, "backward")
            raise exc
        self._release_unviewed()
        self._owner_read(p)
        if p._zero.id not in self._announced:
            self._announced.add(p._zero.id)
            logger.info("zero3: %s is read in the backward after its module's backward ended; gathered again for "
                        "the read", p._zero.name)
        self._coordinator.keep_for_step([p])
        self._coordinator.fetch([p], label=f"a read of {p._zero.name} in the backward after its module's")
        self._held.append((p, _holders(p)))
        result = func(*_unguarded(args, self._coordinator), **_unguarded(kwargs, self._coordinator))
        self._release_unviewed()
        return True, result

    def _release_unviewed(self) -> None:
        """Release every held parameter whose storage nothing else holds now."""
        held = []
        for p, before in self._held:
            if before is None or _holders(p) > before:  # a view of it is still out, or cannot tell
                held.append((p, before))
            else:
                self._coordinator.keep_for_step([p], keep=False)
                self._coordinator.release([p])
        self._held = held

    def step_ended(self) -> None:
        """The step's end released everything and dropped every hold."""
        self._held.clear()


def _holders(p: ZeroParameter) -> int | None:
    """How many hold ``p``'s gathered storage (torch's count); None when torch cannot tell or ``p``'s
    data was replaced: then the parameter stays gathered until the step ends."""
    z = p._zero
    if _USE_COUNT is None or z.flat is None or raw_data(p).untyped_storage()._cdata != z.flat_storage._cdata:
        return None
    return _USE_COUNT(z.flat_storage._cdata)


def _unguarded(tree: Any, coordinator: ParamCoordinator) -> Any:
    """``.data`` aliases of gathered parameters as plain tensors, so the op does not come back here."""
    def plain(t: Any) -> Any:
        if isinstance(t, ReleasedData):
            p = coordinator.param_of(t._zero.id)
            if p is not None and not isinstance(p, PartitionedParameter):
                return raw_data(p)
        return t
    return pytree.tree_map(plain, tree)


def weak_late_read(reads: LateReads) -> Callable[[Any, Any, tuple, dict], tuple[bool, Any]]:
    """What the context holds (`RuntimeContext.late_read`): a weak reference, since the reads' step
    lifecycle holds the context."""
    ref = weakref.ref(reads)

    def late_read(target: Any, func: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        reads = ref()
        return (False, None) if reads is None else reads(target, func, args, kwargs)
    return late_read
