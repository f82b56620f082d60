"""A parameter read in a backward after its module's backward released it, gathered again there.

[Note: a parameter read after its module's backward]
A module closed by its gradients (hooks.py [Note: post-backward from the gradients]) is released when
the last of its parameters has its gradient. That fails for a backward node that reads a parameter it
does not take as a differentiable input: a custom ``autograd.Function`` whose backward reads
``ctx.module.weight`` (or a parameter kept on ``ctx``), or a backward hook of another module reading
it (a weight-norm logger on the root). Such a node may run after the parameter's gradient, when the
parameter is released. Computing with a released parameter reaches its guard (partition/param.py
`_guard`), which asks the context's ``late_read``: inside a backward (no forward running) it gathers
the parameter again, every rank at the same node (the ranks run the same graph), and keeps it until
the step ends; the module owning it is closed by ``_PostBackward`` from then on, which runs after
every node feeding its inputs' gradients. Refused with the optimizer step in backward, which may
have stepped the shard already. Not covered: a node that saved a *view* of the weight made outside
autograd's tracking (``x @ w.detach()``) reads the emptied storage itself, with no guard on the way
(torch's "out of bounds for storage of size 0"); a leaf module runs such a module as torch's.
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import torch

from ..errors import ZeroStateError
from ..partition.param import PartitionedParameter
from .coordinator import ParamCoordinator
from .step import StepLifecycle, StepPhase

logger = logging.getLogger(__name__)


class LateReads:
    """The gather of parameters a backward reads after their module's backward (the Note above)."""

    def __init__(self, step: StepLifecycle, coordinator: ParamCoordinator, forward_stack: list,
                 step_in_backward: bool, owner_read: Callable[[PartitionedParameter], None]) -> None:
        """``forward_stack``: the hooks' stack of running forward calls (not empty: a recompute, whose
        forward hooks gather); ``owner_read(p)``: tells the hooks that ``p``'s module must not be
        closed by its gradients again."""
        self._step = step
        self._coordinator = coordinator
        self._forward_stack = forward_stack
        self._step_in_backward = step_in_backward
        self._owner_read = owner_read
        self._announced: set[int] = set()

    def __call__(self, p: PartitionedParameter) -> bool:
        """Gather ``p`` for a read in this backward, held until the step ends; False (the guard's
        error stands) outside a backward or inside a forward."""
        if self._step.phase is not StepPhase.BACKWARD or self._forward_stack \
                or torch._C._current_graph_task_id() < 0:
            return False
        if self._step_in_backward:
            exc = ZeroStateError(
                f"parameter {p._zero.summary()} is read in the backward after its module's backward ended (a "
                "custom autograd.Function reading module.weight, or a backward hook of another module): with "
                "offload_optimizer_step_in_backward its shard may be stepped already, so its value would not be the "
                "forward's. Make the module that reads it a leaf module (zero3.set_leaf_modules), or turn the step "
                "in backward off")
            self._step.abort(exc, "backward")
            raise exc
        self._owner_read(p)
        if p._zero.id not in self._announced:
            self._announced.add(p._zero.id)
            logger.info("zero3: %s is read in the backward after its module's backward ended; gathered again and "
                        "kept until the step ends", p._zero.name)
        self._coordinator.keep_for_step([p])
        self._coordinator.fetch([p])
        return True


def weak_late_read(reads: LateReads) -> Callable[[PartitionedParameter], bool]:
    """What the context holds (`RuntimeContext.late_read`): a weak reference, since the reads' step
    lifecycle holds the context."""
    ref = weakref.ref(reads)

    def late_read(p: PartitionedParameter) -> bool:
        target = ref()
        return target is not None and target(p)
    return late_read
