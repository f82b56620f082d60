"""memory_budget on 2 gloo ranks with the example GPT: the measured gathered peak stays under the
budget, and losses equal the run with the default knobs (gathers do not change values)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

PER_RANK = 2


def train(steps: int, zero_cfg: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6), zero_cfg)
    losses, peaks = [], []
    for step in range(steps):
        x, y = synthetic_batch(step, PER_RANK * world, cfg)
        loss = engine(x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        peaks.append(engine.last_step_metrics.peak_live_bytes + engine.memory_report()["persistent_param_bytes"])
        engine.coordinator.check_valid()
    budget = engine.coordinator.budget
    return {"losses": losses, "peaks": peaks, "model_bytes": engine.memory_report()["full_param_bytes"],
            "static": None if budget is None else (budget.static.budget, budget.static.reduce_bucket_bytes),
            "explain": engine.explain("budget"), "divergences": engine.last_step_metrics.divergences}


def test_half_the_model_peak_under_budget_and_same_losses(pools):
    pool = pools.get(2)
    plain = pool.run(train, 3, {})
    budget = plain[0]["model_bytes"] // 2
    runs = pool.run(train, 3, {"memory_budget": budget})
    for r, p in zip(runs, plain):
        assert r["losses"] == p["losses"], (r["losses"], p["losses"])
        total, reduce_bytes = r["static"]
        assert total == budget
        assert max(r["peaks"]) <= budget - reduce_bytes, (r["peaks"], budget, reduce_bytes)
        assert any("chose max_live_bytes" in line for line in r["explain"]), r["explain"]
        assert r["divergences"] == 0
    assert runs[0]["explain"] == runs[1]["explain"]  # both ranks chose the same knobs


def test_auto_agrees_over_ranks(pools):
    runs = pools.get(2).run(train, 2, {"memory_budget": "auto"})
    assert runs[0]["static"] == runs[1]["static"]
    assert runs[0]["explain"] == runs[1]["explain"]
