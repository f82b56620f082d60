"""Which parameters stay gathered for the whole run (persistent), and which shards stay in memory.

One rule, used by ``zero3.Init`` (which writes every other shard to the drive while the model is
built, ``remote_device="nvme"``) and by the engine (which marks the persistent parameters and places
every shard, runtime/coordinator.py and runtime/placement.py), so the two cannot disagree on what they see in the
same order. Small parameters cost more in collective latency than they save in memory: a parameter
of at most ``param_persistence_threshold`` elements is persistent while the persistent ones, taken
greedily in the order given, sum to at most ``model_persistence_threshold`` elements. Of the shards
whose home is the drive, the first ``offload_param_max_in_cpu`` elements of non-persistent ones
(in the order given) stay in memory anyway, and persistent ones always do.

The engine decides in ``named_parameters`` order (docs/config.md); ``zero3.Init`` can only decide
as parameters are made, in construction order, so where the two orders differ the engine's decision
stands and moves the shards Init placed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class PersistenceRule:
    """The greedy persistence rule, one parameter at a time (see the module docstring)."""

    param_threshold: int
    budget: int  # elements the model cap still allows

    def admit(self, numel: int) -> bool:
        """Whether the next parameter, of ``numel`` elements, is persistent (it then uses up budget)."""
        if numel <= self.param_threshold and numel <= self.budget:
            self.budget -= numel
            return True
        return False


def choose_persistent(numels: Iterable[int], param_threshold: int, model_threshold: int) -> list[bool]:
    """For parameters of ``numels`` elements, in this order: which are persistent."""
    rule = PersistenceRule(param_threshold, model_threshold)
    return [rule.admit(n) for n in numels]


@dataclass
class MemoryBudget:
    """``offload_param_max_in_cpu``: the shard elements that stay in memory although their home is
    the drive, first come first served; persistent parameters stay without using it up."""

    budget: int

    def stays(self, persistent: bool, shard_numel: int) -> bool:
        """Whether the next shard stays in memory (else it goes to the drive)."""
        if persistent:
            return True
        if shard_numel <= self.budget:
            self.budget -= shard_numel
            return True
        return False
