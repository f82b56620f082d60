"""`ParamCoordinator`: decides when parameters are gathered and released, and keeps the books.

It is the one driver of parameter status: every NOT_AVAILABLE -> INFLIGHT -> AVAILABLE ->
NOT_AVAILABLE change of a partitioned parameter goes through it (param.py has the primitives, the
communicator only moves bytes). The hooks (hooks.py) report module events; ``GatheredParameters``
pins and unpins; the optimizer side asks for persistent parameters to be refreshed.

Every step is recorded (trace.py); when a step ends its events are frozen into a `Trace`, and the
next step that begins the same way follows the `Schedule` that ``schedule.plan`` computed for it:
prefetch buckets, reuse-distance keeps and Belady evictions under a hard live budget. Without a
matching trace the coordinator fetches on demand and releases right after use, under the same hard
budget and with the same eviction policy (`schedule.eviction_order`).

[Note: following a trace]
Each event is compared with the next event of the followed trace (kind, module, parameter ids). On
a match the planned action runs: releases, then the demand fetch (what is not already gathered or
in flight), then the prefetch bucket. On a mismatch the coordinator never raises: it logs the
divergence once, releases every gathered parameter no running module needs (what was prefetched
for nothing included), and fetches on demand until the step ends. The step is still recorded; if
its order is new it becomes another cached trace (up to ``max_traces``, keyed by how the step
began), so alternating control flow does not re-record every step.

Every gathered, non-persistent parameter is in ``_live`` from the moment its gather is issued until
it is released; ``metrics.live_numel`` is their element count and `check_valid` recomputes it.

[Note: reading shards ahead]
With ``offload_param="nvme"`` a shard is only on the drive until it is needed (swap.py
[Note: swapping]). Every gather first makes its shards readable (`_readable`); when a trace is
followed, the order of the step's gathers is known (each action's demand fetch, then its prefetch:
`gather_order`), and after every event the coordinator reads the shards of the next gathers into
the buffer pool, as far as the pool has room, so the drive works while the modules compute. A
shard's slot is freed as soon as its gather is done, which is what makes room for the next reads.
While following, the pool holds only shards of gathers in flight and of the next gathers in order,
so a gather that finds the pool full waits for the gathers in flight; only after a divergence (or
when one module needs more than the pool) are shards read ahead dropped, or read into their own
memory.

[Note: hpZ secondary shards]
With ``zero_hpz_partition_size`` (ZeRO++ hpZ), every parameter gathered from its primary shards
during a training step (grad enabled when the step began) keeps a secondary slice once its gather
completes: 1/L of it, L the ranks of its secondary group (a node; comm.py `Secondary`). Any later
gather of it in the same step (backward, or a tied weight's second use) comes from the secondary
slices, over the node's communicator, so it never crosses nodes. The slices are not counted in the
live budget; ``metrics.secondary_bytes`` is what they hold, and they are all dropped when the step
ends (and a parameter's as soon as a user rewrites its shards).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..partition import param as zparam
from ..comm.communicator import Communicator, GatherWork, Kind, Tag
from ..config import ZeroConfig
from ..errors import ZeroError, ZeroStateError
from ..metrics import StepMetrics
from ..partition.param import ZeroParameter
from ..planning.schedule import PlanConfig, Schedule, eviction_order, plan
from ..partition.state import ParamStatus
from ..offload.nvme import Residence, ShardTier
from ..planning.trace import Event, EventKind, ParamInfo, Trace, TraceRecorder, export_graph

logger = logging.getLogger(__name__)

_PRE = (EventKind.PRE_FORWARD, EventKind.PRE_BACKWARD)


def plan_config(config: ZeroConfig) -> PlanConfig:
    """The planner's budgets: elements, or bytes when ``max_live_bytes`` is set.

    In byte mode an unset ``*_bytes`` knob is its element knob counted as 4-byte elements.
    """
    budget = config.budget
    if budget.max_live_bytes is None:
        return PlanConfig(max_live=budget.max_live_parameters, max_reuse_distance=budget.max_reuse_distance,
                          prefetch_bucket_size=budget.prefetch_bucket_size, unit="numel")
    reuse = budget.max_reuse_distance_bytes
    bucket = budget.prefetch_bucket_bytes
    return PlanConfig(max_live=budget.max_live_bytes,
                      max_reuse_distance=reuse if reuse is not None else 4 * budget.max_reuse_distance,
                      prefetch_bucket_size=bucket if bucket is not None else 4 * budget.prefetch_bucket_size,
                      unit="bytes")


@dataclass(eq=False)
class _Inflight:
    """One issued gather: the communicators' works (two or three under hpZ: from primary shards and
    from secondary slices) and the parameters they fill."""

    works: list[GatherWork]
    params: list[ZeroParameter]
    done: bool = False


@dataclass(eq=False)
class _Following:
    trace: Trace
    schedule: Schedule
    cursor: int = 0
    next_use: dict[int, list[int]] = field(default_factory=dict)  # param id -> PRE event indices
    gathers: tuple[tuple[int, tuple[int, ...]], ...] = ()  # NVMe shards: `gather_order` of the schedule
    ahead: int = 0  # the next entry of `gathers` to read ahead ...
    ahead_at: int = 0  # ... and the next parameter in it


def gather_order(schedule: Schedule) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The step's all-gathers in the order they are issued: (event index, parameter ids) of each
    action's demand fetch, then of its prefetch."""
    out = []
    for a in schedule.actions:
        if a.fetch:
            out.append((a.index, a.fetch))
        if a.prefetch:
            out.append((a.index, a.prefetch))
    return tuple(out)


