"""What a schedule is made of: the budgets it honours (`PlanConfig`), one `Action` per event with
the `Reason` for each `Decision`, what executing it costs (`PlanStats`), and the `Schedule` itself.

The planner (schedule.py) builds them and its last pass (hold.py) edits them; both import them
from here, as does everything that reads a schedule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from .trace import EventKind

__all__ = ["Action", "Decision", "PlanConfig", "PlanStats", "Reason", "Schedule"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConfig:
    """Budgets the planner honours, all counted in `unit`."""

    max_live: int
    """Hard cap on live (gathered or in flight) non-persistent size at any moment."""
    max_reuse_distance: int
    """Keep a param after a visit when its next use is at most this far (see reuse distance)."""
    prefetch_bucket_size: int
    """Most size prefetched ahead of use (in flight or gathered, not yet used); 0 disables."""
    unit: Literal["numel", "bytes"] = "numel"
    """Count sizes in elements (`ParamInfo.numel`) or bytes (`ParamInfo.nbytes`)."""

    def __post_init__(self) -> None:
        for name in ("max_live", "max_reuse_distance", "prefetch_bucket_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"PlanConfig.{name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"PlanConfig.{name} must be >= 0, got {value}")
        if self.unit not in ("numel", "bytes"):
            raise ValueError(f"PlanConfig.unit must be 'numel' or 'bytes', got {self.unit!r}")


class Decision(enum.Enum):
    """Why a param was gathered, kept or released, with its effect on live size.

    - DEMAND_FETCH: gathered at a PRE event because its visit needs it and it was not live (+size).
    - PREFETCH: gathered in the bucket issued after an event, ahead of its next use (+size, and
      +size to pending prefetch until that use).
    - KEPT_REUSE: left gathered when a visit closed; next use within max_reuse_distance (no change).
    - HELD_INSTEAD_OF_REGATHER: left gathered when a visit closed although its next use is farther
      than max_reuse_distance, because the plan gathered it again before that use and holding it keeps the
      live size within the plan's peak (and max_live) until then (no change; hold.py [Note: holds]).
    - RELEASED_AFTER_USE: freed when a visit closed; next use farther than the limit or none (-size).
    - EVICTED_FOR_BUDGET: freed to bring live under max_live, furthest next use first (-size).
    - RELEASED_END_OF_STEP: freed because the trace ended (-size).
    - PREFETCH_WASTED: a prefetched param freed before it was used (-size, and -size pending).
    """

    DEMAND_FETCH = "demand_fetch"
    PREFETCH = "prefetch"
    KEPT_REUSE = "kept_reuse"
    HELD_INSTEAD_OF_REGATHER = "held_instead_of_regather"
    RELEASED_AFTER_USE = "released_after_use"
    EVICTED_FOR_BUDGET = "evicted_for_budget"
    RELEASED_END_OF_STEP = "released_end_of_step"
    PREFETCH_WASTED = "prefetch_wasted"


@dataclass(frozen=True, slots=True, kw_only=True)
class Reason:
    """One decision about one param, with the numbers that decided it.

    `live` is the live size just before the decision; `limit` the cap it was compared with
    (max_live, max_reuse_distance or prefetch_bucket_size); `next_use` the index of the next PRE
    event using the param (None: none); `distance` the reuse distance (None: infinite); `need`
    the incoming size at a PRE event; `pending` the prefetched-not-yet-used size after a prefetch;
    `regather` the event whose gather a hold replaced.
    """

    param: int
    decision: Decision
    size: int
    live: int
    limit: int
    next_use: int | None = None
    distance: int | None = None
    need: int = 0
    pending: int = 0
    regather: int | None = None

    def describe(self) -> str:
        """Human-readable justification, e.g. "kept: next use in 1200 <= max_reuse_distance 5000"."""
        d = self.decision
        at = "never" if self.next_use is None else f"at event {self.next_use}"
        if d is Decision.DEMAND_FETCH:
            return f"demand fetch: not live when needed (live {self.live} + need {self.need}, max_live {self.limit})"
        if d is Decision.PREFETCH:
            return f"prefetch for event {self.next_use}: pending {self.pending} <= prefetch_bucket_size {self.limit}"
        if d is Decision.KEPT_REUSE:
            return f"kept: next use in {self.distance} <= max_reuse_distance {self.limit} ({at})"
        if d is Decision.HELD_INSTEAD_OF_REGATHER:
            return (f"held: next use in {self.distance} ({at}) is beyond max_reuse_distance, and releasing "
                    f"would gather it again at event {self.regather}; holding it keeps live at most {self.live}, "
                    f"within the plan's peak {self.limit}")
        if d is Decision.RELEASED_AFTER_USE:
            if self.distance is None:
                return f"released: no next use, max_reuse_distance {self.limit}"
            return f"released: next use in {self.distance} > max_reuse_distance {self.limit} ({at})"
        if d is Decision.EVICTED_FOR_BUDGET:
            return f"evicted: live {self.live} + need {self.need} > max_live {self.limit}; next use {at} is furthest"
        if d is Decision.PREFETCH_WASTED:
            if self.next_use is None:
                return "prefetch wasted: never used before the end of the step"
            return (
                f"prefetch wasted: evicted before its use {at} "
                f"(live {self.live} + need {self.need} > max_live {self.limit})"
            )
        return "released at end of step"


@dataclass(frozen=True, slots=True)
class Action:
    """What the runtime does at one event, in order: `release`, then `fetch` (one collective,
    PRE only), then issue `prefetch` (one collective). `keep` lists params a closing visit left
    gathered; `reasons` holds one `Reason` per decision, in execution order."""

    index: int
    kind: EventKind
    module: str
    release: tuple[int, ...] = ()
    fetch: tuple[int, ...] = ()
    prefetch: tuple[int, ...] = ()
    keep: tuple[int, ...] = ()
    reasons: tuple[Reason, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanStats:
    """What executing a schedule costs. Sizes of gathers are full and unpadded; `peak_live` is in
    the config's unit, `peak_live_numel`/`peak_live_bytes` are each their own maximum over time;
    `num_demand_fetches` counts params (collectives are in `num_allgathers`)."""

    peak_live: int = 0
    peak_live_numel: int = 0
    peak_live_bytes: int = 0
    num_allgathers: int = 0
    allgather_numel: int = 0
    allgather_bytes: int = 0
    num_demand_fetches: int = 0
    num_prefetched_params: int = 0
    prefetch_hits: int = 0
    wasted_prefetches: int = 0
    persistent_numel: int = 0
    persistent_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Schedule:
    """The plan for one trace: one `Action` per event plus the end-of-step releases."""

    trace_key: str
    trace_version: int
    config: PlanConfig
    actions: tuple[Action, ...]
    end_release: tuple[int, ...]
    stats: PlanStats
    end_reasons: tuple[Reason, ...] = ()
    param_names: tuple[tuple[int, str], ...] = ()

    def explain(self, param_id: int | None = None, module: str | None = None,
                param_ids: frozenset[int] | None = None) -> list[str]:
        """One line per decision, filtered to a param, a set of params (a module's: `engine.explain(module)`)
        and/or a module's events (None: all).

        End-of-step releases belong to no module and are listed unless `module` is given.
        """
        names = dict(self.param_names)
        lines: list[str] = []

        def add(where: str, reason: Reason) -> None:
            if (param_id is None or reason.param == param_id) and (param_ids is None or reason.param in param_ids):
                label = names.get(reason.param, "")
                lines.append(f"{where}: param {reason.param} ({label}) {reason.decision.name}: {reason.describe()}")

        for action in self.actions:
            if module is None or action.module == module:
                for reason in action.reasons:
                    add(f"event {action.index} {action.kind.name} {action.module or '<root>'}", reason)
        if module is None:
            for reason in self.end_reasons:
                add("end of step", reason)
        return lines
