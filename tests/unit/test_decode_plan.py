"""Generation mode's decode plans (planning/generation.py [Note: decode plans]): a resident part and
a few streamed buckets per token, within the live cap, never cutting a tied weight."""

from __future__ import annotations

from zero3.planning.generation import GenerationPrefetch, plan_decode
from zero3.planning.schedule import PlanConfig

# A tied-embedding GPT's cycle: embedding (0), then 8 modules of one param each, then a head that uses
# the embedding again.
CYCLE = [(0,), *((p,) for p in range(1, 9)), (9, 0)]
SIZE = {0: 40, **{p: 20 for p in range(1, 9)}, 9: 1}
TOTAL = sum(SIZE.values())  # 201


def test_a_cycle_that_fits_is_not_planned() -> None:
    assert plan_decode(CYCLE, SIZE, TOTAL, 10**9, 1) is None


def test_the_plan_streams_a_window_in_buckets_within_the_cap() -> None:
    cap = TOTAL // 2
    plan = plan_decode(CYCLE, SIZE, cap, 10**9, 1)
    assert plan is not None
    streamed = [p for _, ids in plan.buckets for p in ids]
    assert sorted(streamed + sorted(plan.resident)) == sorted(SIZE)  # each parameter one way or the other
    assert 0 in plan.resident  # used first and last: never a bucket's
    resident = sum(SIZE[p] for p in plan.resident)
    for start, ids in plan.buckets:
        assert resident + sum(SIZE[p] for p in ids) <= cap
        assert start == min(i for i, ev in enumerate(CYCLE) if set(ev) & set(ids))  # issued at its first use


def test_the_gather_cost_trades_bytes_for_collectives() -> None:
    cap = TOTAL // 2
    cheap = plan_decode(CYCLE, SIZE, cap, 10**9, 0)
    dear = plan_decode(CYCLE, SIZE, cap, 10**9, 10**6)
    assert cheap is not None and dear is not None
    streamed = lambda plan: sum(SIZE[p] for _, ids in plan.buckets for p in ids)  # noqa: E731
    assert streamed(cheap) <= TOTAL - cap + 40  # about what does not fit (and room for the buckets)
    assert len(dear.buckets) < len(cheap.buckets) and streamed(dear) > streamed(cheap)


def test_buckets_are_at_most_the_prefetch_bucket_size_and_none_fits_without_room() -> None:
    plan = plan_decode(CYCLE, SIZE, TOTAL // 2, 40, 10**6)
    assert plan is not None and all(sum(SIZE[p] for p in ids) <= 40 for _, ids in plan.buckets)
    assert plan_decode(CYCLE, SIZE, TOTAL // 2, 19, 10**6) is None  # no module fits a bucket


def test_a_tied_weight_is_never_cut_between_buckets() -> None:
    cycle = [(1,), (2, 5), (4, 5), (6,), (7,), (8,)]  # 5 is used by the second and the third event
    size = {p: 10 for p in (1, 2, 4, 5, 6, 7, 8)}
    checked = 0
    for cap in range(10, 70):
        plan = plan_decode(cycle, size, cap, 10**9, 1)
        if plan is None or 5 in plan.resident:
            continue
        (start, ids), = [(s, ids) for s, ids in plan.buckets if 5 in ids]  # one bucket holds it
        assert start <= 1 and {2, 4} <= set(ids), (cap, plan)  # from its first use through its last
        checked += 1
    assert checked > 0  # some caps stream the tied weight


def test_the_policy_plans_once_a_forward_begins_again_and_drops_the_plan_off_the_cycle() -> None:
    config = PlanConfig(max_live=TOTAL // 2, max_reuse_distance=0, prefetch_bucket_size=10**9)
    policy = GenerationPrefetch(SIZE, config)
    for ev in CYCLE:
        assert policy.step(ev).keep is None  # learning: no plan yet
    assert policy.plan is None
    first = policy.step(CYCLE[0])  # a new forward: planned
    plan = policy.plan
    assert plan is not None
    assert first.keep is not None and plan.resident <= first.keep
    actions = [first] + [policy.step(ev) for ev in CYCLE[1:]]
    gathered = [p for a in actions for p in a.gather]
    assert sorted(gathered) == sorted(p for _, ids in plan.buckets for p in ids)
    assert policy.step((7, 7, 7)).keep is None and policy.plan is None  # left the cycle


def test_without_a_prefetch_bucket_size_the_cycle_is_never_planned() -> None:
    config = PlanConfig(max_live=TOTAL // 2, max_reuse_distance=0, prefetch_bucket_size=0)
    policy = GenerationPrefetch(SIZE, config)
    for _ in range(3):
        for ev in CYCLE:
            policy.step(ev)
    assert policy.plan is None


def test_a_module_after_a_head_tied_to_the_first_is_planned_when_told_where_forwards_begin() -> None:
    """A value head after a head tied to the input embedding (TRL's actor-critic): the tied head's
    event has the cycle's first ids, which the policy took for a new forward, cutting the cycle there
    at every forward (never planned: one gather per module, 10 per token on probe 24D's model). Told
    where the root's forward begins (`forward_boundary`), it learns the whole cycle and plans it."""
    cycle = [*CYCLE[:-1], (0,), (10,)]  # the head reuses the embedding's ids exactly, a value head follows
    size = {**SIZE, 10: 20}
    config = PlanConfig(max_live=sum(size.values()) // 2, max_reuse_distance=0, prefetch_bucket_size=10**9)
    told, untold = GenerationPrefetch(size, config), GenerationPrefetch(size, config)
    for _ in range(3):
        told.forward_boundary(True)
        for ev in cycle:
            told.step(ev)
            untold.step(ev)
    assert told.plan is not None and len(told._cycle) == len(cycle)
    assert untold.plan is None  # the old reading, kept for callers that never tell
    told.forward_boundary(True)
    assert told.step(cycle[0]).keep is not None  # the planned cycle goes on
    told.forward_boundary(True)
    assert told.step((5,)).keep is None and told.plan is None  # a forward that starts elsewhere: learnt anew
