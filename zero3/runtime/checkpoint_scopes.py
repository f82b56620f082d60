"""What activation checkpointing needs the hooks to know that they cannot see by themselves.

[Note: activation checkpointing and the end of a step]
``zero3.checkpointing.checkpoint`` runs its function twice: under ``no_grad`` in the forward, and
again inside the backward (the recompute), followed by a nested ``torch.autograd.backward``; torch's
reentrant checkpoint does the same. Both runs go through the hooks (hooks.py) and are recorded like
any other module visits. Two things are made explicit:
- `checkpoint_forward` (zero3's checkpoint): a root module that returns under ``no_grad`` inside it
  is being checkpointed, not run for inference, so the step does not end there;
- `EnclosingEnd`: the nested backward's graph task may be the only one zero3 queued a callback on
  (when no hooked module ran in the enclosing backward before the recompute, e.g. the layers after
  the checkpoint are all persistent); when it ends, the enclosing backward is still running, so the
  step's end is handed on to that enclosing graph task instead of happening there. It is found at
  the nested task's end, for any checkpoint or a user's ``backward`` inside a
  ``torch.autograd.Function``: autograd's current node is then the enclosing one. Ending the step
  there had reduced a leaf module's unit with one recompute's gradients and dropped the rest (probe
  25C); zero3's checkpoint had a scope of its own for it, which this replaced.

[Note: zero3's tensor work under a dispatch mode]
A forward hook's gathers, releases and `_PostBackward` wrap run inside the module's call, so under
any ``TorchDispatchMode`` active there, and torch's selective checkpoint
(``create_selective_checkpoint_contexts``) is two: one records every op of the forward, per op
kind and in order, the other replays the recompute against that record, and both runs must issue
the same ops. zero3's do not: a call's parameters are gathered in the forward and found gathered
(prefetched) in the recompute, and a module's first call in a step is closed by its gradients where
the recompute, its second call, is wrapped (one ``aten.view`` more). From the second step on the
recompute raised torch's "aten.view.default encountered during backward but not found in storage"
(probe 31I), and a policy that saves more than matmuls handed the user's ops the gather's tensors
("different metadata", a ``[16]`` bias view for a ``[4, 16]`` activation). So a forward hook entered
under a dispatch mode runs with every mode taken off (`outside_dispatch_modes`): its ops belong to
no user's region, and no mode records, replays or counts them. So does the backward's side (the
pre-backward, a gradient's arrival, the post-backward and the end of a backward): under torch's
``allow_mutation_on_saved_tensors()`` (a dispatch mode that clones a saved tensor before an in-place
op on it) the backward's gathers into saved parameters were cloned and handed to autograd half-made:
gradients 1e8-1e24 off torch's, or "illegal status change AVAILABLE -> INFLIGHT", in some runs
(probe 34H).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

CHECKPOINT_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("zero3_checkpoint_forward", default=False)


@contextlib.contextmanager
def checkpoint_forward() -> Iterator[None]:
    """The ``no_grad`` forward of an activation checkpoint runs inside (see [Note: activation
    checkpointing and the end of a step])."""
    token = CHECKPOINT_FORWARD.set(True)
    try:
        yield
    finally:
        CHECKPOINT_FORWARD.reset(token)


dispatch_modes: Callable[[], int] = torch._C._len_torch_dispatch_stack  # how many modes are active


def outside_dispatch_modes(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with no ``TorchDispatchMode`` active ([Note: zero3's tensor work under a dispatch mode])."""
    if not dispatch_modes():
        return fn(*args)
    with _disable_current_modes():
        return fn(*args)


class EnclosingEnd:
    """A step's end handed on to the backward that encloses the graph task where it would have
    happened: a backward nested in one of its nodes (torch's reentrant checkpoint), found at that
    task's end because autograd's current node is then the enclosing one. Autograd reads a node's
    post-hooks after its ``apply``, so one added during it runs once it returns, in the enclosing
    graph task, and calls ``queue`` there (`ModuleHooks.ensure_final_callback`). Not when that node
    is the one the step's forward ran in (a whole training step inside a user's
    ``autograd.Function.backward``): that backward is no part of the step, and waiting for it lost
    the nested backward's gradients when its node then raised (reviews of round 25). A step whose
    enclosing node raises is aborted at the next forward, as any backward that raised; its pending
    hook is removed at any end of step (`settle`)."""

    def __init__(self, queue: Callable[[], None]) -> None:
        self._queue = queue
        self._handle: Any = None

    def defer(self, forward_node: Any) -> bool:
        """At the end of a graph task: whether it ran inside a node of an enclosing backward other
        than ``forward_node`` (then the step's end waits for that node to return)."""
        node = torch._C._current_autograd_node()
        if node is None or node is forward_node:
            return False
        self.settle()
        self._handle = node.register_hook(self._returned)
        return True

    def settle(self) -> bool:
        """Forget a pending end (the step ended, or was aborted); return whether one was pending."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()  # once: a graph kept for another backward runs the node again
        return handle is not None

    def _returned(self, grad_inputs: Any, grad_outputs: Any) -> None:
        if self.settle():
            self._queue()
