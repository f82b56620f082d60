"""Property: whichever way a module's post-backward comes (its own gradients or the wrapper on its
inputs, hooks.py [Note: post-backward from the gradients]), a model trains exactly like plain torch
and nothing stays gathered after a step. Random models mix what decides the way: layers called
more than once, tied weights, frozen biases, a weight the root reads outside its layer's forward
(an automatic external parameter), and a layer whose output the loss never uses."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import zero3
from zero3 import ParamStatus

WIDTH = 4


@dataclass(frozen=True)
class Spec:
    n: int  # Linear layers
    order: tuple[int, ...]  # the layers the forward runs, in order (repeats allowed)
    ties: tuple[tuple[int, int], ...]  # (a, b): layer b's weight is layer a's
    frozen: tuple[int, ...]  # layers whose bias is frozen
    peek: int | None  # a layer whose weight the root reads directly
    dead: int | None  # a layer run on the input whose output the loss ignores


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    n = draw(st.integers(1, 4))
    layer = st.integers(0, n - 1)
    order = tuple(draw(st.lists(layer, min_size=1, max_size=5)))
    ties = tuple((a, b) for a, b in draw(st.lists(st.tuples(layer, layer), max_size=2)) if a < b)
    frozen = tuple(draw(st.lists(layer, max_size=2, unique=True)))
    return Spec(n, order, ties, frozen, draw(st.none() | layer), draw(st.none() | layer))


class Net(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(spec.n)])
        for a, b in spec.ties:
            self.layers[b].weight = self.layers[a].weight
        for i in spec.frozen:
            self.layers[i].bias.requires_grad_(False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = first = torch.tanh(self.layers[self.spec.order[0]](x))
        for i in self.spec.order[1:]:
            h = torch.tanh(self.layers[i](h))
        if self.spec.peek is not None:  # its backward needs the weight itself: the input needs a gradient
            h = h + F.linear(first, self.layers[self.spec.peek].weight)
        if self.spec.dead is not None:
            self.layers[self.spec.dead](x)
        return (h * self.scale).pow(2).mean()


CONFIGS = [
    {"param_persistence_threshold": 0},
    {"param_persistence_threshold": 0, "prefetch_bucket_size": 0, "max_reuse_distance": 0},
    {"param_persistence_threshold": 0, "prefetch_bucket_size": 20, "max_reuse_distance": 0, "max_live_parameters": 40},
]


@settings(max_examples=40, deadline=None)
@given(spec=specs(), config=st.sampled_from(CONFIGS), seed=st.integers(0, 3))
def test_any_mix_of_post_backward_ways_trains_like_plain_torch(spec: Spec, config: dict, seed: int) -> None:
    torch.manual_seed(seed)
    ref = Net(spec)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                              config)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x = torch.randn(3, WIDTH, generator=g)
        ref_loss = ref(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        loss = model(x)
        loss.backward()
        engine.step()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-6, atol=1e-7)
        assert engine.coordinator.live_params == []
        assert all(p.ds_status is ParamStatus.NOT_AVAILABLE for p in model.parameters())
    with zero3.GatheredParameters(list(model.parameters())):
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7, msg=name)
