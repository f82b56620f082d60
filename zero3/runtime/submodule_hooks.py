"""zero3's forward hooks on the submodules of a model, as one set that can be taken off and put back.

A resident decode forward runs a model whose parameters are all gathered and stay so; torch's own
dispatch is then the fastest path, so the root's hook takes these off for that forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class SubmoduleHooks:
    """zero3's forward pre- and post-hooks on every hooked module but the root. A resident decode
    forward (hooks.py, [Note: resident decode forwards]) takes them off, so torch calls those modules without
    dispatching any hook of ours; the next forward that needs them puts them back first (the pre-hook
    first among a module's pre-hooks again, the post-hook after the post-hooks it has then)."""

    def __init__(self) -> None:
        self._hooks: list[tuple[nn.Module, Callable[..., Any], Callable[..., Any]]] = []
        self._handles: list[Any] = []
        self.suspended = False

    def add(self, m: nn.Module, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self._hooks.append((m, pre, post))
        if not self.suspended:  # else `resume` registers it
            self._register(m, pre, post)

    def _register(self, m: nn.Module, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self._handles.append(m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
        # always_call: a forward that raises still closes its visit and releases its params.
        self._handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))

    def suspend(self) -> None:
        if not self.suspended:
            self._drop()
            self.suspended = True

    def resume(self) -> None:
        if self.suspended:
            for m, pre, post in self._hooks:
                self._register(m, pre, post)
            self.suspended = False

    def remove(self) -> None:
        self._drop()
        self._hooks.clear()
        self.suspended = False

    def _drop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
