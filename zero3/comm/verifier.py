"""The verification state machine: epochs, plans, the blocking header exchange and divergence.

How collectives are verified without a round trip each, and what happens when ranks diverge or one
stops taking part: [Note: verified collectives] in verify.py. Every wire request of a communicator is routed
before it is issued (`route`; `planned` for those that can carry a header, which are `register`-ed
after they were issued and whose work's ``wait`` calls `verify_through`); reads of shared-memory
arenas put nothing on the wire and are not verified.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import ZeroCommunicationError, ZeroDivergenceError
from ..metrics import VERIFICATION, StepMetrics
from .failure import posted_cause
from .tags import KIND_CODES, OPTIMIZER_STEP, Kind, Tag
from .verify import (
    LEAVING,
    VOIDED,
    WINDOW,
    WIRE_WORDS,
    EpochMode,
    EpochState,
    PayloadHeader,
    PlanCache,
    PlanKey,
    RequestShape,
    WireHeader,
    content_hash,
)
from .wire import Wire, all_gather_flat

logger = logging.getLogger(__name__)


class Route(enum.Enum):
    PLAIN = enum.auto()  # verification off: just issue it
    PLANNED = enum.auto()  # following the plan: carry a header in the payload
    CHECKED = enum.auto()  # headers agreed in a blocking exchange: issue the data


@dataclass(eq=False)
class UnverifiedCollective:
    """A planned collective (or a dummy) issued and not yet verified."""

    seq: int
    kind: Kind
    sizes: tuple[int, ...]
    works: list[Any]
    read_headers: Callable[[], list[PayloadHeader | None]]
    void: bool = False


DummyIssuer = Callable[[RequestShape, PayloadHeader, Tag], list[Any]]
"""Issues a planned request's wire collectives with zeros and ``header`` (the LEAVING flag set)."""


