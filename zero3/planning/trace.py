"""The recorded order of one training/eval step, as immutable data.

The runtime records module hook events while a step runs (`TraceRecorder`), freezes them into a
`Trace`, and hands the trace to the pure planner in schedule.py. Nothing here imports torch, so the
planner and its property tests run on plain Python data.

[Note: visits]
A PRE event opens a *visit* of a module: the params listed on the event must stay gathered while
the visit is open. A POST event closes the most recent open visit of the same module in the same
direction (forward: PRE_FORWARD/POST_FORWARD; backward: PRE_BACKWARD/POST_BACKWARD). Visits nest
(a parent stays open around its children), may interleave in backward, and may never be closed
(a PRE_BACKWARD without POST_BACKWARD when the module's inputs did not require grad); unclosed
visits end with the step. Forward visits may also appear inside backward (activation-checkpoint
recompute). A module may be visited many times and a param may be used by several modules (tied
weights); a param is one node, however many modules use it.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import networkx as nx

logger = logging.getLogger(__name__)

__all__ = [
    "Direction",
    "Event",
    "EventKind",
    "ParamInfo",
    "Trace",
    "TraceRecorder",
    "trace_from_json",
    "trace_to_json",
    "Visit",
    "export_graph",
    "graph_to_dot",
    "module_graph",
    "write_trace",
]


class Direction(enum.Enum):
    """Which pass a visit belongs to; a POST only closes a visit of its own direction."""

    FORWARD = "forward"
    BACKWARD = "backward"


class EventKind(enum.Enum):
    """The hook that produced an event (hashed by identity: `is_pre` runs per event in the planner).

    - PRE_FORWARD: forward pre-hook. Opens a forward visit; the event's params must be gathered
      until the matching POST_FORWARD. Also fired by activation-checkpoint recompute in backward.
    - POST_FORWARD: forward hook. Closes the most recent open forward visit of the module.
    - PRE_BACKWARD: gradient w.r.t. the module's outputs is ready. Opens a backward visit.
    - POST_BACKWARD: gradient w.r.t. the module's inputs is computed. Closes the most recent open
      backward visit of the module. Missing when the inputs did not require grad; the visit then
      stays open until the end of the step.
    """

    PRE_FORWARD = "pre_forward"
    POST_FORWARD = "post_forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"

    __hash__ = object.__hash__

    @property
    def is_pre(self) -> bool:
        """True for the events that open a visit (`OPENING`, for loops that run per event)."""
        return self in OPENING

    @property
    def direction(self) -> Direction:
        """Forward or backward; pairs PRE and POST events."""
        if self in (EventKind.PRE_FORWARD, EventKind.POST_FORWARD):
            return Direction.FORWARD
        return Direction.BACKWARD


OPENING = frozenset({EventKind.PRE_FORWARD, EventKind.PRE_BACKWARD})
"""The event kinds that open a visit."""


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """Static facts about one parameter, as the planner needs them.

    `numel` and `nbytes` are the full (unpartitioned, unpadded) sizes. A persistent param stays
    gathered for the whole run, so the planner never fetches, releases or counts it. `trains`: it
    gets gradients (`memory_budget` sizes the reduce bucket by the largest such).
    """

    id: int
    name: str
    numel: int
    nbytes: int
    persistent: bool = False
    trains: bool = True

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"ParamInfo {self.id} ({self.name!r}): numel must be >= 0, got {self.numel}")
        if self.nbytes < 0:
            raise ValueError(f"ParamInfo {self.id} ({self.name!r}): nbytes must be >= 0, got {self.nbytes}")


@dataclass(frozen=True, slots=True)
class Event:
    """One hook firing: `module` is the fully qualified name ("" = root) and `params` the ids the
    module fetches (its own and external ones), normalized to sorted and deduplicated."""

    kind: EventKind
    module: str
    params: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kind, EventKind):
            raise TypeError(f"Event.kind must be an EventKind, got {self.kind!r}")
        if not isinstance(self.module, str):
            raise TypeError(f"Event.module must be a str fqn, got {self.module!r}")
        object.__setattr__(self, "params", tuple(sorted(set(self.params))))


@dataclass(frozen=True, slots=True)
class Visit:
    """A PRE event and the POST that closed it (`close_event` None: closed at end of step).

    `params` are the params of the opening event; they must be gathered while the visit is open.
    """

    index: int
    module: str
    direction: Direction
    open_event: int
    close_event: int | None
    params: tuple[int, ...]


def _pair_visits(events: tuple[Event, ...]) -> tuple[tuple[Visit, ...], tuple[int, ...]]:
    """Match POST events to the visits they close; return visits and event -> visit index."""
    stacks: dict[tuple[str, Direction], list[int]] = {}
    opened: list[tuple[int, Event]] = []
    closes: dict[int, int] = {}
    event_visit: list[int] = []
    for i, ev in enumerate(events):
        key = (ev.module, ev.kind.direction)
        if ev.kind.is_pre:
            stacks.setdefault(key, []).append(len(opened))
            event_visit.append(len(opened))
            opened.append((i, ev))
            continue
        stack = stacks.get(key)
        if not stack:
            raise ValueError(
                f"event {i} ({ev.kind.name} {ev.module!r}) closes no open visit: record the "
                f"matching {ev.kind.direction.name} PRE event before it"
            )
        visit = stack.pop()
        closes[visit] = i
        event_visit.append(visit)
    visits = tuple(
        Visit(
            index=v,
            module=ev.module,
            direction=ev.kind.direction,
            open_event=i,
            close_event=closes.get(v),
            params=ev.params,
        )
        for v, (i, ev) in enumerate(opened)
    )
    return visits, tuple(event_visit)


def _opening_uses(events: tuple[Event, ...]) -> dict[int, tuple[int, ...]]:
    """Param id -> the indices of the opening events that use it, ascending (`Trace.uses`)."""
    out: dict[int, list[int]] = {}
    for j, e in enumerate(events):
        if e.kind in OPENING:
            for pid in e.params:
                out.setdefault(pid, []).append(j)
    return {pid: tuple(js) for pid, js in out.items()}


@dataclass(frozen=True)
class Trace:
    """A frozen, validated record of one step: events in order plus the params they use.

    `key` identifies what kind of step this is (the runtime caches one trace per key) and
    `version` counts re-recordings, so a `Schedule` can be matched to the trace it came from.
    `visits`, `event_visit` (event index -> index into `visits`) and `uses` (param id -> indices of
    the opening events that use it, ascending) are derived on construction, once per recorded
    order: a step that follows the trace asks `uses` for its evictions.
    """

    key: str
    version: int
    events: tuple[Event, ...]
    params: Mapping[int, ParamInfo] = field(hash=False)
    visits: tuple[Visit, ...] = field(init=False, repr=False, compare=False, hash=False)
    event_visit: tuple[int, ...] = field(init=False, repr=False, compare=False, hash=False)
    uses: Mapping[int, tuple[int, ...]] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        object.__setattr__(self, "params", types.MappingProxyType(dict(self.params)))
        self.validate()
        visits, event_visit = _pair_visits(self.events)
        object.__setattr__(self, "visits", visits)
        object.__setattr__(self, "event_visit", event_visit)
        object.__setattr__(self, "uses", types.MappingProxyType(_opening_uses(self.events)))

    def __reduce__(self) -> tuple[Any, ...]:
        # MappingProxyType does not pickle; rebuild from a plain dict (e.g. for a cross-rank check).
        return (Trace, (self.key, self.version, self.events, dict(self.params)))

    def validate(self) -> None:
        """Check ids and pairing.

        Raises:
            ValueError: a params key differs from its ParamInfo.id, an event uses an unknown
                param id (names the event index), or a POST closes no open visit.
        """
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"Trace {self.key!r}: version must be an int >= 0, got {self.version!r}")
        for pid, info in self.params.items():
            if not isinstance(info, ParamInfo) or info.id != pid:
                raise ValueError(f"Trace {self.key!r}: params[{pid}] must be a ParamInfo with id {pid}, got {info!r}")
        for i, ev in enumerate(self.events):
            if not isinstance(ev, Event):
                raise ValueError(f"Trace {self.key!r}: event {i} is not an Event: {ev!r}")
            unknown = [p for p in ev.params if p not in self.params]
            if unknown:
                raise ValueError(
                    f"Trace {self.key!r}: event {i} ({ev.kind.name} {ev.module!r}) uses param ids "
                    f"{unknown} missing from trace.params; register them with the recorder"
                )
        _pair_visits(self.events)

    @property
    def modules(self) -> tuple[str, ...]:
        """Module fqns in first-visit order (what a cross-rank order check compares)."""
        return tuple(dict.fromkeys(ev.module for ev in self.events))

    @property
    def trains(self) -> bool:
        """True when the step ran a backward (a training step); an inference step's trace is
        forward-only and no guide to what training gathers."""
        return any(v.direction is Direction.BACKWARD for v in self.visits)


class TraceRecorder:
    """Mutable event log the runtime appends to while a step runs; `freeze` makes the `Trace`."""

    def __init__(self) -> None:
        self._events: list[Event] = []

    def __len__(self) -> int:
        return len(self._events)

    @property
    def events(self) -> tuple[Event, ...]:
        """Events recorded so far."""
        return tuple(self._events)

    def record(self, kind: EventKind, module: str, params: Iterable[int] = ()) -> Event:
        """Append one event; param ids are checked at `freeze`."""
        event = Event(kind, module, tuple(params))
        self._events.append(event)
        self.log(event)
        return event

    @staticmethod
    def log(event: Event) -> None:
        """The DEBUG line of every hook event, recorded now or followed in a cached trace."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("zero3::trace %s (%s) params=%s", event.kind.value, event.module, event.params)

    def extend(self, events: Iterable[Event]) -> None:
        """Append events recorded before (the part of a cached trace a step followed)."""
        self._events.extend(events)

    def clear(self) -> None:
        """Drop the events (a new step, or an aborted one)."""
        self._events.clear()

    def freeze(self, key: str, version: int, params: Mapping[int, ParamInfo]) -> Trace:
        """Return the immutable, validated trace of what was recorded, over ``params``.

        Raises:
            ValueError: see `Trace.validate`.
        """
        return Trace(key, version, tuple(self._events), dict(params))


