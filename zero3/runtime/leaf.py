"""Leaf modules: a module whose whole subtree zero3 treats as one unit (DeepSpeed's z3 leaf modules).

A leaf gets hooks only on itself: entering it gathers every parameter of its subtree at once,
leaving it releases them, and in backward their gradients are reduced together, a gradient of zeros
standing in for a parameter that got none on this rank (an expert no token of this rank reached).
So ranks whose tokens route to different experts run the same module events and issue the same
collectives. A parameter that got a gradient on no rank keeps none, as in a single process.

A module inside a leaf that the model also reaches outside every leaf (a submodule shared with a
parent that is no leaf) gets hooks of its own too, so a call of it there gathers its parameters.
The others get no hooks, but a read of their parameters from another module's forward is seen, as
any module's (param_reads.py `watch_reads`).

[Note: a leaf whose output needs no grad on some rank]
A leaf called once in a step has its unit reduced when that call's backward ends (hooks.py
`_post_backward`), else at the backward's end (`LeafUnit.end_of_backward`). Where a leaf's output
needs no grad on one rank only (every token of that rank routed to a null, "zero-computation",
expert), its backward runs on the other ranks only, so its unit is reduced in another place there,
and in the pre-norm block (``h + moe(ln(h))``) ``ln``'s parameters get a gradient on the other ranks
only: the ranks reduce different sets (ZeroDivergenceError with ``verify_collectives``, the default;
0.029-0.033 off one process in 3 steps without; probe 33Y, world 2). Not fixed; docs/api.md gives
the way around it (the model keeps the leaf's output in the graph on every rank: the null expert's
pass-through scaled by its router probability, or ``+ 0 * probs.sum()``). Two fixes were tried this
round and dropped, each on a review's numbers: a tensor hook on the call's inputs as the reduction
point (it stayed on inputs that outlive the step and fired in later steps: ZeroDivergenceError /
0.037 off where the code before was exact; and it held a leaf's gradients until its input's gradient
was ready, after a whole deep stack's backward), and tying the output to the inputs by a zero
gradient on such a rank (at world size 1 every all-null batch then gave ``ln`` zeros where torch
leaves None, 0.0077 off torch in 3 steps, as did the same on every rank at any world size; and a
leaf returning a detached value on purpose got one that needs grad).

[Note: a leaf called inside and outside a checkpoint]
A leaf's unit is reduced once its only call's backward is done (`LeafUnit.flush`), or at the end of the
backward. A checkpointed call is not counted (its forward runs under no_grad), so with a call inside
a checkpoint and one outside, the unit was reduced after one call's backward and the other's
gradients came after it, each reduced alone: which of them came depended on each rank's data (a
mixture of experts' routing), so the ranks ran different collectives (probe 26A, world 2). Now a
recompute stops that early reduction, and a recompute after it reopens the unit: every rank
recomputes the same calls, so every rank reduces the unit once more at the backward's end, with the
gradients held since.

[Note: a leaf's gradient from outside it]
A leaf's parameter can get a gradient in a step the leaf does not take part in: tied to a module
outside it, or a submodule shared with a parent that is no leaf (which then has hooks of its own).
No rank reduces the leaf's unit then (it ran nowhere), so that gradient is reduced alone, as any
other parameter's; it was held for the unit and dropped at the step's end (probe 25C). With the
optimizer step in backward the first backward already stepped: a gradient after that fails the step
(optim/backward_step.py). A backward with ``create_graph=True`` is another matter: the graph it
builds saves the gathered weights, which the module's post-backward releases, so it is refused
(refusals.py `create_graph_refusal`) unless the call's parameters are held by ``GatheredParameters``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import ZeroConfigError, ZeroStateError

if TYPE_CHECKING:
    from ..partition.param import ZeroParameter
    from .grad import GradientReducer

LEAF_ATTR = "_zero3_leaf"
DEEPSPEED_LEAF_ATTR = "_z3_leaf"  # DeepSpeed's flag (deepspeed.utils.set_z3_leaf_module), read as ours


def set_leaf_modules(model: nn.Module, targets: Iterable[type | str], *,
                     missing_ok: bool = False) -> list[nn.Module]:
    """Mark modules of ``model`` as leaf modules; call it before ``zero3.initialize``.

    Args:
        model: the model.
        targets: module classes (every instance is a leaf), class names, qualified class names
            (``"pkg.moe.MoEBlock"``), or qualified module names (``"blocks.3.moe"``).
        missing_ok: skip a target that matches no module instead of refusing it (DeepSpeed's
            ``raise_if_not_found=False``).

    Returns:
        The modules marked.

    Raises:
        ValueError: a target matches no module of ``model``, or is neither a class nor a string.
        ZeroStateError: ``model`` was already given to ``zero3.initialize``.
    """
    refuse_after_initialize(model, "set_leaf_modules", "the hooks are installed then (or list the classes in the "
                            "config key leaf_modules)")
    marked = find_modules(model, targets, "set_leaf_modules", missing_ok)
    for m in marked:
        mark_leaf(m, True)
    return marked


def unset_leaf_modules(model: nn.Module, targets: Iterable[type | str], *,
                       missing_ok: bool = False) -> list[nn.Module]:
    """Undo `set_leaf_modules` for the modules ``targets`` name (DeepSpeed's ``unset_z3_leaf_modules``);
    before ``zero3.initialize`` only, as setting is (``missing_ok`` as there). Returns the modules unmarked."""
    refuse_after_initialize(model, "unset_leaf_modules")
    unmarked = find_modules(model, targets, "unset_leaf_modules", missing_ok)
    for m in unmarked:
        m.__dict__.pop(LEAF_ATTR, None)
        m.__dict__.pop(DEEPSPEED_LEAF_ATTR, None)
    return unmarked


def refuse_after_initialize(model: nn.Module, caller: str, why: str = "the hooks are installed then") -> None:
    """Refuse ``caller`` on ``model`` (a model or any module of one) that an engine manages: marks are
    read once, by ``zero3.initialize`` (a module's parameters tell, where the root's context does not:
    a submodule marked later was taken and ignored, review 33RD)."""
    if not isinstance(model, nn.Module):
        return  # find_modules names the bad argument
    if model.__dict__.get("_zero3_context") is not None or any(
            (ctx := getattr(getattr(p, "_zero", None), "ctx", None)) is not None and ctx.attached
            for p in model.parameters()):
        raise ZeroStateError(f"{caller} must be called before zero3.initialize: {why}")


def mark_leaf(module: nn.Module, flag: bool) -> None:
    """Mark (or unmark) ``module`` a leaf: zero3's flag, and DeepSpeed's where code written for DeepSpeed
    set it (`is_leaf` reads DeepSpeed's first where it is there, so ``m._z3_leaf = False`` unmarks)."""
    setattr(module, LEAF_ATTR, flag)
    if DEEPSPEED_LEAF_ATTR in module.__dict__:
        setattr(module, DEEPSPEED_LEAF_ATTR, flag)


def find_modules(model: nn.Module, targets: Iterable[type | str], caller: str,
                 missing_ok: bool = False) -> list[nn.Module]:
    """The modules of ``model`` that ``targets`` name: classes (every instance), class names or qualified
    module names, in the order of the targets (one class or name alone counts as a list of it: a string
    would otherwise be read letter by letter); ``caller`` names the public function in errors; a target
    matching no module is refused, or skipped with ``missing_ok``."""
    if isinstance(targets, (str, type)):
        targets = [targets]
    if not isinstance(model, nn.Module):
        raise ZeroConfigError(f"{caller}: the model must be an nn.Module, got {type(model).__name__}")
    if not hasattr(targets, "__iter__"):
        raise ZeroConfigError(f"{caller}: targets must be module classes, class names or qualified module names "
                              f"(one, or a list of them), got {targets!r}")
    named = list(model.named_modules())
    found: list[nn.Module] = []
    for target in targets:
        if isinstance(target, type):
            hits = [m for _, m in named if isinstance(m, target)]
        elif isinstance(target, str):  # a module's name, its class's name, or (DeepSpeed's) its qualified one
            hits = [m for name, m in named if name == target or type(m).__name__ == target
                    or f"{type(m).__module__}.{type(m).__qualname__}" == target]
        else:
            raise ZeroConfigError(f"{caller}: a target must be a module class or a name, got {target!r}")
        if not hits and not missing_ok:
            classes = sorted({type(m).__name__ for _, m in named})
            raise ZeroConfigError(f"{caller}: {target!r} matches no module of the model (its classes: "
                                  f"{', '.join(classes)})")
        found.extend(hits)
    return found


def check_leaf_classes(model: nn.Module, class_names: Iterable[str]) -> None:
    """The config's ``leaf_modules`` each name the class of a module of ``model``: one that names none
    (a misspelling, a module name) would leave routed experts unmarked, silently."""
    classes = {type(m).__name__ for m in model.modules()}
    for name in class_names:
        if name not in classes:
            raise ZeroConfigError(f"leaf_modules: {name!r} is the class name of no module of the model (its classes: "
                                  f"{', '.join(sorted(classes))}); zero3.set_leaf_modules(model, ...) also takes "
                                  "qualified module names")


def is_leaf(module: nn.Module, class_names: Iterable[str] = ()) -> bool:
    """Whether ``module`` is a leaf: marked by `set_leaf_modules` (or with DeepSpeed's own flag, which
    its ``set_z3_leaf_module(m, True)`` and code written for it set), or its class is listed."""
    d = module.__dict__
    marked = d[DEEPSPEED_LEAF_ATTR] if DEEPSPEED_LEAF_ATTR in d else d.get(LEAF_ATTR)
    return bool(marked) or type(module).__name__ in class_names


def leaf_modules(model: nn.Module, class_names: Iterable[str] = ()) -> list[nn.Module]:
    """The leaf modules of ``model`` (outermost ones; a leaf inside a leaf is part of it)."""
    names = tuple(class_names)
    out: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            continue
        if is_leaf(m, names):
            out.append(m)
            inside.update(id(d) for d in m.modules())
    return out


def reached_outside_leaves(model: nn.Module, class_names: Iterable[str] = ()) -> set[int]:
    """The ids of the modules of ``model`` reached from it through no leaf module (leaves included)."""
    seen: set[int] = set()
    todo = [model]
    while todo:
        m = todo.pop()
        if id(m) not in seen:
            seen.add(id(m))
            if not is_leaf(m, class_names):
                todo.extend(c for c in m._modules.values() if c is not None)
    return seen


@dataclass(eq=False)
class LeafUnit:
    """A leaf module's trainable parameters, reduced as one unit once per backward (the module docstring)."""

    params: list[ZeroParameter]  # sorted by id: the same order on every rank
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # id(param) -> full gradient, held
    calls: int = 0  # forward calls in this step (recompute not counted)
    flushed: bool = False
    reopened: bool = False  # a call's backward runs after an end of step reset ``calls``: reduce at this backward's end

    def flush(self, reducer: GradientReducer) -> None:
        if not self.flushed:
            self.flushed = True
            reducer.add_unit([(p, self.grads.pop(id(p), None)) for p in self.params])

    def end_of_backward(self, reducer: GradientReducer) -> None:
        """Reduce the unit if the leaf took part in this backward and it was not reduced yet."""
        if (self.calls or self.reopened) and (self.grads or not self.flushed):
            self.flush(reducer)

    def reset(self) -> None:
        self.calls, self.flushed, self.reopened = 0, False, False
        self.grads.clear()
