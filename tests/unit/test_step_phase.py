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


class SpyComm:
    """Stands in for the model-parallel communicator: records what the step lifecycle asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def abandon_epoch(self, reason: str | None = None) -> None:
        self.calls.append(("abandon_epoch", reason))

    def end_epoch(self) -> None:
        self.calls.append(("end_epoch", None))


def _with_spy_model_parallel(engine) -> SpyComm:
    from zero3.comm.model_parallel import ModelParallel

    spy = SpyComm()
    engine.context.model_parallel = ModelParallel(group=None, world_size=2, rank=0, comm=spy)
    return spy


def _assert_all_released(engine) -> None:
    assert engine.hooks.phase is StepPhase.IDLE and engine.hooks.stack == []
    assert not engine.coordinator.in_step and engine.coordinator.live_params == []
    engine.coordinator.check_valid()
    for p in engine.params:
        z = p._zero
        assert z.status is zero3.ParamStatus.NOT_AVAILABLE, z.summary()
        assert (z.active_forward, z.active_backward, z.user_pins, z.prefetched) == (0, 0, 0, False), z.summary()
        assert z.secondary is None


def test_an_aborted_step_abandons_the_model_parallel_epoch() -> None:
    model = Boom()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    spy = _with_spy_model_parallel(engine)
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="boom"):
        engine(x, fail=True)
    assert len(spy.calls) == 1 and spy.calls[0][0] == "abandon_epoch" and "boom" in spy.calls[0][1]
    assert "in its forward (step 0)" in spy.calls[0][1]
    engine(x).backward()
    engine.step()
    assert spy.calls[1:] == [("end_epoch", None)]  # a finished step ends it with engine.step(), once


def test_remove_hooks_between_forward_and_backward_ends_the_step_aborted() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              {"param_persistence_threshold": 0, "max_reuse_distance": 10**9,
                               "prefetch_bucket_size": 10**5})
    x, y = synthetic_batch(0, 2, CFG)
    engine(x, y).backward()
    engine.step()  # recorded: the next step follows it, keeping what backward reuses
    spy = _with_spy_model_parallel(engine)
    loss = engine(x, y)
    assert engine.coordinator.in_step and engine.coordinator.live_params, "nothing kept for the backward"
    engine.remove_hooks()
    _assert_all_released(engine)
    assert [c[0] for c in spy.calls] == ["abandon_epoch"] and "removed its hooks" in spy.calls[0][1]
    assert engine.coordinator.record_count == 1
    assert all(not p.ds_persist for p in engine.params)
    del loss


def test_remove_hooks_in_the_middle_of_a_forward_leaves_every_parameter_released() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              {"param_persistence_threshold": 0, "prefetch_bucket_size": 10**5})
    x, y = synthetic_batch(0, 2, CFG)
    for _ in range(2):  # the second step follows the first one's trace and prefetches
        engine(x, y).backward()
        engine.step()
    engine.module.h[1].register_forward_pre_hook(lambda *a: engine.remove_hooks())
    with pytest.raises(zero3.ZeroStateError):  # the rest of the forward finds its parameters partitioned
        engine.module(x, y)
    _assert_all_released(engine)
    assert engine.coordinator.record_count == 1


@pytest.mark.parametrize("threshold", [0, 10**6])
def test_a_frozen_model_s_forward_in_grad_mode_is_a_whole_step_unless_its_output_needs_grad(threshold):
    """A DINO teacher (requires_grad_(False), run without no_grad) kept one step open for good: its record
    grew by a module's events per forward, and the EMA setters after the student's step were refused as
    'inside a step' (probe 37H). Input gradients through a frozen model (adversarial examples) still flow."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    model.requires_grad_(False)
    engine = zero3.initialize(model, None, {"param_persistence_threshold": threshold})
    for _ in range(3):
        out = model(torch.randn(3, 4))
        assert not out.requires_grad
        assert engine.hooks.step.phase is StepPhase.IDLE and not engine.coordinator.in_step
    zero3.safe_set_full_fp32_param(model[0].bias, torch.zeros(8))  # between steps: accepted
    x = torch.randn(3, 4, requires_grad=True)
    out = model(x)
    # a backward may come: at threshold 0 it gathers, so the step stays open; with every parameter persistent
    # it has nothing to gather or reduce, and the step ends (review 37R3: the EMA setters were refused after it)
    assert out.requires_grad and engine.hooks.step.phase is (StepPhase.FORWARD if threshold == 0 else StepPhase.IDLE)
    out.sum().backward()
    with torch.no_grad():
        ref[0].bias.zero_()
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    model(torch.randn(3, 4))
    assert engine.hooks.step.phase is StepPhase.IDLE
