"""``memory_budget``: the six budget knobs chosen from one number of bytes per rank.

[Note: memory budget]
The budget covers what a rank holds for ZeRO-3 beyond its shards: persistent parameters, gathered
(or in-flight) parameters, the gradient reduce bucket (what the reducer holds for it: its gradients
and the reduction's buffers, `ReduceHold`) and, under hpZ, the secondary slices. It is split in two
decisions, because persistence changes which modules the hooks record, so it has to be fixed before
the first step:

- At initialize, from the parameters' sizes (`choose_static`): the reduce bucket gets at most
  ``REDUCE_SHARE`` of the budget (never more than DeepSpeed's default); parameters of at most
  DeepSpeed's ``param_persistence_threshold`` elements stay persistent, greedily in
  ``named_parameters`` order, while they sum to at most ``PERSISTENT_SHARE`` of the budget. What is
  left is the *room* for gathered parameters.
- After the first training step (one with a backward: an inference step's forward-only trace has
  no reuse to plan for; it only gets `check_room`), from its recorded trace (`choose_split`): the
  reduce bucket is chosen again with the schedule. Each candidate bucket (the first step's, and for
  each number of reductions the smallest and the largest bucket giving it, from the gradient pieces
  the reducer received in the first step) leaves its own room; in it
  (`choose_schedule`) every combination of a grid of ``max_live``/``max_reuse_distance``/``prefetch_bucket`` is
  planned with `schedule.plan`; those whose planned peak fits the room are compared by predicted
  exposed communication (`exposed_bytes`), then by all-gathers, then by peak; the buckets are then
  compared by that plus their reductions' exposure (`reduce_exposed_bytes`), the two weighed by what
  the first step waited for each (`Calibration`). The grid is
  multiples of the largest module's bytes (the same for every budget) plus the room itself, so a
  room between two multiples is used whole (on the small GPT of bench_budget.py round 39's room was 2.4 of
  those multiples). The chosen
  plan's peak is within the room by construction; within one bucket's room a larger budget never
  predicts more exposure than the fixed grid's best under a smaller one (only the smaller room's own
  size may do better).

Predicted exposed communication, in bytes: a demand fetch is fully exposed; a prefetch bucket is
hidden behind the compute of the modules that run from its issue to its first use, with a module's
compute counted as its parameters' bytes; every collective adds ``LATENCY_BYTES``. A reduction
exposes its fixed cost (``REDUCE_LATENCY_BYTES``), and the last one its gradients too. Bytes of the
two kinds weigh alike unless a `Calibration` from measured waits says otherwise (the runtime's, on CPU:
runtime/budget.py). Pure: no torch, no process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ZeroConfigError
from .persistence import choose_persistent
from .schedule import PlanConfig, Schedule, plan
from .trace import Trace

AUTO_FRACTION = 0.4
"""``memory_budget="auto"``: this share of the memory free at initialize (CUDA: ``mem_get_info``;
CPU: ``MemAvailable`` divided by the ranks on the node), the smallest over the ranks."""

REDUCE_SHARE = 1 / 4
"""Most of the budget the gradient reduce bucket may take (bench_budget.py: on the small GPT a bucket
of one Block beat a quarter Block in 11 of 12 pairs of the sweep)."""

PERSISTENT_SHARE = 1 / 16
"""Most of the budget persistent parameters may take."""

LATENCY_BYTES = 256 * 1024
"""What one collective's fixed cost is counted as, in bytes on the wire."""

REDUCE_LATENCY_BYTES = 4 * LATENCY_BYTES
"""What one gradient reduction's fixed cost is counted as: a round trip (the bucket copied out, sent,
summed and landed into the shards, its headers checked), four collectives' worth. A judgement, not a
fit: on the 2-core host of docs/performance.md, halving the small GPT's reductions (10 to 5 a step)
saved about 2 ms of reduction wait for each one removed (22.2 to 12.7 ms a step, a scratch run of
round 40)."""