# -- JSON ----------------------------------------------------------------------------------------


def trace_to_json(trace: Trace) -> str:
    """A trace as JSON (events and param sizes), the input format of ``python -m zero3.plan``."""
    return json.dumps({
        "format": "zero3-trace", "version": 1, "key": trace.key, "trace_version": trace.version,
        "params": [{"id": p.id, "name": p.name, "numel": p.numel, "nbytes": p.nbytes, "persistent": p.persistent,
                    "trains": p.trains} for p in trace.params.values()],
        "events": [[e.kind.value, e.module, list(e.params)] for e in trace.events],
    })


def trace_from_json(text: str) -> Trace:
    data = json.loads(text)
    if data.get("format") != "zero3-trace" or data.get("version") != 1:
        raise ValueError(f"not a zero3 trace file (format {data.get('format')!r}, version {data.get('version')!r})")
    params = {p["id"]: ParamInfo(**p) for p in data["params"]}
    events = tuple(Event(EventKind(k), m, tuple(ps)) for k, m, ps in data["events"])
    return Trace(data["key"], data["trace_version"], events, params)


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace``: ``.json`` (`trace_to_json`), else the module graph (`export_graph`); the suffix in
    any case."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        Path(path).write_text(trace_to_json(trace))
    elif suffix in (".graphml", ".dot"):
        export_graph(trace, path)
    else:
        raise ValueError(f"export_trace: unsupported suffix {Path(path).suffix!r} in {str(path)!r}; use .json (the "
                         "trace, for python -m zero3.plan), .graphml or .dot (its module graph)")


