"""DeepSpeed's engine calls with DeepSpeed's arguments and results: backward's return and
``scale_wrt_gas``, ``step(lr_kwargs)``, ``zero_grad`` inside an accumulation window, and the arguments
of ``save_checkpoint``/``load_checkpoint`` (each was a TypeError, or a silently different result)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch import nn

import zero3
import zero3.deepspeed as deepspeed
from zero3 import ZeroConfigError, ZeroStateError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _engine(gas: int = 1, model: nn.Module | None = None, **cfg) -> zero3.Engine:
    model = _model() if model is None else model
    return zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            {"param_persistence_threshold": 0, "gradient_accumulation_steps": gas, **cfg})


def _batch(i: int) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(i))


def _weights(model: nn.Module) -> list[torch.Tensor]:
    with zero3.GatheredParameters(list(model.parameters())):
        return [p.detach().clone() for p in model.parameters()]


def test_backward_returns_the_loss_over_the_accumulation_steps_and_scale_wrt_gas_false_keeps_it():
    a, b = _engine(gas=4), _engine(gas=4)
    loss_a, loss_b = a(_batch(0)).pow(2).mean(), b(_batch(0)).pow(2).mean()
    assert torch.equal(a.backward(loss_a), loss_a / 4)
    assert b.backward(loss_b, scale_wrt_gas=False) is loss_b
    for p, q in zip(a.params, b.params):  # gradients 4x: not divided by the accumulation steps
        torch.testing.assert_close(zero3.safe_get_full_grad(q), 4 * zero3.safe_get_full_grad(p))


def test_step_passes_lr_kwargs_to_the_scheduler():
    class Scaled(torch.optim.lr_scheduler.LRScheduler):
        def get_lr(self):
            return [g["lr"] for g in self.optimizer.param_groups]

        def step(self, scale: float = 1.0):
            for g in self.optimizer.param_groups:
                g["lr"] *= scale

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0}, lr_scheduler=Scaled(opt))
    engine.backward(engine(_batch(0)).sum())
    before = _weights(model)
    with pytest.raises(ZeroConfigError, match=r"lr_kwargs=\{'increment': 1\}\): the lr scheduler's step\(\) does not"):
        engine.step(lr_kwargs={"increment": 1})  # refused before the optimizer steps
    assert engine.global_steps == 0 and all(torch.equal(a, b) for a, b in zip(_weights(model), before))
    engine.step(lr_kwargs={"scale": 0.5})
    assert engine.get_lr() == [0.05] and engine.global_steps == 1


def test_lr_kwargs_without_a_scheduler_are_said_and_the_step_goes_on(caplog, monkeypatch):
    """Megatron-DeepSpeed passes lr_kwargs at every step; DeepSpeed gives them to its scheduler only."""
    monkeypatch.setattr("zero3.config.sections._WARNED", set())
    engine = _engine()
    for _ in range(2):
        engine.backward(engine(_batch(0)).sum())
        with caplog.at_level(logging.WARNING, logger="zero3"):
            assert engine.step(lr_kwargs={"increment": 1})
    assert caplog.text.count("without an lr scheduler in the engine") == 1 and engine.global_steps == 2
    engine.backward(engine(_batch(0)).sum())
    with pytest.raises(ZeroConfigError, match="a dict of keywords"):
        engine.step(lr_kwargs=[1])


def test_zero_grad_before_every_micro_batch_keeps_the_window_as_deepspeed_does():
    engine = _engine(gas=2)
    plain = _model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for i in range(4):
        engine.zero_grad()  # DeepSpeed's loop habit: the window's gradients stay
        engine.backward(engine(_batch(i)).pow(2).mean())
        engine.step()
        (plain(_batch(i)).pow(2).mean() / 2).backward()
        if i % 2:
            opt.step()
            opt.zero_grad()
    for p, q in zip(_weights(engine.module), plain.parameters()):
        torch.testing.assert_close(p, q)


def test_zero_grad_drops_a_window_s_first_micro_batch_and_refuses_a_later_one():
    engine = _engine(gas=2)
    plain = _model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    engine.backward(engine(_batch(9)).pow(2).mean())  # a bad batch, skipped before its engine.step()
    engine.zero_grad()
    for i in range(2):
        engine.backward(engine(_batch(i)).pow(2).mean())
        if i == 1:
            with pytest.raises(ZeroStateError, match="after the backward of micro-batch 2 of 2"):
                engine.zero_grad()
        engine.step()
        (plain(_batch(i)).pow(2).mean() / 2).backward()
    opt.step()
    for p, q in zip(_weights(engine.module), plain.parameters()):
        torch.testing.assert_close(p, q)


def test_a_resumed_run_starts_a_full_window_under_its_own_accumulation_steps(tmp_path, caplog):
    engine = _engine(gas=2)
    for i in range(3):  # one window and the first micro-batch of the next
        engine.backward(engine(_batch(i)).sum())
        engine.step()
    with caplog.at_level(logging.WARNING, logger="zero3"):
        engine.save_checkpoint(tmp_path, tag="mid")
    assert "saved after 1 backward(s) of an open accumulation window" in caplog.text
    for gas, want in ((2, [False, True]), (4, [False, False, False, True]), (3, [False, False, True])):
        resumed = _engine(gas=gas)
        resumed.load_checkpoint(tmp_path, tag="mid")
        seen = []
        for i in range(gas):
            seen.append(resumed.is_gradient_accumulation_boundary())
            resumed.backward(resumed(_batch(i)).sum())
            resumed.step()
        assert seen == want, gas


def test_the_rng_states_are_restored_with_the_training_state_only(tmp_path):
    engine = _engine()
    engine.backward(engine(_batch(0)).sum())
    engine.step()
    torch.manual_seed(1)
    random.seed(1)
    engine.save_checkpoint(tmp_path)
    saved = (torch.rand(1).item(), random.random())
    torch.manual_seed(999)
    random.seed(999)
    mine = (torch.rand(1).item(), random.random())
    for kwargs, restored in (({}, True), ({"load_optimizer_states": False}, False), ({"load_module_only": True}, False)):
        resumed = _engine()
        torch.manual_seed(999)
        random.seed(999)
        resumed.load_checkpoint(tmp_path, **kwargs)
        assert (torch.rand(1).item(), random.random()) == (saved if restored else mine), kwargs


def test_load_checkpoint_takes_deepspeed_s_arguments(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0}, lr_scheduler=sched)
    for i in range(2):
        engine.backward(engine(_batch(i)).sum())
        engine.step()
    path = engine.save_checkpoint(tmp_path)
    weights = _weights(model)

    def fresh():
        m = _model()
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        return zero3.initialize(m, o, {"param_persistence_threshold": 0},
                                lr_scheduler=torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))

    e = fresh()
    assert e.load_checkpoint(tmp_path) == (path, {})  # no client_state saved: {}, as DeepSpeed returns it
    assert e.global_steps == 2 and e.get_lr() == [0.025] and e.lr_scheduler.last_epoch == 2
    e = fresh()
    e.load_checkpoint(tmp_path, load_lr_scheduler_states=False)  # the optimizer's groups (their lr) still load
    assert e.global_steps == 2 and e.get_lr() == [0.025] and e.lr_scheduler.last_epoch == 0
    e = fresh()
    e.load_checkpoint(tmp_path, load_module_only=True)
    assert e.global_steps == 0 and e.get_lr() == [0.1] and e.lr_scheduler.last_epoch == 0
    assert all(torch.equal(a, b) for a, b in zip(_weights(e.module), weights))
    before = _weights(e.module)
    for kwargs in ({"load_module_strict": False}, {"custom_load_fn": print}):
        with pytest.raises(ZeroConfigError, match="is not supported: zero3 loads every parameter by name"):
            e.load_checkpoint(tmp_path, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(_weights(e.module), before))


def test_save_checkpoint_takes_deepspeed_s_arguments(tmp_path):
    engine = _engine()
    engine.backward(engine(_batch(0)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path, tag="first")
    engine.save_checkpoint(tmp_path, tag="second", save_latest=False)
    assert (tmp_path / "latest").read_text() == "first" and (tmp_path / "second").is_dir()
    with pytest.raises(ZeroConfigError, match=r"exclude_frozen_parameters=True\) is not supported"):
        engine.save_checkpoint(tmp_path, tag="third", exclude_frozen_parameters=True)
    assert not (tmp_path / "third").exists()


def test_deepspeed_initialize_calls_an_optimizer_callable_over_the_module_s_parameters():
    got = []

    def make(params):
        got.append(list(params))
        decay = [p for p in got[0] if p.ndim > 1]  # DeepSpeed users group by shape
        return torch.optim.AdamW([{"params": decay}, {"params": [p for p in got[0] if p.ndim <= 1],
                                                      "weight_decay": 0.0}], lr=1e-2)

    model = _model()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=make,
                                                   config={"zero_optimization": {"stage": 3}})
    assert [id(p) for p in got[0]] == [id(p) for p in model.parameters()]
    assert [len(g["params"]) for g in engine.optimizer.param_groups] == [2, 2]


def test_zero_grad_after_a_backward_that_stepped_the_optimizer_inside_it_is_refused():
    engine = _engine(offload_optimizer="cpu", offload_optimizer_step_in_backward=True, sub_group_size=64)
    engine.backward(engine(_batch(0)).sum())
    with pytest.raises(ZeroStateError, match="the optimizer stepped inside that backward"):
        engine.zero_grad()
    engine.step()


def test_a_gradient_write_after_a_backward_that_stepped_the_optimizer_inside_it_is_refused():
    """The step in backward used the gradient and dropped it: p.grad = None afterwards changes nothing,
    so it is refused as the read is (it was accepted silently)."""
    engine = _engine(offload_optimizer="cpu", offload_optimizer_step_in_backward=True, sub_group_size=64)
    engine.backward(engine(_batch(0)).sum())
    weight = engine.module[0].weight
    with pytest.raises(ZeroStateError, match="after the optimizer step taken in this backward"):
        weight.grad = None
    engine.step()


def test_checkpoint_calls_take_deepspeed_s_positional_order(tmp_path):
    engine = _engine()
    engine.backward(engine(_batch(0)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path, "first", {"k": 1}, False, False)  # save_latest=False
    assert not (tmp_path / "latest").exists()
    path, client = engine.load_checkpoint(tmp_path, "first", True, False, False, True)  # load_module_only=True
    assert client == {"k": 1} and path.endswith("first")
    with pytest.raises(ZeroConfigError, match="load_module_strict=False"):
        engine.load_checkpoint(tmp_path, "first", False)