DEFAULT_PARAM_PERSISTENCE = 100_000
"""DeepSpeed's ``param_persistence_threshold``: parameters at most this large may be persistent."""

DEFAULT_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's ``reduce_bucket_size`` (elements): never exceeded."""

ReduceHold = Callable[[int], int] | int
"""What a reduce bucket of n gradient elements holds at most, in bytes (the communicator's
``reduce_hold_bytes``: its gradients and the reduction's buffers), or bytes per element."""

_LIVE_STEPS = (1, 2, 3, 4, 6, 8, 12, 16)
_PREFETCH_STEPS = (1, 2, 4)
_REUSE_STEPS = (2,)


@dataclass(frozen=True, slots=True)
class StaticChoice:
    """What `choose_static` fixed at initialize (elements where DeepSpeed counts elements)."""

    budget: int
    param_persistence_threshold: int
    model_persistence_threshold: int
    reduce_bucket_size: int
    persistent_bytes: int
    reduce_bucket_bytes: int
    reasons: tuple[str, ...]
    persistent_count: int = 0
    secondary_bytes: int = 0  # hpZ's secondary slices of the non-persistent parameters, kept through a step

    @property
    def room(self) -> int:
        """Bytes left for gathered, non-persistent parameters."""
        return self.budget - self.persistent_bytes - self.reduce_bucket_bytes - self.secondary_bytes


@dataclass(frozen=True, slots=True)
class ScheduleChoice:
    """What `choose_schedule` chose from a trace, and what its plan predicts."""

    config: PlanConfig
    peak_bytes: int
    exposed_bytes: int
    allgathers: int
    candidates: int
    feasible: int
    reasons: tuple[str, ...]
    room: int = 0  # the room it was chosen in (`choose_split`: the budget less its reduce bucket's hold)
    reduce_bucket_size: int = 0  # `choose_split`'s reduce bucket (elements) and what it holds (bytes)
    reduce_bucket_bytes: int = 0
    reductions: int = 0  # predicted reductions a step


@dataclass(frozen=True, slots=True)
class Calibration:
    """What one predicted exposed byte costs, for gathers and for reductions (`choose_split` scores
    ``gather * gathers' exposure + reduce * reductions' exposure``). The default weighs both alike, as
    bytes; `measured` makes them seconds from a step's waits."""

    gather: float = 1.0
    reduce: float = 1.0
    source: str = "the byte model as it stands (a gathered and a reduced byte weigh alike)"

    @classmethod
    def measured(cls, gather_wait: float, gather_predicted: int, reduce_wait: float, reduce_predicted: int) -> Calibration:
        """Seconds per predicted byte, from what a step waited for its gathers and its reductions and
        what the model predicts that step exposed; the default when the step waited for neither."""
        if gather_wait <= 0 and reduce_wait <= 0 or gather_predicted <= 0 or reduce_predicted <= 0:
            return cls()
        return cls(gather_wait / gather_predicted, reduce_wait / reduce_predicted,
                   f"the first training step's waits: {gather_wait * 1e3:.1f} ms for gathers predicted to expose "
                   f"{gather_predicted:,} bytes, {reduce_wait * 1e3:.1f} ms for reductions predicted to expose "
                   f"{reduce_predicted:,} bytes (the most over the ranks)")


