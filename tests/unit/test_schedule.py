"""Unit tests for zero3.planning.schedule: exact plans for small hand-written traces."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from zero3.planning.schedule import Action, Decision, PlanConfig, PlanStats, Schedule, plan, replay
from zero3.planning.trace import Event, EventKind, ParamInfo, Trace

PF, QF, PB, QB = EventKind.PRE_FORWARD, EventKind.POST_FORWARD, EventKind.PRE_BACKWARD, EventKind.POST_BACKWARD
BIG = 10**9


def cfg(max_live: int, reuse: int, bucket: int, unit: str = "numel") -> PlanConfig:
    return PlanConfig(max_live=max_live, max_reuse_distance=reuse, prefetch_bucket_size=bucket, unit=unit)  # type: ignore[arg-type]


def two_layer(extra: dict[int, ParamInfo] | None = None, l0: tuple[int, ...] = (0,)) -> Trace:
    """Root with layers l0 (param 0) and l1 (param 1), 100 elements / 400 bytes each; fwd + bwd."""
    infos = {0: ParamInfo(0, "l0.w", 100, 400), 1: ParamInfo(1, "l1.w", 100, 400), **(extra or {})}
    events = (
        Event(PF, ""),
        Event(PF, "l0", l0),
        Event(QF, "l0", l0),
        Event(PF, "l1", (1,)),
        Event(QF, "l1", (1,)),
        Event(QF, ""),
        Event(PB, ""),
        Event(PB, "l1", (1,)),
        Event(QB, "l1", (1,)),
        Event(PB, "l0", l0),
        Event(QB, "l0", l0),
        Event(QB, ""),
    )
    return Trace("two_layer", 0, events, infos)


def rows(schedule: Schedule) -> list[tuple[tuple[int, ...], ...]]:
    """(release, fetch, prefetch, keep) per event."""
    return [(a.release, a.fetch, a.prefetch, a.keep) for a in schedule.actions]


def checked(trace: Trace, config: PlanConfig) -> Schedule:
    schedule = plan(trace, config)
    assert replay(trace, schedule) == schedule.stats
    return schedule


E: tuple[int, ...] = ()


def test_two_layer_with_prefetch_has_exact_actions() -> None:
    s = checked(two_layer(), cfg(200, 0, 100))
    assert rows(s) == [
        (E, E, (0,), E),  # root: prefetch l0 (bucket full at 100)
        (E, E, (1,), E),  # l0 uses the prefetch; prefetch l1
        (E, E, E, (0,)),  # l0's next use is 200 away > 0, but it would be prefetched again at once: held
        (E, E, E, E),  # l1 used; l0 already live for backward (live 200 <= 200)
        (E, E, E, (1,)),  # l1's next use is 0 away (only the root's empty PRE between): keep
        (E, E, E, E),
        (E, E, E, E),
        (E, E, E, E),  # l1 backward: still live, no gather
        ((1,), E, E, E),  # no next use
        (E, E, E, E),  # l0 backward: held since event 2
        ((0,), E, E, E),
        (E, E, E, E),
    ]
    assert s.end_release == ()
    assert s.stats == PlanStats(
        peak_live=200,
        peak_live_numel=200,
        peak_live_bytes=800,
        num_allgathers=2,
        allgather_numel=200,
        allgather_bytes=800,
        num_demand_fetches=0,
        num_prefetched_params=2,
        prefetch_hits=2,
    )
    core = plan(two_layer(), cfg(200, 0, 100), holds=False)  # the same plan without holds
    assert (core.actions[2].release, core.actions[3].prefetch, core.stats.num_allgathers) == ((0,), (0,), 3)


def test_two_layer_without_prefetch_demand_fetches() -> None:
    s = checked(two_layer(), cfg(200, 0, 0))
    assert [(a.release, a.fetch, a.keep) for a in s.actions] == [
        (E, E, E),
        (E, (0,), E),
        ((0,), E, E),
        (E, (1,), E),
        (E, E, (1,)),
        (E, E, E),
        (E, E, E),
        (E, E, E),
        ((1,), E, E),
        (E, (0,), E),
        ((0,), E, E),
        (E, E, E),
    ]
    assert (s.stats.num_allgathers, s.stats.num_demand_fetches, s.stats.peak_live) == (3, 3, 100)
    assert all(not a.prefetch for a in s.actions)


def test_budget_evicts_the_kept_param_with_furthest_next_use() -> None:
    s = checked(two_layer(), cfg(100, BIG, 0))
    assert s.actions[2].keep == (0,)
    assert s.actions[3].release == (0,) and s.actions[3].fetch == (1,)
    (reason,) = [r for r in s.actions[3].reasons if r.param == 0]
    assert (reason.decision, reason.live, reason.need, reason.limit, reason.next_use) == (
        Decision.EVICTED_FOR_BUDGET,
        100,
        100,
        100,
        9,
    )
    assert s.actions[9].fetch == (0,)
    assert (s.stats.peak_live, s.stats.num_allgathers) == (100, 3)


def test_eviction_prefers_furthest_next_use() -> None:
    infos = {p: ParamInfo(p, f"w{p}", 10, 10) for p in range(4)}
    mods = [("a", 0), ("b", 1), ("c", 2), ("b", 1), ("d", 3), ("a", 0)]
    events = tuple(Event(k, m, (p,)) for m, p in mods for k in (PF, QF))
    s = checked(Trace("belady", 0, events, infos), cfg(20, BIG, 0))
    # At c (event 4) a and b are kept; a's next use (event 10) is further than b's (6).
    assert s.actions[4].release == (0,) and s.actions[4].fetch == (2,)
    assert s.actions[6].fetch == () and s.actions[8].fetch == (3,)


def test_tied_param_is_kept_across_modules_within_reuse_distance() -> None:
    infos = {0: ParamInfo(0, "emb.weight", 100, 200), 1: ParamInfo(1, "mid.w", 100, 200)}
    events = (
        Event(PF, ""),
        Event(PF, "emb", (0,)),
        Event(QF, "emb", (0,)),
        Event(PF, "mid", (1,)),
        Event(QF, "mid", (1,)),
        Event(PF, "head", (0,)),
        Event(QF, "head", (0,)),
        Event(QF, ""),
    )
    trace = Trace("tied", 0, events, infos)
    kept = checked(trace, cfg(BIG, 100, 0))
    assert kept.actions[2].keep == (0,) and kept.actions[5].fetch == ()
    assert kept.stats.num_allgathers == 2
    assert "kept: next use in 100 <= max_reuse_distance 100 (at event 5)" in "\n".join(kept.explain(param_id=0))
    refetched = checked(trace, cfg(BIG, 99, 0))
    assert refetched.actions[2].release == (0,) and refetched.actions[5].fetch == (0,)
    assert refetched.stats.num_allgathers == 3


def test_param_shared_by_open_parent_is_not_released_by_child() -> None:
    infos = {0: ParamInfo(0, "a.w", 5, 5), 1: ParamInfo(1, "a.b.w", 5, 5)}
    events = (Event(PF, "a", (0,)), Event(PF, "a.b", (0, 1)), Event(QF, "a.b", (0, 1)), Event(QF, "a", (0,)))
    s = checked(Trace("shared", 0, events, infos), cfg(BIG, 0, 0))
    assert rows(s) == [(E, (0,), E, E), (E, (1,), E, E), ((1,), E, E, E), ((0,), E, E, E)]


def test_nested_visits_over_budget_hold_only_what_is_open() -> None:
    infos = {0: ParamInfo(0, "a.w", 3, 3), 1: ParamInfo(1, "a.b.w", 3, 3)}
    events = (
        Event(PF, "a", (0,)),
        Event(PF, "a.b", (1,)),
        Event(QF, "a.b", (1,)),
        Event(QF, "a", (0,)),
        Event(PF, "a.b", (1,)),
        Event(QF, "a.b", (1,)),
    )
    s = checked(Trace("nested", 0, events, infos), cfg(4, 100, 5))
    assert rows(s) == [
        (E, (0,), E, E),  # the look-ahead stops: a and a.b together (6) exceed max_live 4
        (E, (1,), E, E),  # the open visits alone need 6 > 4: fetch anyway, prefetch nothing
        ((1,), E, E, E),  # within reuse distance, but live 6 > 4 once a.b closes: evicted
        ((0,), E, (1,), E),  # a closes; a.b's next visit now fits: prefetch it
        (E, E, E, E),
        ((1,), E, E, E),
    ]
    assert s.actions[2].reasons[0].decision is Decision.EVICTED_FOR_BUDGET
    assert (s.stats.peak_live, s.stats.prefetch_hits, s.stats.num_demand_fetches) == (6, 1, 2)


def test_visit_never_closed_is_released_at_end_of_step() -> None:
    infos = {0: ParamInfo(0, "emb.w", 10, 10), 1: ParamInfo(1, "l.w", 10, 10)}
    events = (Event(PB, ""), Event(PB, "emb", (0,)), Event(PB, "l", (1,)), Event(QB, "l", (1,)))
    s = checked(Trace("open", 0, events, infos), cfg(BIG, 0, 0))
    assert s.actions[3].release == (1,)
    assert s.end_release == (0,)
    assert [r.decision for r in s.end_reasons] == [Decision.RELEASED_END_OF_STEP]
    assert s.explain(param_id=0)[-1].startswith("end of step: param 0 (emb.w) RELEASED_END_OF_STEP")


def test_unit_bytes_counts_nbytes() -> None:
    by_numel = checked(two_layer(), cfg(400, BIG, 0))
    assert by_numel.stats.peak_live == 200 and not any(a.release for a in by_numel.actions[:8])
    by_bytes = checked(two_layer(), cfg(400, BIG, 0, unit="bytes"))
    assert by_bytes.actions[3].release == (0,)  # 400 + 400 bytes > 400
    assert (by_bytes.stats.peak_live, by_bytes.stats.peak_live_numel, by_bytes.stats.peak_live_bytes) == (
        400,
        100,
        400,
    )


def test_persistent_params_are_never_planned() -> None:
    trace = two_layer({2: ParamInfo(2, "l0.bias", 7, 14, persistent=True)}, l0=(0, 2))
    s = checked(trace, cfg(200, 0, 100))
    assert all(2 not in a.release + a.fetch + a.prefetch + a.keep for a in s.actions)
    # l0.w is held from forward to backward (it would be prefetched again at once): 200, not 300
    assert (s.stats.persistent_numel, s.stats.persistent_bytes, s.stats.allgather_numel) == (7, 14, 200)
    assert plan(trace, cfg(200, 0, 100)).stats == s.stats  # deterministic


def sequential(sizes: dict[str, dict[int, int]]) -> Trace:
    infos = {p: ParamInfo(p, f"{m}.p{p}", n, n) for m, ps in sizes.items() for p, n in ps.items()}
    events = [Event(PF, "")]
    for m, ps in sizes.items():
        events += [Event(PF, m, tuple(ps)), Event(QF, m, tuple(ps))]
    return Trace("seq", 0, (*events, Event(QF, "")), infos)


def test_param_larger_than_bucket_is_demand_fetched_and_stops_the_walk() -> None:
    s = checked(sequential({"l0": {0: 100}, "l1": {1: 300}, "l2": {2: 100}}), cfg(BIG, 0, 200))
    assert [a.prefetch for a in s.actions[:4]] == [(0,), E, E, (2,)]
    assert s.actions[3].fetch == (1,)
    assert (s.stats.num_demand_fetches, s.stats.num_prefetched_params) == (1, 2)


def test_look_ahead_stops_before_an_event_whose_working_set_exceeds_max_live() -> None:
    s = checked(sequential({"l0": {1: 100}, "l1": {2: 100, 3: 200}}), cfg(300, 0, 300))
    # After the root: l0 fits, but pinned + {1, 2, 3} = 400 > 300, so none of l1 is prefetched.
    assert [a.prefetch for a in s.actions] == [(1,), E, (2, 3), E, E, E]
    assert s.actions[0].reasons[0].describe() == "prefetch for event 1: pending 100 <= prefetch_bucket_size 300"


def test_prefetch_respects_bucket_and_pending() -> None:
    s = checked(sequential({f"l{k}": {k: 10} for k in range(5)}), cfg(BIG, 0, 20))
    assert [a.prefetch for a in s.actions if a.prefetch] == [(0, 1), (2,), (3,), (4,)]
    assert s.stats.prefetch_hits == 5 and s.stats.num_allgathers == 4


def test_replay_rejects_a_missing_fetch() -> None:
    trace = two_layer()
    s = plan(trace, cfg(200, 0, 0))
    broken = dataclasses.replace(s, actions=(s.actions[0], dataclasses.replace(s.actions[1], fetch=()), *s.actions[2:]))
    with pytest.raises(ValueError, match=r"event 1: fetch \(\) != params not live \[0\]"):
        replay(trace, broken)


def test_replay_counts_a_prefetch_released_unused_as_wasted() -> None:
    trace = two_layer()
    s = plan(trace, cfg(200, 0, 0))
    actions = list(s.actions)
    actions[0] = dataclasses.replace(actions[0], prefetch=(1,))
    actions[1] = dataclasses.replace(actions[1], release=(1,))
    stats = replay(trace, dataclasses.replace(s, config=cfg(200, 0, 100), actions=tuple(actions)))
    assert (stats.wasted_prefetches, stats.num_prefetched_params, stats.num_allgathers) == (1, 1, 4)


def test_explain_filters_by_param_and_module() -> None:
    s = plan(two_layer(), cfg(200, 0, 100))
    assert s.explain(module="l1") == [
        "event 4 POST_FORWARD l1: param 1 (l1.w) KEPT_REUSE: kept: next use in 0 <= max_reuse_distance 0 (at event 7)",
        "event 8 POST_BACKWARD l1: param 1 (l1.w) RELEASED_AFTER_USE: released: no next use, max_reuse_distance 0",
    ]
    assert s.explain(param_id=0)[1] == (
        "event 2 POST_FORWARD l0: param 0 (l0.w) HELD_INSTEAD_OF_REGATHER: held: next use in 200 (at event 9) "
        "is beyond max_reuse_distance, and releasing would gather it again at event 3; holding it keeps "
        "live at most 200, within the plan's peak 200"
    )
    core = plan(two_layer(), cfg(200, 0, 100), holds=False)  # without the holds: released, then prefetched
    assert core.explain(param_id=0)[1] == (
        "event 2 POST_FORWARD l0: param 0 (l0.w) RELEASED_AFTER_USE: "
        "released: next use in 200 > max_reuse_distance 0 (at event 9)"
    )
    assert core.explain(param_id=0, module="l1") == [
        "event 3 PRE_FORWARD l1: param 0 (l0.w) PREFETCH: prefetch for event 9: pending 100 <= prefetch_bucket_size 100"
    ]
    assert s.explain(param_id=0, module="l1") == []
    assert s.explain(param_id=1, module="") == []


def test_plan_logs_a_debug_summary(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="zero3.planning.schedule"):
        plan(two_layer(), cfg(200, 0, 0))
    assert any(r.getMessage().startswith("zero3::plan (two_layer v0) 12 events") for r in caplog.records)


def test_action_defaults_are_empty() -> None:
    a = Action(0, PF, "")
    assert (a.release, a.fetch, a.prefetch, a.keep, a.reasons) == ((), (), (), (), ())


@pytest.mark.parametrize("field", ["max_live", "max_reuse_distance", "prefetch_bucket_size"])
def test_negative_budget_raises_naming_the_field(field: str) -> None:
    values = {"max_live": 1, "max_reuse_distance": 1, "prefetch_bucket_size": 1, field: -3}
    with pytest.raises(ValueError, match=rf"PlanConfig\.{field} must be >= 0, got -3"):
        PlanConfig(**values)


@pytest.mark.parametrize("value", [1.5, True, "10"])
def test_non_int_budget_raises_type_error(value: object) -> None:
    with pytest.raises(TypeError, match=r"PlanConfig\.max_live must be an int"):
        PlanConfig(max_live=value, max_reuse_distance=0, prefetch_bucket_size=0)  # type: ignore[arg-type]


def test_unknown_unit_raises_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"PlanConfig\.unit must be 'numel' or 'bytes', got 'elements'"):
        PlanConfig(max_live=0, max_reuse_distance=0, prefetch_bucket_size=0, unit="elements")  # type: ignore[arg-type]


def test_config_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        PlanConfig(1, 2, 3)  # type: ignore[misc]
    config = cfg(1, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_live = 5  # type: ignore[misc]
