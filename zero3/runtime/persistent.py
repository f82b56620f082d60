"""The persistent parameters: gathered once and kept gathered for the whole run.

Small parameters (``param_persistence_threshold``, up to ``model_persistence_threshold`` in all;
the rule is planning/persistence.py's) cost more as per-module collectives than they hold, so they
are gathered at initialize, stay out of every budget and every schedule, and are gathered again
from their shards when the shards change (optimizer step, checkpoint load, refresh_from_masters).
A local accessor's write (``safe_set_local_fp32_param``) reaches this rank's slice of the gathered
copy at once and marks the copy stale (`mark_stale`): the other ranks' slices in it are old, so the
next forward, ``GatheredParameters`` or ``param.all_gather()`` gathers the stale ones again first
(`refresh_stale`, one collective; every rank calls the setter, so every rank has the same stale
ones), unless a step, load or refresh_from_masters did already. At world size 1 the full tensor is
a view of the shard when both have one device and dtype, and then needs no refresh.

A persistent parameter is torch's own class while gathered, so nothing stops an in-place write to it
between steps (``nn.init.zeros_(p)``, ``p.data.copy_(v)``, ``model.apply(init)``, ``p.data = t``,
torch's ``vector_to_parameters``); the forwards use the written value at once, as in torch. So that
the step does not then lose it (it steps the shards and gathers them again), `take_writes` compares
each rank's slice of the gathered copy with its shard before the optimizer step and writes the
elements that differ into the shard and the master. Every
rank must make the same write (as with DDP, which keeps no two ranks' weights in step either).
A master on the drive (NVMe optimizer) is compared through its shard and read in to take the
write. The step in backward takes the writes before its first sub-group steps. Not covered: shards
on the drive, and, with the step in backward, a write after the backward (the step was taken):
there, write inside ``GatheredParameters(params, modifier_rank=0)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import ContextManager

import torch
from torch import nn

from ..partition import param as zparam
from ..partition.param import PendingGradParameter, ZeroParameter
from ..partition.state import MEMORY, ParamStatus
from ..planning.persistence import choose_persistent


class PersistentParams:
    """Chooses, gathers, refreshes and lets go of the persistent parameters. ``gather(params)``
    gathers ``params`` now (one collective, counted apart from the steps' gathers)."""

    def __init__(self, world_size: int, gather: Callable[[list[ZeroParameter], str], None]) -> None:
        self._world_size = world_size
        self._gather = gather  # (params, label for the collective's tag)
        self.params: list[ZeroParameter] = []
        self._stale: dict[int, str] = {}  # record id -> the setter that left its gathered copy mixed

    def choose(self, params: Sequence[ZeroParameter], param_threshold: int, model_threshold: int) -> None:
        """Mark the persistent ones among ``params``, in this order, and unmark the others: an
        ``initialize`` refused after it chose (a scheduler or drive path found bad later) left its
        marks, and a retry under another threshold would keep gathered copies nothing refreshes."""
        for p, persistent in zip(params, choose_persistent((p._zero.numel for p in params), param_threshold,
                                                           model_threshold)):
            zparam.set_persistent(p, persistent)
            if persistent:
                self.params.append(p)

    def gather(self) -> None:
        """Gather them the first time (after every shard has its final buffer)."""
        if self._world_size == 1:
            for p in self.params:
                # one rank: the shard is the full tensor, no refresh ever needed; but not beside a master on
                # the drive, which a write through the alias would miss (`take_writes` compares a copy)
                if p._zero.train_tensor.untyped_storage().nbytes() > 0:
                    zparam.alias_shard(p)
        self.refresh()

    def mark_stale(self, p: ZeroParameter, what: str) -> None:
        """``what`` (a local setter) wrote this rank's slice of ``p``'s shard and of its gathered copy;
        the other ranks' slices of the copy are old until `refresh_stale` (or any `refresh`). The caller
        wrote a gathered copy that is no view of the shard."""
        if self._world_size > 1:
            self._stale[p._zero.id] = what

    @property
    def stale(self) -> bool:
        return bool(self._stale)

    def refresh_stale(self) -> None:
        """Gather again the parameters `mark_stale` marked, in this list's order (the same on every
        rank), in one collective whose tag names the setter: a rank that did not call it issues
        another collective, which the verifier reports on every rank."""
        if self._stale:
            what = sorted(set(self._stale.values()))
            self.refresh([p for p in self.params if p._zero.id in self._stale],
                         f"persistent parameters written by {', '.join(what)} (called on every rank)")

    def refresh(self, params: Sequence[ZeroParameter] | None = None, label: str = "persistent parameters") -> None:
        """The shards changed: gather ``params`` (default: all) again from the shards (a collective
        when there are any)."""
        params = self.params if params is None else params
        guarded = [p for p in params if type(p) is PendingGradParameter]  # between steps: stays so (step.py)
        for p in params:
            if p._zero.status is not ParamStatus.AVAILABLE:
                continue
            if not p._zero.aliased:
                zparam.release(p)
            elif zparam.alias_replaced(p):  # ``p.data = t`` since: the shards win, as a gather's would
                zparam.view_shard_again(p)
        todo = [p for p in params if p._zero.status is ParamStatus.NOT_AVAILABLE]
        if todo:
            self._gather(todo, label)
        for p in guarded:
            if type(p) is nn.Parameter:
                p.__class__ = PendingGradParameter
        for p in params:  # after the gather: one that raised (a divergence) leaves them for the next try
            self._stale.pop(p._zero.id, None)

    @torch.no_grad()
    def take_writes(self, resident: Callable[[list[ZeroParameter]], ContextManager[None]] | None = None) -> list[str]:
        """Before an optimizer step: write every element of this rank's slice of a gathered copy that
        differs from its shard (an in-place write since the last gather) into the master and the
        shard; returns the names of those parameters. Only the written elements reach the master: a
        low-precision copy of the rest would round the master's other elements. On an accelerator,
        one host sync for all the comparisons. A parameter that views its shard (world size 1) is
        written in place already, unless its data was replaced (``p.data = t``, torch's
        vector_to_parameters): then t is taken and the parameter views its shard again.

        A master on the drive (``offload_optimizer="nvme"``) is compared through its shard, which holds
        its value (cast) between steps, and written inside ``resident`` (the engine's
        `RuntimeContext.resident`, which reads it in and writes it back); without ``resident`` it is
        skipped."""
        todo = []
        written = []
        for p in self.params:
            z = p._zero
            if z.status is not ParamStatus.AVAILABLE or z.residence not in MEMORY:
                continue
            drive = z.train_tensor.untyped_storage().nbytes() == 0  # a master on the drive (NVMe optimizer)
            if drive and (resident is None or z.aliased):
                continue
            if z.aliased:
                if zparam.alias_replaced(p):
                    mine = zparam.raw_data(p).reshape(-1)
                    _take(z, z.numel, mine, z.shard[: z.numel].to(mine.device))
                    zparam.view_shard_again(p)
                    written.append(z.name)
                elif z.train_tensor is not z.shard:  # a write reached the low-precision shard, not the master
                    mine, kept = z.shard[: z.numel], z.train_tensor[: z.numel].to(z.shard.device, z.shard.dtype)
                    if not torch.equal(mine, kept):
                        _take(z, z.numel, mine, kept)
                        written.append(z.name)
                continue
            start, end = z.shard_range()
            n = max(end - start, 0)
            mine = zparam.raw_data(p).reshape(-1)[start:start + n]  # reshape: t may be non-contiguous
            kept = z.shard[:n].to(mine.device, non_blocking=True)
            todo.append((p, drive, n, mine, kept, (mine != kept).any() if mine.device.type != "cpu"
                         else not torch.equal(mine, kept)))
        pending = [d for *_, d in todo if isinstance(d, torch.Tensor)]  # on an accelerator: one sync for all
        synced = iter(torch.stack(pending).tolist() if pending else [])
        changed = [t for t in todo if (next(synced) if isinstance(t[-1], torch.Tensor) else t[-1])]
        on_drive = [t for t in changed if t[1]]
        # masters on the drive are read in for the takes, and written back after
        with resident([p for p, *_ in on_drive]) if on_drive and resident else contextlib.nullcontext():
            for p, _, n, mine, kept, _ in changed:
                _take(p._zero, n, mine, kept)
                written.append(p._zero.name)
        return written

    def unmark(self) -> None:
        """They become ordinary parameters again (hooks removed): release what nothing holds."""
        self._stale.clear()
        for p in self.params:
            zparam.set_persistent(p, False)
            if p._zero.aliased:
                zparam.unalias_shard(p)
            if p._zero.status is ParamStatus.AVAILABLE and not p._zero.pinned:
                zparam.release(p)
        self.params = []


__all__ = ["PersistentParams"]


def _take(z: zparam.ZeroParam, n: int, mine: torch.Tensor, kept: torch.Tensor) -> None:
    """The elements of ``mine`` (this rank's ``n`` of the gathered copy) that differ from ``kept``
    (the shard's, on the same device) into the master, and the master into the shard."""
    master = z.train_tensor
    mask = (mine != kept).to(master.device)
    master[:n] = torch.where(mask, mine.to(master.device, master.dtype), master[:n])
    if master is not z.shard:
        z.shard.copy_(master)
