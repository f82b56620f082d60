"""Parameter gathers through shared memory, for ranks on one machine (``allgather_impl="shm"``).

[Note: shared shards]
On gloo, a pairwise message costs a rank 0.5-0.7 ms of CPU a MiB (benchmarks/bench_p2p_cost.py);
reading the same bytes from a file in ``/dev/shm`` costs 0.05-0.15 ms. So when every rank of the
group runs on one node, each rank keeps its parameter shards in a file of its own there (its
*arena*: one slot per parameter, at the same offset on every rank), and a gather reads each peer's
piece straight from the peer's arena into the parameter's storage (``os.preadv``: no mapping of the
peer's memory, so a rank's resident set does not grow by its peers' shards). Nothing travels on
the wire and no peer takes part: a read is not a collective.

What makes a read safe is *when* it happens. zero3 changes shards between steps (the optimizer, but for one case below;
checkpoint loads, ``offload_states``; ``GatheredParameters`` write-backs and the ``safe_set_*``
accessors are meant for between steps too, `RuntimeContext.resident`), so reads happen only
inside a step, in a *window* (`WindowState`) that opens at the step's first gather with a barrier
(every rank finished what it wrote before the step) and closes at the step's end with another
(every rank finished reading before anyone writes). A ``GatheredParameters(modifier_rank=...)``
inside a step pauses the window with a barrier before it writes (`pause`: it is a collective).
Gathers outside steps travel pairwise as before. The one writer inside a window is the optimizer
step in backward (``offload_optimizer_step_in_backward``): it writes a parameter's shards only after
every peer sent its part of that parameter's gradient, so after every read a peer made for its uses
in that backward; a later read is caught (optim/backward_step.py [Note: optimizer step in backward]).
Each barrier is a verified all-reduce; the
opening one carries each rank's count of shards still in their slots, and ranks that disagree
(one moved its shards out) turn the window off for good, on every rank.

An aborted step (an exception in forward or backward) closes without the barrier, since the other
ranks may never reach it (they learn of the abort from the communicator's epoch), so a peer may
still be reading this rank's arena while this rank goes on and writes its shards (a checkpoint
load, say). So when the window was open (or the closing barrier failed, a peer having aborted),
the rank's shards move into memory of their own (same tensors) and sharing turns off for good
(`evacuate`, from runtime/step.py `close_window`): its later writes never touch what a
peer reads, and the peers, which abort at their next collective with this rank, do the same, so
every rank's gathers go on the wire from then on. A rank-local ``safe_set_*_fp32_param`` inside an
open window is refused (`may_be_read`); a user's own in-place change of a shard tensor inside a
step is not seen.

A rank creates its arena when the engine is built (`SharedShards.create`, a collective), opens
every peer's, and unlinks its own file once all have opened theirs, so no file outlives the job.
Gradient reductions pass through shared memory inside the same window (shared_reduce.py
[Note: shared reductions]).
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import logging
import os
import sys
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import ZeroStateError
from ..partition.param import ZeroParameter

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SLOT_ALIGN = 64  # bytes: every slot starts on a cache line


def available() -> bool:
    """Whether this host can share shards: Linux's ``/dev/shm``, ``preadv`` and ``posix_fallocate``."""
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR) and hasattr(os, "preadv") \
        and hasattr(os, "posix_fallocate")


def close_fds(fds: dict[int, int]) -> None:
    """Close every descriptor in ``fds`` (ignoring ones closed already) and empty it."""
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def open_peers(rank: int, paths: Sequence[str], error: str | None,
               exchange: Callable[[Any], list[Any]]) -> tuple[dict[int, int], str | None]:
    """A collective: open every peer's file in ``paths`` (by group rank) read-only, unless ``error``
    (a rank failed already), then agree. (descriptors by rank, None), or ({}, the first rank's
    error) on every rank when some rank failed."""
    fds: dict[int, int] = {}
    if error is None:
        try:
            for q, peer_path in enumerate(paths):
                if q != rank:
                    fds[q] = os.open(peer_path, os.O_RDONLY)
        except OSError as exc:
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
    failed = next((e for e in exchange(error) if e is not None), None)
    if failed is not None:
        close_fds(fds)
    return fds, failed


class WindowState(enum.Enum):
    """Whether shared-memory reads are allowed now.

    - IDLE: between steps; gathers go on the wire.
    - ARMED: a step began; its first shared gather opens the window (a barrier).
    - OPEN: reads allowed until the step ends (a barrier), or a collective write pauses it (a
      barrier, then ARMED again).
    - OFF: for good (ranks disagreed, or the shards left their arenas); gathers go on the wire.
    """

    IDLE = enum.auto()
    ARMED = enum.auto()
    OPEN = enum.auto()
    OFF = enum.auto()


