"""Observability is a tested surface: the DEBUG event log and the divergence warning."""

from __future__ import annotations

import logging

import torch
from torch import nn

import zero3


def _two_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"param_persistence_threshold": 0})
    return model, engine


def test_debug_log_shows_each_fetch_and_release_event_in_order(caplog):
    model, engine = _two_layers()
    with caplog.at_level(logging.DEBUG, logger="zero3"):
        model(torch.randn(3, 4)).sum().backward()
        engine.step()
    events = [r.getMessage().split(" params=")[0] for r in caplog.records
              if r.getMessage().startswith("zero3::trace")]
    assert events == [
        "zero3::trace pre_forward (0)", "zero3::trace post_forward (0)",
        "zero3::trace pre_forward (1)", "zero3::trace post_forward (1)",
        "zero3::trace pre_backward (1)", "zero3::trace post_backward (1)",
        "zero3::trace pre_backward (0)",
        # its input needs no grad, but its own gradients close it (hooks.py [Note: post-backward from the gradients])
        "zero3::trace post_backward (0)",
    ]
    steps = [r for r in caplog.records if r.getMessage().startswith("zero3::step")]
    assert len(steps) == 1 and "'allgather_calls': 4" in steps[0].getMessage()


def test_a_divergence_is_logged_once_with_the_expected_and_actual_module(caplog):
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = model

        def forward(self, x, skip):
            for i, layer in enumerate(self.layers):
                if not (skip and i == 1):
                    x = layer(x)
            return x.sum()

    net = Net()
    engine = zero3.initialize(net, None, {"param_persistence_threshold": 0})
    with caplog.at_level(logging.WARNING, logger="zero3"):
        for skip in (False, True, True):
            net(torch.randn(2, 4), skip).backward()
            engine.step()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # the second skipping step follows its own cached trace
    assert "expected pre_forward 'layers.1', got pre_forward 'layers.2'" in warnings[0]


def test_settings_that_act_through_an_optimizer_are_named_by_an_engine_without_one(caplog, tmp_path):
    """Probe 34G: offload_optimizer, clipping and an fp16 loss scale were taken silently by an engine
    without an optimizer (a 'scheduler' section is refused there); they do nothing in it, and it says so."""
    config = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "gradient_clipping": 1.0,
              "fp16": {"enabled": True, "loss_scale": 128}}
    with caplog.at_level(logging.INFO, logger="zero3"):
        zero3.initialize(nn.Linear(4, 4), None, config)
    said = [r.getMessage() for r in caplog.records if "without an optimizer" in r.getMessage()]
    assert said == ["zero3.initialize without an optimizer: offload_optimizer='cpu', gradient_clipping=1.0, fp16 "
                    "loss_scale=128.0 act through the optimizer and do nothing in this engine, whose step() steps none"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zero3"):
        zero3.initialize(nn.Linear(4, 4), None, {"fp16": {"enabled": True}})  # an fp16 inference engine: nothing idle
        model = nn.Linear(4, 4)
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    assert not [r for r in caplog.records if "without an optimizer" in r.getMessage()]
