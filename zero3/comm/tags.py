"""What a collective is for (`Kind`) and what it moves (`Tag`): part of every verification header,
every byte count and every error message."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    """What a collective is for; part of every verification header."""

    PARAM_GATHER = "all-gather"
    SECONDARY_GATHER = "secondary all-gather"  # hpZ: from the secondary shards, inside a node group
    GRAD_REDUCE = "gradient reduction"
    ALL_REDUCE = "all-reduce"
    BROADCAST = "broadcast"
    TENSOR_GATHER = "tensor all-gather"
    GATHER_TO_ROOT = "gather to rank 0"
    OBJECTS = "object exchange"
    AGREE = "step agreement"


KIND_CODES = {k: i + 1 for i, k in enumerate(Kind)}
"""A kind as a small integer, for the blocking header exchange (`WireHeader.kind`)."""
OPTIMIZER_STEP = "optimizer step"  # the label of engine.step()'s agreement before it steps (Kind.AGREE)


@dataclass(frozen=True, slots=True)
class Tag:
    """What a collective moves: its kind, a label for messages (``pre_forward blocks.3``,
    ``clip_grad_norm_``), and the ids of the parameters it carries."""

    kind: Kind
    label: str = ""
    ids: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"{self.kind.value} for {self.label or 'a user request'}"
