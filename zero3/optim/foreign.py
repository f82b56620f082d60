"""A torch optimizer over zero3's parameters themselves, which zero3 never steps: refused at its step.

zero3 steps the optimizer it was given over this rank's shards (optimizer.py) and reduces every
gradient into a shard's ``.grad``, never into ``param.grad``. An optimizer built over
``model.parameters()`` after ``zero3.initialize`` (FSDP2's order: shard first, then build the
optimizer) or never passed to it holds the parameters instead: its ``step()`` finds no gradient on a
parameter kept gathered and changes nothing, silently. torch calls every optimizer's global step
pre-hooks, so one hook, registered once per process, catches it at the first step.

The same hook refuses a plain parameter of a model zero3 manages (a module added after
``initialize``: its parameters are not partitioned): no hook averages its gradient across ranks, so
each rank would step its own copy and the ranks would drift apart, silently. The optimizer zero3
steps refuses either kind in ``add_param_group``, when it is called (`guard_groups`): its groups
hold the shards set up at ``initialize``.
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
_managed: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # models zero3's hooks are on
_owned: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers zero3 steps (guard_groups)


def install() -> None:
    """Register the step pre-hook (idempotent)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_before_step)
        _installed = True


def manage(model: torch.nn.Module) -> None:
    """zero3's hooks are on ``model`` (until `release`): a plain parameter of it in an optimizer is refused."""
    _managed.add(model)


def release(model: torch.nn.Module) -> None:
    _managed.discard(model)


def guard_groups(optimizer: torch.optim.Optimizer) -> None:
    """From now on ``optimizer.add_param_group`` refuses, before adding anything, a zero3 parameter (the
    optimizer's groups hold shards set up at ``initialize``) or a plain parameter of a managed model;
    other plain parameters join as in torch."""
    original = optimizer.add_param_group
    _owned.add(optimizer)

    def add_param_group(param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        zp = next((p for p in params if isinstance(p, ZeroParameter)), None)
        if zp is not None and any(t is zp._zero.train_tensor for g in optimizer.param_groups for t in g["params"]):
            raise ZeroStateError(  # probe 37D: it was told it would get no gradient
                f"{type(optimizer).__name__}.add_param_group() with {zp._zero.name or zp._zero.summary()}, which this "
                "optimizer steps already (its shard is in a group): a parameter may be in one group only, as torch "
                "refuses ('some parameters appear in more than one parameter group'). To change its hyperparameters, "
                "change its group's entries (optimizer.param_groups[i]['lr'] = ...). Nothing was added")
        if zp is not None:
            raise ZeroStateError(
                f"{type(optimizer).__name__}.add_param_group() after zero3.initialize with a zero3 parameter "
                f"({zp._zero.name or zp._zero.summary()}): zero3 steps this optimizer over the shards it set up at "
                "initialize, and this one would get no gradient. Put every parameter to train in the optimizer "
                "before zero3.initialize (a group of its own for those to add later), freeze those right after it "
                "(requires_grad_(False)) and unfreeze them when they should train, which trains as torch does. "
                "Nothing was added")
        _refuse_plain(f"{type(optimizer).__name__}.add_param_group()", params, "added")
        original(dict(param_group, params=params))

    optimizer.add_param_group = add_param_group  # type: ignore[method-assign]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    groups = optimizer.param_groups
    shape = tuple(len(g["params"]) for g in groups)
    if _checked.get(optimizer) == shape:  # the same groups as at a step that passed: one check each
        return
    for g in groups:
        for p in g["params"]:
            if isinstance(p, ZeroParameter):
                _refuse(optimizer, p, sum(isinstance(q, ZeroParameter) for h in groups for q in h["params"]))
    if _managed and optimizer not in _owned:  # zero3's own hold shards; their add_param_group checks
        _refuse_plain(f"{type(optimizer).__name__}.step()", [p for g in groups for p in g["params"]], "stepped")
    _checked[optimizer] = shape


def _refuse_plain(what: str, params: list[Any], verb: str) -> None:
    """Refuse a plain (unpartitioned) parameter of a model zero3 manages among ``params``."""
    held = {id(p) for p in params if not isinstance(p, ZeroParameter)}
    if not held:
        return
    for model in list(_managed):
        for name, p in model.named_parameters():
            if id(p) in held:
                raise ZeroStateError(
                    f"{what}: {name!r} {tuple(p.shape)} is a parameter of a model zero3 manages that is not "
                    "partitioned (it, or its module, was added after zero3.initialize: a module set as an attribute, "
                    "a parameter appended to a ParameterList or ParameterDict, or made in a forward). No hook "
                    "averages its gradient across ranks, so each rank would step its own copy and the ranks would "
                    "drift apart. Add it before zero3.initialize (initialize partitions it and it trains with the "
                    f"others). Nothing was {verb}")


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
