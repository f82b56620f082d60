"""`ParamCoordinator`: decides when parameters are gathered and released, and keeps the books.

It is the one driver of parameter status: once a parameter is partitioned, every NOT_AVAILABLE ->
INFLIGHT -> AVAILABLE -> NOT_AVAILABLE change of it goes through it or its `PersistentParams`
(persistent.py; ``engine.remove_hooks`` lets go of those through it too) (partition/param.py has
the primitives, the communicator only moves bytes). The hooks (hooks.py) report module events; ``GatheredParameters``
pins and unpins; the optimizer side asks for persistent parameters to be refreshed; the step's
lifecycle (step.py) ends every step through `ParamCoordinator.end_step`.

Every step is recorded (planning/trace.py); when a step ends its events are frozen into a `Trace` and cached
(planning/trace_cache.py), and the next step that begins the same way follows the `Schedule` that
``schedule.plan`` computed for it: prefetch buckets, reuse-distance keeps and Belady evictions under
a hard live budget. Without a matching trace the coordinator fetches on demand and releases right
after use, under the same hard budget and with the same eviction policy (`schedule.eviction_order`).
Generation mode (planning/generation.py) keeps what it gathered across forwards instead. What
happens when a step leaves the trace it follows: planning/trace_cache.py [Note: following a trace].

Every gathered, non-persistent parameter is in ``_live`` from the moment its gather is issued until
it is released; ``metrics.live_numel`` is their element count and `check_valid` recomputes it.
Shards on the drive are read ahead of their gathers (read_ahead.py [Note: reading shards ahead]);
under hpZ gathers keep and use secondary slices (hpz.py [Note: hpZ secondary shards]).

[Note: exact and quantized gathers]
qwZ (``zero_quantized_weights``) codes only the training path's gathers: the fetches and prefetches
of forward and backward (hook events, generation, parameters found mid-forward). What a user reads
(`gather_for_user`: ``GatheredParameters``, ``param.all_gather()``) and the persistent parameters'
refreshes are exact, so a ``GatheredParameters(modifier_rank=...)`` that changes nothing writes back
the very values the shards hold. ``_rounded`` holds the parameters whose gathered data is
dequantized; a user gather of one that nothing else holds gathers it again, exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

import torch

from ..partition import param as zparam
from ..comm.communicator import Communicator, GatherWork, Kind, Tag
from ..config import ZeroConfig
from ..errors import ZeroError, ZeroStateError
from ..metrics import StepMetrics
from ..partition.param import ZeroParameter
from ..planning.budget import ScheduleChoice
from ..planning.generation import GenerationPrefetch
from ..planning.schedule import PlanConfig, Schedule, eviction_order
from ..partition.state import ParamStatus
from ..offload.nvme import ShardTier
from ..planning.trace import EventKind, ParamInfo, Trace, write_trace
from ..planning.trace_cache import StepTraces
from .budget import MemoryBudget
from .hpz import SecondarySlices
from .persistent import PersistentParams
from .read_ahead import ReadAhead

logger = logging.getLogger(__name__)

_PRE = (EventKind.PRE_FORWARD, EventKind.PRE_BACKWARD)
# Members read on every hook event and per parameter in fetch and release: a module global costs a
# tenth of a member read through its class (Python 3.11).
_PRE_FORWARD, _POST_FORWARD, _PRE_BACKWARD = EventKind.PRE_FORWARD, EventKind.POST_FORWARD, EventKind.PRE_BACKWARD
_NOT_AVAILABLE, _INFLIGHT = ParamStatus.NOT_AVAILABLE, ParamStatus.INFLIGHT


def plan_config(config: ZeroConfig) -> PlanConfig:
    """The planner's budgets: elements, or bytes when ``max_live_bytes`` is set.

    In byte mode an unset ``*_bytes`` knob is its element knob counted as 4-byte elements.
    """
    if config.budget.max_live_bytes is None:
        return PlanConfig(max_live=config.budget.max_live_parameters, max_reuse_distance=config.budget.max_reuse_distance,
                          prefetch_bucket_size=config.budget.prefetch_bucket_size, unit="numel")
    reuse = config.budget.max_reuse_distance_bytes
    bucket = config.budget.prefetch_bucket_bytes
    return PlanConfig(max_live=config.budget.max_live_bytes,
                      max_reuse_distance=reuse if reuse is not None else 4 * config.budget.max_reuse_distance,
                      prefetch_bucket_size=bucket if bucket is not None else 4 * config.budget.prefetch_bucket_size,
                      unit="bytes")


@dataclass(eq=False)
class _Inflight:
    """One issued gather: the communicators' works (two or three under hpZ: from primary shards and
    from secondary slices) and the parameters they fill."""

    works: list[GatherWork]
    params: list[ZeroParameter]
    done: bool = False


class GatherWatch(Protocol):
    """Told of every gather the coordinator issues and every use (fetch) of parameters: the optimizer
    step in backward checks that nothing it stepped is gathered again and used in the same backward
    (optim/backward_step.py `BackwardStep`)."""

    def gathered(self, params: Sequence[ZeroParameter]) -> None: ...

    def used(self, params: Sequence[ZeroParameter]) -> None: ...


class ParamCoordinator:
    def __init__(self, config: ZeroConfig, comm: Communicator, metrics: StepMetrics,
                 params: Sequence[ZeroParameter] = (), shards: ShardTier | None = None) -> None:
        self.config = config
        self.plan_config = plan_config(config)
        self.comm = comm
        self.metrics = metrics
        self.shards = shards  # the NVMe tier of parameter shards (offload_param="nvme"), else None
        self._reading = ReadAhead(shards) if shards is not None else None
        self._hpz: SecondarySlices | None = None  # hpZ (`enable_hpz`)
        self._live: dict[int, ZeroParameter] = {}
        self._rounded: set[int] = set()  # ids gathered by qwZ, holding dequantized values (see the Note)
        self._by_id: dict[int, ZeroParameter] = {}
        self.persistent_params = PersistentParams(comm.world_size, self._gather_persistent)
        self.register(params)
        self.steps = StepTraces(config.budget.max_traces)  # what the running step recorded and follows
        self._event_kind: EventKind | None = None  # the event a gather serves (its tag); two fields, not a tuple (GC)
        self._event_module = ""
        self._keep_off_trace = False  # this step left its trace, and the whole model fits the budgets
        self._generation: GenerationPrefetch | None = None  # generation mode (`begin_generation`)
        self.budget: MemoryBudget | None = None  # memory_budget (`use_budget`)
        self.watch: GatherWatch | None = None  # told of every gather and use (the optimizer step in backward)

    def use_budget(self, config: ZeroConfig, budget: MemoryBudget) -> None:
        """Run with ``memory_budget``'s knobs; after the first trace, with the schedule it chooses (`choose_budget`)."""
        self.config = config
        self.plan_config = plan_config(config)
        self.budget = budget

    def register(self, params: Iterable[ZeroParameter], drop: bool = False) -> None:
        """Drive ``params`` (look them up by record id); with ``drop``, stop: a module dropped them."""
        for p in params:
            self._by_id.pop(p._zero.id) if drop else self._by_id.__setitem__(p._zero.id, p)

    def enable_hpz(self, node_comm: Communicator) -> None:
        """Keep secondary slices from the next step on, gathered over ``node_comm`` (hpz.py)."""
        self._hpz = SecondarySlices(node_comm, self.metrics)

    def drop_secondaries(self, params: Iterable[ZeroParameter] | None = None) -> None:
        """Forget the secondary slices of ``params`` (None: all): the step ended, or shards were rewritten."""
        if self._hpz is not None:
            self._hpz.drop(params)

    def param_of(self, pid: int) -> ZeroParameter | None:
        """The registered parameter with record id ``pid``."""
        return self._by_id.get(pid)

    @property
    def record_count(self) -> int:
        """Traces recorded (new orders)."""
        return self.steps.cache.record_count

    @property
    def last_trace(self) -> Trace | None:
        """The trace the last step followed or recorded (None: no step recorded yet)."""
        return self.steps.last[0] if self.steps.last is not None else None

    @property
    def last_schedule(self) -> Schedule | None:
        return self.steps.last[1] if self.steps.last is not None else None

    @property
    def generating(self) -> bool:
        return self._generation is not None

    @property
    def generation_resident(self) -> bool:
        """Generation mode holds it all, no persistent copy stale (hooks.py [Note: resident decode forwards])."""
        return self._generation is not None and self._generation.resident and not self.persistent_params.stale

    def _size(self, p: ZeroParameter) -> int:
        return p._zero.nbytes if self.plan_config.unit == "bytes" else p._zero.numel

    @property
    def _live_size(self) -> int:
        return self.metrics.live_bytes if self.plan_config.unit == "bytes" else self.metrics.live_numel

    # -- persistent parameters (persistent.py) -------------------------------------------------------
    @property
    def persistent(self) -> list[ZeroParameter]:
        return self.persistent_params.params

    def refresh_persistent(self, gather: bool = True) -> None:
        """The shards changed (optimizer step, loading): re-gather the persistent params and release what
        generation mode keeps, gathered anew when used (only the release without ``gather``: a load's)."""
        if self.generating:
            self.release(list(self._live.values()))
        if gather:
            self.persistent_params.refresh()

    def _gather_persistent(self, params: list[ZeroParameter], label: str) -> None:
        self.metrics.persistent_refresh_numel += sum(p._zero.numel for p in params)
        self._wait(self._issue(params, Tag(Kind.PARAM_GATHER, label), count=False, training=False))

    # -- events from the hooks -------------------------------------------------------------------
    def event(self, kind: EventKind, module: str, params: Sequence[ZeroParameter],
              ids: tuple[int, ...] | None = None) -> None:
        """One hook firing: pin/unpin the module's params, then act (schedule or on demand); ``ids``:
        their sorted ids, when the caller has them cached."""
        if self._generation is not None:
            self._generation_event(self._generation, kind, params)
            return
        if self.steps.key is None:
            self._begin_step(kind, module)
        if ids is None:
            ids = tuple(sorted({p._zero.id for p in params}))
        following = self.steps.following  # before `observe`, which drops it when the step leaves it
        i = self.steps.observe(kind, module, ids, self.metrics.step)
        self._event_kind, self._event_module = kind, module
        _pin(kind, params)
        if following is not None and i is not None:  # the schedule's action at this event
            action = following.schedule.actions[i]
            if action.release:
                self.release([self._by_id[pid] for pid in action.release])
            if kind in _PRE:
                self.fetch(params)
            if action.prefetch:
                self.prefetch([self._by_id[pid] for pid in action.prefetch])
            if self._reading is not None:
                self._reading.advance(i, self._by_id.__getitem__)
            return
        if following is not None:  # the step left its trace here
            self._left_trace(kind, params)
        if kind in _PRE:
            self.fetch(params)
        elif not (self._keep_off_trace and kind is _POST_FORWARD):  # kept for its backward (`_left_trace`)
            self.release(params)

    # -- generation mode -----------------------------------------------------------------------------
    def begin_generation(self) -> None:
        """Keep gathered parameters across forwards (a decode loop) until `end_generation`, under
        the live cap, gathering along the learnt and planned cycle (planning/generation.py)."""
        if self.steps.key is not None:
            raise ZeroStateError("engine.generation() entered in the middle of a step; enter it between steps")
        sizes = {pid: self._size(p) for pid, p in self._by_id.items() if not p._zero.persistent}
        self._generation = GenerationPrefetch(sizes, self.plan_config)

    def forward_boundary(self, began: bool) -> None:
        """The model's forward begins or ends: in generation mode, its decode cycle is learnt in between."""
        if self._generation is not None:
            self._generation.forward_boundary(began)

    def end_generation(self) -> None:
        """Leave generation mode: release everything it kept."""
        self._generation = None
        self.release(list(self._live.values()))

    def _generation_event(self, policy: GenerationPrefetch, kind: EventKind, params: Sequence[ZeroParameter]) -> None:
        _pin(kind, params)
        if kind not in _PRE:
            return
        action = policy.step([p._zero.id for p in params])
        if action.keep is not None:
            self.release([p for pid, p in self._live.items() if pid not in action.keep])
        extra = action.gather
        if not extra and not self._live and policy.whole and self.plan_config.prefetch_bucket_size:
            # The whole model fits the live cap and none of it is gathered (the session's first
            # forward, or the first after a step released it): it all stays gathered until the
            # mode ends, so gather it now in one gather rather than one per module
            # (planning/generation.py [Note: decode plans]).
            extra = tuple(pid for pid, q in self._by_id.items() if not q._zero.persistent)
        if extra:
            own = {p._zero.id for p in params}
            params = [*params, *(self._by_id[pid] for pid in extra if pid not in own)]
        self.fetch(params, label="generation")
        bucket = self.plan_config.prefetch_bucket_size
        if bucket and action.prefetch:
            missing = [q for q in map(self._by_id.__getitem__, action.prefetch)
                       if q._zero.status is ParamStatus.NOT_AVAILABLE and not q._zero.persistent]
            if missing and sum(self._size(q) for q in missing) <= bucket:
                self._make_room(missing)
                if self._live_size + sum(self._size(q) for q in missing) <= self.plan_config.max_live:
                    self.prefetch(missing)

    def _left_trace(self, kind: EventKind, params: Sequence[ZeroParameter]) -> None:
        """The step left its trace: read nothing ahead; release what no running module needs, unless the whole
        model fits the budgets: then a forward's gathers stay for its backward (probe 39P), as on a trace."""
        self.metrics.divergences += 1
        self._keep_off_trace = _fits_whole(self._by_id.values(), self._size, self.plan_config)
        if not self._keep_off_trace:
            keep = {p._zero.id for p in params} if kind in _PRE else set()
            self.release(p for p in list(self._live.values()) if p._zero.id not in keep)
        if self._reading is not None:
            self._reading.stop()

    # -- step boundaries -------------------------------------------------------------------------
    def _begin_step(self, kind: EventKind, module: str) -> None:
        grad = torch.is_grad_enabled()
        self._keep_off_trace = False
        following = self.steps.begin(f"{kind.value}:{module or '<root>'}:{'grad' if grad else 'no_grad'}")
        if self._hpz is not None:
            self._hpz.keeping = grad
        if following is not None and self._reading is not None:
            self._reading.follow(following.schedule, self._by_id.__getitem__)

    @property
    def in_step(self) -> bool:
        return self.steps.key is not None

    def end_step(self, aborted: bool = False, keep_trace: bool = True) -> None:
        """The coordinator's part of the end of a step, normal or aborted (step.py `StepLifecycle`
        is the one end of a step and calls it): unpin and release everything no user context
        (GatheredParameters) holds and, after a step that ended normally, generation mode does not keep; then, unless ``aborted`` or not ``keep_trace``, keep or cache the step's trace."""
        for p in self._by_id.values():
            z = p._zero
            z.active_forward = z.active_backward = 0
        if aborted:
            for p in list(self._live.values()):
                if p._zero.status is ParamStatus.INFLIGHT:
                    self._wait(p._zero.handle, drop=True)
        if not self.generating or aborted:
            self.release(list(self._live.values()))
        elif self._generation is not None:  # the same on every rank: the same gathers ran
            self._make_room(())  # the cap holds between forwards too (the last module may have needed more)
            self._generation.resident = len(self._live) == self._generation.whole
        if self._reading is not None:
            self._reading.stop()
        if self._hpz is not None:
            self._hpz.drop()
            self._hpz.keeping = False
        self.steps.end(aborted or not keep_trace, lambda: _param_infos(self._by_id), self.plan_config)

    def choose_budget(self, waits: tuple[float, float] | None = None, pieces: Sequence[int] | None = None) -> ScheduleChoice | None:
        """`MemoryBudget.choose` after a step (step.py), with its ``waits`` and gradient ``pieces``: a new choice replans."""
        if self.budget is None or (t := self.last_trace) is None or not (chosen := self.budget.choose(t, waits, pieces)):
            return None
        self.steps.replan(chosen)
        self.plan_config = chosen
        return self.budget.schedule

    # -- fetch and release -------------------------------------------------------------------------
    def fetch(self, params: Iterable[ZeroParameter], label: str | None = None, training: bool = True) -> None:
        """Make every param AVAILABLE: wait in-flight gathers, gather the rest in one collective.
        ``training``: forward and backward's fetch, quantized under qwZ; else exact ([Note: exact
        and quantized gathers])."""
        if self.watch is not None:
            self.watch.used(params := list(params))
        missing: dict[int, ZeroParameter] | None = None  # built only when needed: most fetches find all gathered
        waiting: list[_Inflight] | None = None
        for p in params:
            z = p._zero
            status = z.status
            if status is _NOT_AVAILABLE:
                if missing is None:
                    missing = {z.id: p}
                else:  # by id: a user's list of thousands must not cost a scan per entry
                    missing.setdefault(z.id, p)
            elif status is _INFLIGHT:
                if waiting is None:
                    waiting = [z.handle]
                elif z.handle not in waiting:
                    waiting.append(z.handle)
            if z.prefetched:
                z.prefetched = False
                self.metrics.prefetch_hits += 1
        if missing is None and waiting is None:
            return
        waiting = [] if waiting is None else waiting
        if missing:
            todo = list(missing.values())
            self._make_room(todo)
            waiting.append(self._issue(todo, self._tag(todo, label), training=training))
            self._add_live(todo)  # once issued: one that raised (a divergence) left them unlisted (review 42R2 P1)
            self.metrics.demand_fetches += len(todo)
        for h in waiting:
            self._wait(h)

    def prefetch(self, params: Sequence[ZeroParameter]) -> None:
        """Issue one all-gather for ``params`` ahead of use; it is waited when they are needed."""
        todo = [p for p in params if p._zero.status is _NOT_AVAILABLE and not p._zero.persistent]
        if not todo:
            return
        self._issue(todo, self._tag(todo))
        self._add_live(todo)  # once issued, as in `fetch`
        for p in todo:
            p._zero.prefetched = True
        self.metrics.prefetched += len(todo)

    def _tag(self, params: Sequence[ZeroParameter], label: str | None = None) -> Tag:
        if label is None:
            kind = self._event_kind
            label = "" if kind is None else f"{kind.value} {self._event_module or '<root>'}"
        return Tag(Kind.PARAM_GATHER, label, tuple(p._zero.id for p in params))

    def _add_live(self, params: Sequence[ZeroParameter]) -> None:
        """Put ``params`` in the live set; the gauge moves once (up only: the peak one at a time gives)."""
        numel = nbytes = 0
        live = self._live
        for p in params:
            z = p._zero
            if not z.persistent:
                live[z.id] = p
                numel += z.numel
                nbytes += z.nbytes
        if numel or nbytes:
            self.metrics.add_live(numel, nbytes)

    def _issue(self, params: list[ZeroParameter], tag: Tag, count: bool = True, training: bool = True) -> _Inflight:
        """One gather of ``params``: a ``training`` one quantized under qwZ and, under hpZ, from
        secondary slices where they have one; any other exact, from the primary shards."""
        if self._reading is not None:
            self._reading.readable(params, self.wait_in_flight)
        if self.watch is not None:
            self.watch.gathered(params)
        hpz = self._hpz
        if training and self.comm.quantizes_weights:
            self._rounded.update(p._zero.id for p in params)
        works = gather_works(self.comm, hpz if training else None, params, tag, count, training,
                             hpz is not None and hpz.keeping and not self.generating)
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
                assert self._hpz is not None
                self._hpz.adopt(self._by_id[pid], secondary)
        handle.done = True
        for p in handle.params:
            zparam.finish_gather(p)
        if self.shards is not None:
            self.shards.done(handle.params)  # their shards' pool slots make room for the next reads

    def wait_in_flight(self) -> None:
        """Land every gather still in flight (no collective: each was issued before)."""
        for q in list(self._live.values()):
            if q._zero.status is ParamStatus.INFLIGHT:
                self._wait(q._zero.handle)

    def release(self, params: Iterable[ZeroParameter]) -> None:
        """Free every param that nothing pins (an in-flight gather is waited first)."""
        for p in params:
            z = p._zero
            status = z.status
            if status is _NOT_AVAILABLE or z.pinned:
                continue
            if status is _INFLIGHT:
                self._wait(z.handle)
            self._free(p)

    def _free(self, p: ZeroParameter) -> None:
        if self._generation is not None:
            self._generation.resident = False
        z = p._zero
        if z.prefetched:
            z.prefetched = False
            self.metrics.wasted_prefetches += 1
        zparam.release(p)
        if self._rounded:
            self._rounded.discard(z.id)
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
        """Index of the next PRE event using param ``pid`` in the followed trace (None: unknown or
        never); in generation mode, its last use (planning/generation.py)."""
        if self._generation is not None:
            return self._generation.next_use(pid)
        following = self.steps.following
        return None if following is None else following.next_use(pid)

    # -- user requests (GatheredParameters) and parameters found mid-forward -------------------------
    def gather_for_user(self, params: Sequence[ZeroParameter]) -> None:
        """Pin ``params`` for a user context and make them AVAILABLE with their exact values (a
        collective if any is missing). One that a qwZ gather left gathered and nothing holds is
        released first and gathered again exactly; one a running module holds keeps the weights that
        module computes with ([Note: exact and quantized gathers])."""
        self.release([p for p in params if p._zero.id in self._rounded])  # pinned ones stay
        for p in params:
            p._zero.user_pins += 1
        self.fetch(params, label="GatheredParameters", training=False)

    def release_for_user(self, params: Sequence[ZeroParameter]) -> None:
        """Unpin a user context's params and release those nothing else holds."""
        for p in params:
            p._zero.user_pins -= 1
        self.release(params)

    def join_visit(self, p: ZeroParameter) -> None:
        """A running forward turned out to use ``p`` (auto-detected external param): pin and fetch it."""
        p._zero.active_forward += 1
        self.fetch([p])

    def keep_for_step(self, params: Sequence[ZeroParameter], keep: bool = True) -> None:
        """Hold ``params`` gathered until the step ends (`end_step` drops every visit's hold); ``keep``
        False drops one such hold early."""
        for p in params:
            p._zero.active_backward += 1 if keep else -1

    def leave_visit(self, params: Sequence[ZeroParameter]) -> None:
        """The end of a forward that only joined params mid-way (no recorded PRE event)."""
        _pin(EventKind.POST_FORWARD, params)
        self.release(params)

    # -- explain and export ------------------------------------------------------------------------
    def explain(self, target: tuple[str, object]) -> list[str]:
        budget = [] if self.budget is None else self.budget.explain()
        if target[0] == "budget":
            return budget or ["budget: memory_budget is not set; the knobs are as configured"]
        gen = [] if self._generation is None else self._generation.explain()
        return gen + (budget if target[0] == "all" else []) + self.steps.explain(target, self.plan_config)

    def export_trace(self, path: str) -> None:
        if self.last_trace is None:
            raise ZeroStateError("no trace recorded yet: run at least one full step first")
        write_trace(self.last_trace, path)

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


