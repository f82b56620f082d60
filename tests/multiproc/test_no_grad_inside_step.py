"""A forward under ``torch.no_grad()`` between a training forward and its backward (a metric on
held-out rows, a reference output from the same weights) joins that step ([Note: a no_grad forward
inside a step] in runtime/hooks.py): it used to end the step as an inference forward, so the
backward gathered every module again and the trace the schedule (and memory_budget) is planned from
held the backward alone. 2 gloo ranks, against plain torch on the whole batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3
from zero3.planning.trace import EventKind

from _reference import twins

pytestmark = pytest.mark.multiproc


def _deep() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)], nn.Linear(16, 1))


def steps_with_an_eval_inside(cfg: dict, eval_inside: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_deep)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    g = torch.Generator().manual_seed(0)
    calls, eval_diff = [], 0.0
    mine = slice(2 * rank, 2 * rank + 2)
    for _ in range(4):
        x, held_out = torch.randn(2 * world, 16, generator=g), torch.randn(2 * world, 16, generator=g)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        loss = engine(x[mine]).square().mean()
        if eval_inside:
            with torch.no_grad():
                eval_diff = max(eval_diff, (model(held_out[mine]) - ref(held_out[mine])).abs().max().item())
        engine.backward(loss)
        ref_opt.step()
        engine.step()
        calls.append(engine.last_step_metrics.allgather_calls)
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    trace = engine.coordinator.last_trace
    kinds = [e.kind for e in trace.events]
    planned_from = [line for line in engine.explain("budget") if "plans of trace" in line]
    return {"diff": diff, "eval_diff": eval_diff, "calls": calls[1:], "key": trace.key,
            "forwards": kinds.count(EventKind.PRE_FORWARD), "backwards": kinds.count(EventKind.PRE_BACKWARD),
            "planned_from": planned_from}


@pytest.mark.parametrize("cfg", [{"param_persistence_threshold": 0},
                                 {"param_persistence_threshold": 0, "max_live_parameters": 600,
                                  "max_reuse_distance": 300, "prefetch_bucket_size": 300}],
                         ids=["defaults", "lean"])
def test_a_no_grad_forward_between_forward_and_backward_joins_the_step(pools, cfg):
    plain, inside = (pools.get(2).run(steps_with_an_eval_inside, cfg, e) for e in (False, True))
    for p, r in zip(plain, inside):
        assert r["diff"] < 1e-6 and r["eval_diff"] < 1e-6, r  # trained as torch, evaluated on its weights
        assert r["key"] == p["key"] and r["key"].startswith("pre_forward") and r["key"].endswith(":grad"), r
        assert r["forwards"] == 2 * p["forwards"] > 0 and r["backwards"] == p["backwards"] > 0, (p, r)
        if "max_live_parameters" not in cfg:  # the forward's weights stay for the backward: the eval and
            assert r["calls"] == p["calls"], (p, r)  # the backward gather nothing (they gathered it all again)


def test_memory_budget_plans_from_the_whole_step_with_an_eval_inside(pools):
    budget = 3 * sum(p.numel() * 4 for p in _deep().parameters()) // 2
    for r in pools.get(2).run(steps_with_an_eval_inside, {"memory_budget": budget}, True):
        assert r["diff"] < 1e-6 and r["eval_diff"] < 1e-6, r
        assert len(r["planned_from"]) == 1 and f"trace '{r['key']}'" in r["planned_from"][0], r
        assert r["key"].startswith("pre_forward") and r["key"].endswith(":grad"), r  # not the backward alone
