"""``model.to(...)``, ``.half()`` and torch's other module conversions on a partitioned model: what
changes nothing works (buffers and plain parameters converted as torch converts them), what would
change a zero3 parameter is refused before anything changes (partition/conversion.py
[Note: module conversions])."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import zero3
from zero3 import ZeroStateError

from _reference import twins


class Net(nn.Module):
    """Linear, LayerNorm and a conv (a 4-D weight), a float64 buffer and an integer one."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.fc = nn.Linear(3 * 4 * 4, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 2)
        self.register_buffer("scale", torch.full((8,), 0.5, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x)).flatten(1)
        h = self.norm(self.fc(h)) * self.scale.to(x.dtype)
        return self.out(h)


THRESHOLDS = {"partitioned": 0, "mixed": 100, "persistent": 10**6}  # mixed: biases and norm persistent

NO_CHANGE: dict[str, Callable[[nn.Module], object]] = {
    "to(cpu)": lambda m: m.to("cpu"),
    "to(device=cpu)": lambda m: m.to(device=torch.device("cpu")),
    "cpu()": lambda m: m.cpu(),
    "to(float32)": lambda m: m.to(torch.float32),
    "float()": lambda m: m.float(),
    "type(float32)": lambda m: m.type(torch.float32),
    "to(cpu, float32)": lambda m: m.to("cpu", torch.float32),
}

CHANGE: dict[str, tuple[Callable[[nn.Module], object], str]] = {
    "half()": (lambda m: m.half(), "dtype torch.float32 to torch.float16"),
    "bfloat16()": (lambda m: m.bfloat16(), "dtype torch.float32 to torch.bfloat16"),
    "double()": (lambda m: m.double(), "dtype torch.float32 to torch.float64"),
    "to(float16)": (lambda m: m.to(torch.float16), "dtype torch.float32 to torch.float16"),
    "to(meta)": (lambda m: m.to("meta"), "device cpu to meta"),
    "to(channels_last)": (lambda m: m.to(memory_format=torch.channels_last), "layout"),
}


def batches(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 2, 6, 6, generator=g) for _ in range(n)]


def engine_and_ref(threshold: int, config: dict | None = None):
    ref, model = twins(Net)
    cfg = {"param_persistence_threshold": threshold, **(config or {})}
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    return engine, model, ref, ref_opt


def train_and_compare(engine, model, ref, ref_opt, convert: Callable[[nn.Module], object] | None) -> None:
    """Three steps of both; ``convert`` applied to both models before each forward and between each
    backward and step. Losses and final weights must match the plain model's."""
    for x in batches():
        if convert is not None:
            convert(model)
            convert(ref)
        loss, ref_loss = model(x).square().mean(), ref(x).square().mean()
        loss.backward()
        ref_loss.backward()
        if convert is not None:
            convert(model)
            convert(ref)
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-6, atol=1e-7)
    with zero3.GatheredParameters(list(model.parameters())):
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7, msg=name)


def dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    out = {f"param {n}": p.dtype for n, p in model.named_parameters()}
    out.update({f"shard {n}": p.ds_tensor.dtype for n, p in model.named_parameters()})
    out.update({f"buffer {n}": b.dtype for n, b in model.named_buffers()})
    return out


@pytest.mark.parametrize("layout", list(THRESHOLDS))
@pytest.mark.parametrize("name", list(NO_CHANGE))
def test_a_conversion_that_changes_no_parameter_trains_as_torch(layout, name):
    engine, model, ref, ref_opt = engine_and_ref(THRESHOLDS[layout])
    train_and_compare(engine, model, ref, ref_opt, NO_CHANGE[name])
    # Buffers are converted as torch converts them (float() made the float64 buffer float32).
    assert {n: b.dtype for n, b in model.named_buffers()} == {n: b.dtype for n, b in ref.named_buffers()}
    assert engine.coordinator.live_params == []


@pytest.mark.parametrize("layout", list(THRESHOLDS))
@pytest.mark.parametrize("name", list(CHANGE))
def test_a_conversion_that_changes_a_parameter_is_refused_and_changes_nothing(layout, name):
    engine, model, ref, ref_opt = engine_and_ref(THRESHOLDS[layout])
    convert, what = CHANGE[name]
    before = dtypes(model)
    with pytest.raises(ZeroStateError, match="Nothing was converted") as info:
        convert(model)
    message = str(info.value)
    assert what in message and "Net." in message
    assert "zero3.Init" in message
    assert dtypes(model) == before  # persistent parameters and buffers included
    assert engine.coordinator.live_params == []
    train_and_compare(engine, model, ref, ref_opt, None)


