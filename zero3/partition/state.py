"""Lifecycle enums and their tables of legal transitions: a parameter's status, where its shard's bytes
are, and a step's phase."""

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


class Residence(Enum):
    """Where the bytes of a parameter shard are (``ZeroParam.residence``; offload/residence.py
    `ShardStore` is its one writer), or those of a storage swapped by the NVMe tier (nvme.py).

    - DEVICE: in accelerator memory.
    - HOST: in pageable CPU memory.
    - PINNED_HOST: in pinned CPU memory (a pinned shard, or a span of the pinned buffer pool).
    - WRITING: being written to its swap-file region; the memory is freed once the write is done.
    - DRIVE: only in its swap-file region; the storage holds 0 bytes.
    - READING: being read back from the drive; not readable until waited for.
    - STATES_OUT: ``engine.offload_states`` took the bytes out of memory until ``reload_states``.
    With ``ParamStatus``: a shard is gathered (NOT_AVAILABLE -> INFLIGHT) only from a memory place
    (`param.begin_gather`); it is rebound to another tensor only while NOT_AVAILABLE and in memory;
    it is taken out (STATES_OUT) while NOT_AVAILABLE or AVAILABLE (a persistent parameter stays
    gathered, its full data taken with it), never while INFLIGHT; an AVAILABLE parameter's shard may
    be on the drive (dropped once its gather was done).
    """

    DEVICE = auto()
    HOST = auto()
    PINNED_HOST = auto()
    WRITING = auto()
    DRIVE = auto()
    READING = auto()
    STATES_OUT = auto()

    @property
    def in_memory(self) -> bool:
        return self in MEMORY


MEMORY = frozenset({Residence.DEVICE, Residence.HOST, Residence.PINNED_HOST})

_MOVES = (
    {(a, b) for a in MEMORY for b in MEMORY}  # a copy, a cast or a view into another buffer (a rebind)
    | {(m, Residence.WRITING) for m in MEMORY}
    | {(m, Residence.DRIVE) for m in MEMORY}  # a clean copy is dropped without a write
    | {(Residence.DRIVE, m) for m in MEMORY}  # memory for a value that replaces it whole: nothing is read
    | {(Residence.READING, m) for m in MEMORY}
    | {(Residence.WRITING, m) for m in MEMORY}  # a write failed: the bytes are still (only) in memory
    | {(m, Residence.STATES_OUT) for m in MEMORY}
    | {(Residence.STATES_OUT, m) for m in MEMORY}  # reload_states: back where they were (`ShardStore`)
    | {(Residence.DRIVE, Residence.READING),
       (Residence.DRIVE, Residence.WRITING),  # a new value is written over the region from other memory
       (Residence.READING, Residence.DRIVE),  # a read failed: the bytes are still (only) on the drive
       (Residence.WRITING, Residence.DRIVE)}  # written (or a failed `ShardTier.store`: its error is raised)
)


def legal_move(old: Residence, new: Residence) -> bool:
    return (old, new) in _MOVES


def check_move(what: str, old: Residence, new: Residence) -> None:
    if not legal_move(old, new):
        raise ZeroStateError(f"{what}: illegal residence change {old.name} -> {new.name}")


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
