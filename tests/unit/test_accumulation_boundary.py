"""``engine.set_gradient_accumulation_boundary`` (DeepSpeed's override, used by RL trainers whose
micro-batch count changes every step): while set, ``engine.step()`` steps exactly at the set
boundaries, whatever ``gradient_accumulation_steps`` says; the gradients, the clipping checks,
``zero_grad`` and the step in backward follow it; None restores the count. Compared on numbers with
plain torch accumulating the same micro-batches."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero3
from zero3 import ZeroConfigError, ZeroStateError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(i))


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    return model(_batch(i)).pow(2).mean()


def _engine(gas: int, **cfg) -> zero3.Engine:
    model = _model()
    return zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            {"param_persistence_threshold": 0, "gradient_accumulation_steps": gas, **cfg})


def _weights(engine: zero3.Engine) -> list[torch.Tensor]:
    with zero3.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def _reference(windows: list[int], gas: int) -> list[list[torch.Tensor]]:
    """Plain torch: each window's micro-batches' losses over ``gas`` (engine.backward's division),
    accumulated, then one step; the weights after every window."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out, i = [], 0
    for size in windows:
        for _ in range(size):
            (_loss(model, i) / gas).backward()
            i += 1
        opt.step()
        opt.zero_grad()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


WINDOWS = [3, 1, 4, 2]


@pytest.mark.parametrize("gas", [1, 3])
@pytest.mark.parametrize("step_every_micro_batch", [False, True])
def test_windows_set_by_the_override_train_as_torch_accumulating_them(gas, step_every_micro_batch):
    """DeepSpeed's documented loop (one ``step()`` after the window's last backward) and the loop that
    calls ``step()`` after every micro-batch (OpenRLHF's), with window sizes unlike the config's."""
    engine, expected, i = _engine(gas), _reference(WINDOWS, gas), 0
    for w, size in enumerate(WINDOWS):
        for k in range(size):
            engine.set_gradient_accumulation_boundary(k == size - 1)
            assert engine.is_gradient_accumulation_boundary() is (k == size - 1)
            engine.backward(_loss(engine, i))
            i += 1
            if step_every_micro_batch or k == size - 1:
                assert engine.step() is (k == size - 1)
        assert engine.global_steps == w + 1
        for got, want in zip(_weights(engine), expected[w]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_none_restores_the_configured_windows_and_a_true_override_steps_every_call():
    engine = _engine(2)
    engine.set_gradient_accumulation_boundary(True)
    for i in range(2):  # each step() steps while the override says True
        engine.backward(_loss(engine, i))
        assert engine.step() is True
    engine.set_gradient_accumulation_boundary(None)
    assert not engine.is_gradient_accumulation_boundary()  # micro_steps 2: the first of a window of 2
    engine.backward(_loss(engine, 2))
    assert engine.step() is False
    engine.backward(_loss(engine, 3))
    assert engine.step() is True
    assert (engine.global_steps, engine.micro_steps) == (3, 4)
    for got, want in zip(_weights(engine), _reference([1, 1, 2], 2)[-1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_clipping_follows_the_override_and_its_refusal_names_it():
    engine = _engine(4)
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(_loss(engine, 0))
    with pytest.raises(ZeroStateError, match=r"micro-batch 1 of a window whose end "
                                             r"engine.set_gradient_accumulation_boundary sets \(now False\)"):
        zero3.clip_grad_norm_(engine, 1.0)
    with pytest.raises(ZeroStateError, match="set_gradient_accumulation_boundary"):
        torch.nn.utils.clip_grad_norm_(engine.optimizer.param_groups[0]["params"], 1.0)  # the shards
    engine.step()
    engine.set_gradient_accumulation_boundary(True)  # micro-batch 2 of the config's 4: the window ends here
    engine.backward(_loss(engine, 1))
    norm = zero3.clip_grad_norm_(engine, 1e-3)
    assert torch.isfinite(norm) and norm > 1e-3
    assert engine.step() is True


@pytest.mark.parametrize("step_every_micro_batch", [False, True])
def test_zero_grad_before_every_micro_batch_keeps_an_overridden_window_as_deepspeed_s(step_every_micro_batch):
    """While the override is set, ``engine.zero_grad()`` leaves the window's gradients (DeepSpeed's
    clears only ``param.grad``): a loop calling it before every micro-batch accumulates the window,
    whether ``step()`` follows every micro-batch or only the last."""
    engine, expected, i = _engine(1), _reference(WINDOWS, 1), 0
    for w, size in enumerate(WINDOWS):
        for k in range(size):
            engine.zero_grad()
            engine.set_gradient_accumulation_boundary(k == size - 1)
            engine.backward(_loss(engine, i))
            i += 1
            if step_every_micro_batch or k == size - 1:
                engine.step()
        for got, want in zip(_weights(engine), expected[w]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("bad batch")


class _Gate(nn.Module):
    armed = False

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return _Boom.apply(t) if _Gate.armed else t


@pytest.mark.parametrize("step_every_micro_batch", [False, True])
def test_a_backward_that_raises_mid_window_keeps_the_earlier_micro_batches_with_or_without_step_calls(
        step_every_micro_batch):
    """The window's second backward raises after the last layer's gradients landed (caught, batch
    skipped): the first micro-batch's gradients stay in either loop (before, the loop calling
    ``step()`` only at the end dropped them); the first layer, which the failed backward never
    reached, is torch's over micro-batches 1 and 3."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in (0, 2):
        (ref(_batch(i)).pow(2).mean() / 3).backward()
    opt.step()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), _Gate(), nn.Linear(16, 4))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"param_persistence_threshold": 0, "gradient_accumulation_steps": 3})
    try:
        for k in range(3):
            engine.set_gradient_accumulation_boundary(k == 2)
            _Gate.armed = k == 1
            out = engine(_batch(k))
            try:
                engine.backward(out.pow(2).mean())
            except ValueError:
                continue
            if step_every_micro_batch or k == 2:
                engine.step()
    finally:
        _Gate.armed = False
    assert engine.global_steps == 1
    torch.testing.assert_close(_weights(engine)[0], ref[0].weight.detach(), rtol=1e-5, atol=1e-6)


def test_a_backward_that_stepped_inside_ends_its_window_when_the_override_is_turned_off_before_step(caplog):
    """With the step in backward, the backward marked True steps the optimizer inside it; turning the
    override off before ``step()`` cannot undo that: ``step()`` ends the window, and the next one
    trains as usual (None counts as DeepSpeed does: micro-batch 2 ends a window of 2 there)."""
    cfg = {"offload_optimizer": "cpu", "sub_group_size": 64, "offload_optimizer_step_in_backward": True}
    engine = _engine(2, **cfg)
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(_loss(engine, 0))
    engine.set_gradient_accumulation_boundary(False)
    assert engine.is_gradient_accumulation_boundary()  # what step() will do: the backward ended the window
    with caplog.at_level(logging.WARNING, logger="zero3"):
        assert engine.step() is True and engine.global_steps == 1
    assert "the optimizer stepped inside the last backward" in caplog.text
    engine.set_gradient_accumulation_boundary(None)
    engine.backward(_loss(engine, 1))
    assert engine.step() is True and engine.global_steps == 2
    for got, want in zip(_weights(engine), _reference([1, 1], 2)[-1]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", ["yes", 2, 0.5, [True]])
def test_a_boundary_other_than_true_false_or_none_is_refused_and_changes_nothing(value):
    engine = _engine(2)
    with pytest.raises(ZeroConfigError, match="must be True, False or None"):
        engine.set_gradient_accumulation_boundary(value)
    assert engine.context.boundary_override is None and not engine.is_gradient_accumulation_boundary()


def test_the_step_in_backward_steps_at_the_overridden_boundary_as_the_step_after_it():
    """With ``offload_optimizer_step_in_backward`` the window's last backward steps the optimizer: the
    override moves that step to the backward it marks, and the weights are the plain step's."""
    cfg = {"offload_optimizer": "cpu", "sub_group_size": 64}
    plain, inside = _engine(2, **cfg), _engine(2, offload_optimizer_step_in_backward=True, **cfg)
    i = 0
    for size in WINDOWS:
        for k in range(size):
            for engine in (plain, inside):
                engine.set_gradient_accumulation_boundary(k == size - 1)
                engine.backward(_loss(engine, i))
                engine.step()
            i += 1
    assert plain.global_steps == inside.global_steps == len(WINDOWS)
    for a, b in zip(_weights(plain), _weights(inside)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(_weights(plain), _reference(WINDOWS, 2)[-1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_window_s_first_backward_that_raises_leaves_nothing_with_or_without_the_step_in_backward(in_backward):
    """Caught and skipped, as torch's skip-a-batch loop: the next micro-batches train as if it never
    ran (with the step in backward its partial gradients stayed before)."""
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i in (1, 2):
        (_loss(ref, i) / 2).backward()
    opt.step()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), _Gate(), nn.Linear(16, 4))
    cfg = {"offload_optimizer": "cpu", "sub_group_size": 64, "offload_optimizer_step_in_backward": in_backward}
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                              {"param_persistence_threshold": 0, "gradient_accumulation_steps": 2, **cfg})
    try:
        _Gate.armed = True
        with pytest.raises(ValueError, match="bad batch"):
            engine.backward(engine(_batch(0)).pow(2).mean())
    finally:
        _Gate.armed = False
    for i in (1, 2):
        engine.backward(engine(_batch(i)).pow(2).mean())
        engine.step()
    assert engine.global_steps == 1
    for got, want in zip(_weights(engine), ref.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loop", ["engine", "plain"])
def test_the_torch_habit_of_optimizer_zero_grad_after_every_step_keeps_the_window(loop):
    """``optimizer.zero_grad()`` on the torch optimizer given to initialize, after every ``engine.step()``
    (or ``optimizer.step()``) of a window: it is ``engine.zero_grad()``, which keeps the window's
    gradients; torch's own dropped the gradient shards, so each window stepped on its last micro-batch
    alone (probe 30A: 0.89 off after one window with SGD). DeepSpeed's drops nothing there either."""
    gas = 3
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0, "gradient_accumulation_steps": gas})
    got = []
    for i in range(2 * gas):
        if loop == "engine":
            engine.backward(_loss(engine, i))
            engine.step()
        else:  # the plain loop (its gradients are divided by gas, as engine.backward's)
            _loss(model, i).backward()
            if engine.is_gradient_accumulation_boundary():
                opt.step()
            else:
                engine.step()  # counts the micro-batch (optimizer.step() mid-window is refused)
        opt.zero_grad()
        if i % gas == gas - 1:
            got.append(_weights(engine))
    for w, r in zip(got, _reference([gas, gas], gas)):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(w, r))
    opt.zero_grad(set_to_none=False)  # dropping to zeros: the same as to None for the next backward
    engine.backward(_loss(engine, 9))  # a window's first micro-batch, never stepped
    engine.remove_hooks()
    opt.zero_grad()  # no engine steps its tensors now: torch's own, which drops them
    assert all(p._zero.train_tensor.grad is None for p in engine.params)


def test_a_new_engine_drops_the_gradients_an_unfinished_window_left_and_the_old_optimizer_defers_to_it(caplog):
    """Review 30Z: the first step of a new engine over the model stepped on the half window the old one
    left in the shards; review 30Y: the old optimizer's zero_grad() dropped the new engine's gradients."""
    gas = 2
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cfg = {"param_persistence_threshold": 0, "gradient_accumulation_steps": gas}
    engine = zero3.initialize(model, opt, cfg)
    engine.backward(_loss(engine, 0))
    engine.step()  # half a window, then the engine goes
    engine.remove_hooks()
    with caplog.at_level(logging.WARNING, logger="zero3"):
        new = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), cfg)
    assert "were left by an earlier engine" in caplog.text
    got = []
    for i in range(1, 1 + 2 * gas):
        new.backward(_loss(new, i))
        with pytest.raises(ZeroStateError, match="a new engine manages the model's parameters"):
            opt.zero_grad()
        new.step()
        if i % gas == 0:
            got.append(_weights(new))
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for window, w in zip(([1, 2], [3, 4]), got):
        for i in window:
            (_loss(ref, i) / gas).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(w, ref.parameters()))


def test_a_new_engine_over_a_model_whose_old_engine_stepped_in_backward_and_was_removed_builds():
    """Review 30Z2: the old engine's step in backward was left at STEPPED (remove_hooks before
    engine.step()), and the new initialize's read of param.grad went through that engine's guard, which
    refused it ("its gradient was used by the optimizer step taken in this backward"). remove_hooks is
    refused there now (the weights were stepped, the step not counted): after engine.step() it is
    accepted, and a new engine builds and trains."""
    model = _model()
    cfg = {"param_persistence_threshold": 0, "sub_group_size": 100, "reduce_bucket_size": 100,
           "offload_optimizer": {"device": "none", "step_in_backward": True}}
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    engine.backward(_loss(engine, 0))
    with pytest.raises(ZeroStateError, match=r"engine.remove_hooks\(\) between a backward that stepped the optimizer"):
        engine.remove_hooks()
    engine.step()
    engine.remove_hooks()
    with zero3.GatheredParameters(list(model.parameters())):
        ref = _model()
        ref.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    new = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    new.backward(_loss(new, 1))
    new.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _loss(ref, 1).backward()
    ref_opt.step()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(_weights(new), ref.parameters()))
