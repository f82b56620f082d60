"""Property: whatever structure a module returns (tuples, lists, dicts, dataclasses, an object of the
user's own class, nested to any depth) and whatever its leaves are (products, the module's own
parameter, views of it, its ``.detach()`` and ``.data``, plain values), a model whose parameters are released after every forward
trains exactly like plain torch, nothing stays gathered after a step, and the structure comes back
as the module built it (runtime/outputs.py [Note: module outputs])."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from _reference import train_both

ON_DEMAND = {"param_persistence_threshold": 0, "prefetch_bucket_size": 0, "max_reuse_distance": 0}
LEAVES = ("product", "whole", "row", "transposed", "bias", "detached", "data", "int", "none")
NO_GRAD = ("detached", "data", "int", "none")


@dataclasses.dataclass
class Pair:
    first: Any
    second: Any


class Box:
    """A class of the user's: nothing can look into it."""

    def __init__(self, value: Any) -> None:
        self.value = value


def outputs() -> st.SearchStrategy:
    leaves = st.sampled_from(LEAVES)
    return st.recursive(leaves, lambda kids: st.one_of(
        st.tuples(st.just("tuple"), st.lists(kids, min_size=1, max_size=3)),
        st.tuples(st.just("list"), st.lists(kids, min_size=1, max_size=3)),
        st.tuples(st.just("dict"), st.lists(kids, min_size=1, max_size=3)),
        st.tuples(st.just("pair"), st.tuples(kids, kids)),
        st.tuples(st.just("box"), st.tuples(kids)),
    ), max_leaves=6).filter(_has_gradient)


def _has_gradient(spec: Any) -> bool:
    """Whether the loss over ``spec`` has a gradient."""
    return spec not in NO_GRAD if isinstance(spec, str) else any(_has_gradient(k) for k in spec[1])


class Returns(nn.Module):
    def __init__(self, spec: Any) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.randn(6, 6) / 6)
        self.bias = nn.Parameter(torch.randn(6) / 6)

    def forward(self, h: torch.Tensor) -> Any:
        return self._build(self.spec, h)

    def _build(self, spec: Any, h: torch.Tensor) -> Any:
        if isinstance(spec, str):
            return {"product": lambda: h @ self.weight + self.bias, "whole": lambda: self.weight,
                    "row": lambda: self.weight[1], "transposed": lambda: self.weight.t(),
                    "bias": lambda: self.bias, "detached": lambda: self.weight.detach(),
                    "data": lambda: self.weight.data, "int": lambda: 3, "none": lambda: None}[spec]()
        kind, kids = spec
        built = [self._build(k, h) for k in kids]
        if kind == "tuple":
            return tuple(built)
        if kind == "list":
            return built
        if kind == "dict":
            return {f"k{i}": b for i, b in enumerate(built)}
        if kind == "pair":
            return Pair(*built)
        return Box(built[0])


class Model(nn.Module):
    def __init__(self, spec: Any) -> None:
        super().__init__()
        self.pre = nn.Linear(6, 6)
        self.returns = Returns(spec)

    def forward(self, x: torch.Tensor) -> Any:
        return self.returns(torch.tanh(self.pre(x)))


def _loss(spec: Any, out: Any) -> torch.Tensor:
    """Every tensor leaf's mean square, each with its own weight; the structure must be the spec's."""
    total = torch.zeros(())
    todo = [(spec, out)]
    i = 0
    while todo:
        s, o = todo.pop()
        i += 1
        if isinstance(s, str):
            if s in ("int", "none"):
                assert o == (3 if s == "int" else None)
            else:
                assert isinstance(o, torch.Tensor), (s, type(o))
                total = total + i * o.square().mean()
            continue
        kind, kids = s
        if kind in ("tuple", "list"):
            assert type(o) is (tuple if kind == "tuple" else list) and len(o) == len(kids)
            todo.extend(zip(kids, o))
        elif kind == "dict":
            assert type(o) is dict and len(o) == len(kids)
            todo.extend(zip(kids, (o[f"k{j}"] for j in range(len(kids)))))
        elif kind == "pair":
            assert type(o) is Pair
            todo.extend(zip(kids, (o.first, o.second)))
        else:
            assert type(o) is Box
            todo.append((kids[0], o.value))
    return total


@settings(max_examples=30, deadline=None)
@given(spec=outputs(), seed=st.integers(0, 2**16))
def test_any_output_structure_trains_like_torch(spec: Any, seed: int) -> None:
    torch.manual_seed(seed)
    ref = Model(spec)
    model = copy.deepcopy(ref)
    batches = [torch.randn(4, 6) for _ in range(3)]
    train_both(ref, model, ON_DEMAND, batches, lambda m, x: _loss(spec, m(x)))
