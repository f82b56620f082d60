"""Unit tests for zero3.planning.trace: the immutable trace, visit pairing, recorder and graph export."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import networkx as nx
import pytest

from zero3.planning.trace import (
    Direction,
    Event,
    EventKind,
    ParamInfo,
    Trace,
    TraceRecorder,
    export_graph,
    graph_to_dot,
    module_graph,
)

PF, QF, PB, QB = EventKind.PRE_FORWARD, EventKind.POST_FORWARD, EventKind.PRE_BACKWARD, EventKind.POST_BACKWARD


def _params(*ids: int) -> dict[int, ParamInfo]:
    return {i: ParamInfo(i, f"w{i}", 10 * (i + 1), 40 * (i + 1)) for i in ids}


def test_event_kinds_know_their_direction_and_role() -> None:
    assert [k.is_pre for k in (PF, QF, PB, QB)] == [True, False, True, False]
    assert [k.direction for k in (PF, QF, PB, QB)] == [Direction.FORWARD] * 2 + [Direction.BACKWARD] * 2


def test_event_params_are_sorted_and_deduplicated() -> None:
    assert Event(PF, "a", (3, 1, 3, 2)).params == (1, 2, 3)


def test_event_rejects_a_string_kind() -> None:
    with pytest.raises(TypeError, match="EventKind"):
        Event("pre_forward", "a", ())  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["numel", "nbytes"])
def test_param_info_rejects_negative_sizes(field: str) -> None:
    kwargs = {"numel": 1, "nbytes": 1, field: -1}
    with pytest.raises(ValueError, match=f"{field} must be >= 0, got -1"):
        ParamInfo(7, "w", **kwargs)


def test_unknown_param_id_names_the_event_index() -> None:
    events = (Event(PF, "a", (0,)), Event(QF, "a", (0,)), Event(PF, "b", (0, 9)))
    with pytest.raises(ValueError, match=r"event 2 \(PRE_FORWARD 'b'\) uses param ids \[9\]"):
        Trace("k", 0, events, _params(0))


def test_post_without_open_visit_names_the_event_index() -> None:
    events = (Event(PF, "a", ()), Event(QB, "a", ()))
    with pytest.raises(ValueError, match=r"event 1 \(POST_BACKWARD 'a'\) closes no open visit"):
        Trace("k", 0, events, {})


def test_params_key_must_match_param_id() -> None:
    with pytest.raises(ValueError, match=r"params\[1\]"):
        Trace("k", 0, (), {1: ParamInfo(2, "w", 1, 1)})


def test_trace_params_are_read_only() -> None:
    source = _params(0)
    trace = Trace("k", 0, (Event(PF, "", (0,)),), source)
    source[1] = ParamInfo(1, "late", 1, 1)
    assert 1 not in trace.params
    with pytest.raises(TypeError):
        trace.params[5] = ParamInfo(5, "x", 1, 1)  # type: ignore[index]


def test_post_closes_most_recent_visit_of_same_module_and_direction() -> None:
    events = (
        Event(PF, "a", (0,)),  # visit 0: outer call of a
        Event(PF, "a", (1,)),  # visit 1: re-entrant call of a
        Event(PB, "a", (0,)),  # visit 2: backward, another direction
        Event(QF, "a", (1,)),  # closes visit 1, not 0 (most recent forward of a)
        Event(QF, "a", (0,)),  # closes visit 0
        Event(PB, "b", (1,)),  # visit 3: interleaved with visit 2
        Event(QB, "a", (0,)),  # closes visit 2 while visit 3 stays open
    )
    trace = Trace("k", 0, events, _params(0, 1))
    assert [(v.module, v.direction, v.open_event, v.close_event) for v in trace.visits] == [
        ("a", Direction.FORWARD, 0, 4),
        ("a", Direction.FORWARD, 1, 3),
        ("a", Direction.BACKWARD, 2, 6),
        ("b", Direction.BACKWARD, 5, None),  # never closed: ends with the step
    ]
    assert trace.event_visit == (0, 1, 2, 1, 0, 3, 2)
    assert trace.visits[1].params == (1,)


def test_recorder_freezes_what_it_recorded() -> None:
    rec = TraceRecorder()
    params = {0: ParamInfo(0, "w0", 4, 16)}
    rec.record(PF, "", [0, 0])
    rec.record(QF, "", [0])
    trace = rec.freeze("train", 3, params)
    assert (trace.key, trace.version, len(rec)) == ("train", 3, 2)
    assert trace.events == (Event(PF, "", (0,)), Event(QF, "", (0,)))
    rec.clear()
    assert len(rec) == 0 and rec.freeze("train", 4, params).params == trace.params
    assert trace.events == (Event(PF, "", (0,)), Event(QF, "", (0,)))  # frozen copy untouched


def test_recorder_checks_param_ids_at_freeze() -> None:
    rec = TraceRecorder()
    rec.record(PF, "a", [4])
    with pytest.raises(ValueError, match="event 0"):
        rec.freeze("k", 0, {})


def test_trace_pickles_and_compares_by_value() -> None:
    trace = Trace("k", 1, (Event(PF, "a", (0,)), Event(QF, "a", (0,))), _params(0))
    clone = pickle.loads(pickle.dumps(trace))
    assert clone == trace and hash(clone) == hash(trace)
    assert clone.visits == trace.visits
    assert trace.modules == ("a",)


def _tied_nested_trace() -> Trace:
    events = (
        Event(PF, "", ()),
        Event(PF, "emb", (0,)),
        Event(QF, "emb", (0,)),
        Event(PF, "blocks.0.attn", (1,)),
        Event(QF, "blocks.0.attn", (1,)),
        Event(PF, "head", (0,)),  # tied with emb: the same param node
        Event(QF, "head", (0,)),
        Event(QF, "", ()),
        Event(PB, "head", (0,)),
    )
    infos = {0: ParamInfo(0, 'emb."weight"', 100, 200), 1: ParamInfo(1, "blocks.0.attn.w", 5, 10, True)}
    return Trace("tied", 2, events, infos)


def test_module_graph_has_tree_shared_params_and_visit_order() -> None:
    g = module_graph(_tied_nested_trace())
    modules = {n for n, d in g.nodes(data=True) if d["kind"] == "module"}
    assert modules == {f"module:{m}" for m in ("", "emb", "blocks", "blocks.0", "blocks.0.attn", "head")}
    children = {(u, v) for u, v, d in g.edges(data=True) if d["kind"] == "child"}
    assert ("module:blocks", "module:blocks.0") in children and ("module:", "module:blocks") in children
    uses = sorted(u for u, v, d in g.edges(data=True) if d["kind"] == "uses" and v == "param:0")
    assert uses == ["visit:1", "visit:3", "visit:4"]  # emb fwd, head fwd, head bwd: one param node
    order = [(u, v) for u, v, d in g.edges(data=True) if d["kind"] == "next"]
    assert order == [(f"visit:{i}", f"visit:{i + 1}") for i in range(4)]
    assert g.nodes["visit:4"]["close_event"] == -1
    assert g.nodes["param:1"]["persistent"] is True
    assert ("module:head", "visit:3") in g.edges


def test_export_graphml_round_trips(tmp_path: Path) -> None:
    trace = _tied_nested_trace()
    path = export_graph(trace, tmp_path / "trace.graphml")
    back = nx.read_graphml(path)
    g = module_graph(trace)
    assert set(back.nodes) == set(g.nodes)
    assert {(u, v, d["kind"]) for u, v, d in back.edges(data=True)} == {
        (u, v, d["kind"]) for u, v, d in g.edges(data=True)
    }
    assert back.nodes["param:0"]["numel"] == 100 and back.nodes["param:0"]["name"] == 'emb."weight"'
    assert back.graph["trace_key"] == "tied"


def test_export_dot_lists_every_node_and_edge(tmp_path: Path) -> None:
    trace = _tied_nested_trace()
    text = export_graph(trace, tmp_path / "trace.DOT").read_text()
    g = module_graph(trace)
    assert text == graph_to_dot(g)
    assert text.startswith('digraph "zero3 tied" {') and text.rstrip().endswith("}")
    quoted = r'"((?:[^"\\]|\\.)*)"'
    nodes = re.findall(rf"^  {quoted} \[", text, flags=re.M)
    edges = re.findall(rf"^  {quoted} -> {quoted} \[", text, flags=re.M)
    assert set(nodes) == set(g.nodes) and len(nodes) == g.number_of_nodes()
    assert set(edges) == set(g.edges) and len(edges) == g.number_of_edges()
    assert r'name="emb.\"weight\""' in text  # quotes in names are escaped


def test_export_rejects_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unsupported suffix '\.png'"):
        export_graph(_tied_nested_trace(), tmp_path / "trace.png")
