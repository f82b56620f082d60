"""Hypothesis strategies for random step traces and planner budgets (pure data, no torch).

Three trace shapes: `layered_traces` are transformer-like stacks (the common case);
`model_traces` walk a random module tree the way hooks fire in a real step (nested forward,
mirrored backward with missing POST_BACKWARDs, delayed closes that interleave, checkpoint
recompute inside backward, repeated and tied modules); `random_traces` fire arbitrary legal
PRE/POST sequences to reach orders no model produces.
"""

from __future__ import annotations

from hypothesis import strategies as st

from zero3.planning.schedule import PlanConfig
from zero3.planning.trace import Event, EventKind, ParamInfo, Trace

MODULES = ("", "a", "a.b", "a.c", "a.b.d", "b", "b.a", "b.b", "c", "c.a", "c.a.b")
HUGE = 10**12

sizes = st.integers(0, 19).flatmap(
    lambda tag: (
        st.just(HUGE)
        if tag == 0
        else st.sampled_from([0, 1, 2, 3, 8, 100])
        if tag < 6
        else st.integers(min_value=0, max_value=1000)
    )
)


@st.composite
def param_infos(draw: st.DrawFn, min_size: int = 0, max_size: int = 8) -> dict[int, ParamInfo]:
    """Non-contiguous ids, sizes including 0 and huge, about one in five persistent."""
    ids = draw(st.lists(st.integers(0, 40), min_size=min_size, max_size=max_size, unique=True))
    infos = {}
    for pid in ids:
        numel = draw(sizes)
        nbytes = numel * draw(st.sampled_from([1, 2, 4])) if draw(st.booleans()) else draw(sizes)
        persistent = draw(st.sampled_from([False, False, False, False, True]))
        infos[pid] = ParamInfo(pid, f"p{pid}", numel, nbytes, persistent)
    return infos


def _children(modules: list[str], parent: str) -> list[str]:
    """Nearest chosen descendants of `parent` (a missing middle module is skipped over)."""
    below = [m for m in modules if m != parent and (parent == "" or m.startswith(parent + "."))]
    return [m for m in below if not any(o != m and m.startswith(o + ".") for o in below)]


@st.composite
def model_traces(draw: st.DrawFn) -> Trace:
    infos = draw(param_infos(min_size=3, max_size=12))
    pids = sorted(infos)
    modules = ["", *draw(st.lists(st.sampled_from(MODULES[1:]), unique=True, min_size=3))]
    # Mostly each param has one owner; extra draws add tied and external params.
    owner = {pid: draw(st.sampled_from(modules)) for pid in pids}
    owned = {
        m: (*(p for p in pids if owner[p] == m), *draw(st.lists(st.sampled_from(pids), max_size=1))) for m in modules
    }
    events: list[Event] = []

    def emit(kind: EventKind, m: str) -> None:
        events.append(Event(kind, m, owned[m]))

    def forward(m: str, depth: int) -> list[tuple[str, list]]:  # the call tree, for backward
        emit(EventKind.PRE_FORWARD, m)
        calls = []
        if depth < 3:
            for child in _children(modules, m):
                for _ in range(draw(st.sampled_from([1, 1, 1, 2, 0]))):  # repeated or skipped calls
                    calls.append((child, forward(child, depth + 1)))
        emit(EventKind.POST_FORWARD, m)
        return calls

    delayed: list[str] = []

    def backward(m: str, calls: list[tuple[str, list]]) -> None:
        if draw(st.integers(0, 5)) == 0:  # activation-checkpoint recompute inside backward
            emit(EventKind.PRE_FORWARD, m)
            emit(EventKind.POST_FORWARD, m)
        emit(EventKind.PRE_BACKWARD, m)
        for child, sub in reversed(calls):
            backward(child, sub)
        if delayed and draw(st.booleans()):
            emit(EventKind.POST_BACKWARD, delayed.pop(draw(st.integers(0, len(delayed) - 1))))
        close = draw(st.sampled_from(["now"] * 6 + ["later", "never"]))
        if close == "now":
            emit(EventKind.POST_BACKWARD, m)
        elif close == "later":  # closes after other visits opened: interleaved backward visits
            delayed.append(m)

    tree = forward("", 0)
    for _ in range(draw(st.integers(0, 1))):  # sometimes a second forward (eval or grad accumulation)
        tree = forward("", 0)
    backward("", tree)
    for m in delayed:
        emit(EventKind.POST_BACKWARD, m)
    return Trace("model", draw(st.integers(0, 3)), tuple(events), infos)