# -- graph view ------------------------------------------------------------------------------------


def _module_node(fqn: str) -> str:
    return f"module:{fqn}"


def _param_node(pid: int) -> str:
    return f"param:{pid}"


def _visit_node(index: int) -> str:
    return f"visit:{index}"


def module_graph(trace: Trace) -> nx.DiGraph:
    """Build a graph view of the trace for inspection and export.

    Nodes (string ids, attribute `kind`): `module:<fqn>` for every module and its ancestors
    ("a.b" is a child of "a", "" is the root); `param:<id>` once per param however many modules
    use it (attrs param_id, name, numel, nbytes, persistent); `visit:<n>` per visit (attrs module,
    direction, open_event, close_event = -1 when never closed). Edges (attribute `kind`): `child`
    module -> submodule, `visits` module -> visit, `uses` visit -> param, `next` visit -> the
    visit opened after it.
    """
    import networkx as nx  # kept local: the data model above must not depend on it

    graph = nx.DiGraph(trace_key=trace.key, trace_version=trace.version)

    def add_module(fqn: str) -> None:
        node = _module_node(fqn)
        if node in graph:
            return
        graph.add_node(node, kind="module", fqn=fqn, label=fqn or "<root>")
        if fqn:
            parent = fqn.rpartition(".")[0]
            add_module(parent)
            graph.add_edge(_module_node(parent), node, kind="child")

    add_module("")
    for pid in sorted(trace.params):
        info = trace.params[pid]
        graph.add_node(
            _param_node(pid),
            kind="param",
            param_id=pid,
            name=info.name,
            numel=info.numel,
            nbytes=info.nbytes,
            persistent=info.persistent,
            label=info.name or str(pid),
        )
    previous: str | None = None
    for visit in trace.visits:
        add_module(visit.module)
        node = _visit_node(visit.index)
        close = -1 if visit.close_event is None else visit.close_event
        graph.add_node(
            node,
            kind="visit",
            module=visit.module,
            direction=visit.direction.value,
            open_event=visit.open_event,
            close_event=close,
            label=f"{visit.module or '<root>'} {visit.direction.value[0]}{visit.open_event}",
        )
        graph.add_edge(_module_node(visit.module), node, kind="visits")
        for pid in visit.params:
            graph.add_edge(node, _param_node(pid), kind="uses")
        if previous is not None:
            graph.add_edge(previous, node, kind="next")
        previous = node
    return graph


