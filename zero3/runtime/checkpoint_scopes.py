"""The scopes activation checkpointing opens around what the hooks cannot tell by themselves.

[Note: activation checkpointing and the end of a step]
``zero3.checkpointing.checkpoint`` runs its function twice: under ``no_grad`` in the forward, and
again inside the backward (the recompute), followed by a nested ``torch.autograd.backward``. Both
runs go through the hooks (hooks.py) and are recorded like any other module visits. Two scopes tell the
hooks what they cannot see by themselves:
- `checkpoint_forward`: a root module that returns under ``no_grad`` inside it is being
  checkpointed, not run for inference, so the step does not end there;
- `nested_backward`: around the nested backward. Its graph task may be the only one zero3 queued a
  callback on (when no hooked module ran in the enclosing backward before the recompute, e.g. the
  layers after the checkpoint are all persistent); when it ends, the enclosing backward is still
  running, so the step's end is handed on to that enclosing graph task instead of happening there.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

CHECKPOINT_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("zero3_checkpoint_forward", default=False)
NESTED_BACKWARD: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "zero3_nested_backward", default=None)


@contextlib.contextmanager
def checkpoint_forward() -> Iterator[None]:
    """The ``no_grad`` forward of an activation checkpoint runs inside (see [Note: activation
    checkpointing and the end of a step])."""
    token = CHECKPOINT_FORWARD.set(True)
    try:
        yield
    finally:
        CHECKPOINT_FORWARD.reset(token)


@contextlib.contextmanager
def nested_backward() -> Iterator[None]:
    """A backward nested in a running one (an activation checkpoint's) runs inside: a step whose last
    graph task ends in it ends with the enclosing backward instead (see [Note: activation
    checkpointing and the end of a step]). Call it from the enclosing backward's node."""
    deferred: list[Any] = []  # hooks.py `ModuleHooks` whose step ends with the enclosing backward
    token = NESTED_BACKWARD.set(deferred)
    try:
        yield
    finally:
        NESTED_BACKWARD.reset(token)
    for hooks in deferred:
        hooks.ensure_final_callback()  # queued on the enclosing graph task, which is current again
