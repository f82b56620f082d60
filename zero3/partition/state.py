"""A partitioned parameter's lifecycle enums and their tables of legal transitions: its status
(`ParamStatus`) and where its shard's bytes are (`Residence`). A step's phase: runtime/step.py."""

from __future__ import annotations

from enum import Enum, auto

from ..errors import ZeroStateError


class ParamStatus(Enum):
    """Where a partitioned parameter's full data is.

    - NOT_AVAILABLE: only this rank's shard is resident (``ds_numel / world`` elements, padded);
      ``param.data`` is an empty placeholder and computing with the parameter raises.
    - INFLIGHT: an all-gather into the parameter's own (resized) storage was issued and not yet
      waited on; that storage counts as live memory.
    - AVAILABLE: the full tensor is ``param.data``; counts toward ``max_live_parameters`` unless the
      parameter is persistent.
    """

    NOT_AVAILABLE = auto()
    INFLIGHT = auto()
    AVAILABLE = auto()

    # Members are singletons compared by identity; Enum's own hash is a Python call, and every
    # status change of every parameter hashes two members (`check_transition`).
    __hash__ = object.__hash__


LEGAL_STATUS_CHANGES = frozenset({
    (ParamStatus.NOT_AVAILABLE, ParamStatus.INFLIGHT),
    (ParamStatus.INFLIGHT, ParamStatus.AVAILABLE),
    (ParamStatus.AVAILABLE, ParamStatus.NOT_AVAILABLE),
})


# The same table by the status changed from: what `ZeroParam.set_status` looks up on every change,
# without building an (old, new) tuple (three changes per gather; tuples feed the cyclic GC).
LEGAL_NEXT_STATUS: dict[ParamStatus, frozenset[ParamStatus]] = {
    old: frozenset(new for o, new in LEGAL_STATUS_CHANGES if o is old) for old in ParamStatus
}


def check_transition(name: str, old: ParamStatus, new: ParamStatus) -> None:
    if new not in LEGAL_NEXT_STATUS[old]:
        raise ZeroStateError(f"parameter {name!r}: illegal status change {old.name} -> {new.name}")


class Residence(Enum):
    """Where the bytes of a parameter shard are (``ZeroParam.residence``; offload/residence.py
    `ShardStore` is its one writer), or those of a storage swapped by the NVMe tier (offload/nvme.py).

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

    __hash__ = object.__hash__  # identity, as `ParamStatus`: checked on every gather

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
