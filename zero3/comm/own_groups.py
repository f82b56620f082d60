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

So a group is made once per (ranks, timeout, backend) and every later communicator over the same
ranks runs on it: communicators over one group issue their collectives in program order on every
rank, as they would over the caller's group. A group on which a collective failed (some
communicator's `EpochState` is BROKEN) may be out of step between ranks, and only the ranks that saw
the failure know it; so before using a kept group, the ranks agree that every one of them holds it
healthy (one small all-reduce over the caller's group); else every rank makes a new one. Nothing is
destroyed before the exit (exit_release.py), so every rank's registry holds the same names and the
new group gets the same name on every rank.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from .verify import EpochMode, EpochState

_GROUPS: dict[tuple[tuple[int, ...], float, str], tuple[Any, list[EpochState]]] = {}


def _registered(group: Any) -> bool:
    try:
        dist.get_process_group_ranks(group)
        return True
    except (ValueError, RuntimeError):  # destroyed (destroy_process_group of the default group destroys all)
        return False


def own_group(group: Any, timeout_s: float, backend: str, device: torch.device, state: EpochState) -> tuple[Any, int]:
    """zero3's group over ``group``'s ranks with ``timeout_s``, kept or made (see the Note), and how
    many communicators ran on it before the one whose epochs ``state`` tracks (its failure reports
    go under their own key: an earlier engine's must not be read as this one's). A collective over
    ``group``."""
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    key = (ranks, float(timeout_s), backend)
    kept = _GROUPS.get(key)
    healthy = kept is not None and _registered(kept[0]) and all(s.mode is not EpochMode.BROKEN for s in kept[1])
    flag = torch.tensor([int(healthy)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if not int(flag.item()) or kept is None:
        made = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s), backend=backend,
                              use_local_synchronization=True)
        kept = _GROUPS[key] = (made, [])
    kept[1].append(state)
    return kept[0], len(kept[1]) - 1