def _dot_quote(value: object) -> str:
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def _dot_attrs(data: Mapping[str, object]) -> str:
    return ", ".join(f"{key}={_dot_quote(value)}" for key, value in sorted(data.items()))


_DOT_SHAPES = {"module": "box", "param": "ellipse", "visit": "cds"}


def graph_to_dot(graph: nx.DiGraph) -> str:
    """Render a `module_graph` as DOT text (every id and value quoted; no pydot needed)."""
    lines = [f"digraph {_dot_quote('zero3 ' + str(graph.graph.get('trace_key', '')))} {{"]
    if graph.graph:
        lines.append(f"  graph [{_dot_attrs(graph.graph)}];")
    for node, data in graph.nodes(data=True):
        attrs = dict(data)
        if attrs.get("kind") in _DOT_SHAPES:
            attrs["shape"] = _DOT_SHAPES[str(attrs["kind"])]
        lines.append(f"  {_dot_quote(node)} [{_dot_attrs(attrs)}];")
    for u, v, data in graph.edges(data=True):
        lines.append(f"  {_dot_quote(u)} -> {_dot_quote(v)} [{_dot_attrs(data)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def export_graph(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write `module_graph(trace)` as GraphML (`.graphml`) or DOT (`.dot`), chosen by suffix.

    Returns:
        The path written.

    Raises:
        ValueError: any other suffix.
    """
    out = Path(path)
    suffix = out.suffix.lower()
    if suffix not in (".graphml", ".dot"):
        raise ValueError(f"export_graph: unsupported suffix {out.suffix!r} in {str(out)!r}; use .graphml or .dot")
    graph = module_graph(trace)
    if suffix == ".graphml":
        import networkx as nx

        nx.write_graphml(graph, out)
    else:
        out.write_text(graph_to_dot(graph), encoding="utf-8")
    logger.debug("zero3::export_graph (%s) %d nodes -> %s", trace.key, graph.number_of_nodes(), out)
    return out
