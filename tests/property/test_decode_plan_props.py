"""Generation mode's decode plans, replayed over random cycles the way the coordinator acts on them
(runtime/coordinator.py `_generation_event`): once planned, the live size stays within the cap
without a single eviction, and a token costs exactly one collective per streamed bucket."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from zero3.planning.generation import GATHER_COST_BYTES, GenerationPrefetch, plan_decode
from zero3.planning.schedule import PlanConfig, eviction_order


@st.composite
def cycles(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], dict[int, int]]:
    """Events with a parameter of their own each (so no two are equal) and some shared ones (tied)."""
    n = draw(st.integers(2, 12))
    shared = draw(st.lists(st.integers(100, 103), max_size=4, unique=True))
    events = []
    for i in range(n):
        extra = draw(st.lists(st.sampled_from(shared), max_size=2, unique=True)) if shared and draw(st.booleans()) else []
        events.append(tuple([i, *extra]))
    size = {p: draw(st.integers(1, 50)) for p in {p for ev in events for p in ev}}
    return events, size


class Replay:
    """The coordinator's generation events over sets of ids: fetch (evicting in `eviction_order`
    when the cap needs it), releases, prefetches that fit."""

    def __init__(self, policy: GenerationPrefetch, size: dict[int, int], config: PlanConfig) -> None:
        self.policy, self.size, self.config = policy, size, config
        self.live: set[int] = set()
        self.evictions = self.collectives = 0

    def _live_size(self, extra: set[int] = frozenset()) -> int:  # type: ignore[assignment]
        return sum(self.size[p] for p in self.live | extra)

    def _make_room(self, incoming: set[int], pinned: set[int]) -> None:
        for p in eviction_order(self.live - incoming - pinned, self.policy.next_use):
            if self._live_size(incoming) <= self.config.max_live:
                break
            self.live.discard(p)
            self.evictions += 1

    def event(self, ids: tuple[int, ...]) -> None:
        action = self.policy.step(ids)
        pinned = set(ids)
        if action.keep is not None:
            self.live = {p for p in self.live if p in action.keep or p in pinned}
        missing = (pinned | set(action.gather)) - self.live
        if missing:
            self._make_room(missing, pinned)
            self.live |= missing
            self.collectives += 1
        ahead = set(action.prefetch) - self.live
        if ahead and sum(self.size[p] for p in ahead) <= self.config.prefetch_bucket_size:
            self._make_room(ahead, pinned)
            if self._live_size(ahead) <= self.config.max_live:
                self.live |= ahead
                self.collectives += 1


@settings(max_examples=300, deadline=None)
@given(cycles(), st.floats(0.3, 1.2), st.sampled_from([10, 60, 10**9]))
def test_a_planned_decode_needs_no_eviction_and_one_collective_per_bucket(cycle, fraction, bucket) -> None:
    events, size = cycle
    cap = max(max(sum(size[p] for p in set(ev)) for ev in events), int(fraction * sum(size.values())))
    config = PlanConfig(max_live=cap, max_reuse_distance=0, prefetch_bucket_size=bucket)
    policy = GenerationPrefetch(size, config)
    replay = Replay(policy, size, config)
    for ids in events:  # learning
        replay.event(ids)
    for _ in range(3):
        before = (replay.evictions, replay.collectives)
        for ids in events:
            replay.event(ids)
            assert replay._live_size() <= cap
        plan = policy.plan
        # the policy plans exactly when the planner has a plan for the learnt cycle (element budgets)
        assert plan == plan_decode(events, size, cap, bucket, GATHER_COST_BYTES // 4)
        if plan is None:
            event("not planned")
            return  # the cycle fits, or no plan does: the learning policy goes on
        event("planned")
        assert replay.evictions == before[0], plan
        assert plan.resident <= replay.live
        for _, ids in plan.buckets:
            assert sum(size[p] for p in plan.resident | set(ids)) <= cap and sum(size[p] for p in ids) <= bucket
    assert replay.collectives - before[1] == len(plan.buckets), plan  # the last token: one per bucket