class Verifier:
    """One communicator's verified sequence of collectives (``verify`` on, world size > 1; else every
    request is PLAIN). ``issue_dummy`` puts a void stand-in for a planned request on the wire."""

    def __init__(self, wire: Wire, state: EpochState, metrics: StepMetrics, enabled: bool, plans: int,
                 issue_dummy: DummyIssuer) -> None:
        self.wire = wire
        self.state = state
        self.metrics = metrics
        self.enabled = enabled
        self.plans = PlanCache(plans)
        self._issue_dummy = issue_dummy
        self._plan: tuple[RequestShape, ...] = ()
        self._plan_key: PlanKey = (0, True)
        self._log: list[RequestShape] = []
        self._outstanding: deque[UnverifiedCollective] = deque()
        self._realigned = False  # a divergence just set the next epoch: the abort of that same step does not count

    # -- epochs ----------------------------------------------------------------------------------
    def end_epoch(self) -> None:
        """The runtime finished an epoch: leave the plan if it is not done, remember what this epoch
        issued, and start counting afresh."""
        if not self.enabled or self.state.mode in (EpochMode.IDLE, EpochMode.BROKEN):
            return
        self._finish_plan()
        self._drain()
        self.plans.record(self._plan_key, self._log)
        self._reset_epoch()

    def abandon_epoch(self) -> None:
        """The step was aborted: leave the plan in-band so the others do not wait on slots this rank
        will not issue, and forget this epoch. It counts even when it issued no collective (every
        parameter persistent, an error early in the forward): a rank that catches the exception and
        goes on is then a step ahead, and the next header exchange names both steps."""
        if not self.enabled or self.state.mode is EpochMode.BROKEN:
            return
        if self.state.mode is EpochMode.IDLE:
            if self._realigned:  # the step that diverged (review 30Z3: ranks whose error surfaced in an abort
                self._realigned = False  # counted it twice, the others once)
                return
            self._reset_epoch()
            return
        try:
            self._finish_plan()
            self._drain()
        except ZeroCommunicationError:
            return
        except ZeroDivergenceError:
            pass
        self._reset_epoch()

    def step_began(self) -> None:
        """A step began: an abort from here on is this step's own, counted even right after a divergence
        that reached this rank outside a step (review 30Z4: it was swallowed, and a batch went unpaired)."""
        self._realigned = False

    def _finish_plan(self) -> None:
        if self.state.mode is EpochMode.PLANNED:
            while self._outstanding and self.state.mode is EpochMode.PLANNED:
                self._verify_next()
            if self.state.mode is EpochMode.PLANNED and self.state.seq < len(self._plan):
                self._leave()

    def _reset_epoch(self) -> None:
        s = self.state
        self._realigned = False
        if s.mode is EpochMode.BROKEN:
            return
        s.epoch += 1
        s.mode = EpochMode.IDLE
        s.seq = 0
        self._plan = ()
        self._log = []
        self._outstanding.clear()

    def forget(self) -> None:
        """At exit: drop every slot in flight unwaited, and close (every later request raises)."""
        self._outstanding.clear()
        self.state.mode = EpochMode.BROKEN

    # -- requests --------------------------------------------------------------------------------
    def planned(self, tag: Tag, shape: RequestShape) -> PayloadHeader | None:
        """Route a request; the header its payload carries when it follows the plan, else None."""
        if self.route(tag, shape) is not Route.PLANNED:
            return None
        return self.header(shape.kind, tag.ids, shape.sizes)

    def route(self, tag: Tag, shape: RequestShape) -> Route:
        """Decide how to issue a request; may block (epoch start, window, header exchange)."""
        if not self.enabled:
            return Route.PLAIN
        s = self.state
        if s.mode is EpochMode.BROKEN:
            raise ZeroCommunicationError(f"{tag.describe()}: the process group zero3 runs this on is closed after a "
                                         "failed collective (see the first error); restart from the last checkpoint")
        self._log.append(shape)
        if s.mode is EpochMode.IDLE and self._start_epoch(tag, shape):
            return Route.CHECKED
        if s.mode is EpochMode.PLANNED:
            if self._outstanding and (shape.header_first or self._outstanding[0].seq <= s.seq - WINDOW):
                self._flush_window(shape.header_first)
            if s.mode is EpochMode.PLANNED:
                if s.seq < len(self._plan) and self._plan[s.seq] == shape:
                    if not shape.header_first or self._planned_exchange(tag, shape):
                        return Route.PLANNED if not shape.header_first else Route.CHECKED
                else:
                    self._leave()
        self._exchange(tag, shape)
        return Route.CHECKED

    def header(self, kind: str, ids: tuple[int, ...], sizes: tuple[int, ...], flags: int = 0) -> PayloadHeader:
        """The payload header of the next planned collective."""
        return PayloadHeader(self.state.epoch & 0xFFFF, self.state.seq, content_hash(kind, ids, sizes), flags)

    def register(self, shape: RequestShape, works: list[Any],
                 reader: Callable[[], list[PayloadHeader | None]]) -> UnverifiedCollective:
        """A planned request was issued: verify it later (`verify_through`), in order."""
        s = UnverifiedCollective(self.state.seq, Kind(shape.kind), shape.sizes, works, reader)
        self._outstanding.append(s)
        self.state.seq += 1
        return s

    def verify_through(self, slot: UnverifiedCollective) -> None:
        """Verify, in order, every collective up to and including ``slot``."""
        while self.state.mode is EpochMode.PLANNED and any(s is slot for s in self._outstanding):
            self._verify_next()
        if any(s is slot for s in self._outstanding):  # drained as void by a switch meanwhile
            self._outstanding.remove(slot)

    def voided(self, tag: Tag, sizes: tuple[int, ...]) -> None:
        """A request of this rank was issued in a slot another rank left the plan at: the ranks are
        not doing the same thing. Tell everyone in a header exchange flagged VOIDED: all raise."""
        if self.state.mode is EpochMode.PLANNED:
            self._leave()
        self._exchange(tag, RequestShape(tag.kind.value, sizes, "", False), flags=VOIDED)

    # -- the state machine -----------------------------------------------------------------------
    def _planned_exchange(self, tag: Tag, shape: RequestShape) -> bool:
        """A planned request that starts with a blocking header exchange: True when every rank is at
        this very slot; else every rank switches right after it (it completed everywhere at once)."""
        s = self.state
        mine = WireHeader(s.epoch, s.seq, KIND_CODES[tag.kind], content_hash(tag.kind.value, tag.ids, shape.sizes),
                          sum(shape.sizes))
        rows = self._wire_exchange(mine, tag)
        self.metrics.header_exchanges += 1
        s.seq += 1
        if all(mine.same_request(r) and r is not None and r.flags == 0 for r in rows):
            return True
        self.metrics.anomalies += 1
        s.mode = EpochMode.CHECKED
        logger.info("zero3: collective plan left at slot %d of step %d; verifying every collective until the "
                    "step ends", s.seq - 1, s.epoch)
        return False

    def _flush_window(self, everything: bool) -> None:
        """Verify the oldest slots: all of them, or those K behind the next sequence number."""
        while self._outstanding and self.state.mode is EpochMode.PLANNED and \
                (everything or self._outstanding[0].seq <= self.state.seq - WINDOW):
            self.metrics.forced_verifies += 1
            self._verify_next()

    def _start_epoch(self, tag: Tag, shape: RequestShape) -> bool:
        """One blocking exchange: this epoch's first request and the plan each rank proposes. Returns
        True when it also verified the request (no common plan: the epoch runs CHECKED)."""
        s = self.state
        self._realigned = False
        key = content_hash(tag.kind.value, tag.ids, shape.sizes)
        self._plan_key = (key, torch.is_grad_enabled())  # an inference epoch is another key (`PlanKey`)
        choice = self.plans.choose(self._plan_key)
        digest = choice[1] if choice is not None else 0
        mine = WireHeader(s.epoch, 0, KIND_CODES[tag.kind], key, sum(shape.sizes), digest)
        rows = self._wire_exchange(mine, tag)
        self.metrics.header_exchanges += 1
        if not all(mine.same_request(r) for r in rows):
            self._diverged(tag, shape, rows)
        if choice is not None and all(r is not None and r.digest == digest for r in rows):
            s.mode = EpochMode.PLANNED
            self._plan = choice[0]
            s.seq = 0
            return False
        s.mode = EpochMode.CHECKED
        s.seq = 1
        return True

    def _exchange(self, tag: Tag, shape: RequestShape, flags: int = 0) -> None:
        """CHECKED: agree on this request in one blocking header exchange, or raise on every rank."""
        s = self.state
        mine = WireHeader(s.epoch, s.seq, KIND_CODES[tag.kind], content_hash(tag.kind.value, tag.ids, shape.sizes),
                          sum(shape.sizes), flags=flags)
        rows = self._wire_exchange(mine, tag)
        self.metrics.header_exchanges += 1
        if not all(mine.same_request(r) and r is not None and r.flags == 0 for r in rows):
            self._diverged(tag, shape, rows, voided=bool(flags))
        s.seq += 1

    def _wire_exchange(self, mine: WireHeader, tag: Tag) -> list[WireHeader | None]:
        w = self.wire
        out = torch.empty(WIRE_WORDS * w.world_size, dtype=torch.int64, device=w.device)
        t0 = time.perf_counter()
        w.monitor.blocking(lambda: all_gather_flat(out, mine.to_tensor(w.device), group=w.group), tag)
        self.metrics.header_seconds += time.perf_counter() - t0
        w.counter.peers(VERIFICATION, WIRE_WORDS * 8)
        return WireHeader.rows(out)

    def _diverged(self, tag: Tag, shape: RequestShape, rows: list[WireHeader | None], voided: bool = False) -> None:
        """Every rank saw the same mismatching headers: describe and raise on all of them."""
        s = self.state
        seq = s.seq
        what = f"{tag.describe()} ({sum(shape.sizes):,} elements"
        if tag.ids:  # ranks may agree on everything but which parameters (they numbered them differently)
            shown = ", ".join(map(str, tag.ids[:6])) + (f", ... ({len(tag.ids)} in all)" if len(tag.ids) > 6 else "")
            what += f"; parameter ds_ids {shown}"
        what += ")"
        if voided:
            what += ", issued where another rank had left the plan"
        stepping = tag.kind is Kind.AGREE and tag.label.startswith(OPTIMIZER_STEP)
        details = self.wire.objects((s.epoch, seq, what, self.wire.monitor.last_post, stepping), VERIFICATION)
        name = self.wire.global_rank  # default-group ranks, as torch's messages (probe 37T)
        lines = "; ".join(f"rank {name(r)}: step {e} collective #{q} {w}" for r, (e, q, w, _, _) in enumerate(details))
        steps = sorted({e for e, _, _, _, _ in details})
        cause = ""
        posted = [(r, posted_cause(p, steps[0], steps[-1])) for r, (_, _, _, p, _) in enumerate(details)]
        if len({d[4] for d in details}) > 1 and not any(m for _, m in posted):
            at = [r for r, d in enumerate(details) if d[4]]
            cause = (f" Rank(s) {at} are at engine.step()'s optimizer step and the others are not: either the ranks "
                     "end their accumulation windows at different engine.step() calls (every rank must call it as "
                     "often, with the same engine.set_gradient_accumulation_boundary where that is set), or the "
                     "others ran something before it that these did not (below).")
        elif len(steps) == 1 and all(r is not None and r.kind == KIND_CODES[Kind.GRAD_REDUCE] for r in rows):
            cause = (" Every rank is reducing gradients, but not the same ones here: the ranks ran modules in "
                     "different orders or on some ranks only (below), or every rank ran them and an output reached "
                     "the loss on some ranks only, so a parameter got a gradient there alone (a loss term under "
                     "`if rank == 0:`, an auxiliary output some ranks drop): keep it in the graph on every rank, as "
                     "`loss = loss + 0 * aux.sum()` where the term is left out (probe 37E).")
        elif len(steps) > 1:  # a rank aborted a step (an exception it caught) and went on; the others did not
            where = ", ".join(f"rank {name(r)} at step {e}" for r, (e, _, _, _, _) in enumerate(details))
            cause = (f" The ranks are at different steps ({where})"
                     + "".join(f"; rank {name(r)} {m}" for r, m in posted if m)
                     + ". A rank that catches an exception from its forward or backward and goes on has aborted "
                     "that step while the others have not: raise it on every rank, or skip the batch on every rank.")
        self.wire.monitor.post(f"{s.epoch}|raised ZeroDivergenceError at collective #{seq} ({what})")
        # Every rank starts its next epoch at the same count: a rank steps ahead by an epoch no other ran
        # (an inference forward, an aborted step), and behind it the ranks stayed apart for good (probe 30G:
        # every later step raised), where the docs promise an engine that trains on.
        s.epoch = max(e for e, _, _, _, _ in details)
        self._reset_epoch()
        self._realigned = True
        raise ZeroDivergenceError(
            f"ranks disagree on the next collective ({lines}).{cause} zero3 needs every rank to run the same "
            "modules in the same order with the same parameters (SPMD). Run on every rank what only some "
            "ranks run (under `if rank == 0:`: a forward for evaluation or sampling, engine.save_checkpoint, "
            "a consolidated state dict; each is a collective), and pass synced_gpus=True to a Hugging Face "
            "generate() (a rank that finished early stops its forwards); make skipped branches run on every "
            "rank (e.g. with zero inputs), or make the module around the part whose routing differs a leaf "
            "module (zero3.set_leaf_modules) so it is gathered and reduced as one unit: the leaf itself must "
            "still run on every rank, as many times, only what runs inside it may differ.")

    def _leave(self) -> None:
        """This rank's next request is not the planned slot (or its epoch ends early): verify what is
        in flight, then mark the planned slots from here void in-band and switch to CHECKED."""
        while self._outstanding and self.state.mode is EpochMode.PLANNED:
            self._verify_next()
        if self.state.mode is EpochMode.PLANNED:
            self.metrics.plan_departures += 1
            self._switch(self.state.seq)

    def _switch(self, first: int) -> None:
        """The first anomaly is at slot ``first``: issue every planned slot up to the agreed switch
        point as a void dummy, wait for everything in flight, and go CHECKED."""
        s, plan = self.state, self._plan
        last = first if first < len(plan) and plan[first].header_first else first + WINDOW - 1
        for u in self._outstanding:
            u.void = True
        while s.seq <= min(last, len(plan) - 1):
            self._outstanding.append(self._dummy(plan[s.seq]))
            s.seq += 1
        self._drain()
        s.seq = max(s.seq, min(last, len(plan) - 1) + 1)
        s.mode = EpochMode.CHECKED
        logger.info("zero3: collective plan left at slot %d of step %d; verifying every collective until the "
                    "step ends", first, s.epoch)

    def _dummy(self, shape: RequestShape) -> UnverifiedCollective:
        """Issue a planned slot with zeros and the LEAVING flag (see [Note: verified collectives])."""
        s = self.state
        kind = Kind(shape.kind)
        tag = Tag(kind, "leaving the plan")
        if shape.header_first:
            self._wire_exchange(WireHeader(s.epoch, s.seq, KIND_CODES[kind], 0, 0, flags=LEAVING), tag)
            return UnverifiedCollective(s.seq, kind, shape.sizes, [], lambda: [], void=True)
        works = self._issue_dummy(shape, self.header(shape.kind, (), shape.sizes, LEAVING), tag)
        self.metrics.dummy_collectives += 1
        return UnverifiedCollective(s.seq, kind, shape.sizes, works, lambda: [], void=True)

    def _drain(self) -> None:
        """Wait for every slot in flight without using it (they are void, or verified already)."""
        while self._outstanding:
            u = self._outstanding.popleft()
            for w in u.works:
                self.wire.monitor.wait(w, None)
            u.works = []

    def _verify_next(self) -> None:
        u = self._outstanding.popleft()
        for w in u.works:
            self.wire.monitor.wait(w, None)
        u.works = []  # nothing zero3 holds may keep a finished work alive (exit_release.py)
        headers = u.read_headers()
        first = headers[0]
        ok = first is not None and first.epoch == self.state.epoch & 0xFFFF and first.seq == u.seq and \
            first.flags == 0 and all(h == first for h in headers)
        if ok and not u.void:
            return
        self.metrics.anomalies += 1
        u.void = True
        if self.state.mode is EpochMode.PLANNED:
            self._outstanding.appendleft(u)
            self._switch(u.seq)
