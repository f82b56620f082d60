"""Reads of a module's parameters that its own hooks do not see: a parent reading a child's weight
without calling the child (``F.linear(x, self.head.weight)``, MultiheadAttention's ``out_proj.weight``)
goes through the child's ``_parameters``, which `watch_reads` replaces by a `ParamDict` that tells the
hooks of a partitioned parameter read there (docs/design.md, "External parameters")."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..partition.param import PartitionedParameter
from .refusals import refuse_copy


class ParamDict(dict):
    """``module._parameters`` replacement that notices another module's partitioned param in use."""

    __slots__ = ("owner", "hooks")

    def __getitem__(self, key: str) -> Any:
        p = dict.__getitem__(self, key)
        if type(p) is PartitionedParameter:
            self.hooks._on_access(p)
        return p

    def __reduce_ex__(self, protocol: Any) -> Any:  # copy.deepcopy and pickle reach it first in a module
        raise refuse_copy(self.owner)



def watch_reads(m: nn.Module, hooks: Any) -> None:
    """Replace ``m._parameters`` by a `ParamDict`, which tells ``hooks`` of a partitioned read."""
    pd = ParamDict(m._parameters)
    pd.owner, pd.hooks = m, hooks
    m._parameters = pd


def unwatch_reads(m: nn.Module, hooks: Any) -> None:
    """Give ``m`` back a plain ``_parameters`` where ``hooks`` watch it."""
    if isinstance(m._parameters, ParamDict) and m._parameters.hooks is hooks:
        m._parameters = dict(m._parameters)