def choose_static(params: Sequence[tuple[str, int, int]], budget: int, reduce_hold: ReduceHold,
                  grad_numel: int = 0, secondary_group: int = 1) -> StaticChoice:
    """Persistence thresholds and the reduce bucket for ``params`` (``(name, numel, nbytes)`` in
    ``named_parameters`` order) under ``budget`` bytes (see [Note: memory budget]). ``reduce_hold``:
    what a bucket of n gradient elements holds at most (bytes), or bytes per element. ``grad_numel``:
    the elements of the largest piece one reduction takes whole (a trainable parameter, or a leaf
    module's), so the reduce bucket is counted as at least that. ``secondary_group``: hpZ's ranks per
    secondary group (1: off); above 1, each non-persistent parameter's secondary slice (its bytes over
    the group, rounded up) is counted outside the room: a training step keeps them all.

    Raises:
        ZeroConfigError: the budget cannot hold the largest non-persistent parameter gathered; names
            the least budget that can.
    """
    if budget <= 0:
        raise ZeroConfigError(f"memory_budget must be > 0 bytes, got {budget!r}")
    choice, (largest, name) = _static(params, budget, reduce_hold, grad_numel, secondary_group)
    if largest > choice.room:
        raise ZeroConfigError(
            f"memory_budget {budget:,} bytes is too small: parameter {name!r} alone needs {largest:,} bytes "
            f"gathered, and persistent parameters ({choice.persistent_bytes:,}) and the reduce bucket "
            f"({choice.reduce_bucket_bytes:,})" + (f" and hpZ's secondary slices ({choice.secondary_bytes:,})"
                                                   if choice.secondary_bytes else "") + " take the rest; give at least "
            f"{smallest_budget(params, reduce_hold, grad_numel, start=budget, secondary_group=secondary_group):,} "
            "bytes (the least budget whose own persistent parameters, reduce bucket and hpZ slices leave that room)")
    reasons = (
        f"memory_budget {budget:,} bytes per rank",
        f"reduce_bucket_size {choice.reduce_bucket_size:,} elements ({choice.reduce_bucket_bytes:,} bytes held at most: "
        "its gradients and the reduction's buffers): "
        + (f"the largest gradient piece, reduced whole, larger than min(DeepSpeed's {DEFAULT_REDUCE_BUCKET:,}, "
           f"{REDUCE_SHARE:g} of the budget)" if choice.reduce_bucket_size == grad_numel else
           f"min(DeepSpeed's {DEFAULT_REDUCE_BUCKET:,}, {REDUCE_SHARE:g} of the budget)"),
        f"persistent: {choice.persistent_count} parameters of <= {DEFAULT_PARAM_PERSISTENCE:,} elements, "
        f"{choice.persistent_bytes:,} bytes (model_persistence_threshold {choice.model_persistence_threshold:,} "
        f"elements = {PERSISTENT_SHARE:g} of the budget)",
        *((f"hpZ secondary slices: {choice.secondary_bytes:,} bytes (the non-persistent parameters over groups "
           f"of {secondary_group} ranks, kept through a training step)",) if choice.secondary_bytes else ()),
        f"room for gathered parameters: {choice.room:,} bytes",
    )
    return dataclasses.replace(choice, reasons=reasons)


def smallest_budget(params: Sequence[tuple[str, int, int]], reduce_hold: ReduceHold, grad_numel: int = 0, *,
                    room: int = 0, start: int = 1, secondary_group: int = 1) -> int:
    """The least budget from ``start`` up whose static choice leaves room for the largest
    non-persistent parameter and for ``room`` bytes gathered at once. The persistent set and the
    reduce bucket grow with the budget, so each step asks again at the size the last one named."""
    budget = max(1, start)
    for _ in range(256):
        choice, (largest, _) = _static(params, budget, reduce_hold, grad_numel, secondary_group)
        need = max(largest, room) + choice.persistent_bytes + choice.reduce_bucket_bytes + choice.secondary_bytes
        if need <= budget:
            return budget
        budget = need
    return budget


