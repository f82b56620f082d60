"""``deepspeed.utils`` names over zero3: the accessors of full and local parameters, gradients and
optimizer state (zero3's own, accessors.py); DeepSpeed's MoE calls ``set_z3_leaf_modules``,
``unset_z3_leaf_modules``, ``set_z3_leaf_module``, ``get_z3_leaf_modules`` and ``z3_leaf_module``
(runtime/leaf.py, marks read by ``zero3.initialize``, DeepSpeed's own ``_z3_leaf`` flag too);
``zero3.deepspeed.utils.zero_to_fp32`` (imported by name, as DeepSpeed's) converts a checkpoint to
fp32 weights without a model or an engine. Only what zero3 implements is here."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...accessors import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
from ...errors import ZeroConfigError
from ...runtime.leaf import (DEEPSPEED_LEAF_ATTR, is_leaf, mark_leaf, refuse_after_initialize, set_leaf_modules,
                              unset_leaf_modules)


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Any, raise_if_not_found: bool = True) -> list[nn.Module]:
    """DeepSpeed's name for `zero3.set_leaf_modules` (before ``zero3.initialize``), with DeepSpeed's
    rule for classes the model lacks: refused only where none of them matches a module (with
    ``raise_if_not_found``), the others skipped. Classes may be given by name or qualified name."""
    return _found(set_leaf_modules(model, leaf_module_classes, missing_ok=True), "set_z3_leaf_modules",
                  leaf_module_classes, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Any,
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    """DeepSpeed's name for undoing `set_z3_leaf_modules` (before ``zero3.initialize``); the same rule
    for classes the model lacks."""
    return _found(unset_leaf_modules(model, leaf_module_classes, missing_ok=True), "unset_z3_leaf_modules",
                  leaf_module_classes, raise_if_not_found)


def _found(modules: list[nn.Module], caller: str, classes: Any, raise_if_not_found: bool) -> list[nn.Module]:
    if not modules and raise_if_not_found:
        raise ZeroConfigError(f"{caller}: no module of the model is of {classes!r} (pass raise_if_not_found=False "
                              "to go on without one)")
    return modules


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """DeepSpeed's one-module switch: mark (``flag`` True) or unmark ``model`` itself as a leaf module,
    before ``zero3.initialize`` reads the marks (refused after: its hooks are installed then)."""
    refuse_after_initialize(model, "set_z3_leaf_module")
    setattr(model, DEEPSPEED_LEAF_ATTR, bool(flag))
    mark_leaf(model, bool(flag))


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is marked a leaf module (by ``set_z3_leaf_modules``, ``set_z3_leaf_module`` or
    DeepSpeed's ``_z3_leaf`` flag; DeepSpeed's name)."""
    return is_leaf(model)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` marked leaf modules (DeepSpeed's name)."""
    return [m for m in model.modules() if z3_leaf_module(m)]


__all__ = ["get_z3_leaf_modules", "set_z3_leaf_module", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "z3_leaf_module",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"]
