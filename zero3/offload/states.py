"""``engine.offload_states`` / ``engine.reload_states``: move model states out of memory between
phases (an RL loop's generation and training, evaluation between epochs), DeepSpeed's names.

[Note: offloading states]
The states are tensors of four kinds (`StateKind`): ``lp_params`` (parameter shards, and the full
tensors of persistent parameters, which stay gathered), ``hp_params`` (fp32 masters, when they are
separate from the shards), ``optim_states`` (every tensor in the optimizer's state) and ``lp_grads``
(gradient shards, when a backward left some). They are moved by their unique underlying storages:
each storage's bytes are copied out (to a swap file on NVMe, or to host memory for a device storage
with ``device="cpu"``) and the storage is resized to 0 bytes; reloading resizes it back and copies
the bytes in place. Every tensor, every view (shards are views into flat buffers under mixed
precision) and every optimizer-state key stays the same object, so training continues bit for bit.

Storages that hold nothing (shards or optimizer state that live on NVMe between steps anyway) are
skipped, and so are, with ``device="cpu"``, storages already in CPU memory: there is nothing to free.
While states are out, `StatesOffload.check` refuses whatever needs them with an error naming what
to reload: a forward needs ``lp_params`` (and ``lp_grads``, which its backward adds into, when grad
is on), so generation can run with the optimizer's state offloaded; ``engine.step`` needs every
kind; checkpoints, accessors and gathers what they read. It runs when a step begins and at those
entry points, never per module.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ZeroConfigError, ZeroStateError
from ..partition.param import ZeroParameter, raw_data
from ..partition.state import ParamStatus, Residence
from .nvme import StorageTier
from .swapfile import SwapFile, storage_view

logger = logging.getLogger(__name__)


class StateKind(str, enum.Enum):
    """The kinds of model state `engine.offload_states` moves (DeepSpeed's ``OffloadStateTypeEnum``
    names, as ``include`` takes them)."""

    LP_PARAMS = "lp_params"
    HP_PARAMS = "hp_params"
    OPTIM_STATES = "optim_states"
    LP_GRADS = "lp_grads"


class OffloadPhase(enum.Enum):
    """Where the states that `StatesOffload` manages are.

    - RESIDENT: in memory; nothing is refused.
    - OFFLOADED: the included kinds are out (with ``non_blocking`` their writes may still run);
      everything that needs them is refused.
    - RELOADING: ``reload_states(non_blocking=True)`` started the copies back; the next thing that
      needs the states waits for them.
    """

    RESIDENT = enum.auto()
    OFFLOADED = enum.auto()
    RELOADING = enum.auto()


_PHASES = {
    (OffloadPhase.RESIDENT, OffloadPhase.OFFLOADED),
    (OffloadPhase.OFFLOADED, OffloadPhase.RELOADING),
    (OffloadPhase.RELOADING, OffloadPhase.RESIDENT),
}


@dataclass(eq=False)
class _Moved:
    storage: torch.UntypedStorage
    kind: StateKind
    nbytes: int
    host: torch.Tensor | None = None  # device="cpu": the host copy of a device storage


class StatesOffload:
    """The phase memory manager of one engine (see [Note: offloading states])."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx  # the engine's RuntimeContext (runtime/context.py imports this module)
        self.phase = OffloadPhase.RESIDENT
        self.device = ""
        self.kinds: tuple[StateKind, ...] = ()
        self._moved: list[_Moved] = []
        self._taken: list[ZeroParameter] = []  # whose shards' storages are moved (their residence STATES_OUT)
        self._tier: StorageTier | None = None
        self._path = ""
        self._copies_done: list[Any] = []  # CUDA events after a non-blocking reload's copies

    # -- the two calls -------------------------------------------------------------------------------
    def offload(self, include: Iterable[str] | None, device: str, pin_memory: bool, non_blocking: bool,
                nvme_path: str | None) -> int:
        """Move the ``include``d kinds out; returns the bytes moved. See `Engine.offload_states`."""
        kinds = _kinds(include)
        if device not in ("cpu", "nvme"):
            raise ZeroConfigError(f"offload_states(device={device!r}): device must be 'cpu' or 'nvme'")
        if self.phase is not OffloadPhase.RESIDENT:
            raise ZeroStateError(f"offload_states: {', '.join(k.value for k in self.kinds)} are already offloaded "
                                 f"to {self._where()}; call engine.reload_states() before offloading again")
        if not kinds:  # nothing to move (an empty include, or contiguous_grad_buffer alone): nothing changes
            return 0
        self._settle_swaps()
        tier = self._nvme(nvme_path) if device == "nvme" else None
        shared = self.ctx.comm.shared
        if tier is not None and StateKind.LP_PARAMS in kinds and shared is not None and shared.params:
            # A shared-memory arena is one mapped file: it cannot be resized away. Each shard gets memory of
            # its own (the same tensor), and gathers go back on the wire (comm/shared.py).
            shared.evacuate(self.ctx.store.own_memory)
        moved: list[_Moved] = []
        seen: set[int] = set()
        for kind in kinds:
            for t in _tensors(self.ctx, kind):
                storage = t.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue  # holds nothing (on NVMe between steps), or already taken under another tensor
                seen.add(storage.data_ptr())
                if device == "cpu" and storage.device.type == "cpu":
                    continue  # already in CPU memory
                moved.append(_Moved(storage, kind, storage.nbytes()))
        ptrs = {m.storage.data_ptr() for m in moved}
        taken = [p for p in self.ctx.params if p._zero.shard.untyped_storage().data_ptr() in ptrs]
        pin = pin_memory and torch.cuda.is_available()
        try:
            self.ctx.store.take(taken, lambda: _move_out(moved, tier, pin, non_blocking))
        except BaseException:  # the shards' residences are unchanged (take moves them after move_out)
            self._failed_offload(moved, [], kinds, tier)
            raise
        if tier is not None and not non_blocking:
            try:
                tier.settle_all(raise_first=True)
            except BaseException:  # a failed write (a full drive): nothing stays moved, nothing is lost
                self._failed_offload(moved, taken, kinds, tier)
                raise
        freed = 0
        if StateKind.LP_PARAMS in kinds and self.ctx.coordinator.shards is not None:
            freed = self.ctx.coordinator.shards.pool.release_memory()  # scratch, allocated again when needed
        self._moved, self._taken, self.kinds, self.device = moved, taken, kinds, device
        self._enter(OffloadPhase.OFFLOADED)
        total = sum(m.nbytes for m in moved)
        logger.info("zero3::offload_states %s -> %s: %d storages, %.1f MiB (and %.1f MiB of swap buffers freed)",
                    ", ".join(k.value for k in kinds), self._where(), len(moved), total / 2**20, freed / 2**20)
        return total

    def _failed_offload(self, moved: list[_Moved], taken: list[ZeroParameter], kinds: tuple[StateKind, ...],
                        tier: StorageTier | None) -> None:
        """A blocking offload failed (a write, or moving a storage out): bring back what left memory. When
        a read fails too, what is still on the drive stays offloaded, for `reload` to read again (review
        30X: a 0-byte storage taken for resident, and the next forward segfaulted). ``taken``: the
        shards whose residences `take` changed (none when it raised)."""
        try:
            _bring_back(moved, tier)
        except BaseException:  # noqa: BLE001 - the offload's failure is the one raised
            self._moved, self._taken, self.kinds, self.device = moved, taken, kinds, "nvme"
            self._enter(OffloadPhase.OFFLOADED)
            logger.warning("zero3::offload_states to NVMe (%s) failed, and reading back what it had written failed "
                           "too: those states stay offloaded; call engine.reload_states() to read them again", self._path)
            return
        self.ctx.store.give_back(taken)
        self._tier = None  # its file is closed once nothing refers to it
        logger.warning("zero3::offload_states to %s failed; every state is back in memory",
                       f"NVMe ({self._path})" if tier is not None else "CPU memory")

    def reload(self, non_blocking: bool) -> None:
        """Bring back what `offload` moved (a no-op when nothing is offloaded)."""
        if self.phase is OffloadPhase.RESIDENT:
            return
        if self.phase is OffloadPhase.OFFLOADED:
            if self.device == "nvme":  # a non-blocking offload's failed writes left their storages in memory
                assert self._tier is not None
                failed = self._tier.settle_all()
                if failed:
                    logger.warning("zero3::offload_states: %d transfers with %s failed (the first: %s): what they "
                                   "wrote stayed in memory and what they read is read again, so nothing was lost",
                                   len(failed), self._where(), failed[0])
            for i, m in enumerate(self._moved):
                if self.device == "nvme":
                    assert self._tier is not None
                    if self._tier.state(i) is Residence.DRIVE:
                        self._tier.swap_in(i)
                else:
                    assert m.host is not None
                    m.storage.resize_(m.nbytes)
                    storage_view(m.storage).copy_(m.host, non_blocking=non_blocking and m.host.is_pinned())
            if self.device == "cpu" and torch.cuda.is_available():  # the streams the copies were queued on
                devices = {m.storage.device for m in self._moved if m.storage.device.type == "cuda"}
                self._copies_done = [torch.cuda.current_stream(d).record_event() for d in devices]
            self._enter(OffloadPhase.RELOADING)
        if not non_blocking:
            self._finish_reload()

    def check(self, what: str, kinds: Iterable[str] | None = None) -> None:
        """Raise when states of ``kinds`` (default: all) that ``what`` needs are out (a non-blocking
        reload is waited for first)."""
        if self.phase is OffloadPhase.RELOADING:
            self._finish_reload()
        elif self.phase is OffloadPhase.OFFLOADED:
            needed = [k for k in self.kinds if kinds is None or k.value in kinds]
            if needed:
                raise ZeroStateError(
                    f"{what} needs {', '.join(k.value for k in needed)}, but engine.offload_states() moved "
                    f"{', '.join(k.value for k in self.kinds)} ({self.moved_bytes / 2**20:.1f} MiB) to "
                    f"{self._where()}; call engine.reload_states() first")

    # -- accounting ----------------------------------------------------------------------------------
    @property
    def moved_bytes(self) -> int:
        """Bytes out of memory now: what was moved, less what a failed write left in memory, and what a
        failed read left on the drive (review 30X); 0 when resident."""
        if self.phase is OffloadPhase.RESIDENT:
            return 0
        if self.device == "nvme" and self._tier is not None:  # read without settling anything
            return sum(m.nbytes for i, m in enumerate(self._moved) if not self._tier.holds(i))
        return sum(m.nbytes for m in self._moved) if self.phase is OffloadPhase.OFFLOADED else 0

    @property
    def nvme_bytes(self) -> int:
        return self.moved_bytes if self.device == "nvme" else 0

    @property
    def swap_file(self) -> SwapFile | None:
        """The swap file of states moved to NVMe (None when none is open)."""
        return self._tier.file if self._tier is not None else None

    # -- helpers -------------------------------------------------------------------------------------
    def _finish_reload(self) -> None:
        if self._tier is not None and self.device == "nvme":
            failed = self._tier.settle_all()
            if failed:
                logger.warning("zero3::reload_states: %d reads from %s failed (the first: %s); reading them again",
                               len(failed), self._where(), failed[0])
            for i in range(len(self._moved)):
                if self._tier.state(i) is Residence.DRIVE:  # its read failed: read it again
                    self._tier.swap_in(i)
            # every read settled before a failure is raised, the phase unchanged: the next call reads it again
            self._tier.settle_all(raise_first=True)
            self._tier = None  # its file is closed, and the drive space freed, once nothing refers to it
        if self.device == "cpu" and torch.cuda.is_available():  # whatever stream is current now
            for event in self._copies_done:
                event.synchronize()
            self._copies_done = []
        self.ctx.store.give_back(self._taken)
        self._moved, self._taken = [], []
        self.kinds = ()
        self._enter(OffloadPhase.RESIDENT)

    def _enter(self, new: OffloadPhase) -> None:
        if (self.phase, new) not in _PHASES:
            raise ZeroStateError(f"offload_states: illegal phase change {self.phase.name} -> {new.name}")
        self.phase = new

    def _nvme(self, nvme_path: str | None) -> StorageTier:
        path = self.ctx.store.placement.states_nvme_path(nvme_path)
        if not path:
            raise ZeroConfigError("offload_states(device='nvme') needs a directory for its swap file: pass "
                                  "nvme_path=..., or set offload_param.nvme_path or offload_optimizer.nvme_path "
                                  "in the config")
        # A new file each time: the last one is closed (and its space freed) once nothing refers to it.
        self._tier = StorageTier(self.ctx.swap_io(), SwapFile(path, f"states-rank{self.ctx.rank}"))
        self._path = path
        return self._tier

    def _where(self) -> str:
        return f"NVMe ({self._path})" if self.device == "nvme" else "CPU memory"

    def _settle_swaps(self) -> None:
        """Finish the writes the NVMe tiers may still have in flight: their storages are settled."""
        if self.ctx.coordinator.shards is not None:
            self.ctx.coordinator.shards.flush()
        if self.ctx.optimizer is not None and self.ctx.optimizer.states is not None:
            self.ctx.optimizer.states.wait()


