"""Whether the autograd graph of a step's training forward still lives, so a forward under
``torch.no_grad()`` after it can tell a backward that may still come from one that cannot (hooks.py
[Note: a no_grad forward inside a step])."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

_KEY = "zero3.forward_graph"


class _Mark:
    """Kept by the ``metadata`` of a forward's output nodes only: it lives exactly as long as one of them."""

    __slots__ = ("__weakref__",)


class ForwardGraphs:
    """The graphs of the training forwards of the open step, held weakly (cleared when the step ends)."""

    def __init__(self) -> None:
        self._marks: list[weakref.ref[_Mark]] = []
        self._unseen = False  # a forward whose output nodes could not be reached (an object pytree does not open)

    def mark(self, output: Any) -> None:
        """Put one mark on the autograd node of every output tensor of a training forward."""
        nodes = [t.grad_fn for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not nodes:
            self._unseen = True  # taken as alive: joining costs nothing when no backward comes but memory until it ends
            return
        mark = _Mark()
        for node in nodes:
            node.metadata[_KEY] = mark
        self._marks.append(weakref.ref(mark))

    def alive(self) -> bool:
        """A backward of the step's forwards can still come: autograd keeps one of their output nodes."""
        return self._unseen or any(r() is not None for r in self._marks)

    def clear(self) -> None:
        self._marks.clear()
        self._unseen = False
