"""zero3's own process groups (``collective_timeout``), one per set of ranks, shared by the communicators over them.

[Note: one own group per set of ranks]
A communicator runs on a group of its own whose timeout is ``collective_timeout``, so a rank that stops
taking part is named instead of waited for (failure.py). Made anew for every communicator, those
groups stayed in torch's registry until the process exited: 3 threads and 2 sockets per engine at
world size 2 (measured), "Too many open files" after some hundreds of engines built in one process
(a sweep, an evaluation loop that builds its own). They cannot be destroyed when an engine goes:
torch 2.13 names a group over a subset of ranks after its ranks, and a second group over the same
ranks made after a destroy took the first one's name and its stale rendezvous keys in the store, and
failed to connect (checked on 2 ranks).

So groups are kept per (ranks, timeout, backend), and a communicator takes a kept group that no
live communicator runs on (a sweep's engines, one after another, share one group; two engines alive
together, a teacher and a student, run on two, so a failure in one leaves the other intact, as
before). A group on which a collective failed (its communicator's `EpochState` went BROKEN) may be
out of step between ranks, and only the ranks that saw the failure know it; whether a communicator
is still alive can differ between ranks too (the cyclic GC runs at different moments). So the ranks
agree on which kept group is free on every one of them (one small all-reduce over the caller's
group, a flag per kept group), take the first, or all make a new one. Nothing is destroyed before
the exit (exit_release.py): every rank makes the same groups in the same order, so the new group
gets the same name on every rank. The list holds the groups weakly (torch's registry holds them
while they are registered): a destroy of the default group destroys them too, and then the old
groups and their rendezvous store go with it (a strong reference here kept both until the exit).
Their entries stay, never free, so the list is the same length on every rank.

torch names a group made with ``use_local_synchronization`` after its ranks and after how many groups
the calling rank has registered (torch 2.13 ``_hash_ranks_to_str``). Ranks that made different numbers
of groups (rank 0 alone built an engine over ``new_group([0])``, or an engine over two of four ranks
came first) gave the same new group different names, and the next engine over all of them hung in
torch's rendezvous (probe 29C). So the ranks agree on their counts in the same all-reduce, and a rank
behind makes groups of itself alone (no peer, no rendezvous; 3 threads each on gloo, as many as the
others' lead) until the counts match, whether a kept group is taken or a new one made; hpZ's blocks
(hpz.py) align the counts again before they are made (`align_group_counts`: without an own group,
``collective_timeout=0``, nothing else would; review 29Y).

A destroyed group lowers the count too, so the next group over the same ranks can get the name of one
that lives (a user's subgroup made before engine A and destroyed while A lives: engine B's own group
took A's name, and torch refused it, review 30Y). Before a group is made, the ranks agree whether its
name is taken on any of them, and all make a group of themselves alone until it is not
(`step_past_taken_names`).
"""

from __future__ import annotations

import datetime
import gc
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ZeroConfigError
from .verify import EpochMode, EpochState
from .wire import group_alive


@dataclass(eq=False)
class _Kept:
    group_ref: "weakref.ref[Any]"  # weak: a group destroyed with the default group must go, and its store with it
    users: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)  # live communicators on it
    broken: bool = False  # a collective on it failed (told by a user's finalizer, or seen live)
    uses: int = 0  # communicators that ran on it

    def free(self) -> bool:
        group = self.group_ref()
        if self.broken or group is None or not group_alive(group):
            return False
        if any(u._state.mode is EpochMode.BROKEN for u in self.users):
            self.broken = True
            return False
        return not self.users


_GROUPS: dict[tuple[tuple[int, ...], float, str], list[_Kept]] = {}


def _on_collected(kept: _Kept, state: EpochState) -> None:
    if state.mode is EpochMode.BROKEN:
        kept.broken = True


def _registered_count() -> int:
    """How many process groups torch has registered on this rank (the count its group names hash)."""
    return len(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", ()))


def _pad(n: int, backend: str) -> None:
    """``n`` groups of this rank alone, so that its count reaches the others' (torch's registry holds
    them until the exit)."""
    for _ in range(n):
        dist.new_group([dist.get_rank()], backend=backend, use_local_synchronization=True)


def _next_name_taken(ranks: list[int]) -> bool:
    """Whether a group made now over ``ranks`` with local synchronization gets the name of a live group
    (torch 2.13 names it after the ranks and the count a destroy lowers; see the Note)."""
    c10d = dist.distributed_c10d
    name_of = getattr(c10d, "_hash_ranks_to_str", None)
    world = getattr(c10d, "_world", None)
    if name_of is None or world is None:
        return False
    return name_of(sorted(ranks)) in set(world.pg_names.values())


def step_past_taken_names(group: Any, ranks: list[int], backend: str, device: torch.device) -> None:
    """Make groups of each rank alone until the group over ``ranks`` (this rank's; it may differ between
    ranks, as hpZ's blocks do) would get a free name on every rank of ``group``. Every rank must be at
    the same count already (`align_group_counts`). A collective over ``group``."""
    while True:
        flags = torch.tensor([int(_next_name_taken(ranks)), int(_next_name_taken([dist.get_rank()]))],
                             device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        taken, pad_taken = (int(v) for v in flags.tolist())
        if not taken:
            return
        if pad_taken:
            raise ZeroConfigError(
                f"cannot make a process group over ranks {sorted(ranks)}: torch 2.13 would give it, and every "
                "group that could move the count past it, the name of a live group, because a process "
                "group was destroyed after groups made later than it (torch names a group after its ranks "
                "and how many groups are registered). Build the engine before destroying other subgroups")
        _pad(1, backend)


def align_group_counts(group: Any, backend: str, device: torch.device) -> None:
    """Every rank of ``group`` at the same count of registered groups before they make local groups
    (see the Note). A collective over ``group``."""
    count = _registered_count()
    most = torch.tensor([count], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    _pad(int(most.item()) - count, backend)


def own_group(group: Any, timeout_s: float, backend: str, device: torch.device, comm: Any) -> tuple[Any, int]:
    """zero3's group over ``group``'s ranks with ``timeout_s`` for the communicator ``comm``, kept or
    made (see the Note), and how many communicators ran on it before (its failure reports go under
    their own key: an earlier engine's must not be read as this one's). A collective over ``group``."""
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    key = (ranks, float(timeout_s), backend)
    kept = _GROUPS.setdefault(key, [])
    if any(k.users for k in kept):
        gc.collect()  # communicators of dropped engines left in reference cycles
    count = _registered_count()
    flags = torch.tensor([int(k.free()) for k in kept] + [1, -count], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)  # the first group free everywhere; the most groups
    *free, most = flags.tolist()
    pick = int(free.index(1))
    _pad(-most - count, backend)  # also when a kept group is taken: the next local group is named by the count
    made = None  # held here until the communicator holds it
    if pick == len(kept):
        step_past_taken_names(group, list(ranks), backend, device)
        made = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s), backend=backend,
                              use_local_synchronization=True)
        kept.append(_Kept(weakref.ref(made)))
    chosen = kept[pick]
    chosen.users.add(comm)
    weakref.finalize(comm, _on_collected, chosen, comm._state)
    chosen.uses += 1
    return chosen.group_ref(), chosen.uses - 1
