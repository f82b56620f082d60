"""zero3's gradient hook on a parameter stays the last of its post-accumulate-grad hooks.

[Note: the user's gradient hooks]
zero3 takes a parameter's gradient in a ``register_post_accumulate_grad_hook`` (hooks.py): it hands
the full gradient to the reducer and sets ``p.grad`` to None. torch runs a tensor's hooks in the
order they were registered, so a hook the user registers after ``initialize`` (a per-parameter
gradient log, zeroing a gradient to hold a weight still) ran after zero3's and saw ``p.grad`` None,
and what it wrote into the gradient was lost, silently. So ``initialize`` gives each trainable
parameter its own ``register_post_accumulate_grad_hook`` (an instance attribute, found before the
class's method) that registers as torch does and then moves zero3's hook behind the new one. Every
user hook then runs before zero3's, as one registered before ``initialize`` does: it sees this
rank's full gradient of this backward, before the reduction (the gradient of this rank's batch, not
the global one; under accumulation, this micro-batch's alone, undivided: docs/api.md), and what it
writes there is what zero3 reduces.

torch snapshots a tensor's hooks when it calls them (``PyDict_Values``), in the order of the
underlying dict, which ``OrderedDict.move_to_end`` does not change: zero3's entry is popped and
inserted again instead. Its handle keeps working: same dict, same key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

_ATTR = "register_post_accumulate_grad_hook"


class LastGradHook:
    """The handle of zero3's hook on one parameter; ``remove()`` takes the hook off and gives the
    parameter back torch's own registration method."""

    def __init__(self, p: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        self._param = p
        self._handle = torch.Tensor.register_post_accumulate_grad_hook(p, hook)
        p.__dict__[_ATTR] = self._register_before  # an instance attribute: torch's method stays for others

    def _register_before(self, hook: Callable[[torch.Tensor], Any]) -> RemovableHandle:
        handle = torch.Tensor.register_post_accumulate_grad_hook(self._param, hook)
        hooks = self._param._post_accumulate_grad_hooks
        key = self._handle.id
        if hooks is not None and key in hooks:
            hooks[key] = hooks.pop(key)  # to the end of the dict's own order (see the Note)
        return handle

    def remove(self) -> None:
        self._handle.remove()
        if self._param.__dict__.get(_ATTR) == self._register_before:
            del self._param.__dict__[_ATTR]
