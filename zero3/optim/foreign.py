"""A torch optimizer over zero3's parameters themselves, which zero3 never steps: refused at its step.

zero3 steps the optimizer it was given over this rank's shards (optimizer.py) and reduces every
gradient into a shard's ``.grad``, never into ``param.grad``. An optimizer built over
``model.parameters()`` after ``zero3.initialize`` (FSDP2's order: shard first, then build the
optimizer) or never passed to it holds the parameters instead: its ``step()`` finds no gradient on a
parameter kept gathered and changes nothing, silently. torch calls every optimizer's global step
pre-hooks, so one hook, registered once per process, catches it at the first step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import ZeroStateError
from ..partition.param import ZeroParameter

_installed = False
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, ...]]" = weakref.WeakKeyDictionary()


def install() -> None:
    """Register the step pre-hook (idempotent)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_before_step)
        _installed = True


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    groups = optimizer.param_groups
    shape = tuple(len(g["params"]) for g in groups)
    if _checked.get(optimizer) == shape:  # the same groups as at a step that passed: one check each
        return
    for g in groups:
        for p in g["params"]:
            if isinstance(p, ZeroParameter):
                _refuse(optimizer, p, sum(isinstance(q, ZeroParameter) for h in groups for q in h["params"]))
    _checked[optimizer] = shape


def _refuse(optimizer: torch.optim.Optimizer, p: ZeroParameter, count: int) -> None:
    raise ZeroStateError(
        f"{type(optimizer).__name__}.step(): this optimizer holds {count} zero3-partitioned parameters "
        f"(the first: {p._zero.name or p._zero.summary()}), not the shards zero3 steps. It was built over "
        "model.parameters() after zero3.initialize, never passed to it, or given them by add_param_group "
        "after it; zero3 reduces gradients into "
        "shards, so this optimizer would find no gradient and change nothing. Build it before "
        "zero3.initialize and pass it in (zero3.initialize(model, optimizer, config): zero3 then steps it "
        "over the shards, and optimizer.step() or engine.step() both work), or let the config's "
        "'optimizer' section build one")
