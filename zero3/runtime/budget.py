"""``memory_budget`` in the runtime: the number resolved at initialize, the knobs it fixes then, and
the schedule knobs chosen from the first training step's trace (planning/budget.py [Note: memory budget]).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.tags import Kind, Tag
from ..config import ZeroConfig
from ..optim.precision import torch_dtype
from ..planning.budget import (AUTO_FRACTION, Calibration, ReduceHold, ScheduleChoice, StaticChoice, check_room,
                               choose_split, choose_static, exposed_bytes, gradient_pieces, reduce_exposed_bytes,
                               smallest_budget)
from ..planning.schedule import PlanConfig, plan
from ..planning.trace import Trace

logger = logging.getLogger(__name__)

_CHECKED_KEPT = 256
"""Inference traces whose room `MemoryBudget.choose` remembers having checked (an older one seen again
is checked again: one plan)."""


def free_bytes(comm: Communicator, device: torch.device) -> int:
    """The memory free to this rank now: CUDA's free device memory, else ``MemAvailable`` shared by
    the ranks on this node."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as fh:
        available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    nodes = comm.nodes
    return available // max(1, list(nodes).count(nodes[comm.rank]))


class MemoryBudget:
    """The budget's choices: the static ones from initialize; the reduce bucket and the schedule after
    the first training trace."""

    def __init__(self, static: StaticChoice, budget_for_room: Callable[[int], int] | None = None, *,
                 reduce_hold: ReduceHold = 0, grad_numel: int = 0, grad_itemsize: int = 4,
                 comm: Communicator | None = None, mixed_fp64: bool = False) -> None:
        """``budget_for_room(r)``: the least budget leaving ``r`` bytes of room (for the refusal);
        ``reduce_hold``: what a bucket of n elements holds (comm/reduce.py `hold_bytes`); ``grad_numel``:
        the largest gradient piece, reduced whole; ``comm``: the data-parallel communicator, whose ranks
        agree on the measured waits the choice is weighed by (None: the byte model unweighed); ``mixed_fp64``: fp64
        parameters beside others, whose bucket is reduced in fp64 (grad.py), so that on 3 or more ranks
        the bucket changes the numbers."""
        self.static = static
        self.schedule: ScheduleChoice | None = None
        self._budget_for_room = budget_for_room
        self._reduce_hold = reduce_hold
        self._grad_numel = grad_numel
        self._grad_itemsize = grad_itemsize
        self._comm = comm
        self._mixed_fp64 = mixed_fp64
        # inference traces whose room was checked, the `_CHECKED_KEPT` checked last (a run that never trains
        # records new versions without end under LayerDrop: review 32RD, 1,661 entries after 2,000 steps)
        self._checked: OrderedDict[tuple[str, int], None] = OrderedDict()

    @classmethod
    def resolve(cls, config: ZeroConfig, comm: Communicator, named: Sequence[tuple[str, nn.Parameter]],
                device: torch.device, units: Sequence[Sequence[nn.Parameter]] = ()) -> tuple[ZeroConfig, MemoryBudget | None]:
        """The config the runtime runs with: ``memory_budget`` replaced by the knobs it fixes at
        initialize (persistence, reduce bucket, the live cap for the first step); and the budget
        (None without ``memory_budget``). ``"auto"`` takes the smallest share over the ranks.
        ``units``: each leaf module's trainable parameters, reduced as one piece (runtime/grad.py)."""
        budget = config.budget.memory_budget
        if budget is None:
            return config, None
        if budget == "auto":
            mine = int(AUTO_FRACTION * free_bytes(comm, device))
            budget = min(comm.exchange_objects(mine, Tag(Kind.OBJECTS, "memory_budget auto")))
            logger.info("zero3: memory_budget auto: %.1f MiB per rank (%g of the free memory, least over ranks)",
                        budget / 2**20, AUTO_FRACTION)
        lowered = torch_dtype(config.precision.dtype)
        lowered = None if lowered == torch.float32 else lowered  # bf16/fp16 cast every floating shard; fp32 keeps each
        itemsize = {name: _itemsize(p, lowered) for name, p in named}  # one's own (an fp64 model stays fp64)
        sizes = [(name, n, n * itemsize[name]) for name, p in named for n in [_numel(p)]]
        grad_numel = max([_numel(p) for _, p in named if p.requires_grad] + [sum(map(_numel, u)) for u in units],
                         default=0)  # the largest piece one reduction takes whole
        trained = [itemsize[name] for name, p in named if p.requires_grad]
        grad_itemsize = max(trained, default=4)
        reduce_itemsize = torch_dtype(config.precision.reduce_dtype).itemsize
        if any(p.requires_grad and p.dtype == torch.float64 for _, p in named):
            reduce_itemsize = 8  # an fp64 model's gradients are reduced in fp64 (grad.py `flush`)
        pieces, holes = len(trained), bool(units)

        # Megatron's sequence-parallel gradients are summed over the model-parallel group in the wider of
        # the two dtypes (grad.py): counted as if all of a bucket were, beside the others' cast (review 39R2)
        sequence_parallel = any(getattr(p, "sequence_parallel", False) for _, p in named)
        wider = max(reduce_itemsize - grad_itemsize, 0) if sequence_parallel else 0

        def reduce_bytes(n: int) -> int:  # the gradients and the reduction's buffers (comm/reduce.py `hold_bytes`)
            return comm.reduce_hold_bytes(n, pieces, grad_itemsize, reduce_itemsize, holes) + wider * n

        static = choose_static(sizes, budget, reduce_bytes, grad_numel, secondary_group=comm.hpz)
        resolved = config.replace(memory_budget=None, param_persistence_threshold=static.param_persistence_threshold,
                                  model_persistence_threshold=static.model_persistence_threshold,
                                  reduce_bucket_size=static.reduce_bucket_size, max_live_bytes=static.room,
                                  max_reuse_distance_bytes=0, prefetch_bucket_bytes=0)
        return resolved, cls(static, lambda room: smallest_budget(sizes, reduce_bytes, grad_numel, room=room,
                                                                  start=budget, secondary_group=comm.hpz),
                             reduce_hold=reduce_bytes, grad_numel=grad_numel, grad_itemsize=grad_itemsize, comm=comm,
                             mixed_fp64=len({p.dtype == torch.float64 for _, p in named if p.requires_grad}) > 1)

    @property
    def room(self) -> int:
        """Bytes for gathered parameters: the static room until the schedule is chosen, then its own."""
        return self.schedule.room if self.schedule is not None else self.static.room

    @property
    def reduce_bucket_bytes(self) -> int:
        """What the reduce bucket in use holds at most (the static one's until the schedule is chosen)."""
        return self.schedule.reduce_bucket_bytes if self.schedule is not None else self.static.reduce_bucket_bytes

    def choose(self, trace: Trace, waits: tuple[float, float] | None = None,
               pieces: Sequence[int] | None = None) -> PlanConfig | None:
        """The schedule knobs for ``trace`` (the first training step's), with the reduce bucket
        (`ScheduleChoice.reduce_bucket_size`), logged once. None for an inference step's trace (an eval
        before training, generation): forward-only, it has no reuse to plan for, and knobs fitted to it
        would hold for all training, so the room's knobs stay until a step trains; its modules are still
        checked to fit the room. ``waits``: the seconds that step waited for gathers and for reductions,
        which weigh the choice (`Calibration.measured`; a collective over the ranks, which all choose at
        the same step). ``pieces``: the elements of each gradient piece the reducer received in that step,
        in order (None or empty: predicted from the trace, `gradient_pieces`).

        Raises:
            ZeroConfigError: not even gathering one module at a time fits the room."""
        if not trace.trains or self.schedule is not None:  # a trace after the choice (new modules, a
            if (trace.key, trace.version) not in self._checked:  # divergence) must fit the room too (probe 39M)
                check_room(trace, self.room, self._budget_for_room)
                self._checked[(trace.key, trace.version)] = None
                while len(self._checked) > _CHECKED_KEPT:
                    self._checked.popitem(last=False)
            return None
        st = self.static
        pieces = list(pieces) if pieces else gradient_pieces(trace)
        self.schedule = choose_split(trace, st.budget - st.persistent_bytes - st.secondary_bytes, self._reduce_hold,
                                     self._grad_numel, st.reduce_bucket_size, grad_itemsize=self._grad_itemsize,
                                     calibration=self._calibration(trace, waits, pieces),
                                     budget_for_room=self._budget_for_room, pieces=pieces)
        self.schedule = c = self._agreed(self.schedule)
        logger.info("zero3: memory_budget %d bytes: max_live_bytes %d, prefetch_bucket_bytes %d, "
                    "max_reuse_distance_bytes %d, reduce_bucket_size %d; predicted peak %d gathered + %d persistent "
                    "+ %d reduce bucket (engine.explain('budget') says why)", st.budget, c.config.max_live,
                    c.config.prefetch_bucket_size, c.config.max_reuse_distance, c.reduce_bucket_size, c.peak_bytes,
                    st.persistent_bytes, c.reduce_bucket_bytes)
        return c.config

    def _agreed(self, mine: ScheduleChoice) -> ScheduleChoice:
        """Rank 0's choice on every rank where the ranks' choices differ (one exchange, once a run). They
        are made from each rank's own first training step, and its trace can differ between ranks without
        anything raising (a no_grad forward one rank alone ran inside it, needing no collective:
        runtime/hooks.py [Note: a no_grad forward inside a step]; review 42R1 measured reuse 98,304
        bytes on one rank and 0 on the other). The knobs and above all the reduce bucket must be the same
        on every rank; each rank then plans its own trace with them, under the same caps."""
        comm = self._comm
        if comm is None or comm.world_size == 1:
            return mine
        choices = comm.exchange_objects(mine, Tag(Kind.OBJECTS, "memory_budget choice"))
        first = choices[0]
        if all(_knobs(c) == _knobs(first) for c in choices):
            return mine
        apart = [r for r, c in enumerate(choices) if _knobs(c) != _knobs(first)]
        logger.info("zero3: memory_budget: ranks %s chose other knobs than rank 0 (their first training steps "
                    "differed: a forward one rank alone ran?); every rank takes rank 0's", apart)
        if _knobs(mine) == _knobs(first):
            reason = f"ranks {apart} chose otherwise from their own first training steps and run this choice too"
        else:
            reason = ("rank 0's choice, and the lines above are rank 0's: this rank's first training step differed "
                      "from rank 0's and it chose otherwise; the knobs and the reduce bucket must be the same on every rank")
        return dataclasses.replace(first, reasons=first.reasons + (reason,))

    def _calibration(self, trace: Trace, waits: tuple[float, float] | None,
                     pieces: Sequence[int] | None = None) -> Calibration:
        """The weights of `choose_split`'s two exposures from what ``trace``'s step waited (``waits``,
        the most over the ranks) against what the model predicts that step exposed: it ran on demand
        within the static room, releasing after use, with the static reduce bucket. The byte model
        unweighed where a wait does not measure exposure or the choice must not vary from run to run:
        at world size 1 (no reductions), without waits, on CUDA (a wait there is a stream dependency, not
        host time), and where the bucket changes the numbers on 3 or more ranks (reduce_scatter or
        all_reduce without qgZ, or fp64 parameters beside others: docs/config.md), so that a run there
        repeats its numbers."""
        comm = self._comm
        if comm is None or comm.world_size == 1 or waits is None or comm.device.type != "cpu" or \
                comm.world_size > 2 and (self._mixed_fp64 or comm.config.reduce_impl in ("reduce_scatter", "all_reduce")
                                         and not comm.config.quantize_gradients):
            return Calibration()
        waits = comm.exchange_objects(tuple(waits), Tag(Kind.OBJECTS, "memory_budget calibration"))
        first = PlanConfig(max_live=self.static.room, max_reuse_distance=0, prefetch_bucket_size=0, unit="bytes")
        return Calibration.measured(max(w[0] for w in waits), exposed_bytes(trace, plan(trace, first)),
                                    max(w[1] for w in waits), reduce_exposed_bytes(
                                        gradient_pieces(trace) if pieces is None else pieces,
                                        self.static.reduce_bucket_size, self._grad_itemsize))

    def explain(self) -> list[str]:
        lines = [f"budget: {r}" for r in self.static.reasons]
        if self.schedule is None:
            return lines + ["budget: no schedule chosen: no training step has recorded a gather yet (none has run, "
                            "only inference steps have, or every parameter is persistent); a step gathers on demand "
                            "within the room, prefetching nothing"]
        return lines + [f"budget: {r}" for r in self.schedule.reasons]


def _knobs(c: ScheduleChoice) -> tuple:
    """What of a choice must be the same on every rank."""
    return c.config, c.room, c.reduce_bucket_size, c.reduce_bucket_bytes


def _itemsize(p: nn.Parameter, lowered: torch.dtype | None) -> int:
    """Bytes per element of ``p``'s shards and gathers: ``lowered`` (bf16/fp16) for a floating parameter
    under mixed precision, its own dtype's otherwise."""
    return lowered.itemsize if lowered is not None and p.dtype.is_floating_point else p.dtype.itemsize


def _numel(p: nn.Parameter) -> int:
    z = getattr(p, "_zero", None)
    return z.numel if z is not None else p.numel()
