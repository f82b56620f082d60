"""A live engine's state as the checkpoint names it: the ``state_dict`` layout and buffers, which
optimizer state is per-element, and the optimizer's param groups with parameter names for tensors.
Saving writes these into the metadata; loading compares them with it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..partition.param import ZeroParameter
from .format import to_json

if TYPE_CHECKING:
    from ..optim.optimizer import PartitionedOptimizer
    from ..runtime.context import RuntimeContext


def state_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict(keep_vars=True)``'s keys, in its order, each with the tensor itself: the
    parameter object (tied names sharing it) or the buffer. Not through ``state_dict()``, whose hooks
    hand out copies of gathered parameters (runtime/hooks.py `_clone_gathered`): a persistent
    parameter, always gathered, would pass for a buffer."""
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


__all__ = ["is_sharded_state", "model_entries", "optimizer_groups"]