def _static(params: Sequence[tuple[str, int, int]], budget: int, reduce_hold: ReduceHold,
            grad_numel: int, secondary_group: int = 1) -> tuple[StaticChoice, tuple[int, str]]:
    """`choose_static`'s choice without its checks and reasons, and the largest non-persistent
    parameter's bytes and name ((0, "") when every one is persistent)."""
    # A gradient piece larger than the share is reduced whole anyway: the bucket takes its size (as
    # coarse as the account already allows: fewer reductions for the same bytes).
    hold = _hold_of(reduce_hold)
    reduce_elems = max(1, grad_numel, _largest_within(hold, int(budget * REDUCE_SHARE)))
    element = max((nbytes // numel for _, numel, nbytes in params if numel), default=4) or 1
    model_threshold = int(budget * PERSISTENT_SHARE) // element
    chosen = choose_persistent((numel for _, numel, _ in params), DEFAULT_PARAM_PERSISTENCE, model_threshold)
    persistent = sum(nbytes for (_, _, nbytes), keep in zip(params, chosen) if keep)
    secondary = 0 if secondary_group <= 1 else sum(
        -(-numel // secondary_group) * (nbytes // numel) for (_, numel, nbytes), keep in zip(params, chosen)
        if numel and not keep)
    choice = StaticChoice(budget, DEFAULT_PARAM_PERSISTENCE, model_threshold, reduce_elems, persistent,
                          hold(reduce_elems), (), sum(chosen), secondary)
    others = [(nbytes, name) for (name, _, nbytes), keep in zip(params, chosen) if not keep]
    return choice, max(others, key=lambda o: o[0]) if others else (0, "")  # the first of the largest


def _hold_of(reduce_hold: ReduceHold) -> Callable[[int], int]:
    if callable(reduce_hold):
        return reduce_hold
    return lambda n: n * reduce_hold


def _largest_within(hold: Callable[[int], int], share: int) -> int:
    """The most elements, up to DeepSpeed's default bucket, whose bucket holds at most ``share`` bytes
    (``hold`` grows with its argument)."""
    lo, hi = 0, DEFAULT_REDUCE_BUCKET
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hold(mid) <= share:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _pre_bytes(trace: Trace) -> list[int]:
    """Per event: the bytes of the non-persistent params a PRE event gathers (0 for POST)."""
    infos = trace.params
    return [sum(infos[p].nbytes for p in ev.params if not infos[p].persistent) if ev.kind.is_pre else 0
            for ev in trace.events]


def _compute_bytes(trace: Trace) -> list[int]:
    """Per event: the compute proxy, every param a PRE event uses (persistent ones too)."""
    infos = trace.params
    return [sum(infos[p].nbytes for p in ev.params) if ev.kind.is_pre else 0 for ev in trace.events]


def exposed_bytes(trace: Trace, schedule: Schedule) -> int:
    """Predicted exposed communication of ``schedule`` (see [Note: memory budget])."""
    compute = _compute_bytes(trace)
    cum = [0]
    for c in compute:
        cum.append(cum[-1] + c)
    infos = trace.params
    exposed = 0
    for action in schedule.actions:
        i = action.index
        if action.fetch:
            exposed += sum(infos[p].nbytes for p in action.fetch) + LATENCY_BYTES
        if action.prefetch:
            first = min((j for p in action.prefetch for j in trace.uses.get(p, ()) if j > i), default=None)
            window = 0 if first is None else cum[first] - cum[i + (0 if trace.events[i].kind.is_pre else 1)]
            exposed += max(0, sum(infos[p].nbytes for p in action.prefetch) + LATENCY_BYTES - window)
    return exposed


def candidates(trace: Trace, room: int | None = None) -> list[PlanConfig]:
    """The grid `choose_schedule` searches besides the floor (everything 0): multiples of the largest
    module's gathered bytes (the same for every budget), "everything" for each knob, and, given the
    ``room``, the whole room as the live cap and as the prefetch bucket (so a room between two
    multiples is not left unused)."""
    pre = _pre_bytes(trace)
    largest = max(pre, default=0) or 1
    total = sum(i.nbytes for i in trace.params.values() if not i.persistent) or 1
    whole = set() if room is None else {min(total, room)}
    lives = sorted({min(total, k * largest) for k in _LIVE_STEPS} | {total} | whole)
    buckets = sorted({0, total} | {min(total, k * largest) for k in _PREFETCH_STEPS} | whole)
    reuses = sorted({0, total} | {min(total, k * largest) for k in _REUSE_STEPS} | whole)
    return [PlanConfig(max_live=live, max_reuse_distance=reuse, prefetch_bucket_size=bucket, unit="bytes")
            for live in lives for bucket in buckets if bucket <= live for reuse in reuses]


def check_room(trace: Trace, room: int, budget_for_room: Callable[[int], int] | None = None) -> Schedule:
    """The plan of ``trace`` gathering one module at a time (the floor), checked to fit ``room``.

    Raises:
        ZeroConfigError: not even that fits ``room``; names the module and the budget that would.
    """
    floor = plan(trace, PlanConfig(max_live=0, max_reuse_distance=0, prefetch_bucket_size=0, unit="bytes"))
    if floor.stats.peak_live_bytes > room:
        pre = _pre_bytes(trace)
        at = max(range(len(pre)), key=pre.__getitem__)
        raise ZeroConfigError(
            f"memory_budget leaves {room:,} bytes for gathered parameters, but module "
            f"{trace.events[at].module or '<root>'!r} gathers {pre[at]:,} bytes and the step needs "
            f"{floor.stats.peak_live_bytes:,} bytes gathered at once (modules open together); " +
            (f"give memory_budget at least {budget_for_room(floor.stats.peak_live_bytes):,} bytes (the least whose "
             "own persistent parameters, reduce bucket and hpZ slices leave that room)" if budget_for_room is not None else
             f"the room must grow by at least {floor.stats.peak_live_bytes - room:,} bytes"))
    return floor


Plans = dict[PlanConfig, tuple[Schedule, int]]
"""Plans of one trace by config, with their predicted exposure (`choose_split` asks for many rooms)."""

_FLOOR = PlanConfig(max_live=0, max_reuse_distance=0, prefetch_bucket_size=0, unit="bytes")


def _planned(trace: Trace, config: PlanConfig, plans: Plans | None) -> tuple[Schedule, int]:
    if plans is not None and (hit := plans.get(config)) is not None:
        return hit
    schedule = plan(trace, config)
    out = (schedule, exposed_bytes(trace, schedule))
    if plans is not None:
        plans[config] = out
    return out


def choose_schedule(trace: Trace, room: int, budget_for_room: Callable[[int], int] | None = None,
                    plans: Plans | None = None, *, own_room: bool = True) -> ScheduleChoice:
    """The ``max_live``/``max_reuse_distance``/``prefetch_bucket`` (bytes) whose plan of ``trace``
    peaks within ``room`` bytes and exposes the least communication (see [Note: memory budget]).
    ``budget_for_room(r)``: the least budget that leaves ``r`` bytes of room, for the refusal.
    ``plans``: plans by config, filled and reused; ``own_room=False`` leaves out the grid points made
    of the room's own size (`choose_split`'s first pass over many rooms).

    Raises:
        ZeroConfigError: not even gathering one module at a time fits ``room``; names the module.
    """
    floor, floor_exposed = _planned(trace, _FLOOR, plans)
    if floor.stats.peak_live_bytes > room:
        check_room(trace, room, budget_for_room)
    grid = candidates(trace, room if own_room else None)
    best: tuple[tuple[int, int, int], PlanConfig] | None = None
    feasible = 0
    for config in [_FLOOR, *grid]:
        schedule, exposed = _planned(trace, config, plans) if config != _FLOOR else (floor, floor_exposed)
        peak = schedule.stats.peak_live_bytes
        if peak > room:
            continue
        feasible += 1
        score = (exposed, schedule.stats.num_allgathers, peak)
        if best is None or score < best[0]:
            best = (score, config)
    assert best is not None  # the floor fits
    (exposed, gathers, peak), config = best
    reasons = (
        f"searched {len(grid) + 1} plans of trace {trace.key!r} v{trace.version}; {feasible} peak within "
        f"the room of {room:,} bytes",
        f"chose max_live_bytes {config.max_live:,}, prefetch_bucket_bytes {config.prefetch_bucket_size:,}, "
        f"max_reuse_distance_bytes {config.max_reuse_distance:,}",
        f"why: least predicted exposed communication {exposed:,} bytes (demand fetches + prefetches not "
        f"hidden behind the modules before their use), then fewest all-gathers ({gathers}), then lowest "
        f"peak ({peak:,} bytes gathered)",
    )
    return ScheduleChoice(config, peak, exposed, gathers, len(grid) + 1, feasible, reasons, room)


def _fewest_bucket(pieces: Sequence[int], lo: int, hi: int) -> list[int]:
    """For each number of reductions a bucket from ``lo`` to ``hi`` elements gives ``pieces``, the
    smallest such bucket (it holds the least for that many reductions) and the largest (its last
    reduction may be the smallest), found by bisection: the count never rises as the bucket grows."""
    if not pieces or lo > hi:
        return []
    most, _ = reductions(pieces, lo)
    least, _ = reductions(pieces, hi)
    smallest = {}
    for count in range(least, most + 1):
        a, b = lo, hi  # the smallest bucket in [a, b] with at most `count` reductions (hi has)
        while a < b:
            mid = (a + b) // 2
            if reductions(pieces, mid)[0] <= count:
                b = mid
            else:
                a = mid + 1
        smallest[count] = a
    out = set(smallest.values()) | {hi}
    out |= {smallest[count - 1] - 1 for count in smallest if count - 1 in smallest}  # the largest with `count`
    return sorted(b for b in out if lo <= b <= hi)


def gradient_pieces(trace: Trace) -> list[int]:
    """A prediction of the gradient pieces' elements in the order the reducer receives them, for
    ``zero3.plan`` (the runtime records the real order in its first step: `GradientReducer.arrivals`):
    by the last event that uses each trainable parameter. A module whose parameters are all persistent
    records no event, so its gradients are not in it; a leaf module's unit, reduced whole, is counted
    by its parameters."""
    last: dict[int, int] = {}
    for i, ev in enumerate(trace.events):
        if ev.kind.is_pre:
            for p in ev.params:
                last[p] = i
    infos = trace.params
    return [infos[p].numel for p in sorted(last, key=last.__getitem__) if infos[p].trains]


def reductions(pieces: Sequence[int], bucket: int) -> tuple[int, int]:
    """(reductions, elements of the last one) when ``pieces`` arrive in order into a bucket of ``bucket``
    elements, as the gradient reducer issues them (runtime/grad.py: before a piece that would take the
    bucket past its size, and once it reaches it)."""
    count = queued = last = pending = 0  # pending: pieces queued (an empty parameter is queued too)
    for k in pieces:
        if queued and queued + k > bucket:
            count, last, queued, pending = count + 1, queued, 0, 0
        queued, pending = queued + k, pending + 1
        if queued >= bucket:
            count, last, queued, pending = count + 1, queued, 0, 0
    if pending:
        count, last = count + 1, queued
    return count, last


def reduce_exposed_bytes(pieces: Sequence[int], bucket: int, grad_itemsize: int) -> int:
    """Predicted exposed bytes of a step's reductions: each one's fixed cost (``REDUCE_LATENCY_BYTES``)
    and the last reduction's gradients whole, which no backward compute follows (the others are hidden
    behind the modules whose backward runs after them)."""
    count, last = reductions(pieces, bucket)
    return count * REDUCE_LATENCY_BYTES + last * grad_itemsize


_REFINED = 3
"""`choose_split` plans the room's own grid points for this many of the best buckets only (review 40R1:
planning them for every bucket took 38 s on a 48-layer trace, against 4.7 s for one room)."""


def choose_split(trace: Trace, avail: int, reduce_hold: ReduceHold, grad_numel: int, first_bucket: int, *,
                 grad_itemsize: int = 4, calibration: Calibration = Calibration(),
                 budget_for_room: Callable[[int], int] | None = None,
                 pieces: Sequence[int] | None = None) -> ScheduleChoice:
    """The reduce bucket and the schedule knobs together, from ``trace``, within ``avail`` bytes (the
    budget less the persistent parameters and hpZ's slices): for each candidate bucket (``first_bucket``,
    which the first step ran with, and for each number of reductions the smallest and the largest bucket
    that give it, none below ``grad_numel``, the largest piece reduced whole), `choose_schedule` in the
    room it leaves, on the grid common to all rooms, and for the ``_REFINED`` best buckets again with
    the room's own size in the grid; the pair with the least predicted exposure, gathers' and reductions'
    weighed by ``calibration``, wins (then the fewest collectives, the lowest peak, the larger bucket).
    ``pieces``: the elements of each gradient piece in the order the reducer receives them (the
    runtime records them in the first step; None: `gradient_pieces` of the trace). A bucket that holds nothing (world size 1) is not varied: there every gradient
    goes straight into its shard.

    Raises:
        ZeroConfigError: not even gathering one module at a time fits beside any candidate bucket; names
            the module and the budget whose own first-step bucket leaves room for it.
    """
    hold = _hold_of(reduce_hold)
    pieces = list(pieces) if pieces is not None else gradient_pieces(trace)
    buckets = {first_bucket}
    if hold(first_bucket) > 0:
        top = min(DEFAULT_REDUCE_BUCKET, max(sum(pieces), first_bucket), max(_largest_within(hold, avail), first_bucket))
        buckets |= set(_fewest_bucket(pieces, max(grad_numel, 1), top))
    plans: Plans = {}
    floor = _planned(trace, _FLOOR, plans)[0].stats.peak_live_bytes

    def ranked(bucket: int, own_room: bool) -> tuple[tuple[float, int, int, int], ScheduleChoice, int]:
        choice = choose_schedule(trace, avail - hold(bucket), budget_for_room, plans, own_room=own_room)
        held = hold(bucket) > 0
        count = reductions(pieces, bucket)[0] if held else 0
        reduce_exposed = reduce_exposed_bytes(pieces, bucket, grad_itemsize) if held else 0
        score = calibration.gather * choice.exposed_bytes + calibration.reduce * reduce_exposed
        choice = dataclasses.replace(choice, reduce_bucket_size=bucket, reduce_bucket_bytes=hold(bucket), reductions=count)
        return (score, choice.allgathers + count, choice.peak_bytes, -bucket), choice, reduce_exposed

    fitting = sorted(b for b in buckets if avail - hold(b) >= floor)
    if not fitting:  # not even the floor fits beside the smallest bucket: the first step's room refuses
        check_room(trace, avail - hold(first_bucket), budget_for_room)
        raise AssertionError("check_room accepted a room below the floor")  # pragma: no cover
    rough = sorted((ranked(b, own_room=False)[0], b) for b in fitting)
    (score, *_), choice, reduce_exposed = min((ranked(b, own_room=True) for _, b in rough[:_REFINED]),
                                              key=lambda r: r[0])
    if choice.reduce_bucket_bytes == 0:  # nothing is held, nothing reduced: the schedule alone was chosen
        return dataclasses.replace(choice, reasons=(*choice.reasons, "reduce bucket: holds nothing here (world "
                                                    "size 1: each gradient goes straight into its shard's)"))
    reasons = (
        f"reduce bucket: {len(fitting)} sizes leave room for one module at a time ({len(buckets)} candidates); "
        f"chose {choice.reduce_bucket_size:,} elements ({choice.reduce_bucket_bytes:,} bytes held at most), "
        f"{choice.reductions} reductions a step predicted, leaving a room of {choice.room:,} bytes for gathered "
        "parameters",
        *choice.reasons,
        f"why this bucket: least predicted cost {score:.4g} = {calibration.gather:.3g} x {choice.exposed_bytes:,} "
        f"gathered bytes exposed + {calibration.reduce:.3g} x {reduce_exposed:,} reduced bytes exposed (each "
        f"reduction's {REDUCE_LATENCY_BYTES:,}-byte fixed cost and the last one whole); weights from {calibration.source}",
    )
    return dataclasses.replace(choice, reasons=reasons)