class ParamCoordinator:
    def __init__(self, config: ZeroConfig, comm: Communicator, metrics: StepMetrics,
                 params: Sequence[ZeroParameter] = (), shards: ShardTier | None = None) -> None:
        self.config = config
        self.plan_config = plan_config(config)
        self.comm = comm
        self.metrics = metrics
        self.shards = shards  # the NVMe tier of parameter shards (offload_param="nvme"), else None
        self._live: dict[int, ZeroParameter] = {}
        self.node_comm: Communicator | None = None  # hpZ: the secondary group's communicator (`enable_hpz`)
        self._keep_secondary = False  # this step keeps secondary slices (hpZ, a training step)
        self._secondary: dict[int, ZeroParameter] = {}  # params holding a secondary slice now
        self._recorder = TraceRecorder()
        self._by_id: dict[int, ZeroParameter] = {}
        self.persistent: list[ZeroParameter] = []
        self.register(params)
        self._traces: OrderedDict[str, list[tuple[Trace, Schedule]]] = OrderedDict()
        self._versions = 0
        self._step_key: str | None = None
        self._following: _Following | None = None
        self._diverged = False
        self._announced: set[tuple[str, int, int]] = set()
        self._last_seen: dict[str, int] = {}  # key -> version of the trace the last such step had
        self._successor: dict[tuple[str, int | None], int] = {}  # (key, previous version) -> next
        self._event: tuple[EventKind, str] | None = None  # the event a gather serves (for its tag)
        self.record_count = 0  # traces recorded (new orders)
        self.last_trace: Trace | None = None
        self.last_schedule: Schedule | None = None
        self.generating = False  # generation mode: keep what was gathered across forwards, under the cap
        self._clock = 0
        self._last_use: dict[int, int] = {}  # param id -> clock of its last use (generation mode)
        self._cycle: list[list[ZeroParameter]] = []  # generation mode: the PRE events of one forward, in order
        self._cycle_at = 0  # where in that cycle the next PRE event should be

    def register(self, params: Iterable[ZeroParameter]) -> None:
        for p in params:
            self._by_id[p._zero.id] = p

    def enable_hpz(self, node_comm: Communicator) -> None:
        """From the next step on, keep secondary slices and gather from them over ``node_comm``
        ([Note: hpZ secondary shards])."""
        self.node_comm = node_comm

    def drop_secondaries(self, params: Iterable[ZeroParameter] | None = None) -> None:
        """Forget the secondary slices of ``params`` (None: all): the step ended, or their shards were
        rewritten."""
        for p in list(self._secondary.values()) if params is None else params:
            if self._secondary.pop(p._zero.id, None) is not None:
                self.metrics.add_secondary(-p._zero.secondary.nbytes)
                p._zero.secondary = None

    def param_of(self, pid: int) -> ZeroParameter | None:
        """The registered parameter with record id ``pid``."""
        return self._by_id.get(pid)

    def _size(self, p: ZeroParameter) -> int:
        return p._zero.nbytes if self.plan_config.unit == "bytes" else p._zero.numel

    @property
    def _live_size(self) -> int:
        return self.metrics.live_bytes if self.plan_config.unit == "bytes" else self.metrics.live_numel

    # -- persistent parameters and where shards live ----------------------------------------------
    def choose_persistent(self, params: Sequence[ZeroParameter]) -> None:
        """Small params stay gathered for the whole run; greedy in the given order under the model cap.
        They are gathered by `gather_persistent`."""
        budget = self.config.budget.model_persistence_threshold
        for p in params:
            n = p._zero.numel
            if n <= self.config.budget.param_persistence_threshold and n <= budget:
                budget -= n
                p._zero.persistent = True
                self.persistent.append(p)

    def place_shards(self, params: Sequence[ZeroParameter]) -> None:
        """Put every shard in the tier ``offload_param`` asks for: CPU memory (pinned if asked, with
        CUDA), or the drive, except persistent parameters and the first ``offload_param_max_in_cpu``
        elements (in parameter order), which stay in memory. Shards already on the drive (written by
        ``zero3.Init(remote_device="nvme")``) are adopted, or read back when they belong in memory."""
        tier = self.config.offload.offload_param
        pin = self.config.offload.offload_param_pin_memory and torch.cuda.is_available()
        budget = self.config.offload.offload_param_max_in_cpu
        for p in sorted(params, key=lambda q: q._zero.id):
            z = p._zero
            if tier == "cpu" and (z.shard.device.type != "cpu" or (pin and not z.shard.is_pinned())):
                z.replace_shard(z.shard.detach().to("cpu").pin_memory() if pin else z.shard.detach().to("cpu"))
            if self.shards is None:
                continue
            if z.persistent or z.shard_numel <= budget:
                if not z.persistent:
                    budget -= z.shard_numel
                self.shards.keep(p)
            else:
                self.shards.offload(p)
        if self.shards is not None:
            self.shards.flush()

    def gather_persistent(self) -> None:
        """Gather the persistent params (at world size 1 the full tensor is a view of the shard)."""
        if self.comm.world_size == 1:
            for p in self.persistent:
                zparam.alias_shard(p)  # one rank: the shard is the full tensor, no refresh ever needed
        self.refresh_persistent()

    def refresh_persistent(self) -> None:
        """The shards changed (optimizer step, loading): re-gather the persistent params from them.
        Their traffic is counted apart from the step's gathers. A collective when there are any."""
        for p in self.persistent:
            if p._zero.status is ParamStatus.AVAILABLE and not p._zero.aliased:
                zparam.release(p)
        todo = [p for p in self.persistent if p._zero.status is ParamStatus.NOT_AVAILABLE]
        if todo:
            self.metrics.persistent_refresh_numel += sum(p._zero.numel for p in todo)
            self._wait(self._issue(todo, Tag(Kind.PARAM_GATHER, "persistent parameters"), count=False))

    def unmark_persistent(self) -> None:
        """Persistent params become ordinary again (hooks removed): release what nothing holds."""
        for p in self.persistent:
            p._zero.persistent = False
            if p._zero.aliased:
                zparam.unalias_shard(p)
            if p._zero.status is ParamStatus.AVAILABLE and not p._zero.pinned:
                zparam.release(p)
        self.persistent = []

    # -- events from the hooks -------------------------------------------------------------------
    def event(self, kind: EventKind, module: str, params: Sequence[ZeroParameter],
              ids: tuple[int, ...] | None = None) -> None:
        """One hook firing: pin/unpin the module's params, then act (schedule or on demand).

        ``ids`` are the params' sorted ids when the caller has them cached.
        """
        if self.generating:
            self._generation_event(kind, params)
            return
        if self._step_key is None:
            self._begin_step(kind, module)
        if ids is None:
            ids = tuple(sorted({p._zero.id for p in params}))
        self._recorder.record(kind, module, ids)
        self._event = (kind, module)
        self._pin(kind, params)
        following = self._following
        if following is not None:
            i = following.cursor
            events = following.trace.events
            expected = events[i] if i < len(events) else None
            if expected is not None and expected.kind is kind and expected.module == module and expected.params == ids:
                following.cursor += 1
                self._apply(following.schedule, i, kind, params)
                if following.gathers:
                    self._read_ahead(following, i)
                return
            self._diverge(following.trace, i, expected, kind, module, params)
        if kind in _PRE:
            self.fetch(params)
        else:
            self.release(params)

    # -- generation mode -----------------------------------------------------------------------------
    def begin_generation(self) -> None:
        """Keep gathered parameters across forwards (a decode loop) until `end_generation`; when the
        live cap forces a release, the most recently used goes first: in a loop that visits the
        modules in the same order every token, it is the one needed furthest ahead (Belady), so only
        what does not fit is gathered again."""
        if self._step_key is not None:
            raise ZeroStateError("engine.generation() entered in the middle of a step; enter it between steps")
        self.generating = True

    def end_generation(self) -> None:
        """Leave generation mode: release everything it kept."""
        self.generating = False
        self._last_use.clear()
        self._cycle, self._cycle_at = [], 0
        self.release(list(self._live.values()))

    def _generation_event(self, kind: EventKind, params: Sequence[ZeroParameter]) -> None:
        self._pin(kind, params)
        if kind not in _PRE:
            return
        self._clock += 1
        for p in params:
            self._last_use[p._zero.id] = self._clock
        self.fetch(params, label="generation")
        # Learn the cycle of one forward, then prefetch one event ahead along it.
        cycle, at = self._cycle, self._cycle_at
        if at < len(cycle) and [q._zero.id for q in cycle[at]] == [q._zero.id for q in params]:
            at += 1
        elif cycle and [q._zero.id for q in cycle[0]] == [q._zero.id for q in params]:
            at = 1  # a new forward began
        else:
            del cycle[at:]  # a new order: record it from here
            cycle.append(list(params))
            at = len(cycle)
        self._cycle_at = at
        if self.plan_config.prefetch_bucket_size and len(cycle) > 1:
            upcoming = cycle[at % len(cycle)]
            missing = [q for q in upcoming if q._zero.status is ParamStatus.NOT_AVAILABLE and not q._zero.persistent]
            if missing and sum(self._size(q) for q in missing) <= self.plan_config.prefetch_bucket_size:
                self._make_room(missing)
                if self._live_size + sum(self._size(q) for q in missing) <= self.plan_config.max_live:
                    self.prefetch(missing)

    def _pin(self, kind: EventKind, params: Sequence[ZeroParameter]) -> None:
        if kind is EventKind.PRE_FORWARD:
            for p in params:
                p._zero.active_forward += 1
        elif kind is EventKind.POST_FORWARD:
            for p in params:
                z = p._zero
                if z.active_forward <= 0:
                    raise ZeroStateError(f"post-forward of {z.summary()} without a matching pre-forward")
                z.active_forward -= 1
        elif kind is EventKind.PRE_BACKWARD:
            for p in params:
                p._zero.active_backward += 1
        else:
            for p in params:
                p._zero.active_backward = max(0, p._zero.active_backward - 1)

    def _apply(self, schedule: Schedule, i: int, kind: EventKind, params: Sequence[ZeroParameter]) -> None:
        action = schedule.actions[i]
        if action.release:
            self.release(self._by_id[pid] for pid in action.release)
        if kind in _PRE:
            self.fetch(params)
        if action.prefetch:
            self.prefetch([self._by_id[pid] for pid in action.prefetch])

    def _diverge(self, trace: Trace, i: int, expected: Event | None, kind: EventKind, module: str,
                 params: Sequence[ZeroParameter]) -> None:
        self.metrics.divergences += 1
        key = (trace.key, trace.version, i)
        if key not in self._announced:
            self._announced.add(key)
            want = "the end of the trace" if expected is None else \
                f"{expected.kind.value} {expected.module or '<root>'!r}"
            logger.warning("zero3: step %d left trace %r v%d at event %d: expected %s, got %s %r; fetching on "
                           "demand for the rest of the step", self.metrics.step, trace.key, trace.version, i, want,
                           kind.value, module or "<root>")
        self._following = None
        self._diverged = True
        keep = {p._zero.id for p in params} if kind in _PRE else set()
        self.release(p for p in list(self._live.values()) if p._zero.id not in keep)
        if self.shards is not None:
            self.shards.drop_ahead()

    # -- step boundaries -------------------------------------------------------------------------
    def _begin_step(self, kind: EventKind, module: str) -> None:
        self._step_key = f"{kind.value}:{module or '<root>'}:{'grad' if torch.is_grad_enabled() else 'no_grad'}"
        self._diverged = False
        self._keep_secondary = self.node_comm is not None and torch.is_grad_enabled()
        candidates = self._traces.get(self._step_key) or []
        # Predict with what followed the previous step's trace last time (alternating orders hit).
        wanted = self._successor.get((self._step_key, self._last_seen.get(self._step_key)))
        chosen = next((e for e in candidates if e[0].version == wanted), None) or \
            (candidates[0] if candidates else None)
        self._following = None
        if chosen is not None:
            self._following = _Following(chosen[0], chosen[1], next_use=_uses(chosen[0]))
            self.last_trace, self.last_schedule = chosen
            if self.shards is not None and self.shards.shards:
                self._following.gathers = gather_order(chosen[1])
                self._read_ahead(self._following, -1)

    @property
    def in_step(self) -> bool:
        return self._step_key is not None

    def end_step(self, aborted: bool = False) -> None:
        """The one end of a step, normal or aborted: unpin and release everything no user context
        (GatheredParameters) holds; then, unless ``aborted``, keep or cache the step's trace."""
        for p in self._by_id.values():
            z = p._zero
            z.active_forward = z.active_backward = 0
        if aborted:
            for p in list(self._live.values()):
                if p._zero.status is ParamStatus.INFLIGHT:
                    self._wait(p._zero.handle, drop=True)
        if not self.generating or aborted:
            self.release(list(self._live.values()))
        if self.shards is not None:
            self.shards.drop_ahead()
        self.drop_secondaries()
        self._keep_secondary = False
        key, self._step_key = self._step_key, None
        followed, self._following = self._following, None
        events = self._recorder.events
        try:
            if key is not None and not aborted and events:
                self._keep_trace(key, followed, events)
        finally:
            self._recorder.clear()

    def _keep_trace(self, key: str, followed: _Following | None, events: tuple[Event, ...]) -> None:
        if followed is not None and not self._diverged and followed.cursor == len(followed.trace.events):
            self._touch(key, (followed.trace, followed.schedule))
            return
        for entry in self._traces.get(key, []):
            if entry[0].events == events:
                self._touch(key, entry)
                return
        self._versions += 1
        infos = {pid: ParamInfo(id=pid, name=p._zero.name, numel=p._zero.numel, nbytes=p._zero.nbytes,
                                persistent=p._zero.persistent) for pid, p in self._by_id.items()}
        trace = self._recorder.freeze(key, self._versions, infos)
        entry = (trace, plan(trace, self.plan_config))
        self._traces.setdefault(key, []).insert(0, entry)
        self._traces.move_to_end(key, last=False)
        self._seen(key, trace.version)
        self._evict_traces()
        self.record_count += 1
        self.last_trace, self.last_schedule = entry
        logger.info("zero3: recorded trace %r v%d (%d events); planned peak live %d %s, %d all-gathers",
                    key, trace.version, len(events), entry[1].stats.peak_live, self.plan_config.unit,
                    entry[1].stats.num_allgathers)

    def _seen(self, key: str, version: int) -> None:
        self._successor[(key, self._last_seen.get(key))] = version
        self._last_seen[key] = version

    def _touch(self, key: str, entry: tuple[Trace, Schedule]) -> None:
        self._seen(key, entry[0].version)
        entries = self._traces[key]
        entries.remove(entry)
        entries.insert(0, entry)
        self._traces.move_to_end(key, last=False)

    def _evict_traces(self) -> None:
        total = sum(len(v) for v in self._traces.values())
        while total > self.config.budget.max_traces:
            last_key = next(reversed(self._traces))
            self._traces[last_key].pop()
            if not self._traces[last_key]:
                del self._traces[last_key]
            total -= 1

    def invalidate_traces(self) -> None:
        """Forget every cached trace (e.g. after budgets change)."""
        self._traces.clear()

    @property
    def traces(self) -> list[Trace]:
        return [t for entries in self._traces.values() for t, _ in entries]

    # -- fetch and release -------------------------------------------------------------------------
    def fetch(self, params: Iterable[ZeroParameter], label: str | None = None) -> None:
        """Make every param AVAILABLE: wait in-flight gathers, gather the rest in one collective."""
        missing: list[ZeroParameter] = []
        waiting: list[_Inflight] = []
        for p in params:
            z = p._zero
            status = z.status
            if status is ParamStatus.NOT_AVAILABLE:
                if not any(q is p for q in missing):
                    missing.append(p)
            elif status is ParamStatus.INFLIGHT:
                if z.handle not in waiting:
                    waiting.append(z.handle)
            if z.prefetched:
                z.prefetched = False
                self.metrics.prefetch_hits += 1
        if missing:
            self._make_room(missing)
            self._add_live(missing)
            self.metrics.demand_fetches += len(missing)
            waiting.append(self._issue(missing, self._tag(missing, label)))
        for h in waiting:
            self._wait(h)

    def prefetch(self, params: Sequence[ZeroParameter]) -> None:
        """Issue one all-gather for ``params`` ahead of use; it is waited when they are needed."""
        todo = [p for p in params if p._zero.status is ParamStatus.NOT_AVAILABLE and not p._zero.persistent]
        if not todo:
            return
        for p in todo:
            p._zero.prefetched = True
        self._add_live(todo)
        self.metrics.prefetched += len(todo)
        self._issue(todo, self._tag(todo))

    def _tag(self, params: Sequence[ZeroParameter], label: str | None = None) -> Tag:
        if label is None:
            label = "" if self._event is None else f"{self._event[0].value} {self._event[1] or '<root>'}"
        return Tag(Kind.PARAM_GATHER, label, tuple(p._zero.id for p in params))

    def _add_live(self, params: Sequence[ZeroParameter]) -> None:
        for p in params:
            z = p._zero
            if not z.persistent:
                self._live[z.id] = p
                self.metrics.add_live(z.numel, z.nbytes)

    def _issue(self, params: list[ZeroParameter], tag: Tag, count: bool = True) -> _Inflight:
        """One gather of ``params``; under hpZ those with a secondary slice come from it, inside the
        node (at most one gather per slice form, the same split on every rank)."""
        if self.shards is not None:
            self._readable(params)
        keep = self._keep_secondary and not self.generating
        if self.node_comm is None or all(p._zero.secondary is None for p in params):
            works = [self.comm.all_gather_params(params, tag, count=count, keep_secondary=keep)]
        else:
            works = []
            for quantized in (False, True):
                part = [p for p in params if p._zero.secondary is not None and p._zero.secondary.quantized is quantized]
                if part:
                    works.append(self.node_comm.all_gather_secondary(part, _subtag(tag, part)))
            primary = [p for p in params if p._zero.secondary is None]
            if primary:
                works.append(self.comm.all_gather_params(primary, _subtag(tag, primary), count=count,
                                                         keep_secondary=keep))
        handle = _Inflight(works, params)
        for p in params:
            zparam.begin_gather(p, handle)
        return handle

    def _wait(self, handle: _Inflight, drop: bool = False) -> None:
        """Wait for an issued gather (and keep the secondary slices it cut); ``drop`` (an aborted
        step): do not let a failed or void collective raise again, the parameters are released
        unused right after."""
        if handle.done:
            return
        for work in handle.works:
            try:
                work.wait()
            except ZeroError:
                if not drop:
                    raise  # the params stay INFLIGHT; the aborted step's end drops them
                continue
            for pid, secondary in work.secondaries.items():
                p = self._by_id[pid]
                self.drop_secondaries([p])
                p._zero.secondary = secondary
                self._secondary[pid] = p
                self.metrics.add_secondary(secondary.nbytes)
        handle.done = True
        for p in handle.params:
            zparam.finish_gather(p)
        if self.shards is not None:
            self.shards.done(handle.params)  # their shards' pool slots make room for the next reads

    # -- shards on NVMe ([Note: reading shards ahead]) -----------------------------------------------
    def _readable(self, params: list[ZeroParameter]) -> None:
        """Make the shards of ``params`` readable for their gather (reading what is only on the drive)."""
        tier = self.shards
        assert tier is not None
        missed = tier.read(params)
        if missed:  # the pool is full: gathers in flight hold it; their shards go once they are done
            for q in list(self._live.values()):
                if q._zero.status is ParamStatus.INFLIGHT:
                    self._wait(q._zero.handle)
            missed = tier.read(missed)
        if missed:  # still full: shards read ahead for later gathers (only after a divergence)
            tier.drop_ahead(keep=params)
            if self._following is not None:
                self._following.ahead = self._following.ahead_at = 0  # read them again later
            tier.read(missed, overflow=True)
        tier.wait(params)

    def _read_ahead(self, following: _Following, i: int) -> None:
        """Read the shards of the gathers after event ``i``, in order, while the pool has room."""
        tier = self.shards
        assert tier is not None
        seq = following.gathers
        k, at = following.ahead, following.ahead_at
        while k < len(seq) and seq[k][0] <= i:  # gathers issued by now: no longer ahead
            k, at = k + 1, 0
        while k < len(seq):
            ids = seq[k][1]
            while at < len(ids):
                p = self._by_id[ids[at]]
                sw = p._zero.swap
                if sw is not None:
                    if sw.state is not Residence.ON_NVME and sw.state is not Residence.WRITING:
                        following.ahead, following.ahead_at = k, at
                        return  # still in memory for an earlier gather: wait until that one is done
                    if tier.read([p], ahead=True):
                        following.ahead, following.ahead_at = k, at
                        return  # the pool is full
                at += 1
            k, at = k + 1, 0
        following.ahead, following.ahead_at = k, at

    def release(self, params: Iterable[ZeroParameter]) -> None:
        """Free every param that nothing pins (an in-flight gather is waited first)."""
        for p in params:
            z = p._zero
            if z.pinned or z.status is ParamStatus.NOT_AVAILABLE:
                continue
            if z.status is ParamStatus.INFLIGHT:
                self._wait(z.handle)
            self._free(p)

    def _free(self, p: ZeroParameter) -> None:
        z = p._zero
        if z.prefetched:
            z.prefetched = False
            self.metrics.wasted_prefetches += 1
        zparam.release(p)
        if self._live.pop(z.id, None) is not None:
            self.metrics.add_live(-z.numel, -z.nbytes)
        self.metrics.releases += 1

    def _make_room(self, incoming: Sequence[ZeroParameter]) -> None:
        """Hard live budget: before a gather, release unpinned live params in `eviction_order`."""
        need = sum(self._size(p) for p in incoming if not p._zero.persistent)
        cap = self.plan_config.max_live
        if self._live_size + need <= cap:
            return
        incoming_ids = {p._zero.id for p in incoming}
        candidates = [pid for pid, p in self._live.items() if pid not in incoming_ids and not p._zero.pinned]
        for pid in eviction_order(candidates, self._next_use):
            if self._live_size + need <= cap:
                break
            p = self._live[pid]
            if p._zero.status is ParamStatus.INFLIGHT:
                self._wait(p._zero.handle)
            self._free(p)

    def _next_use(self, pid: int) -> int | None:
        """Index of the next PRE event using param ``pid`` in the followed trace (None: unknown or never).
        In generation mode the modules repeat in a cycle, so the later a parameter was last used, the
        later it is used next: its last use stands in for its next one."""
        if self.generating:
            return self._last_use.get(pid, 0)
        following = self._following
        if following is None:
            return None
        for j in following.next_use.get(pid, ()):
            if j >= following.cursor:
                return j
        return None

    # -- user requests (GatheredParameters) and parameters found mid-forward -------------------------
    def gather_for_user(self, params: Sequence[ZeroParameter]) -> None:
        """Pin ``params`` for a user context and make them AVAILABLE (a collective if any is missing)."""
        for p in params:
            p._zero.user_pins += 1
        self.fetch(params, label="GatheredParameters")

    def release_for_user(self, params: Sequence[ZeroParameter]) -> None:
        """Unpin a user context's params and release those nothing else holds."""
        for p in params:
            p._zero.user_pins -= 1
        self.release(params)

    def join_visit(self, p: ZeroParameter) -> None:
        """A running forward turned out to use ``p`` (auto-detected external param): pin and fetch it."""
        p._zero.active_forward += 1
        self.fetch([p])

    def leave_visit(self, params: Sequence[ZeroParameter]) -> None:
        """The end of a forward that only joined params mid-way (no recorded PRE event)."""
        self._pin(EventKind.POST_FORWARD, params)
        self.release(params)

    # -- explain and export ------------------------------------------------------------------------
    def explain(self, target: tuple[str, object]) -> list[str]:
        kind, value = target
        schedule = self.last_schedule
        if schedule is None:
            return ["no step has been recorded yet: every fetch so far was on demand, released right after use"]
        header = [f"trace {schedule.trace_key!r} v{schedule.trace_version}, budgets {self.plan_config}"]
        if self._diverged:
            header.append("note: the last step left this trace and fetched on demand after the divergence")
        if kind == "param":
            return header + schedule.explain(param_id=value)  # type: ignore[arg-type]
        if kind == "module":
            return header + schedule.explain(module=value)  # type: ignore[arg-type]
        return header + schedule.explain()

    def export_trace(self, path: str) -> None:
        if self.last_trace is None:
            raise ZeroStateError("no trace recorded yet: run at least one full step first")
        if str(path).endswith(".json"):
            Path(path).write_text(trace_to_json(self.last_trace))
        else:
            export_graph(self.last_trace, path)

    # -- invariants --------------------------------------------------------------------------------
    @property
    def live_params(self) -> list[ZeroParameter]:
        return list(self._live.values())

    def check_valid(self) -> None:
        """Recompute the live gauge from scratch and compare it with the running counter."""
        numel = sum(p._zero.numel for p in self._live.values())
        if numel != self.metrics.live_numel:
            raise AssertionError(f"live_numel counter {self.metrics.live_numel} != recomputed {numel}")
        for p in self._live.values():
            if p._zero.status is ParamStatus.NOT_AVAILABLE or p._zero.persistent:
                raise AssertionError(f"{p._zero.summary()} is in the live set but not gathered")


