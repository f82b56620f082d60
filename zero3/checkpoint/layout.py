"""A live engine's state as the checkpoint names it: the ``state_dict`` layout and buffers, the
modules with extra state, which optimizer state is per-element, and the optimizer's param groups
with parameter names for tensors. Saving writes these into the metadata; loading compares them with it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..partition.param import ZeroParameter
from .format import to_json

if TYPE_CHECKING:
    from ..optim.optimizer import PartitionedOptimizer
    from ..runtime.context import RuntimeContext


EXTRA_STATE_KEY = "_extra_state"
"""The last part of a module's extra-state key in ``state_dict()`` (torch's ``_EXTRA_STATE_KEY_SUFFIX``)."""


def state_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict(keep_vars=True)``'s keys, in its order, each with the tensor itself: the
    parameter object (tied names sharing it) or the buffer. Not through ``state_dict()``, whose hooks
    copy gathered parameters inside ``GatheredParameters`` (runtime/handed_copies.py `copy_gathered_state`),
    and which a user's state-dict hooks may change."""
    out: dict[str, torch.Tensor] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, p in dict.items(m._parameters):
            if p is not None:
                out[dot + name] = p
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[dot + name] = b
    return out


def extra_state_modules(module: torch.nn.Module,
                        method: str = "get_extra_state") -> dict[str, tuple[int, torch.nn.Module]]:
    """The modules of ``module`` (itself included) whose class overrides ``method``, torch's test:
    ``get_extra_state`` names those whose extra state ``state_dict()`` holds, ``set_extra_state``
    those ``load_state_dict`` hands it to. Keyed ``<prefix>._extra_state`` as ``state_dict()`` keys
    them, in its order; each with the number of `state_tensors` keys before its own."""
    out: dict[str, tuple[int, torch.nn.Module]] = {}
    before = 0
    for prefix, m in module.named_modules(remove_duplicate=False):
        before += sum(p is not None for p in dict.values(m._parameters))
        before += sum(b is not None and name not in m._non_persistent_buffers_set for name, b in m._buffers.items())
        if getattr(type(m), method) is not getattr(torch.nn.Module, method):
            out[f"{prefix}.{EXTRA_STATE_KEY}" if prefix else EXTRA_STATE_KEY] = (before, m)
    return out


def model_entries(ctx: RuntimeContext) -> tuple[list[list[str]], dict[str, torch.Tensor]]:
    """(state_dict layout, buffers): layout rows are [key, "param", canonical name] or [key, "buffer", key]."""
    canonical = {id(p): p._zero.name for p in ctx.params}
    layout: list[list[str]] = []
    buffers: dict[str, torch.Tensor] = {}
    for key, value in state_tensors(ctx.module).items():
        if isinstance(value, ZeroParameter) and id(value) in canonical:
            layout.append([key, "param", canonical[id(value)]])
        elif isinstance(value, torch.Tensor):
            layout.append([key, "buffer", key])
            buffers[key] = value.detach()
    return layout, buffers


def is_sharded_state(v: Any, master: torch.Tensor) -> bool:
    """Optimizer state stored as ranges of the flat parameter (one value per master element)."""
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == master.numel()


def optimizer_groups(optimizer: PartitionedOptimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters (encoded with `to_json`), with the names of its parameters
    instead of tensors."""
    groups = []
    for i, (hyper, names) in enumerate(zip(optimizer.group_hyperparameters(), optimizer.group_param_names())):
        group = {k: to_json(v, f"optimizer.param_groups[{i}][{k!r}]") for k, v in hyper.items()}
        group["params"] = names
        groups.append(group)
    return groups


__all__ = ["EXTRA_STATE_KEY", "extra_state_modules", "is_sharded_state", "model_entries", "optimizer_groups"]
