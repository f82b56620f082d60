"""A partitioned parameter's status and its table of legal transitions (a step's phase: runtime/step.py)."""

from __future__ import annotations

from enum import Enum, auto

from ..errors import ZeroStateError


class ParamStatus(Enum):
    """Where a partitioned parameter's full data is.

    - NOT_AVAILABLE: only this rank's shard is resident (``ds_numel / world`` elements, padded);
      ``param.data`` is an empty placeholder and computing with the parameter raises.
    - INFLIGHT: an all-gather into a new buffer was issued and not yet waited on; the buffer counts
      as live memory.
    - AVAILABLE: the full tensor is ``param.data``; counts toward ``max_live_parameters`` unless the
      parameter is persistent.
    """

    NOT_AVAILABLE = auto()
    INFLIGHT = auto()
    AVAILABLE = auto()


_LEGAL = {
    (ParamStatus.NOT_AVAILABLE, ParamStatus.INFLIGHT),
    (ParamStatus.INFLIGHT, ParamStatus.AVAILABLE),
    (ParamStatus.AVAILABLE, ParamStatus.NOT_AVAILABLE),
}


def check_transition(name: str, old: ParamStatus, new: ParamStatus) -> None:
    if (old, new) not in _LEGAL:
        raise ZeroStateError(f"parameter {name!r}: illegal status change {old.name} -> {new.name}")