def _subtag(tag: Tag, params: Sequence[ZeroParameter]) -> Tag:
    """``tag`` for the part ``params`` of a gather that was split."""
    return Tag(tag.kind, tag.label, tuple(p._zero.id for p in params))


def _uses(trace: Trace) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for j, e in enumerate(trace.events):
        if e.kind in _PRE:
            for pid in e.params:
                out.setdefault(pid, []).append(j)
    return out


def trace_to_json(trace: Trace) -> str:
    """A trace as JSON (events and param sizes), the input format of ``python -m zero3.plan``."""
    return json.dumps({
        "format": "zero3-trace", "version": 1, "key": trace.key, "trace_version": trace.version,
        "params": [{"id": p.id, "name": p.name, "numel": p.numel, "nbytes": p.nbytes, "persistent": p.persistent}
                   for p in trace.params.values()],
        "events": [[e.kind.value, e.module, list(e.params)] for e in trace.events],
    })


def trace_from_json(text: str) -> Trace:
    data = json.loads(text)
    if data.get("format") != "zero3-trace" or data.get("version") != 1:
        raise ValueError(f"not a zero3 trace file (format {data.get('format')!r}, version {data.get('version')!r})")
    params = {p["id"]: ParamInfo(**p) for p in data["params"]}
    events = tuple(Event(EventKind(k), m, tuple(ps)) for k, m, ps in data["events"])
    return Trace(data["key"], data["trace_version"], events, params)
