"""memory_budget on 2 gloo ranks with the example GPT: the measured gathered peak stays under the
budget, and losses equal the run with the default knobs (gathers do not change values); what the
gradient reducer holds (its gauge: the storages of the queued gradients and of the reduction in flight,
comm/works.py `held_storages`) stays within the budget's account of it, on every reduction transport."""

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
    losses, peaks, reduce_peaks, joint, secondary, accounts, reductions = [], [], [], [], [], [], []
    for step in range(steps):
        budget = engine.coordinator.budget  # what the bucket this step runs with is counted as (chosen after step 1)
        accounts.append(None if budget is None else (budget.room, budget.reduce_bucket_bytes))
        x, y = synthetic_batch(step, PER_RANK * world, cfg)
        loss = engine(x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        m = engine.last_step_metrics
        persistent = engine.memory_report()["persistent_param_bytes"]
        peaks.append(m.peak_live_bytes + persistent)
        reduce_peaks.append(m.peak_reduce_held_bytes)
        joint.append(m.peak_gathered_and_reduce_bytes + persistent)
        secondary.append(m.peak_secondary_bytes)
        if budget is not None and budget.schedule is not None and step > 0:  # the prediction from recorded pieces
            reductions.append((m.reduce_calls, budget.schedule.reductions, engine.context.reducer.arrivals))
        assert m.reduce_held_bytes == 0  # nothing is held between steps
        engine.coordinator.check_valid()
    budget = engine.coordinator.budget
    return {"losses": losses, "peaks": peaks, "reduce_peaks": reduce_peaks, "joint": joint, "accounts": accounts,
            "reductions": reductions,
            "secondary": secondary, "model_bytes": engine.memory_report()["full_param_bytes"],
            "static": None if budget is None else (budget.static.budget, budget.reduce_bucket_bytes),
            "bucket": (engine.context.reducer.bucket_numel, engine.context.reducer.held_cap,
                       None if budget is None or budget.schedule is None else
                       (budget.schedule.reduce_bucket_size, budget.schedule.reduce_bucket_bytes)),
            "secondary_bytes": None if budget is None else budget.static.secondary_bytes,
            "explain": engine.explain("budget"), "divergences": engine.last_step_metrics.divergences}


def test_two_thirds_of_the_model_peak_under_budget_and_same_losses(pools):
    """Two thirds: half the model (71,424 bytes) is refused on 2 ranks, naming 87,528 bytes: the tied
    embedding's 32 KiB gathered beside its gradient reduced whole (32 KiB and a 16 KiB result)."""
    pool = pools.get(2)
    plain = pool.run(train, 3, {})
    budget = plain[0]["model_bytes"] * 2 // 3
    runs = pool.run(train, 3, {"memory_budget": budget})
    for r, p in zip(runs, plain):
        assert r["losses"] == p["losses"], (r["losses"], p["losses"])
        total, reduce_bytes = r["static"]
        assert total == budget
        for peak, reduce_peak, (room, account) in zip(r["peaks"], r["reduce_peaks"], r["accounts"]):
            assert peak <= budget - account, (r["peaks"], budget, r["accounts"])
            assert 0 < reduce_peak <= account, (r["reduce_peaks"], r["accounts"])
        assert max(r["joint"]) <= budget, (r["joint"], budget)
        assert any("chose max_live_bytes" in line for line in r["explain"]), r["explain"]
        assert any(line.startswith("budget: reduce bucket:") for line in r["explain"]), r["explain"]
        numel, cap, chosen = r["bucket"]
        assert (numel, cap) == chosen and cap == reduce_bytes  # the reducer runs the bucket chosen after step 1
        # each step after the choice issues the reductions predicted from the first step's recorded pieces
        assert r["reductions"] and all(calls == predicted and arrivals is None
                                       for calls, predicted, arrivals in r["reductions"]), r["reductions"]
        assert r["divergences"] == 0
    assert runs[0]["explain"] == runs[1]["explain"]  # both ranks chose the same knobs, weighed by the same waits


def test_auto_agrees_over_ranks(pools):
    runs = pools.get(2).run(train, 2, {"memory_budget": "auto"})
    assert runs[0]["static"] == runs[1]["static"]
    assert runs[0]["explain"] == runs[1]["explain"]


@pytest.mark.parametrize("transport", [{"reduce_scatter_impl": "reduce_scatter"}, {"reduce_scatter_impl": "all_reduce"},
                                       {"reduce_scatter_impl": "p2p"}, {"zero_quantized_gradients": True},
                                       {"dtype": "bf16"}])
def test_reducer_holds_what_the_budget_counts(pools, transport):
    """Each transport's account of a bucket (comm/reduce.py `hold_bytes`) against the storages the
    reducer held (a consistency check of a formula against a count of live storages, both zero3's), and
    the gathered and reduce peaks together, at one moment, within the budget."""
    pool = pools.get(2)
    budget = pool.run(train, 1, {})[0]["model_bytes"] * 2  # qgZ's quantization copies need more than the model
    runs = pool.run(train, 2, {"memory_budget": budget, **transport})
    for r in runs:
        for reduce_peak, (_, account) in zip(r["reduce_peaks"], r["accounts"]):
            assert 0 < reduce_peak <= account, (r["reduce_peaks"], r["accounts"])
        assert max(r["joint"]) <= budget, (r["joint"], budget)


def test_hpz_secondary_slices_within_the_budget(pools):
    """4 ranks, hpZ groups of 2: the secondary slices a training step keeps are counted outside the
    room (probe 39M: left out, 1.83x the budget); with them, every peak within the budget."""
    pool = pools.get(4)
    budget = pool.run(train, 1, {})[0]["model_bytes"] * 3 // 2
    runs = pool.run(train, 3, {"memory_budget": budget, "zero_hpz_partition_size": 2})
    plain = pool.run(train, 3, {})
    for r, p in zip(runs, plain):
        assert r["losses"] == p["losses"]
        assert 0 < max(r["secondary"]) <= r["secondary_bytes"], (r["secondary"], r["secondary_bytes"])
        assert max(r["joint"]) + max(r["secondary"]) <= budget



def _blocks_run(budget: int) -> list[tuple[int, int]]:
    """Linear + LayerNorm blocks: under a budget the LayerNorms are persistent, so a trace records no
    event for them, but their gradients reach the reducer between the Linears'."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))])
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), {"memory_budget": budget})
    out = []
    for step in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))[rank::world]
        engine.backward(engine(x).square().mean())
        engine.step()
        chosen = engine.coordinator.budget.schedule
        if step > 0:
            out.append((engine.last_step_metrics.reduce_calls, chosen.reductions))
    return out


@pytest.mark.parametrize("fraction", [0.6, 0.7, 0.9, 1.5])
def test_reductions_are_predicted_from_the_pieces_the_first_step_received(pools, fraction):
    """The bucket's reductions are predicted from the gradient pieces the reducer received in the first
    step, in their order (review 40R2: from the trace, the persistent LayerNorms' gradients were put last,
    and the predicted count and last reduction were wrong: at 0.7 of the model, 4 predicted, 6 issued)."""
    model_bytes = 6 * (64 * 64 + 64 + 2 * 64) * 4
    for r in pools.get(2).run(_blocks_run, int(model_bytes * fraction)):
        assert r and all(calls == predicted for calls, predicted in r), r
