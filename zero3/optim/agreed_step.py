"""An optimizer step agreed by every rank when it reads or writes a drive: taken on every rank or none
when staged, else reported on every rank.

[Note: agreed optimizer step]
A streamed step (optimizer.py [Note: streamed optimizer step]) reads and writes swap files, and a
drive can fail on one rank only (disk full, an I/O error). Without agreement that rank raises and
the others have stepped: the shards are one step apart and the others learn of it only from their
next collective. So, when the optimizer state is on NVMe, the step is staged: every write of the
optimizer's tier, and of the parameter shards' tier when they are on NVMe too, goes to a second
region of its key (nvme.py `StorageTier.stage`, `ShardTier.stage`), so the region read from still
holds the value from before; what the step changes in memory (parameter shards in memory, optimizer
state that is not on the drive such as Adam's step counter, the fp16 loss scale) is copied first.
When the step is done, or failed, on this rank, the ranks exchange their errors (one small
all-gather, also over the model-parallel group). If none failed, the second regions become the
keys' regions; if one did, every rank rolls back: the keys point at their old regions, the copies
are put back, state the step created is removed, and the gradients are dropped. Every rank then
raises the same error, of the failing rank's type, naming that rank and carrying its message (for a
full disk: ``[Errno 28] ... No space left on device``).

What it guarantees, with ``offload_optimizer="nvme"`` (any ``offload_param``): after a failure
anywhere in the step on any rank (a read or write of a swap file, the optimizer itself), on every
rank the parameter shards, fp32 masters, optimizer state and loss scale equal their values before
the step, and the step counters do not advance. What it does not undo: optimizer step hooks the
user registered have run on the ranks that got that far. The cost: a second region per key doubles
the swap files, and the copy of the shards in memory is one shard's worth per parameter, held
during the step. With only ``offload_param="nvme"`` (optimizer state in memory, updated in place;
under mixed precision the step runs in memory and the masters are then cast into the shards on the
drive, which that agreement covers too) the step is agreed, so every rank raises naming the failing rank and its cause, but not rolled back;
the same holds with ``offload_optimizer_staged_step=False``, which writes the drive in place.

The second regions are the drive's largest cost: every key holds two from the first step on. A key
the step creates (Adam's moments, in the first step) has no value to keep yet, but its second region
is reserved then all the same (`SwapFile.reserve`, which allocates the blocks), so a drive too small
for training fails the first step, rolled back, and not the second one after an hour of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..comm.communicator import Communicator, Kind, Tag
from ..comm.failure import rebuild_error
from ..comm.model_parallel import ModelParallel
from ..offload.nvme import ShardTier, StorageTier
from ..partition.param import ZeroParameter
from .precision import LossScaler


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a step changes: the user's optimizer, its trainable parameters, the tier of its state
    (None: nothing is staged, only agreed), the tier of the parameter shards (None: in memory or not
    staged), the loss scaler, how to tell per-element state, and, for the error of a step that is
    not staged, why it is not; and every NVMe tier the step writes, staged or not."""

    optimizer: torch.optim.Optimizer
    params: list[ZeroParameter]
    states: StorageTier | None
    shards: ShardTier | None
    scaler: LossScaler | None
    per_element: Callable[[Any, int], bool]
    unstaged: str
    tiers: tuple[StorageTier | ShardTier, ...] = ()


@dataclasses.dataclass(frozen=True)
class Kept:
    """Copies of what a staged step changes in memory (the tier keeps what is on the drive): each
    parameter's optimizer state (per-element tensors by reference: their bytes are in the tier; None:
    no state yet), each parameter shard in memory (a shard tier keeps those on NVMe), and the loss
    scaler's state."""

    state: dict[int, dict[str, Any] | None]
    shards: dict[int, torch.Tensor]
    scaler: dict[str, Any] | None