def test_a_dtype_refusal_names_the_mixed_precision_config():
    engine, model, *_ = engine_and_ref(0)
    with pytest.raises(ZeroStateError, match=r'Net.half\(\) would change conv.weight .*"bf16"'):
        model.half()


def test_under_bf16_the_bf16_conversion_is_a_no_op_and_float_is_refused():
    engine, model, _, _ = engine_and_ref(100, {"bf16": {"enabled": True}})
    before = dtypes(model)
    model.bfloat16()
    model.to("cpu", torch.bfloat16)
    after = dtypes(model)
    assert before["param conv.weight"] == torch.bfloat16 and before["buffer scale"] == torch.float64
    assert after == {**before, "buffer scale": torch.bfloat16}  # the buffer converted, as torch does
    with pytest.raises(ZeroStateError, match="dtype torch.bfloat16 to torch.float32"):
        model.float()
    x = batches(1)[0].bfloat16()
    engine.backward(model(x).float().square().mean())
    engine.step()


def test_a_submodule_conversion_checks_only_that_submodule():
    engine, model, *_ = engine_and_ref(0)
    model.out.to("cpu")
    with pytest.raises(ZeroStateError, match=r"Linear.half\(\) would change out.weight"):
        model.out.half()


def test_torch_future_flags_that_replace_parameters_are_refused():
    engine, model, ref, ref_opt = engine_and_ref(0)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(ZeroStateError, match="set_swap_module_params_on_conversion"):
            model.to("cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    ref.to("cpu")
    train_and_compare(engine, model, ref, ref_opt, None)


def test_a_no_op_conversion_under_init_leaves_nothing_gathered_and_a_dtype_change_repartitions():
    """Under Init, ``to(cpu)`` used to gather every parameter and keep it gathered; a later ``float()``
    then converted the gathered copy while the shards stayed fp16."""
    with zero3.Init():
        model = Net()
        model.half()
        model.to("cpu")
        assert all(zero3.is_partitioned(p) and type(p).__name__ == "PartitionedParameter" for p in model.parameters())
        model.float()
    for p in model.parameters():
        assert p.dtype == p.ds_tensor.dtype == torch.float32
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    assert engine(batches(1)[0]).dtype == torch.float32


def test_a_layout_change_under_init_is_refused_and_changes_nothing():
    """Under Init, ``to(memory_format=channels_last)`` was accepted and re-partitioned the converted
    weight into flat shards: every gather then handed back the contiguous layout."""
    torch.manual_seed(0)
    ref = Net()
    torch.manual_seed(0)
    with zero3.Init():
        model = Net()
        with pytest.raises(ZeroStateError, match=r"Net.to\(\) would change conv.weight .*layout strides.*Nothing was converted"):
            model.to(memory_format=torch.channels_last)
        model.to(torch.float32)  # a conversion that changes nothing still works under Init
    assert all(zero3.is_partitioned(p) for p in model.parameters())
    with zero3.GatheredParameters(list(model.parameters())):
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), r.detach(), msg=name)


def test_a_plain_model_is_converted_as_torch_converts_it():
    zero3.initialize(Net(), None, {})  # installs the wrapper (once zero3 has partitioned something)
    plain = Net()
    plain.half()
    assert all(p.dtype == torch.float16 for p in plain.parameters())
    assert plain.scale.dtype == torch.float16 and plain.count.dtype == torch.int64


CONVERSIONS = {**{k: v for k, v in NO_CHANGE.items()}, **{k: v[0] for k, v in CHANGE.items()}}


@settings(max_examples=25, deadline=None)
@given(layout=st.sampled_from(sorted(THRESHOLDS)), names=st.lists(st.sampled_from(sorted(CONVERSIONS)), max_size=4))
def test_refused_exactly_when_torch_would_change_a_parameter(layout, names):
    """Invariant: a conversion of a partitioned model is refused if and only if it changes a parameter
    (dtype, device or strides) of the same model built plainly, and a refused one changes nothing."""
    ref, model = twins(Net)
    zero3.initialize(model, None, {"param_persistence_threshold": THRESHOLDS[layout]})
    for name in names:
        plain = Net()
        before = [(p.dtype, p.device, p.stride()) for p in plain.parameters()]
        CONVERSIONS[name](plain)
        changes = before != [(p.dtype, p.device, p.stride()) for p in plain.parameters()]
        state = dtypes(model)
        if changes:
            with pytest.raises(ZeroStateError, match="Nothing was converted"):
                CONVERSIONS[name](model)
            assert dtypes(model) == state
        else:
            CONVERSIONS[name](model)
    with zero3.GatheredParameters(list(model.parameters())):
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.detach(), r.detach())