@st.composite
def random_traces(draw: st.DrawFn) -> Trace:
    infos = draw(param_infos(max_size=10))
    pids = sorted(infos)
    pick = st.lists(st.sampled_from(pids), max_size=4) if pids else st.just([])
    events: list[Event] = []
    open_visits: list[tuple[EventKind, str, tuple[int, ...]]] = []
    for _ in range(draw(st.integers(0, 30))):
        if open_visits and draw(st.booleans()):
            kind, module, _ = open_visits[draw(st.integers(0, len(open_visits) - 1))]
            # The POST closes the most recent open visit of that module and direction.
            last = max(n for n, v in enumerate(open_visits) if v[:2] == (kind, module))
            _, _, params = open_visits.pop(last)
            post = EventKind.POST_FORWARD if kind is EventKind.PRE_FORWARD else EventKind.POST_BACKWARD
            events.append(Event(post, module, params))
        else:
            kind = draw(st.sampled_from([EventKind.PRE_FORWARD, EventKind.PRE_BACKWARD]))
            module = draw(st.sampled_from(MODULES))
            params = tuple(draw(pick))
            open_visits.append((kind, module, params))
            events.append(Event(kind, module, params))
    return Trace("random", 0, tuple(events), infos)  # visits left open close at end of step


@st.composite
def layered_traces(draw: st.DrawFn) -> Trace:
    """A transformer-like stack: distinct params per layer, tied embedding/head, 1-2 steps' worth
    of forward and reverse backward; the case the budgets are designed for."""
    n = draw(st.integers(2, 8))
    infos = {}
    layers = []
    for k in range(n):
        ids = tuple(range(10 * k + 1, 10 * k + 1 + draw(st.integers(1, 3))))
        for pid in ids:
            numel = draw(sizes)
            infos[pid] = ParamInfo(pid, f"layers.{k}.p{pid}", numel, 2 * numel, draw(st.booleans()) and numel < 4)
        layers.append((f"layers.{k}", ids))
    tied = draw(st.booleans())
    if tied:
        infos[0] = ParamInfo(0, "emb.weight", draw(sizes), draw(sizes))
        layers = [("emb", (0,)), *layers, ("head", (0,))]
    events = [Event(EventKind.PRE_FORWARD, "", ())]
    for m, ids in layers:
        events += [Event(EventKind.PRE_FORWARD, m, ids), Event(EventKind.POST_FORWARD, m, ids)]
    events += [Event(EventKind.POST_FORWARD, "", ()), Event(EventKind.PRE_BACKWARD, "", ())]
    for m, ids in reversed(layers):
        if draw(st.integers(0, 3)) == 0:  # checkpointed layer: recompute forward first
            events += [Event(EventKind.PRE_FORWARD, m, ids), Event(EventKind.POST_FORWARD, m, ids)]
        events.append(Event(EventKind.PRE_BACKWARD, m, ids))
        if m != "emb":  # the embedding's inputs need no grad: its backward visit never closes
            events.append(Event(EventKind.POST_BACKWARD, m, ids))
    return Trace("layered", 0, tuple(events), infos)


traces = st.one_of(model_traces(), random_traces(), layered_traces())


@st.composite
def plan_configs(draw: st.DrawFn, trace: Trace) -> PlanConfig:
    """Budgets around the trace's own sizes: 0, tiny, sums of a few params, the total, unbounded."""
    unit = draw(st.sampled_from(["numel", "bytes"]))
    used = {p for ev in trace.events for p in ev.params}
    infos = [trace.params[p] for p in sorted(used)]
    sizes_ = [i.nbytes if unit == "bytes" else i.numel for i in infos if not i.persistent]
    total = sum(sizes_)
    some = st.lists(st.sampled_from(sizes_), max_size=4).map(sum) if sizes_ else st.just(1)
    budget = st.one_of(
        st.just(0),
        st.integers(0, 5),
        some,  # sums of a few params: the interesting region for eviction and prefetch
        st.integers(0, max(total, 1)),
        st.just(total),
        st.just(10**15),
    )
    # Between what the open visits need at worst and the total, the cap forces evictions
    # without ever overflowing: where Belady and the prefetch look-ahead matter most.
    pinned_peak = _pinned_peak(trace, unit)
    fitting = st.integers(pinned_peak, max(pinned_peak, total))
    return PlanConfig(
        max_live=draw(fitting if draw(st.booleans()) else budget),
        max_reuse_distance=draw(st.one_of(budget, st.just(10**15))),
        prefetch_bucket_size=draw(budget),
        unit=unit,
    )


def _pinned_peak(trace: Trace, unit: str) -> int:
    """Largest size the open visits need at once (persistent params excluded)."""
    size = {p: (i.nbytes if unit == "bytes" else i.numel) for p, i in trace.params.items() if not i.persistent}
    open_: dict[int, tuple[int, ...]] = {}
    peak = 0
    for i, ev in enumerate(trace.events):
        visit = trace.event_visit[i]
        if ev.kind.is_pre:
            open_[visit] = trace.visits[visit].params
            peak = max(peak, sum(size.get(p, 0) for p in set().union(*open_.values())))
        else:
            del open_[visit]
    return peak


@st.composite
def cases(draw: st.DrawFn) -> tuple[Trace, PlanConfig]:
    trace = draw(traces)
    return trace, draw(plan_configs(trace))