class AgreedStep:
    """Runs a streamed step on every rank or on none ([Note: agreed optimizer step])."""

    def __init__(self, parts: StepParts, comm: Communicator, model_parallel: ModelParallel | None) -> None:
        self.parts = parts
        self.comm = comm
        self.model_parallel = model_parallel

    def run(self, step: Callable[[], None], drop_grads: Callable[[], None], scaler_state: dict[str, Any] | None) -> None:
        """Run ``step`` (it calls no collective); raise on every rank, with nothing changed, if it
        failed on any. ``scaler_state``: the loss scaler's state before this step updated it."""
        kept = self.keep(scaler_state)
        error = self.stage()
        if error is None:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - agreed across ranks below
                error = exc
        self.conclude(kept, error, drop_grads)

    def keep(self, scaler_state: dict[str, Any] | None) -> Kept | None:
        """Before anything changes: copies of what a staged step changes in memory (None: not staged)."""
        return self._keep(scaler_state) if self.parts.states is not None else None

    def stage(self) -> Exception | None:
        """Open the staged step on the tiers (nothing when not staged); the error, if that failed."""
        states, shards = self.parts.states, self.parts.shards
        try:
            if states is not None:
                states.stage()
                if shards is not None:
                    shards.stage()
        except Exception as exc:  # noqa: BLE001 - agreed across ranks by conclude
            return exc
        return None

    def conclude(self, kept: Kept | None, error: BaseException | None, drop_grads: Callable[[], None]) -> None:
        """After the step's last write finished (or failed) on this rank: agree with the other ranks,
        then commit, or roll back (``kept``), drop the gradients and raise the first failure."""
        states, shards = self.parts.states, self.parts.shards
        failures = self._agree(error)
        if not failures:
            if states is not None:
                states.commit()
                if shards is not None:
                    shards.commit()
            return
        if kept is not None:
            self.roll_back(kept)
        else:  # the failed step's other transfers: each would raise its failure again at its key's next use
            for tier in self.parts.tiers:  # (a load of the last checkpoint, probe 30C), one per call
                tier.settle_all()
        drop_grads()
        rank, kind, message = failures[0]
        if kept is not None:
            what = (f"the optimizer step was taken on no rank: rank {rank} failed: {message}. Every rank's parameters "
                    "and optimizer state are as before the step and its gradients were dropped; fix the cause (for a "
                    "drive: free space on, or repair, that rank's nvme_path), then go on with the next batch or load "
                    "the last checkpoint")
        else:
            what = (f"the optimizer step failed: rank {rank} failed: {message}. The step was not staged ("
                    f"{self.parts.unstaged}), so the ranks may now differ: load the last checkpoint after fixing "
                    "the cause")
        raise rebuild_error(rank, kind, what) from error

    def _agree(self, error: BaseException | None) -> list[tuple[int, str, str]]:
        """Every rank's failure (global rank, exception type, message), lowest rank first."""
        mine = None if error is None else (self.comm.global_rank(self.comm.rank), type(error).__name__, str(error))
        tag = Tag(Kind.OBJECTS, "optimizer step (agreement)")
        got = self.comm.agree_on_errors(mine, None, tag)
        if self.model_parallel is not None:
            got = [f for group in self.model_parallel.comm.agree_on_errors(got, None, tag) for f in group]
        return sorted(f for f in got if f is not None)

    def _keep(self, scaler_state: dict[str, Any] | None) -> Kept:
        opt, per_element = self.parts.optimizer, self.parts.per_element
        state: dict[int, dict[str, Any] | None] = {}
        for p in self.parts.params:
            z = p._zero
            st = opt.state.get(z.train_tensor)
            state[z.id] = None if st is None else {
                k: v if per_element(v, z.shard_numel) else (v.clone() if isinstance(v, torch.Tensor) else v)
                for k, v in st.items()}
        in_memory = {p._zero.id: p._zero.shard.clone() for p in self.parts.params if p._zero.swap is None}
        return Kept(state, in_memory, scaler_state)

    def roll_back(self, kept: Kept) -> None:
        """Put back what the staged step changed, on this rank (no collective)."""
        assert self.parts.states is not None
        self.parts.states.rollback()
        if self.parts.shards is not None:
            self.parts.shards.rollback()
        opt = self.parts.optimizer
        for p in self.parts.params:
            z = p._zero
            before = kept.state[z.id]
            if before is None:
                opt.state.pop(z.train_tensor, None)
            else:
                opt.state[z.train_tensor] = before
            if z.id in kept.shards:
                z.shard.copy_(kept.shards[z.id])
        if kept.scaler is not None:
            assert self.parts.scaler is not None
            self.parts.scaler.restore(kept.scaler)


__all__ = ["AgreedStep", "StepParts"]
