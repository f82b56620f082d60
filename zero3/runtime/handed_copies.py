"""The copies ``state_dict()`` hands out inside ``GatheredParameters``, and the writes made through them.

Inside a context, ``state_dict()`` gives copies of the partitioned parameters (`copy_gathered_state`),
where torch gives views: a view would point at freed memory once the gather ends. An EMA written as
timm's (``ev.copy_(...)`` over ``ema.state_dict().values()`` inside ``GatheredParameters(...,
modifier_rank=0)``) wrote into the copies, and the EMA never moved, or moved only in its persistent
parameters (probe 36H). So each copy of a parameter held by an open user context is recorded
(`HandedCopy`: the copy, its version counter, the parameter's `bit_sum` then), shared by every open
context holding the parameter, until the outermost of them exits. A copy written in place (its
version moved) goes into its parameter's gathered data, as a write through a view would have:

- at the next ``state_dict()`` that copies the parameter again, so that a second pass over the state
  dict sees the first pass's writes (review 36R3: three passes gave one pass's result), and
- at the exit of the context (`take_copies`), before a ``modifier_rank`` context publishes; in a
  context without one it is then a write as any other, discarded and raised for a parameter the
  context gathered, kept for one gathered before (gathered.py [Note: writes that GatheredParameters
  discards]).

A read of the parameter itself between the write and either point still sees the old value. A
parameter written both through its copy and otherwise since the copy was taken (directly, or through
another copy taken in first: its `bit_sum` moved, which a permutation of its words does not show) is
refused under ``modifier_rank``, which write came last being unknown (review 36R2: the copy overwrote
a direct ``mul_``; review 36R4: a later copy's take hid the conflict); without one the other write
stays, with a WARNING. A context that raised takes nothing, and the writes made in it through its
copies are taken by no enclosing one either (review 36R3: an outer block published the write of an
inner block that raised); a write into such a copy after the raise, inside the enclosing one, is taken
there, as a view's would be. A copy
of a tied name written alike is no conflict; torch's views make such a timm EMA update a tied weight
twice (once per name), the copies once.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn

from ..errors import ZeroStateError
from ..partition.param import PartitionedParameter, ZeroParameter, raw_data
from .rank_values import bit_sum

logger = logging.getLogger(__name__)

OPEN: list[Any] = []
"""The user's ``GatheredParameters`` contexts now open, innermost last (gathered.py appends and removes
them; each has ``holds(p)``, ``modifier_rank`` and ``_handed``, the copies of its parameters)."""

_BY_PARAM: dict[int, list[HandedCopy]] = {}  # id(parameter) -> its copies handed out while any context is open


@dataclasses.dataclass(eq=False)
class HandedCopy:
    """One copy ``state_dict()`` handed out of a parameter an open context holds."""

    p: ZeroParameter
    copy: torch.Tensor
    version: int  # the copy's version counter when it was handed out or last taken
    before: int  # the parameter's `bit_sum` then, or after a copy of it was last taken in
    holders: int = 0  # the open contexts whose ``_handed`` holds it


def copy_gathered_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """A state-dict post-hook on every hooked module (runtime/hooks.py): ``state_dict()`` inside
    ``GatheredParameters`` copies gathered partitioned params, because their storage is emptied again
    when the gather ends and a view would then point at freed memory. Not a persistent one, whose
    storage stays (a step gathers into it again), nor the parameter itself (``keep_vars=True``): as
    in torch, writes through those reach the model (probe 34C). Unless the persistent one's storage
    holds more than it (at world size 1 under bf16/fp16 it views one buffer of every shard), which
    ``torch.save`` would write whole (review 34RA: 266 kB for a few biases' 5). A copy is per name,
    so tied names get one each (a cache across modules kept stale copies for a reused destination and
    refused a plain dict one: review 34RC). A parameter an open context holds takes the copies of it
    written since first, and its new copy is recorded (module docstring)."""
    for name, p in dict.items(module._parameters):
        key = prefix + name
        if not isinstance(p, ZeroParameter) or isinstance(p, PartitionedParameter) or (v := state_dict.get(key, p)) is p:
            continue
        if not p._zero.persistent or v.untyped_storage().nbytes() != v.numel() * v.element_size():
            held = [context for context in OPEN if context.holds(p)]
            for record in _BY_PARAM.get(id(p), ()) if held else ():
                _take(record)  # a conflict is left for the exit to report
            state_dict[key] = copy = v.clone()
            if held:
                record = HandedCopy(p, copy, copy._version, int(bit_sum(v)))
                _BY_PARAM.setdefault(id(p), []).append(record)
                for context in held:
                    context._handed.append(record)
                record.holders = len(held)


def _take(record: HandedCopy) -> bool:
    """``record``'s copy into its parameter if it was written since; False (nothing taken) where the
    parameter was written too since the copy was taken."""
    if record.copy._version == record.version:
        return True
    data = raw_data(record.p)
    if not torch.equal(data, record.copy):  # a tied name's copy written alike needs nothing
        if int(bit_sum(data)) != record.before:
            return False
        data.copy_(record.copy)
    record.version = record.copy._version
    now = int(bit_sum(data))
    for other in _BY_PARAM.get(id(record.p), ()):  # its other unwritten copies compare with the value now; a
        if other.copy._version == other.version:  # written one keeps its conflict (review 36R4)
            other.before = now
    return True


def take_copies(handed: list[HandedCopy], modifier_rank: Any, take: bool) -> ZeroStateError | None:
    """At a context's exit: the written copies of ``handed`` into their parameters (``take``: the
    context did not raise), or none; either way no enclosing context takes them again. Under a
    ``modifier_rank``, a parameter written both ways is returned as an error (the caller agrees on it,
    so nothing is published)."""
    error = None
    for record in handed:
        if take and error is None and not _take(record):
            if modifier_rank is not None:
                error = ZeroStateError(
                    f"GatheredParameters(modifier_rank={modifier_rank}): {record.p._zero.name} was written both "
                    "through a state_dict() copy and directly (or through another copy) inside the block, which "
                    "write came last is not known; write it one way (nothing of the block's parameters of this "
                    "model was published)")
            else:
                logger.warning("zero3: %s was written both through a state_dict() copy and directly (or through "
                               "another copy) inside GatheredParameters; the copy's write is dropped",
                               record.p._zero.name)
        record.version = record.copy._version  # taken, or dropped with the block
        record.holders -= 1
        if record.holders <= 0:  # no open context holds it: a later block must not take it (review 36R4)
            records = _BY_PARAM.get(id(record.p), [])
            if record in records:
                records.remove(record)
            if not records:
                _BY_PARAM.pop(id(record.p), None)
    if not OPEN:
        _BY_PARAM.clear()
    return error


def modifier_holding(p: ZeroParameter) -> int | None:
    """The ``modifier_rank`` of the innermost open user context that holds ``p`` with one, else None: the
    rank whose values of ``p`` the context will publish."""
    return next((c.modifier_rank for c in reversed(OPEN) if c.modifier_rank is not None and c.holds(p)), None)
