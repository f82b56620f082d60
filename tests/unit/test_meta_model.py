"""A model built on the meta device has no values to partition: ``zero3.initialize`` and
``Init(module=)`` refuse it, naming ``zero3.Init`` on a real device and materialising first. Before,
``initialize`` partitioned meta shards without a word."""

from __future__ import annotations

import pytest
import torch

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(block_size=16, n_layer=2, n_embd=32, n_head=2)


def _meta() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(CFG)


def test_initialize_refuses_a_meta_model_before_partitioning_anything():
    model = _meta()
    with pytest.raises(zero3.ZeroStateError, match=r"wte.weight is on the meta device.*zero3.Init.*nothing was"):
        zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {})
    assert not any(zero3.is_partitioned(p) for p in model.parameters())
    model.to_empty(device="cpu")  # the way out named: materialise, initialise, then initialize
    torch.manual_seed(0)
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {})
    engine.backward(engine(*synthetic_batch(0, 2, CFG)))
    assert engine.step()


def test_init_module_refuses_meta_parameters_and_initialize_refuses_what_init_left_on_meta():
    model = _meta()
    with pytest.raises(zero3.ZeroStateError, match=r"wte.weight is on the meta device.*nothing was partitioned"):
        zero3.Init(module=model)
    assert not any(zero3.is_partitioned(p) for p in model.parameters())
    # Inside an Init block a meta parameter is partitioned as it comes (transformers' from_pretrained
    # builds on meta, then registers the loaded weights in its place); one still on meta is refused.
    with zero3.Init(), torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(zero3.ZeroStateError, match=r"0.weight is on the meta device.*nothing was partitioned"):
        zero3.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), {})


@pytest.mark.parametrize("how", ["set_default_device", "device_context", "entered_inside"])
def test_init_entered_under_a_meta_default_device_is_refused_before_anything_changes(how):
    """FSDP2's habit, the meta device around ``Init``: every module built inside would be meta.
    Before, Init took it at world size 1 and only ``initialize`` refused (at world size 2 the config
    agreement failed with an internal AssertionError: tests/multiproc/test_setup_and_agreement.py)."""
    linear_init = torch.nn.Linear.__init__
    match = r"zero3.Init was entered under the meta default device.*to_empty.*nothing was changed"
    with pytest.raises(zero3.ZeroStateError, match=match):
        if how == "set_default_device":
            torch.set_default_device("meta")
            try:
                with zero3.Init():
                    torch.nn.Linear(5, 7)
            finally:
                torch.set_default_device(None)
        elif how == "device_context":
            with torch.device("meta"), zero3.Init():
                torch.nn.Linear(5, 7)
        else:
            init = zero3.Init()  # made on a real device, entered under meta
            with torch.device("meta"), init:
                torch.nn.Linear(5, 7)
    assert torch.nn.Linear.__init__ is linear_init  # no patch of Init's left behind
    assert not zero3.is_partitioned(torch.nn.Linear(5, 7).weight)
    with torch.device("meta"), zero3.Init(enabled=False):  # a disabled Init is a plain build
        assert torch.nn.Linear(5, 7).weight.is_meta