def _move_out(moved: list[_Moved], tier: StorageTier | None, pin: bool, non_blocking: bool) -> None:
    """Start moving every storage out: to ``tier``'s swap file, or (None) into host copies."""
    for i, m in enumerate(moved):
        if tier is not None:
            tier.swap_out(i, m.storage)
        else:
            m.host = torch.empty(m.nbytes, dtype=torch.uint8, pin_memory=pin)
            m.host.copy_(storage_view(m.storage), non_blocking=non_blocking and pin)
            m.storage.resize_(0)


def _bring_back(moved: list[_Moved], tier: StorageTier | None) -> None:
    """Undo a `_move_out` that failed part-way: every storage it moved is in memory again (a failed
    write left its own there; the others are read back from the drive, or copied from their host copy)."""
    if tier is None:
        for m in moved:
            if m.host is not None and m.storage.nbytes() == 0:
                m.storage.resize_(m.nbytes)
                storage_view(m.storage).copy_(m.host)
            m.host = None
        return
    tier.settle_all()  # the failures are the one being raised (or like it)
    for i in range(len(moved)):
        if tier.state(i) is Residence.DRIVE:
            tier.swap_in(i)
    tier.settle_all(raise_first=True)


# DeepSpeed's fifth kind: its stage 3 keeps a flat buffer for the gradients it reduces; zero3 keeps
# none apart from the gradient shards (`lp_grads`), so the kind names nothing to move (probe 30C:
# DeepSpeed's enum member was refused).
_NOTHING_HERE = "contiguous_grad_buffer"


