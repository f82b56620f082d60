"""Lifecycle enums and their tables of legal transitions: a parameter's status and a step's phase."""

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


class StepPhase(Enum):
    """Where the model is in a training step, as the hooks see it (hooks.py).

    - IDLE: between steps. Only persistent parameters and those held by ``GatheredParameters`` are
      gathered; no module visit is open and no gradient is pending.
    - FORWARD: at least one forward ran since the step began (several may run before a backward);
      gathered parameters are those of running modules, prefetches and reuse keeps.
    - BACKWARD: a backward is running (forwards may run inside it: activation-checkpoint recompute);
      gradients are being reduced into shards.
    A step returns to IDLE when its backward ends, when an inference forward (no grad) returns, when
    ``engine.step()`` runs, or when it is aborted (an exception in forward or backward).
    """

    IDLE = auto()
    FORWARD = auto()
    BACKWARD = auto()


_PHASES = {
    (StepPhase.IDLE, StepPhase.FORWARD),
    (StepPhase.IDLE, StepPhase.BACKWARD),  # a backward through a graph built before the step began
    (StepPhase.FORWARD, StepPhase.BACKWARD),
    (StepPhase.FORWARD, StepPhase.IDLE),
    (StepPhase.BACKWARD, StepPhase.IDLE),
}


def check_phase(old: StepPhase, new: StepPhase) -> None:
    if old is not new and (old, new) not in _PHASES:
        raise ZeroStateError(f"illegal step phase change {old.name} -> {new.name}")


class CallState(Enum):
    """One forward call of a module with gathered parameters (hooks.py ``_Call``).

    - OPEN: its PRE_FORWARD event was recorded; its parameters are pinned until POST_FORWARD.
    - JOINED: it had no parameters to gather at entry but its forward used another module's
      partitioned parameter, which was pinned for it (an automatic external parameter); no event
      was recorded, so closing it only unpins.
    - FORWARD_DONE: its forward returned; a gradient reaching its outputs will open its backward.
    - BACKWARD_OPEN: PRE_BACKWARD recorded; its parameters are pinned until POST_BACKWARD.
    - BACKWARD_DONE: POST_BACKWARD recorded; nothing more happens to this call.
    """

    OPEN = auto()
    JOINED = auto()
    FORWARD_DONE = auto()
    BACKWARD_OPEN = auto()
    BACKWARD_DONE = auto()
