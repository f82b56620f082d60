"""Which optimizers zero3 steps over flat shards (optim/steppable.py [Note: optimizers zero3 can
step]): torch.optim's element-wise ones; others only with DeepSpeed's
``zero_allow_untested_optimizer``; never one known to read the whole parameter.

Probe 28C trained these against torch on the full parameters, 20 steps: a hand-written LAMB was 5.05e-2
off (relative, weights) at world 2; transformers' Adafactor (lr 1e-2, no relative step or scaling) 1.1e-1
off at world 1, its second moment unfactored on a 1-D shard. zero3 accepted both, silently."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero3
from zero3 import ZeroConfigError
from zero3.config import ZeroConfig
from zero3.optim import steppable


class _Momentum(torch.optim.Optimizer):
    """A hand-written heavy-ball SGD: element by element, as zero3 needs, but not one of torch's."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                m.mul_(0.9).add_(p.grad)
                p.add_(m, alpha=-group["lr"])


def _stand_in(name: str) -> type:
    """An element-wise optimizer class under a name zero3 knows reads the whole parameter."""
    return type(name, (_Momentum,), {})


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(model: nn.Module, step) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(5):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        loss = (model(x) - y).pow(2).mean()
        losses.append(loss.item())
        step(loss)
    return losses


def test_an_untested_optimizer_is_refused_until_the_config_allows_it_and_then_trains_as_torch(caplog, monkeypatch):
    monkeypatch.setattr(steppable, "_warned", set())  # the warning is once per class and process
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ZeroConfigError, match=r"_Momentum \(test_optimizer_check\) is not one of torch.optim's "
                                              r"optimizers.*flat 1-D shard.*\"zero_allow_untested_optimizer\": true.*"
                                              r"zero3.initialize changed nothing"):
        zero3.initialize(model, _Momentum(model.parameters()), {"param_persistence_threshold": 0})
    assert not any(zero3.is_zero_param(p) for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    reference = _model()
    opt = _Momentum(reference.parameters())

    def torch_step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()

    expected = _train(reference, torch_step)
    for allow in (True, "yes", 1):  # DeepSpeed reads its booleans leniently
        with caplog.at_level(logging.WARNING, logger="zero3"):
            model = _model()
            engine = zero3.initialize(model, _Momentum(model.parameters()),
                                      {"param_persistence_threshold": 0, "zero_allow_untested_optimizer": allow})

        def zero3_step(loss):
            engine.backward(loss)
            engine.step()

        assert _train(engine, zero3_step) == pytest.approx(expected, rel=1e-6)
        with zero3.GatheredParameters(list(model.parameters())):
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        engine.remove_hooks()
    warned = [r for r in caplog.records if "untested optimizer _Momentum" in r.getMessage()]
    assert len(warned) == 1  # once per class


def test_a_factory_s_untested_optimizer_is_refused_too():
    model = _model()
    with pytest.raises(ZeroConfigError, match=r"_Momentum .* is not one of torch.optim's.*the factory was called"):
        zero3.initialize(model, lambda groups: _Momentum(groups), {"dtype": "bf16"})
    model = _model()
    engine = zero3.initialize(model, lambda groups: _Momentum(groups),
                              {"dtype": "bf16", "zero_allow_untested_optimizer": True})
    assert type(engine.optimizer) is _Momentum


@pytest.mark.parametrize("name, why", [  # real classes' names (review 28X found the first list missed most)
    ("Lamb", "scales each parameter's update by norms over the whole parameter"),
    ("LAMB8bit", "scales each parameter's update by norms"),
    ("OnebitLamb", "scales each parameter's update by norms"),
    ("LARS", "scales each parameter's update by norms"),
    ("NvNovoGrad", "scales each parameter's update by norms"),
    ("AdaLomo", "scales each parameter's update by norms"),
    ("StableAdamW", "divides its step by the update's RMS over the whole parameter"),
    ("Adam_mini", "shares one second moment per block"),
    ("SingleDeviceMuon", "transforms each gradient as a matrix"),
    ("Shampoo", "transforms each gradient as a matrix"),
    ("GaLoreAdamW", "transforms each gradient as a matrix"),
    ("APOLLOAdamW", "transforms each gradient as a matrix"),
    ("DAdaptAdam", "adapts its step size from sums over every parameter"),
    ("Prodigy", "adapts its step size from sums over every parameter"),
    ("AdafactorBigVision", "keeps its second moment factored"),
    ("CAME", "keeps its second moment factored"),
    ("SM3", "keeps its accumulators over the parameter's rows and columns"),
])
@pytest.mark.parametrize("allow", [False, True])
def test_an_optimizer_known_to_read_the_whole_parameter_is_refused_whatever_the_config_says(name, why, allow):
    cls = _stand_in(name)
    model = _model()
    with pytest.raises(ZeroConfigError, match=rf"{name} \(test_optimizer_check\) {why}.*flat 1-D shard.*"
                                              r"refused even with zero_allow_untested_optimizer"):
        zero3.initialize(model, cls(model.parameters()), {"zero_allow_untested_optimizer": allow})
    assert not any(zero3.is_zero_param(p) for p in model.parameters())
    sub = type("MyVariant", (cls,), {})  # by its base class's name too
    with pytest.raises(ZeroConfigError, match=rf"MyVariant \(test_optimizer_check\) is a {name}, which {why}"):
        zero3.initialize(model, sub(model.parameters()), {"zero_allow_untested_optimizer": allow})


def test_transformers_adafactor_is_refused():
    """What the Hugging Face Trainer builds for ``optim="adafactor"``."""
    Adafactor = pytest.importorskip("transformers.optimization").Adafactor
    model = _model()
    opt = Adafactor(model.parameters(), lr=1e-2, scale_parameter=False, relative_step=False)
    with pytest.raises(ZeroConfigError, match=r"Adafactor \(transformers.optimization\) keeps its second moment "
                                              r"factored.*an unfactored moment"):
        zero3.initialize(model, opt, {"zero_allow_untested_optimizer": True})


def test_sparse_adam_is_refused_at_initialize():
    """It was taken, and its first step raised torch's "does not support dense gradients" (review 28X)."""
    model = _model()
    with pytest.raises(ZeroConfigError, match=r"SparseAdam \(torch.optim.sparse_adam\) steps sparse gradients only"):
        zero3.initialize(model, torch.optim.SparseAdam(list(model.parameters())), {})
    assert not any(zero3.is_zero_param(p) for p in model.parameters())


def test_zero_allow_untested_optimizer_reads_booleans_leniently_and_strings_by_their_meaning():
    """DeepSpeed tests the raw value's truth, so its "false" allows; zero3 reads the words by their meaning."""
    assert ZeroConfig.from_dict({}).training.zero_allow_untested_optimizer is False
    for value, read in ((True, True), ("on", True), (1, True), (False, False), ("no", False), (0, False),
                        ("auto", False), (None, False)):
        config = ZeroConfig.from_dict({"zero_allow_untested_optimizer": value})
        assert config.training.zero_allow_untested_optimizer is read, value
    assert ZeroConfig.from_dict({"zero_allow_untested_optimizer": True}).get("zero_allow_untested_optimizer") is True
    with pytest.raises(ZeroConfigError, match=r"zero_allow_untested_optimizer must be a boolean as DeepSpeed reads "
                                              r"it \(true/false, 0/1, \"yes\"/\"no\"\), got 'maybe'"):
        ZeroConfig.from_dict({"zero_allow_untested_optimizer": "maybe"})