def _kinds(include: Iterable[str] | None) -> tuple[StateKind, ...]:
    if include is None:
        return tuple(StateKind)
    if isinstance(include, str):
        include = [include]
    out: list[StateKind] = []
    for name in include:
        value = getattr(name, "value", name)  # a StateKind, or DeepSpeed's OffloadStateTypeEnum member
        if value == _NOTHING_HERE:
            continue
        try:
            kind = StateKind(value)
        except ValueError:
            raise ZeroConfigError(f"offload_states(include=...): {name!r} is not a state kind; use a subset of "
                                  f"{[k.value for k in StateKind]} (None: all of them)") from None
        if kind not in out:
            out.append(kind)
    return tuple(out)


def _tensors(ctx: Any, kind: StateKind) -> list[torch.Tensor]:
    """The tensors of one kind of state (views included: the caller takes each storage once)."""
    part = ctx.optimizer
    if kind is StateKind.LP_PARAMS:
        out = [p._zero.shard for p in ctx.params]
        out += [raw_data(p) for p in ctx.params if p._zero.status is ParamStatus.AVAILABLE]
        return out
    if kind is StateKind.HP_PARAMS:
        return [p._zero.master for p in ctx.params if p._zero.master is not None]
    if kind is StateKind.OPTIM_STATES:
        if part is None:
            return []
        return [v for state in part.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return [g for p in ctx.params if (g := p._zero.train_tensor.grad) is not None]