_WINDOW = {
    (WindowState.IDLE, WindowState.ARMED),
    (WindowState.ARMED, WindowState.OPEN),
    (WindowState.ARMED, WindowState.IDLE),
    (WindowState.OPEN, WindowState.IDLE),
    (WindowState.OPEN, WindowState.ARMED),  # paused for a collective write inside the step
    (WindowState.IDLE, WindowState.OFF),
    (WindowState.ARMED, WindowState.OFF),
    (WindowState.OPEN, WindowState.OFF),
}


@dataclass(frozen=True, slots=True)
class SlotSpec:
    """One parameter's slot: its record id, its padded shard size and its dtype."""

    id: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def layout(specs: Sequence[SlotSpec]) -> tuple[dict[int, int], int]:
    """Each slot's byte offset (by record id), and the arena's size: slots back to back in ``specs``'
    order, each aligned to `SLOT_ALIGN`. The same specs give the same layout on every rank."""
    offsets, off = {}, 0
    for s in specs:
        offsets[s.id] = off
        off += -(-s.nbytes // SLOT_ALIGN) * SLOT_ALIGN
    return offsets, max(off, SLOT_ALIGN)


class SharedShards:
    """This rank's arena and its peers' (see [Note: shared shards]). Built by `create`."""

    def __init__(self, specs: Sequence[SlotSpec], arena: torch.Tensor, peers: dict[int, int],
                 barrier: Any) -> None:
        self.offsets = layout(specs)[0]
        self.arena = arena  # uint8, this rank's file mapped shared
        self._fds = peers  # group rank -> read-only descriptor of its arena
        # An engine dropped before the process ends closes them (and so lets its peers' arenas go).
        self._finalizer = weakref.finalize(self, close_fds, peers)
        self._barrier = barrier  # (values: list[int], label) -> every rank's max of each value
        base = arena.data_ptr()
        self._ptr = {pid: base + off for pid, off in self.offsets.items()}
        self.params: list[ZeroParameter] = []  # whose shards were bound to their slots (`adopt`)
        self.state = WindowState.IDLE

    # -- set-up ----------------------------------------------------------------------------------
    @classmethod
    def create(cls, rank: int, specs: Sequence[SlotSpec], exchange: Any, barrier: Any) -> SharedShards | None:
        """A collective: every rank makes its arena, opens every peer's, and unlinks its own file.
        ``exchange(obj)`` gives every rank's object; ``barrier`` as in `SharedShards`. None (on every
        rank) when some rank could not (no room in ``/dev/shm``, say): the gathers then travel on the
        wire. The arena's pages are allocated here (``posix_fallocate``), so a full ``/dev/shm`` is
        a clean fallback now rather than a SIGBUS at the first write."""
        nbytes = layout(specs)[1]
        path = os.path.join(SHM_DIR, f"zero3-{os.getpid()}-{uuid.uuid4().hex}")
        arena, made, fds, failed = None, False, {}, None
        try:
            error = None
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                made = True
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
                arena = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            except (OSError, RuntimeError) as exc:
                error = f"rank {rank}: {type(exc).__name__}: {exc} ({nbytes / 2**20:.1f} MiB in {SHM_DIR})"
            keys = exchange((error, path, _layout_key(specs)))
            error = next((e for e, _, _ in keys if e is not None), None)
            if error is None and len({k for _, _, k in keys}) != 1:
                error = "the ranks hold different parameter shards"
            fds, failed = open_peers(rank, [p for _, p, _ in keys], error, exchange)
        finally:
            if made:  # every rank opened every peer's file (or failed): each unlinks its own
                try:
                    os.unlink(path)
                except OSError:
                    pass
        if failed is not None:
            logger.warning("zero3: shared-memory gathers off (%s); parameter gathers travel on the wire", failed)
            return None
        assert arena is not None
        logger.info("zero3: shared-memory gathers: %d parameter shards, %.1f MiB per rank in %s",
                    len(specs), nbytes / 2**20, SHM_DIR)
        return cls(specs, arena, fds, barrier)

    def slot(self, spec: SlotSpec) -> torch.Tensor:
        """This rank's slot for ``spec`` as a tensor of its dtype (to bind the shard to)."""
        off = self.offsets[spec.id]
        return self.arena[off: off + spec.nbytes].view(spec.dtype)

    def adopt(self, params: Sequence[ZeroParameter]) -> None:
        """``params``' shards are now the tensors in their slots (the runtime bound them)."""
        self.params = list(params)

    def bound(self, p: ZeroParameter) -> bool:
        """Whether ``p``'s shard is the tensor in its slot here."""
        ptr = self._ptr.get(p._zero.id)
        return ptr is not None and p._zero.shard.data_ptr() == ptr

    def covers(self, params: Sequence[ZeroParameter]) -> bool:
        """Whether ``params`` can be gathered from the arenas now (the window is not off, and every
        shard is in its slot, so every peer's is too: the window's barrier checked that)."""
        if self.state is WindowState.IDLE or self.state is WindowState.OFF:
            return False
        ptr = self._ptr
        for p in params:
            z = p._zero
            if ptr.get(z.id) != z.shard.data_ptr():
                return False
        return True

    def may_be_read(self, p: ZeroParameter) -> bool:
        """Whether a peer may be reading ``p``'s shard now (the window is open and the shard is in
        its slot): a rank-local write to it now would race that read."""
        return self.state is WindowState.OPEN and self.bound(p)

    # -- the window ------------------------------------------------------------------------------
    def _enter(self, new: WindowState) -> None:
        if (self.state, new) not in _WINDOW:
            raise ZeroStateError(f"shared-memory window: illegal change {self.state.name} -> {new.name}")
        self.state = new

    def arm(self) -> None:
        """A step began."""
        if self.state is WindowState.IDLE:
            self._enter(WindowState.ARMED)

    def open(self) -> bool:
        """Before the first read of a step: the opening barrier (every rank finished its writes), which
        also compares the ranks' counts of shards in their slots. Whether reads may go on."""
        if self.state is WindowState.OPEN:
            return True
        if self.state is not WindowState.ARMED:
            return False
        here = sum(1 for p in self.params if self.bound(p))
        most, least = self._barrier([here, -here], "shared-memory window opens")
        if most != here or -least != here:
            logger.warning("zero3: shared-memory gathers off: the ranks hold %d to %d shards in their arenas "
                           "(this one %d); parameter gathers travel on the wire", -least, most, here)
            self._enter(WindowState.OFF)
            return False
        self._enter(WindowState.OPEN)
        return True

    def close(self, aborted: bool) -> bool:
        """The step ended: the closing barrier (every rank finished reading). An aborted step has no
        barrier (the other ranks may never reach it; they learn of the abort from the
        communicator's epoch), so if the window was open a peer may still be reading this rank's
        arena: returns True then, and the caller moves the shards out (`evacuate`) before anything
        can write them. A window that was only armed saw no read: no peer got past the opening
        barrier this rank never joined."""
        if self.state is WindowState.OPEN and aborted:
            return True
        if self.state is WindowState.OPEN:
            self._barrier([0], "shared-memory window closes")
        if self.state is WindowState.OPEN or self.state is WindowState.ARMED:
            self._enter(WindowState.IDLE)
        return False

    def pause(self) -> None:
        """Every rank is about to change shards inside a step (``GatheredParameters(modifier_rank=...)``,
        a collective): the closing barrier now, and the next read opens the window again."""
        if self.state is WindowState.OPEN:
            self._barrier([0], "shared-memory window pauses")
            self._enter(WindowState.ARMED)

    def evacuate(self, own_memory: Callable[[ZeroParameter], None]) -> None:
        """Every shard still in its slot moves out (``own_memory``: into memory of its own, the same
        tensor), and sharing turns off for good: after an aborted step peers may still read the
        arena, and ``offload_states`` cannot empty a mapped file in place."""
        for p in self.params:
            if self.bound(p):
                own_memory(p)
        self.turn_off()

    def turn_off(self) -> None:
        """For good (the shards leave their arenas: ``offload_states``); releases the descriptors."""
        if self.state is not WindowState.OFF:
            self._enter(WindowState.OFF)
        self.params = []
        self.arena = torch.empty(0, dtype=torch.uint8)  # unmapped once no shard views it
        self._ptr = {}
        self.release()

    def release(self) -> None:
        """Close the peers' arenas (at exit, or when turned off)."""
        close_fds(self._fds)

    # -- reads -----------------------------------------------------------------------------------
    def read(self, peer: int, p_id: int, into: torch.Tensor) -> None:
        """The first ``into.numel()`` elements of peer ``peer``'s shard of parameter ``p_id`` into
        ``into`` (contiguous, of the shard's dtype), straight from the peer's arena."""
        nbytes = into.numel() * into.element_size()
        off = self.offsets[p_id]
        buf = (ctypes.c_char * nbytes).from_address(into.data_ptr())
        got = os.preadv(self._fds[peer], [buf], off)
        if got != nbytes:
            raise ZeroStateError(f"shared-memory gather: read {got} of {nbytes} bytes of rank {peer}'s arena")



def _layout_key(specs: Sequence[SlotSpec]) -> str:
    return hashlib.sha1(repr([(s.numel, str(s.dtype)) for s in specs]).encode()).hexdigest()