def gather_works(comm: Communicator, hpz: SecondarySlices | None, params: list[ZeroParameter], tag: Tag,
                 count: bool, training: bool, keep: bool) -> list[GatherWork]:
    """The works of one gather of ``params``: from primary shards, or under hpZ (``hpz``) from
    secondary slices where they have one; one gather per shard dtype when they mix dtypes (a
    gather's wire carries one dtype: a bf16 gain in a bucket of fp32 weights rounded the weights to
    bf16 on every path but the shared-memory one)."""
    if comm.world_size > 1:
        dtype = params[0]._zero.shard.dtype
        for p in params:
            if p._zero.shard.dtype is not dtype:
                parts: dict[torch.dtype, list[ZeroParameter]] = {}
                for q in params:
                    parts.setdefault(q._zero.shard.dtype, []).append(q)
                return [w for part in parts.values() for w in gather_works(
                    comm, hpz, part, Tag(tag.kind, tag.label, tuple(q._zero.id for q in part)), count, training, keep)]
    if hpz is None:
        return [comm.all_gather_params(params, tag, count=count, keep_secondary=False, quantize=training)]
    return hpz.gather(comm, params, tag, count, keep=keep)


def _param_infos(by_id: dict[int, ZeroParameter]) -> dict[int, ParamInfo]:
    return {pid: ParamInfo(id=pid, name=p._zero.name, numel=p._zero.numel, nbytes=p._zero.nbytes,
                           persistent=p._zero.persistent, trains=p.requires_grad) for pid, p in by_id.items()}


def _fits_whole(params: Iterable[ZeroParameter], size: Callable[[ZeroParameter], int], config: PlanConfig) -> bool:
    """Whether every non-persistent parameter fits ``max_live`` and ``max_reuse_distance`` at once
    (DeepSpeed's defaults, 1e9, for a model under 1e9 elements): then nothing need go before the step ends."""
    return sum(size(p) for p in params if not p._zero.persistent) <= min(config.max_live, config.max_reuse_distance)


def _pin(kind: EventKind, params: Sequence[ZeroParameter]) -> None:
    """Count the module visits that hold ``params`` (a held parameter is never released)."""
    if kind is _PRE_FORWARD:
        for p in params:
            p._zero.active_forward += 1
    elif kind is _POST_FORWARD:
        for p in params:
            z = p._zero
            if z.active_forward <= 0:
                raise ZeroStateError(f"post-forward of {z.summary()} without a matching pre-forward")
            z.active_forward -= 1
    elif kind is _PRE_BACKWARD:
        for p in params:
            p._zero.active_backward += 1
    else:
        for p in params:
            z = p._zero
            if z.active_backward > 0:
                z.active_backward -= 1
