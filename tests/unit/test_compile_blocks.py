"""zero3.compile_blocks at world size 1: what it refuses, and a compiled GPT against the eager one."""

from __future__ import annotations

import pytest
import torch

import zero3
from zero3 import ZeroConfigError, ZeroStateError
from zero3.runtime.leaf import is_leaf

from gpt import GPT, Block, GPTConfig, synthetic_batch

CFG = GPTConfig(block_size=16)


def _gpt() -> GPT:
    torch.manual_seed(0)
    with zero3.Init():
        return GPT(CFG)


def _engine(model: GPT, optimizer: type = torch.optim.AdamW) -> zero3.Engine:
    return zero3.initialize(model, optimizer(model.parameters(), lr=1e-2), {"param_persistence_threshold": 0})


def _train(model: GPT, steps: int = 3, optimizer: type = torch.optim.AdamW) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine = _engine(model, optimizer)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(step, 4, CFG)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with zero3.GatheredParameters(list(model.parameters())):
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_marks_blocks_as_leaves_and_compiles_their_inner_forward():
    model = _gpt()
    blocks = zero3.compile_blocks(model, ["Block"], backend="eager")
    assert blocks == list(model.h)
    for b in blocks:
        assert is_leaf(b) and "forward" in b.__dict__  # the instance's forward; _call_impl stays eager
        assert b._compiled_call_impl is None


def test_refuses_after_initialize():
    model = _gpt()
    _engine(model)
    with pytest.raises(ZeroStateError, match="before zero3.initialize"):
        zero3.compile_blocks(model, [Block], backend="eager")


def test_refuses_a_block_compiled_twice():
    model = _gpt()
    zero3.compile_blocks(model, [Block], backend="eager")
    with pytest.raises(ZeroStateError, match="'h.0' is compiled already"):
        zero3.compile_blocks(model, ["h.0"], backend="eager")


def test_refuses_module_compile_and_a_compiled_model():
    model = _gpt()
    model.h[1].compile(backend="eager")
    with pytest.raises(ZeroConfigError, match=r"'h.1' was compiled with module.compile\(\)"):
        zero3.compile_blocks(model, [Block], backend="eager")
    model = _gpt()
    model.h[0].attn.compile(backend="eager")
    with pytest.raises(ZeroConfigError, match="'h.0.attn' inside block 'h.0'"):
        zero3.compile_blocks(model, [Block], backend="eager")
    with pytest.raises(ZeroConfigError, match="torch.compile\\(model\\) wrapper"):
        zero3.compile_blocks(torch.compile(_gpt(), backend="eager"), [Block], backend="eager")


@pytest.mark.parametrize("threshold", [0, 10**9])
def test_torch_compile_of_a_whole_managed_model_names_compile_blocks(threshold):
    """``torch.compile(model)`` of a model zero3 manages, refused by the pre-forward hooks before dynamo
    reads a partitioned parameter or compiles zero3's hooks. It used to fail with the generic 'used
    while partitioned', or inside dynamo ("'dict' object has no attribute 'node'")."""
    model = _gpt()
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                              {"param_persistence_threshold": threshold})
    x, y = synthetic_batch(0, 4, CFG)
    with pytest.raises(Exception, match=r"torch.compile of a model zero3 manages.*zero3.compile_blocks\(model, \[Block\]\)"):
        torch.compile(model, backend="eager")(x, y)
    torch._dynamo.reset()
    model.h[0].compile(backend="eager")  # one block's _call_impl, zero3's hooks included, after initialize
    with pytest.raises(Exception, match=r"torch.compile of a model zero3 manages.*compile_blocks"):
        engine(x, y)
    model.h[0]._compiled_call_impl = None  # torch's way back from module.compile()
    torch._dynamo.reset()
    loss = engine(x, y)  # uncompiled, it still trains
    engine.backward(loss)
    engine.step()
    if threshold == 0:
        with pytest.raises(ZeroStateError, match="is used by") as info:
            model.h[0].attn.c_attn.weight.sum()  # the same access outside dynamo: the general message
        assert "torch.compile" not in str(info.value)


@pytest.mark.parametrize("how", ["torch.compile(engine)", "a compiled function calling the engine"])
def test_torch_compile_of_the_engine_names_compile_blocks(how):
    """Dynamo traced the engine's forward and read a partitioned parameter before any module hook could
    refuse: the general 'used while partitioned' inside an InternalTorchDynamoError (probe 25A)."""
    model = _gpt()
    engine = _engine(model)
    x, y = synthetic_batch(0, 4, CFG)
    torch._dynamo.reset()
    compiled = torch.compile(engine if how == "torch.compile(engine)" else lambda a, b: engine(a, b), backend="eager")
    with pytest.raises(ZeroStateError, match=r"torch.compile of a model zero3 manages.*compile_blocks"):
        compiled(x, y)
    torch._dynamo.reset()
    loss = engine(x, y)  # uncompiled, it still trains
    engine.backward(loss)
    engine.step()


def test_refuses_nested_blocks_and_unknown_targets():
    model = _gpt()
    with pytest.raises(ZeroConfigError, match="'h.0.attn' lie inside block 'h.0'"):
        zero3.compile_blocks(model, [Block, "h.0.attn"], backend="eager")
    with pytest.raises(ZeroConfigError, match="'Decoder' matches no module"):
        zero3.compile_blocks(model, ["Decoder"], backend="eager")
    with pytest.raises(ZeroConfigError, match="a target must be a module class or a name"):
        zero3.compile_blocks(model, [3], backend="eager")
    assert not any(is_leaf(b) for b in model.h)  # a refusal changes nothing


def test_compiled_blocks_train_like_eager():
    eager = _train(_gpt())
    model = _gpt()
    zero3.compile_blocks(model, [Block], backend="aot_eager")
    compiled = _train(model)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_inductor_blocks_train_like_eager():
    """Inductor's generated C++ kernels (the first compile takes about a minute on a busy machine).

    With SGD: inductor sums in another order, and the attention's key bias has an exactly zero
    gradient (softmax ignores a shift per query), so its gradient is rounding noise, which Adam
    would turn into full-size steps of either sign."""
    eager = _train(_gpt(), steps=2, optimizer=torch.optim.SGD)
    model = _gpt()
    zero3.compile_blocks(model, [Block], backend="inductor")
    compiled = _train(model, steps=2, optimizer=torch.optim.SGD)
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-5)
