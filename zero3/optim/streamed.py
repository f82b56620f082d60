"""The step's data movement for sub-groups: masters, parameter shards and optimizer state between
the drive and memory, and the user's optimizer narrowed to one sub-group (optimizer.py [Note:
streamed optimizer step]; backward_step.py steps the same sub-groups inside the backward).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from typing import Any

import torch

from ..offload.nvme import ShardTier, StorageTier
from ..partition.param import ZeroParameter
from ..partition.state import MEMORY, Residence
from .routed_step import torch_step


class SubgroupStreamer:
    """Moves sub-groups of the optimizer's tensors in and out of memory and steps them.

    ``optimizer``: the user's (re-pointed) optimizer; ``states``: the tier of masters and optimizer
    state (None: in memory); ``shards``: the tier of parameter shards (None: in memory);
    ``separate_masters``: the optimizer steps on fp32 masters, cast into the shards after it;
    ``subgroups``: (param group index, parameters) to stream, in order; ``per_element(v, numel)``:
    whether a state value has one entry per shard element.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, states: StorageTier | None, shards: ShardTier | None,
                 separate_masters: bool, subgroups: Sequence[tuple[int, list[ZeroParameter]]],
                 per_element: Callable[[Any, int], bool]) -> None:
        self.optimizer = optimizer
        self.states = states
        self.shards = shards
        self.separate_masters = separate_masters
        self.subgroups = list(subgroups)
        self._per_element = per_element
        self._writing: deque[list[ZeroParameter]] = deque()  # sub-groups stepped one by one, being written

    # -- whole steps ---------------------------------------------------------------------------------
    def step_all(self) -> None:
        """Every sub-group, the next read while one steps and the one before written."""
        subs = self.subgroups
        writing: deque[list[ZeroParameter]] = deque()
        if subs:
            self._bring_in(subs[0][1])
        for k, (gi, ps) in enumerate(subs):
            self._wait_in(ps)
            while len(writing) > 1:
                self._wait_out(writing.popleft())
            if k + 1 < len(subs):
                self._bring_in(subs[k + 1][1])
            self._narrowed_step(gi, ps)
            self._send_out(ps)
            writing.append(ps)
        while writing:
            self._wait_out(writing.popleft())

    def step_one(self, gi: int, ps: list[ZeroParameter]) -> None:
        """One sub-group (the step in backward): read it in, step it, start its writes (at most two
        sub-groups' writes in flight; `wait_writes` waits for them)."""
        self._bring_in(ps)
        self._wait_in(ps)
        while len(self._writing) > 1:
            self._wait_out(self._writing.popleft())
        self._narrowed_step(gi, ps)
        self._send_out(ps)
        self._writing.append(ps)

    def wait_writes(self) -> None:
        """Wait for the writes of every sub-group `step_one` stepped (the first failure raises, after
        the others are waited for)."""
        error: BaseException | None = None
        while self._writing:
            try:
                self._wait_out(self._writing.popleft())
            except Exception as exc:  # noqa: BLE001 - re-raised below, once every write settled
                error = error or exc
        if error is not None:
            raise error

    def _narrowed_step(self, gi: int, ps: Sequence[ZeroParameter]) -> None:
        """The user's optimizer steps on ``ps`` (of param group ``gi``) only: the other groups' and
        parameters' ``params`` are empty for the call, and every group's list is put back after it."""
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for j, g in enumerate(groups):
                g["params"] = [p._zero.train_tensor for p in ps] if j == gi else []
            torch_step(self.optimizer)
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params

    # -- moves -----------------------------------------------------------------------------------------
    def state_keys(self, ps: Sequence[ZeroParameter], resident: Collection[Residence] | None = None) -> list[Hashable]:
        """Swap keys of ``ps``' separate masters and per-element optimizer state (in ``resident`` only)."""
        assert self.states is not None
        keys: list[Hashable] = []
        for p in ps:
            z = p._zero
            if z.master is not None:
                keys.append(("master", z.id))
            for name, v in self.optimizer.state.get(z.train_tensor, {}).items():
                if self._per_element(v, z.shard_numel):
                    keys.append((z.id, name))
        if resident is None:
            return keys
        return [k for k in keys if self.states.state(k) in resident]

    def _bring_in(self, ps: Sequence[ZeroParameter]) -> None:
        if self.shards is not None and not self.separate_masters:
            self.shards.load(ps, wait=False)
        if self.states is not None:
            for key in self.state_keys(ps, {Residence.DRIVE}):
                self.states.swap_in(key)

    def _wait_in(self, ps: Sequence[ZeroParameter]) -> None:
        if self.shards is not None and not self.separate_masters:
            self.shards.wait(ps)
        if self.states is not None:
            self.states.wait(self.state_keys(ps))

    def _send_out(self, ps: Sequence[ZeroParameter]) -> None:
        if self.separate_masters:
            for p in ps:
                self.write_shard(p, p._zero.train_tensor)
        elif self.shards is not None:
            self.shards.unload(ps, write=True)
        if self.states is not None:
            self.send_out_states(ps)

    def _wait_out(self, ps: Sequence[ZeroParameter]) -> None:
        if self.shards is not None:
            self.shards.wait(ps)
        if self.states is not None:
            self.states.wait(self.state_keys(ps))

    def write_shard(self, p: ZeroParameter, master: torch.Tensor) -> None:
        """Cast ``master`` into ``p``'s shard, in memory or in its region on the drive."""
        if self.shards is not None and p._zero.swap is not None:
            self.shards.store(p, master)
        else:
            p._zero.shard.copy_(master)

    @contextlib.contextmanager
    def loaded(self, params: Sequence[ZeroParameter], write: bool) -> Iterator[None]:
        """Keep ``params``' masters and optimizer state in memory inside the block (read from the
        drive with ``offload_optimizer="nvme"``); with ``write``, what the block changed (or put in
        their place, as a checkpoint load does) goes back to the drive after it."""
        if self.states is None:
            yield
            return
        ps = [p for p in params if p.requires_grad]
        for key in self.state_keys(ps, {Residence.DRIVE}):
            self.states.swap_in(key)
        before = self.state_keys(ps)
        self.states.wait(before)
        try:
            yield
        finally:
            if write:
                self.send_out_states(ps)
                kept = set(self.state_keys(ps))
                for key in before:  # a load of a state without it (saved before the first step): forgotten, not
                    if key not in kept:  # left in memory, where the next staged step found it
                        self.states.forget(key)
            else:
                for key in self.state_keys(ps, MEMORY):
                    self.states.drop(key)
            self.states.wait(self.state_keys(ps))

    def send_out_states(self, ps: Sequence[ZeroParameter]) -> None:
        assert self.states is not None
        for p in ps:
            z = p._zero
            if z.master is not None:
                self.states.swap_out(("master", z.id), z.master.untyped_storage())
            for name, v in self.optimizer.state.get(z.train_tensor, {}).items():
                if self._per_element(v, z.shard_numel):
                    self.states.swap_out((z.id, name), v.untyped_storage())


__all__ = ["SubgroupStreamer"]
