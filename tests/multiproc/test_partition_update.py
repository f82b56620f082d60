"""DeepSpeed's ``param.all_gather()`` / ``param.partition(has_been_updated=True)`` with data of a new
shape (runtime/publish.py): before ``initialize`` the parameter is partitioned anew with it and trains
as the plain model with the same change; after ``initialize`` it is refused, and the parameter keeps its
shape and values. It used to fail inside the shard copy ("The size of tensor a (12) must match the size
of tensor b (16)"), leaving the parameter with data of one shape and shards of another."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3

pytestmark = pytest.mark.multiproc


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _grow_head(weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head gets a third output: the old rows, then a new one (the same on every rank)."""
    extra = torch.arange(6, dtype=torch.float32).unsqueeze(0) / 10
    return torch.cat([weight.detach(), extra]), torch.cat([bias.detach(), torch.tensor([0.5])])


def partition_with_new_shape() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    plain = _net()
    w, b = _grow_head(plain[2].weight, plain[2].bias)
    plain[2] = nn.Linear(6, 3)
    with torch.no_grad():
        plain[2].weight.copy_(w)
        plain[2].bias.copy_(b)
    torch.manual_seed(0)
    with zero3.Init():
        model = _net()
    head = model[2]
    head.weight.all_gather([head.bias])
    w, b = _grow_head(head.weight, head.bias)
    head.weight.data, head.bias.data = w, b
    head.weight.partition([head.bias], has_been_updated=True)
    shapes = (tuple(head.weight.ds_shape), tuple(head.bias.ds_shape))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * r)) for r in range(world)]
    engine.backward(engine(xs[rank]).pow(2).mean())
    engine.step()
    (sum(plain(x).pow(2).mean() for x in xs) / world).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    trained = max((zero3.safe_get_full_fp32_param(p) - q.detach()).abs().max().item()
                  for p, q in zip(model.parameters(), plain.parameters()))

    before = zero3.safe_get_full_fp32_param(head.weight).clone()
    head.weight.all_gather()
    head.weight.data = torch.ones(4, 6)
    refused = ""
    try:
        head.weight.partition(has_been_updated=True)
    except zero3.ZeroStateError as exc:
        refused = str(exc)
    kept = tuple(head.weight.ds_shape) == (3, 6) and torch.equal(before, zero3.safe_get_full_fp32_param(head.weight))
    engine.backward(engine(xs[rank]).pow(2).mean())  # and training goes on
    engine.step()
    (sum(plain(x).pow(2).mean() for x in xs) / world).backward()
    ref_opt.step()
    after = max((zero3.safe_get_full_fp32_param(p) - q.detach()).abs().max().item()
                for p, q in zip(model.parameters(), plain.parameters()))
    engine.remove_hooks()
    return {"shapes": shapes, "trained": trained, "refused": refused, "kept": kept, "after": after}


def test_partition_has_been_updated_with_a_new_shape(pools):
    for r in pools.get(2).run(partition_with_new_shape, timeout=60):
        assert r["shapes"] == ((3, 6), (3,))
        assert r["trained"] <= 1e-6
        assert "param.partition(has_been_updated=True): 2.weight was given data of shape (4, 6)" in r["refused"], r
        assert r["kept"]
        assert r["after"] <= 1e-6
