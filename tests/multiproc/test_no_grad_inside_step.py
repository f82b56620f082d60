"""A forward under ``torch.no_grad()`` between a training forward and its backward (a metric on
held-out rows, a reference output from the same weights): it ends the step as an inference step
(step.py), and the backward gathers what it needs again. Trained and evaluated as plain torch on the
whole batch, on 2 gloo ranks, at the default reuse, a lean live cap and under memory_budget. (Round 41
tried joining it to the step instead and reverted that: the ranks must agree on the join, and the
budget's first-step search must not run over the joined forwards; review 41R1.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3

from _reference import twins

pytestmark = pytest.mark.multiproc


def _deep() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)], nn.Linear(16, 1))


def steps_with_an_eval_inside(cfg: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_deep)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    g = torch.Generator().manual_seed(0)
    eval_diff, mine = 0.0, slice(2 * rank, 2 * rank + 2)
    for _ in range(4):
        x, held_out = torch.randn(2 * world, 16, generator=g), torch.randn(2 * world, 16, generator=g)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        loss = engine(x[mine]).square().mean()
        with torch.no_grad():
            eval_diff = max(eval_diff, (model(held_out[mine]) - ref(held_out[mine])).abs().max().item())
        engine.backward(loss)
        ref_opt.step()
        engine.step()
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "eval_diff": eval_diff, "steps": engine.global_steps}


_BUDGET = 3 * sum(p.numel() * 4 for p in _deep().parameters()) // 2


@pytest.mark.parametrize("cfg", [{"param_persistence_threshold": 0},
                                 {"param_persistence_threshold": 0, "max_live_parameters": 600,
                                  "max_reuse_distance": 300, "prefetch_bucket_size": 300},
                                 {"memory_budget": _BUDGET}],
                         ids=["defaults", "lean", "memory_budget"])
def test_a_no_grad_forward_between_forward_and_backward_trains_and_evaluates_as_torch(pools, cfg):
    for r in pools.get(2).run(steps_with_an_eval_inside, cfg):
        assert r["diff"] < 1e-6 and r["eval_diff"] < 1e-6 and r["steps"] == 4, r
