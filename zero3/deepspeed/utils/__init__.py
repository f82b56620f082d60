"""``deepspeed.utils`` names over zero3: the accessors of full and local parameters, gradients and
optimizer state (zero3's own, accessors.py); DeepSpeed's MoE calls ``set_z3_leaf_modules``,
``unset_z3_leaf_modules``, ``get_z3_leaf_modules`` and ``z3_leaf_module`` (runtime/leaf.py, marks read by
``zero3.initialize``); ``zero3.deepspeed.utils.zero_to_fp32`` (imported by name,
as DeepSpeed's) converts a checkpoint to fp32 weights without a model or an engine. Only what zero3
implements is here."""

from __future__ import annotations

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
from ...runtime.leaf import LEAF_ATTR
from ...runtime.leaf import set_leaf_modules as set_z3_leaf_modules
from ...runtime.leaf import unset_leaf_modules as unset_z3_leaf_modules


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` is marked a leaf module by ``set_z3_leaf_modules`` (DeepSpeed's name)."""
    return bool(model.__dict__.get(LEAF_ATTR))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` marked leaf modules by ``set_z3_leaf_modules`` (DeepSpeed's name)."""
    return [m for m in model.modules() if z3_leaf_module(m)]


__all__ = ["get_z3_leaf_modules", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"]
