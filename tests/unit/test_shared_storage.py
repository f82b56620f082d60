"""Tensors that share a parameter's memory are refused at ``initialize``, before it changes anything
(runtime/refusals.py `refuse_shared_storage`), and so is a ``channels_last`` parameter
(`refuse_memory_format`). Probe 29A: two parameters viewing one tensor trained apart (torch moves both
with either's step: 2.5e-2 off DDP after two steps), a tensor attribute kept as a view of a weight kept
its first values (built plainly) or failed inside torch ("setStorage ... storage of size 0", built
under Init), and a channels_last model came back contiguous from every gather without a word."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import zero3
from zero3 import ZeroConfigError
from zero3.runtime.refusals import _overlap


class _Views(nn.Module):
    def __init__(self, stop: int, start: int) -> None:
        super().__init__()
        base = torch.randn(10)
        self.lin = nn.Linear(6, 6)
        self.a = nn.Parameter(base[:stop])
        self.b = nn.Parameter(base[start:start + 6])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.a[:6].sum() + self.b


class _Attribute(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        if how == "view":
            self.rows = self.lin.weight[:2]
        elif how == "data":
            self.rows = self.lin.weight.data
        elif how == "buffer":
            self.register_buffer("rows", self.lin.weight.detach()[:2])
        else:
            self.rows = self.lin.weight.detach()[:2].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + (x @ self.rows[:2].t()).sum(-1, keepdim=True)


def _train(model: nn.Module, engine: bool, steps: int = 3) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if engine:
        eng = zero3.initialize(model, opt, {"param_persistence_threshold": 0})
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = model(torch.randn(4, 6)).pow(2).mean()
        losses.append(loss.item())
        if engine:
            eng.backward(loss)
            eng.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
    return losses


def test_overlapping_parameters_are_refused_and_side_by_side_ones_train_as_in_torch():
    torch.manual_seed(0)
    model = _Views(stop=6, start=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ZeroConfigError, match=r"parameters a and b share memory.*changed nothing"):
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not any(zero3.is_partitioned(p) for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    torch.manual_seed(0)
    ref = _Views(stop=4, start=4)
    torch.manual_seed(0)
    model = _Views(stop=4, start=4)  # a = base[:4], b = base[4:]: one tensor, no shared element
    assert _train(model, engine=True) == pytest.approx(_train(ref, engine=False), rel=1e-6)


@pytest.mark.parametrize("how", ["view", "data", "buffer"])
@pytest.mark.parametrize("under_init", [False, True])
def test_a_tensor_sharing_a_weights_memory_is_refused_by_name(how, under_init):
    torch.manual_seed(0)
    if under_init:
        with zero3.Init():
            model = _Attribute(how)
    else:
        model = _Attribute(how)
    kind = "buffer" if how == "buffer" else "tensor attribute"
    with pytest.raises(ZeroConfigError, match=rf"{kind} rows shares memory with parameter lin.weight"):
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if not under_init:
        assert not any(zero3.is_partitioned(p) for p in model.parameters())


class _OldNorms(nn.Module):
    """torch's old reparametrizations keep a plain tensor attribute a forward pre-hook recomputes:
    spectral_norm's is weight_orig's .data (shared memory, never read stale); review 29X: refused."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.utils.spectral_norm(nn.Linear(6, 6))
        self.b = torch.nn.utils.weight_norm(nn.Linear(6, 6))
        self.register_buffer("adjacency", torch.eye(6).to_sparse(), persistent=False)  # no storage at all
        self.graph = torch.eye(6).to_sparse()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.sparse.mm(self.graph, self.a(x).t()).t() + (self.adjacency @ x.t()).t())


def test_old_norm_attributes_and_sparse_tensors_are_taken_and_train_as_in_torch():
    torch.manual_seed(0)
    ref = _OldNorms()
    torch.manual_seed(0)
    model = _OldNorms()
    assert _train(model, engine=True) == pytest.approx(_train(ref, engine=False), rel=1e-5)


def test_a_cloned_attribute_trains_as_in_torch():
    torch.manual_seed(0)
    ref = _Attribute("clone")
    torch.manual_seed(0)
    model = _Attribute("clone")
    assert _train(model, engine=True) == pytest.approx(_train(ref, engine=False), rel=1e-6)


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.conv3 = nn.Conv3d(3, 2, (1, 2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(self.conv(x).unsqueeze(2))


@pytest.mark.parametrize("fmt, name", [(torch.channels_last, "conv.weight"), (torch.channels_last_3d, "conv3.weight")])
def test_a_channels_last_parameter_is_refused_and_channels_last_inputs_train_as_in_torch(fmt, name):
    torch.manual_seed(0)
    model = _Conv()
    getattr(model, name.split(".")[0]).to(memory_format=fmt)
    with pytest.raises(ZeroConfigError, match=rf"parameter {name} is in {fmt} layout.*Make it contiguous.*convert its "
                                              "inputs instead"):
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not any(zero3.is_partitioned(p) for p in model.parameters())
    torch.manual_seed(0)
    ref = _Conv()
    torch.manual_seed(0)
    model = _Conv()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(2, 2, 5, 5).to(memory_format=torch.channels_last)
        out = model(x)
        want = ref(x)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
        engine.backward(out.pow(2).mean())
        engine.step()
        want.pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()


@settings(max_examples=200, deadline=None)
@given(shape=st.sampled_from([(12,), (3, 4), (2, 3, 2)]), data=st.data())
def test_the_overlap_test_never_misses_a_shared_element_and_is_exact_for_contiguous_slices(shape, data):
    """Property: `_overlap` of two views of one tensor is true whenever they share an element (the
    brute-force answer over the base's element indexes), and false for contiguous slices that share none."""
    base = torch.arange(12.0).reshape(shape)
    index = torch.arange(12).reshape(shape)

    def view() -> tuple[torch.Tensor, set[int]]:
        dim = data.draw(st.integers(0, len(shape) - 1))
        n = shape[dim]
        start = data.draw(st.integers(0, n))
        stop = data.draw(st.integers(start, n))
        step = data.draw(st.integers(1, 3))
        sl = tuple(slice(None) if d != dim else slice(start, stop, step) for d in range(len(shape)))
        return base[sl], set(index[sl].reshape(-1).tolist())

    (a, ea), (b, eb) = view(), view()
    shares = bool(ea & eb)
    if shares:
        assert _overlap(a, b) and _overlap(b, a)
    elif a.is_contiguous() and b.is_contiguous():
        assert not _overlap(a, b)
    assert not _overlap(a, a.clone())


def test_a_parameter_left_on_memory_a_gathered_block_released_is_refused_by_name():
    """A Parameter made from a gathered one inside GatheredParameters views memory the block's end
    empties: initialize read it (SIGSEGV at 2 ranks, probe 37A). Refused, naming it."""
    with zero3.Init():
        model = nn.Sequential(nn.Linear(4, 4))
    with zero3.GatheredParameters([model[0].weight], modifier_rank=0):
        model.extra = nn.Parameter(model[0].weight.detach())
    assert model.extra.untyped_storage().nbytes() == 0
    with pytest.raises(ZeroConfigError, match=r"parameter extra \(4, 4\) views memory that was freed.*\.clone\(\)"):
        zero3.initialize(model, None)
    assert not zero3.is_zero_param(model.extra)
