"""Stateful test of the ParamCoordinator against a reference model of open module visits.

The coordinator runs with a real world-size-1 communicator (gathers are local copies, prefetches
stay INFLIGHT until waited). Rules enter and exit module visits in and out of trace order, end
steps, replay the previous step (so the coordinator follows its planned schedule) with or without a
perturbation, and change budgets. After every rule the invariants recompute everything from scratch.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

from zero3.comm.communicator import Communicator
from zero3.comm.settings import CommSettings
from zero3.config import ZeroConfig
from zero3.runtime.coordinator import ParamCoordinator
from zero3.metrics import StepMetrics
from zero3.partition.param import PartitionedParameter, ZeroParameter, partition
from zero3.partition.state import ParamStatus
from zero3.planning.trace import EventKind

OPEN = {EventKind.PRE_FORWARD: EventKind.POST_FORWARD, EventKind.PRE_BACKWARD: EventKind.POST_BACKWARD}


class CoordinatorMachine(RuleBasedStateMachine):
    @initialize(sizes=st.lists(st.integers(0, 300), min_size=2, max_size=8),
                data=st.data(),
                max_live=st.integers(0, 1500), reuse=st.integers(0, 1500), bucket=st.integers(0, 800))
    def setup(self, sizes, data, max_live, reuse, bucket):
        self.params = [partition(nn.Parameter(torch.arange(float(n))), name=f"p{i}", world_size=1, rank=0,
                                 group=None) for i, n in enumerate(sizes)]
        self.originals = [torch.arange(float(n)) for n in sizes]
        n_modules = data.draw(st.integers(1, 5))
        self.modules = {}
        for m in range(n_modules):
            idx = data.draw(st.lists(st.integers(0, len(sizes) - 1), min_size=1, max_size=3, unique=True))
            self.modules[f"m{m}"] = [self.params[i] for i in idx]
        self.metrics = StepMetrics()
        self.config = ZeroConfig(max_live_parameters=max_live, max_reuse_distance=reuse, prefetch_bucket_size=bucket)
        comm = Communicator(None, CommSettings(overlap=True, bucket_numel=10**9), world_size=1, rank=0,
                            metrics=self.metrics)
        self.coord = ParamCoordinator(self.config, comm, self.metrics, self.params)
        self.open: list[tuple[str, EventKind]] = []  # the reference model: open visits, in order
        self.step_events: list[tuple[EventKind, str]] = []
        self.last_step: list[tuple[EventKind, str]] = []

    # -- rules ----------------------------------------------------------------------------------
    def _event(self, kind: EventKind, module: str) -> None:
        self.coord.event(kind, module, self.modules[module])
        self.step_events.append((kind, module))

    @rule(data=st.data(), backward=st.booleans())
    def enter(self, data, backward):
        module = data.draw(st.sampled_from(sorted(self.modules)))
        kind = EventKind.PRE_BACKWARD if backward else EventKind.PRE_FORWARD
        self._event(kind, module)
        self.open.append((module, kind))

    @precondition(lambda self: bool(getattr(self, "open", None)))
    @rule(data=st.data())
    def exit(self, data):
        i = data.draw(st.integers(0, len(self.open) - 1))
        module, kind = self.open[i]
        # A POST closes the most recent open visit of that module and direction.
        j = max(k for k, (m, kd) in enumerate(self.open) if m == module and kd is kind)
        del self.open[j]
        self._event(OPEN[kind], module)

    @precondition(lambda self: hasattr(self, "coord"))
    @rule()
    def end_step(self):
        self.coord.end_step()
        self.open.clear()
        self.last_step, self.step_events = self.step_events, []
        assert self.coord.live_params == [], "parameters left gathered after end_step"

    @precondition(lambda self: hasattr(self, "coord") and not self.open and bool(self.last_step))
    @rule(perturb=st.booleans(), data=st.data())
    def replay_last_step(self, perturb, data):
        """Re-run the previous step's events (the coordinator follows its schedule), maybe perturbed."""
        events = list(self.last_step)
        if perturb:
            cut = data.draw(st.integers(0, len(events) - 1))
            events = events[:cut]  # stop early: the rest of the trace never comes
        for kind, module in events:
            self._event(kind, module)
            if kind in OPEN:
                self.open.append((module, kind))
            else:
                j = max(k for k, (m, kd) in enumerate(self.open) if m == module and OPEN[kd] is kind)
                del self.open[j]
            self.coordinator_state_is_consistent()

    @precondition(lambda self: hasattr(self, "coord") and not self.open and not self.step_events)
    @rule(max_live=st.integers(0, 1500), reuse=st.integers(0, 1500), bucket=st.integers(0, 800))
    def change_budget(self, max_live, reuse, bucket):
        from zero3.planning.trace_cache import TraceCache
        from zero3.runtime.coordinator import plan_config

        self.config = self.config.replace(max_live_parameters=max_live, max_reuse_distance=reuse,
                                          prefetch_bucket_size=bucket)
        self.coord.config = self.config
        self.coord.plan_config = plan_config(self.config)
        self.coord.steps.cache = TraceCache(self.config.budget.max_traces)  # schedules planned under the old budgets go

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def coordinator_state_is_consistent(self):
        if not hasattr(self, "coord"):
            return
        self.coord.check_valid()
        pinned: dict[int, object] = {}
        for module, _ in self.open:
            for p in self.modules[module]:
                assert p._zero.status is ParamStatus.AVAILABLE, f"{p._zero.name} used by open {module} not gathered"
                assert torch.equal(p.data, self.originals[int(p._zero.name[1:])]), "gathered data is wrong"
                pinned[p._zero.id] = p
        pinned_numel = sum(p._zero.numel for p in pinned.values())
        cap = self.coord.plan_config.max_live
        assert self.metrics.live_numel <= max(cap, pinned_numel), (self.metrics.live_numel, cap, pinned_numel)
        for p in self.params:
            z = p._zero
            live = z.id in {q._zero.id for q in self.coord.live_params}
            assert live == (z.status is not ParamStatus.NOT_AVAILABLE), z.summary()
            # The class tells the status (exactly nn.Parameter when gathered), the API answers the record.
            assert type(p) is (nn.Parameter if z.status is ParamStatus.AVAILABLE else PartitionedParameter), z.summary()
            assert isinstance(p, ZeroParameter)
            assert (p.ds_id, p.ds_status, p.ds_persist, p.ds_numel) == (z.id, z.status, z.persistent, z.numel)
            assert p.ds_tensor is z.shard


CoordinatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestCoordinatorMachine = CoordinatorMachine.TestCase
