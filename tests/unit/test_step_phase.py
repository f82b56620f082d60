"""The step phase (StepPhase) the hooks drive, its transition table, and the one end of a step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero3
from zero3.runtime.hooks import CallState
from zero3.runtime.step import StepPhase, check_phase

from gpt import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(block_size=16)


def _engine():
    torch.manual_seed(0)
    model = GPT(CFG)
    return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            {"param_persistence_threshold": 0})


@pytest.mark.parametrize("old,new", [(StepPhase.FORWARD, StepPhase.FORWARD), (StepPhase.IDLE, StepPhase.FORWARD),
                                     (StepPhase.FORWARD, StepPhase.BACKWARD), (StepPhase.BACKWARD, StepPhase.IDLE),
                                     (StepPhase.FORWARD, StepPhase.IDLE), (StepPhase.IDLE, StepPhase.BACKWARD)])
def test_legal_phase_changes_pass(old, new) -> None:
    check_phase(old, new)


def test_a_backward_never_goes_back_to_forward() -> None:
    with pytest.raises(zero3.ZeroStateError, match="BACKWARD -> FORWARD"):
        check_phase(StepPhase.BACKWARD, StepPhase.FORWARD)


def test_phases_of_a_training_step_and_an_inference_forward() -> None:
    engine = _engine()
    seen = []
    x, y = synthetic_batch(0, 2, CFG)
    assert engine.hooks.phase is StepPhase.IDLE
    engine.module.h[0].register_full_backward_hook(lambda *a: seen.append(engine.hooks.phase))
    loss = engine(x, y)
    assert engine.hooks.phase is StepPhase.FORWARD and engine.coordinator.in_step
    engine.backward(loss)
    assert seen == [StepPhase.BACKWARD]
    assert engine.hooks.phase is StepPhase.IDLE and not engine.coordinator.in_step  # backward ended the step
    assert engine.coordinator.live_params == []
    engine.step()
    with torch.no_grad():
        engine(x, y)
    assert engine.hooks.phase is StepPhase.IDLE and engine.coordinator.live_params == []


def test_calls_move_through_their_states_once() -> None:
    engine = _engine()
    x, y = synthetic_batch(0, 2, CFG)
    calls = []
    real = engine.hooks._pre_backward

    def spy(call, grad):
        calls.append(call)
        return real(call, grad)

    engine.hooks._pre_backward = spy
    engine(x, y).backward()
    assert calls and all(c.state is CallState.BACKWARD_DONE for c in calls if c.record.name == "h.0.mlp.c_fc")


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, fail: bool = False):
        h = self.a(x)
        if fail:
            raise RuntimeError("boom")
        return self.b(h).sum()


def test_an_aborted_forward_ends_the_step_without_recording_it() -> None:
    model = Boom()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="boom"):
        engine(x, fail=True)
    assert engine.hooks.phase is StepPhase.IDLE and engine.hooks.stack == []
    assert engine.coordinator.live_params == [] and engine.coordinator.record_count == 0
    engine(x).backward()
    engine.step()
    assert engine.coordinator.record_count == 1
