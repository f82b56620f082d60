"""Where a module's pre-backward hangs (runtime/outputs.py `prepare_output`): a pre-hook on the autograd
node of its outputs, one per node, or a tensor hook on an output that is a leaf. With parameters
released after forward (on demand, reuse 0), a pre-backward that fired late or never would leave
the backward computing with a released parameter, so training like plain torch is the check."""

from __future__ import annotations

import copy

import torch
from torch import nn

import zero3

from _reference import train_both

ON_DEMAND = {"param_persistence_threshold": 0, "prefetch_bucket_size": 0, "max_reuse_distance": 0}


class _Residual(nn.Module):
    """A ReLU in place on the Linear's output: the node the Linear's pre-backward hangs on is followed
    by an in-place one before any gradient reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.fc(h)
        self.act(y)
        return h + y


def test_outputs_changed_in_place_after_the_module_train_like_torch() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(_Residual(), _Residual(), nn.Linear(8, 1))
    model = copy.deepcopy(ref)
    batches = [torch.randn(4, 8) for _ in range(3)]
    train_both(ref, model, ON_DEMAND, batches, lambda m, x: m(x).square().mean())


class _Halves(nn.Module):
    """Returns the two halves of its product: two tensors of one multi-output node."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = (x @ self.weight).chunk(2, dim=-1)
        return a, b


class _UsesOneHalf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.halves = _Halves()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, _ = self.halves(x)
        return self.head(a)


def _pre_backwards(engine: zero3.Engine, step) -> list[str]:
    """The modules whose pre-backward fired during ``step()`` (one forward, backward and step)."""
    fired: list[str] = []
    pre_backward = engine.hooks._pre_backward

    def counting(call, grads):
        fired.append(call.record.name)
        return pre_backward(call, grads)

    engine.hooks._pre_backward = counting  # bound when each call's forward ends, so set before it
    try:
        step()
    finally:
        del engine.hooks._pre_backward
    return fired


def test_a_multi_output_node_opens_its_module_backward_once() -> None:
    torch.manual_seed(0)
    ref = _UsesOneHalf()
    model = copy.deepcopy(ref)
    batches = [torch.randn(4, 8) for _ in range(2)]
    engine = train_both(ref, model, ON_DEMAND, batches, lambda m, x: m(x).square().mean())
    x = torch.randn(4, 8)
    fired = _pre_backwards(engine, lambda: (model(x).square().mean().backward(), engine.step()))
    # two output tensors, one node (chunk's), one hook; and one on the product both view, which stays in
    # the graph when an in-place op on a view takes the view's node out (probe 37N): it finds the call open
    assert fired.count("halves") == 2


class _PassThrough(nn.Module):
    """Returns its input untouched when asked: an output that is a leaf (no autograd node)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        return x if skip else x * self.scale


def test_a_leaf_output_still_opens_its_module_backward() -> None:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = _PassThrough()
            self.fc = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.first(x, skip=True))

    ref = Net()
    model = copy.deepcopy(ref)
    batches = [torch.randn(4, 8).requires_grad_() for _ in range(2)]
    engine = train_both(ref, model, ON_DEMAND, batches, lambda m, x: m(x).square().mean())
    x = torch.randn(4, 8).requires_grad_()
    fired = _pre_backwards(engine, lambda: (model(x).square().mean().backward(), engine.step()))
    assert fired.count("first") == 1  # its output is its input, a leaf: a tensor hook opens its backward
    assert engine.coordinator.live_params == []
