"""`ParamCoordinator`: decides when parameters are gathered and released, and keeps the books.

The hooks (hooks.py) report module events; the coordinator turns them into fetches and releases.
Without a trace it fetches on demand and releases right after use. With a recorded trace it follows
a precomputed `Schedule` (prefetch, reuse-distance keeps, budget evictions); see schedule.py.

Every gathered, non-persistent parameter is in ``_live`` from the moment its gather is issued until
it is released, and ``metrics.live_numel`` is their element count; `check_valid` recomputes it.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from .comm import Communicator
from .config import ZeroConfig
from .errors import ZeroStateError
from .metrics import StepMetrics
from .param import ZeroParameter, free_full
from .state import ParamStatus

logger = logging.getLogger(__name__)


class ParamCoordinator:
    def __init__(self, config: ZeroConfig, comm: Communicator, metrics: StepMetrics) -> None:
        self.config = config
        self.comm = comm
        self.metrics = metrics
        self._live: dict[int, ZeroParameter] = {}

    # -- module events -----------------------------------------------------------------------------
    def pre_forward(self, params: Sequence[ZeroParameter]) -> None:
        for p in params:
            p._zero.active_forward += 1
        self.fetch(params)

    def post_forward(self, params: Sequence[ZeroParameter]) -> None:
        for p in params:
            z = p._zero
            if z.active_forward <= 0:
                raise ZeroStateError(f"post-forward of {z.summary()} without a matching pre-forward")
            z.active_forward -= 1
        self.release(params)

    def pre_backward(self, params: Sequence[ZeroParameter]) -> None:
        for p in params:
            p._zero.active_backward += 1
        self.fetch(params)

    def post_backward(self, params: Sequence[ZeroParameter]) -> None:
        for p in params:
            z = p._zero
            z.active_backward = max(0, z.active_backward - 1)
        self.release(params)

    def end_backward(self) -> None:
        """Backward finished: modules whose post-backward never fired (inputs without grad) are done."""
        for p in list(self._live.values()):
            p._zero.active_backward = 0
        self.release(list(self._live.values()))

    def release_all(self) -> None:
        """End of a step: nothing non-persistent stays gathered unless a user context holds it."""
        for p in list(self._live.values()):
            z = p._zero
            z.active_forward = z.active_backward = 0
        self.release(list(self._live.values()))

    # -- fetch and release -------------------------------------------------------------------------
    def fetch(self, params: Iterable[ZeroParameter], *, prefetch: bool = False) -> None:
        """Make every param AVAILABLE: wait in-flight gathers, gather the rest in one collective."""
        missing: list[ZeroParameter] = []
        waiting = []
        for p in params:
            status = p._zero.status
            if status is ParamStatus.NOT_AVAILABLE:
                if not any(q is p for q in missing):
                    missing.append(p)
            elif status is ParamStatus.INFLIGHT:
                waiting.append(p._zero.handle)
        if missing:
            self._make_room(missing)
            handle = self.gather(missing, prefetch=prefetch)
            waiting.append(handle)
        for h in waiting:
            h.wait()

    def gather(self, params: list[ZeroParameter], *, prefetch: bool) -> object:
        """Issue the all-gather and account the params as live (persistent ones are not counted)."""
        for p in params:
            if not p._zero.persistent:
                self._live[p._zero.id] = p
                self.metrics.add_live(p._zero.numel, p._zero.nbytes)
        if prefetch:
            self.metrics.prefetched += len(params)
        else:
            self.metrics.demand_fetches += len(params)
        return self.comm.all_gather(params, prefetch=prefetch)

    def release(self, params: Iterable[ZeroParameter]) -> None:
        for p in params:
            z = p._zero
            if z.pinned or z.status is ParamStatus.NOT_AVAILABLE:
                continue
            if z.status is ParamStatus.INFLIGHT:
                z.handle.wait()
            self._free(p)

    def _free(self, p: ZeroParameter) -> None:
        z = p._zero
        free_full(p)
        if self._live.pop(z.id, None) is not None:
            self.metrics.add_live(-z.numel, -z.nbytes)
        self.metrics.releases += 1

    def _make_room(self, incoming: Sequence[ZeroParameter]) -> None:
        """Hard live budget: release unpinned live params (not needed now) before gathering more."""
        need = sum(p._zero.numel for p in incoming if not p._zero.persistent)
        cap = self.config.max_live_parameters
        if self.metrics.live_numel + need <= cap:
            return
        incoming_ids = {p._zero.id for p in incoming}
        for p in list(self._live.values()):
            if self.metrics.live_numel + need <= cap:
                break
            if p._zero.id in incoming_ids or p._zero.pinned:
                continue
            if p._zero.status is ParamStatus.INFLIGHT:
                p._zero.handle.wait()
            self._free(p)

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
