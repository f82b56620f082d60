"""A forward under ``torch.no_grad()`` between a training forward and its backward (a metric on
held-out rows, a reference output from the same weights): the first joins the step ([Note: a no_grad
forward inside a step] in runtime/hooks.py), a second ends it. Trained and evaluated as plain torch
on the whole batch, on 2 gloo ranks, at the default reuse, a lean live cap and under memory_budget;
and the cases review 41R1 raised against round 41's first try (ranks deciding apart, a step that
grows with an evaluation loop, memory_budget's first choice searched over every joined forward)."""

from __future__ import annotations

import gc

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


_BUDGET = 3 * sum(p.numel() * 4 for p in _deep().parameters()) // 2
_CONFIGS = [{"param_persistence_threshold": 0},
            {"param_persistence_threshold": 0, "max_live_parameters": 600,
             "max_reuse_distance": 300, "prefetch_bucket_size": 300},
            {"memory_budget": _BUDGET}]
_IDS = ["defaults", "lean", "memory_budget"]


def steps_with_evals_inside(cfg: dict, evals: int) -> dict:
    """4 steps, each with ``evals`` no_grad forwards between the forward and its backward, against torch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_deep)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    g = torch.Generator().manual_seed(0)
    eval_diff, mine, calls, phases = 0.0, slice(2 * rank, 2 * rank + 2), [], []
    for _ in range(4):
        x, held_out = torch.randn(2 * world, 16, generator=g), torch.randn(2 * world, 16, generator=g)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        loss = engine(x[mine]).square().mean()
        for _ in range(evals):
            with torch.no_grad():
                eval_diff = max(eval_diff, (model(held_out[mine]) - ref(held_out[mine])).abs().max().item())
            phases.append(engine.hooks.phase.name)
        engine.backward(loss)
        ref_opt.step()
        engine.step()
        calls.append(engine.last_step_metrics.allgather_calls)
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    trace = engine.coordinator.last_trace
    kinds = [e.kind for e in trace.events]
    planned_from = [line for line in engine.explain("budget") if "plans of trace" in line]
    return {"diff": diff, "eval_diff": eval_diff, "steps": engine.global_steps, "calls": calls[1:],
            "key": trace.key, "forwards": kinds.count(EventKind.PRE_FORWARD), "phases": phases,
            "backwards": kinds.count(EventKind.PRE_BACKWARD), "planned_from": planned_from}


@pytest.mark.parametrize("cfg", _CONFIGS, ids=_IDS)
def test_a_no_grad_forward_between_forward_and_backward_trains_and_evaluates_as_torch(pools, cfg):
    for r in pools.get(2).run(steps_with_evals_inside, cfg, 1):
        assert r["diff"] < 1e-6 and r["eval_diff"] < 1e-6 and r["steps"] == 4, r


@pytest.mark.parametrize("cfg", _CONFIGS[:2], ids=_IDS[:2])
def test_the_first_no_grad_forward_joins_the_step(pools, cfg):
    plain, inside = (pools.get(2).run(steps_with_evals_inside, cfg, e) for e in (0, 1))
    for p, r in zip(plain, inside):
        assert r["phases"] == ["FORWARD"] * 4, r  # the step stays open for its backward
        assert r["key"] == p["key"] and r["key"].startswith("pre_forward") and r["key"].endswith(":grad"), r
        assert r["forwards"] == 2 * p["forwards"] > 0 and r["backwards"] == p["backwards"] > 0, (p, r)
        if "max_live_parameters" not in cfg:  # the forward's weights stay for the backward: the eval and
            assert r["calls"] == p["calls"], (p, r)  # the backward gather nothing (they gathered it all again)


@pytest.mark.parametrize("cfg", _CONFIGS, ids=_IDS)
def test_a_second_no_grad_forward_ends_the_step_and_training_stays_torchs(pools, cfg):
    for r in pools.get(2).run(steps_with_evals_inside, cfg, 3):
        assert r["phases"] == ["FORWARD", "IDLE", "IDLE"] * 4, r
        assert r["diff"] < 1e-6 and r["eval_diff"] < 1e-6 and r["steps"] == 4, r


def test_memory_budget_plans_from_the_whole_step_with_an_eval_inside(pools):
    for r in pools.get(2).run(steps_with_evals_inside, {"memory_budget": _BUDGET}, 1):
        assert r["diff"] < 1e-6 and r["eval_diff"] < 1e-6, r
        assert len(r["planned_from"]) == 1 and f"trace '{r['key']}'" in r["planned_from"][0], r
        assert r["key"].startswith("pre_forward") and r["key"].endswith(":grad"), r  # not the backward alone


def evaluation_loop_after_a_held_loss(cfg: dict) -> dict:
    """A loss held with no backward (a skipped batch), then an evaluation loop, then training goes on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_deep)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    g = torch.Generator().manual_seed(1)
    mine = slice(2 * rank, 2 * rank + 2)
    held = engine(torch.randn(2 * world, 16, generator=g)[mine]).square().mean()  # its backward never runs
    events, phases, eval_diff = [], [], 0.0
    for _ in range(30):
        x = torch.randn(2 * world, 16, generator=g)[mine]
        with torch.no_grad():
            eval_diff = max(eval_diff, (model(x) - ref(x)).abs().max().item())
        phases.append(engine.hooks.phase.name)
        events.append(len(t.events) if (t := engine.coordinator.last_trace) is not None else 0)
    return {"phases": phases, "events": events, "eval_diff": eval_diff, "held": held.requires_grad}


@pytest.mark.parametrize("cfg", _CONFIGS, ids=_IDS)
def test_an_evaluation_loop_after_a_held_loss_is_not_one_growing_step(pools, cfg):
    for r in pools.get(2).run(evaluation_loop_after_a_held_loss, cfg):
        assert r["eval_diff"] < 1e-6, r
        assert r["phases"] == ["FORWARD"] + ["IDLE"] * 29, r
        # the step ended at the second eval holds three forwards; each eval after it is a step of one
        assert r["events"][1] == 3 * r["events"][2] > 0 and r["events"][2:] == [r["events"][2]] * 28, r


def ranks_that_free_the_graph_apart(cfg: dict) -> dict:
    """Rank 0 drops its loss and collects (its graph is freed), rank 1 holds its own; both then
    evaluate and train on. The join is decided from the calls alone, so both decide alike."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_deep)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    g = torch.Generator().manual_seed(2)
    mine = slice(2 * rank, 2 * rank + 2)
    skipped = [engine(torch.randn(2 * world, 16, generator=g)[mine]).square().mean()]  # no backward
    if rank == 0:
        skipped.clear()
        gc.collect()
    phases = []
    for _ in range(3):
        x, held_out = torch.randn(2 * world, 16, generator=g), torch.randn(2 * world, 16, generator=g)
        with torch.no_grad():
            model(held_out[mine])
        phases.append(engine.hooks.phase.name)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        engine.backward(engine(x[mine]).square().mean())
        ref_opt.step()
        engine.step()
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "phases": phases, "held": len(skipped)}


@pytest.mark.parametrize("cfg", _CONFIGS, ids=_IDS)
def test_ranks_whose_skipped_graphs_are_freed_apart_decide_alike(pools, cfg):
    results = pools.get(2).run(ranks_that_free_the_graph_apart, cfg)
    for r in results:
        assert r["diff"] < 1e-6, r
        assert r["phases"] == ["FORWARD", "IDLE", "IDLE"], r  # the first eval joined the skipped step


def evaluation_through_a_submodule_first(cfg: dict, frozen: bool) -> dict:
    """An evaluation that calls a submodule before the model (T5's encoder inside ``generate``, an
    embedding looked up before ``model(inputs_embeds=...)``): no forward a backward can reach ran, so
    the model's forward ends the step its submodule opened (review 42R1: it joined it, and the step
    stayed open with the model gathered, refusing ``engine.generation()``). ``frozen``: a frozen model
    run in grad mode (review 42R2: grad mode alone made the submodule's call count)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_deep)
    if frozen:
        model.requires_grad_(False)
    engine = zero3.initialize(model, None if frozen else torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    g = torch.Generator().manual_seed(3)
    mine = slice(2 * rank, 2 * rank + 2)
    phases, live, diff = [], [], 0.0
    for _ in range(3):
        x = torch.randn(2 * world, 16, generator=g)[mine]
        with torch.set_grad_enabled(frozen):
            diff = max(diff, (model[0](x) - ref[0](x)).abs().max().item(), (model(x) - ref(x)).abs().max().item())
        phases.append(engine.hooks.phase.name)
        live.append(engine.coordinator.metrics.live_numel)
    with torch.no_grad(), engine.generation():
        diff = max(diff, (model(x) - ref(x)).abs().max().item())
    return {"phases": phases, "live": live, "diff": diff}


@pytest.mark.parametrize("frozen", [False, True], ids=["no_grad", "frozen-grad-mode"])
@pytest.mark.parametrize("cfg", _CONFIGS, ids=_IDS)
def test_an_evaluation_that_calls_a_submodule_first_ends_its_steps(pools, cfg, frozen):
    for r in pools.get(2).run(evaluation_through_a_submodule_first, cfg, frozen):
        assert r["phases"] == ["IDLE"] * 3 and r["live"] == [0] * 3 and r["diff"] < 1e-6, r


def one_rank_evaluates_in_the_first_step(budget_fraction: float) -> dict:
    """Rank 0 alone runs a no_grad forward inside the first training step under memory_budget: with
    shared-memory gathers it needs no collective, so nothing raises, but its trace is not rank 1's."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def build() -> nn.Module:
        return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)], nn.Linear(64, 1))

    ref, model = twins(build)
    budget = int(budget_fraction * sum(p.numel() * 4 for p in ref.parameters()))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"memory_budget": budget})
    g = torch.Generator().manual_seed(0)
    mine = slice(2 * rank, 2 * rank + 2)
    for step in range(3):
        x, held_out = torch.randn(2 * world, 64, generator=g), torch.randn(2 * world, 64, generator=g)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        loss = engine(x[mine]).square().mean()
        if rank == 0 and step == 0:
            with torch.no_grad():
                model(held_out[mine])
        engine.backward(loss)
        engine.step()
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    c = engine.coordinator.budget.schedule
    return {"diff": diff, "knobs": (c.config, c.room, c.reduce_bucket_size), "reasons": c.reasons}


@pytest.mark.parametrize("fraction", [1.1, 1.5])
def test_memory_budget_takes_rank_0s_choice_when_one_rank_evaluated_in_the_first_step(pools, fraction):
    results = pools.get(2).run(one_rank_evaluates_in_the_first_step, fraction)
    assert all(r["diff"] < 1e-6 for r in results), results
    assert results[0]["knobs"] == results[1]["knobs"], results  # review 42R1: reuse 98,304 bytes against 0
    assert "rank 0's choice" in results[1]["reasons"][-1], results[1]["reasons"]
    assert "rank 0's choice" not in results[0]["reasons"][-1], results[0]["reasons"]  # review 42R2: said on rank 0 too
    assert "ranks [1] chose otherwise" in results[0]["reasons"][-1], results[0]["reasons"]


def an_eval_raises_on_one_rank(cfg: dict) -> dict:
    """Rank 0's eval inside the step raises (a user's pre-hook); its held loss's backward then meets rank
    1's reduction and ZeroDivergenceError is raised on both at a gather's issue. Nothing was gathered
    there, so nothing may stay counted live (review 42R2 P1: 65 elements stayed in rank 0's gauge for
    the rest of the run, and `check_valid` failed; older than the join)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _, model = twins(_deep)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    g = torch.Generator().manual_seed(4)
    mine = slice(2 * rank, 2 * rank + 2)
    errors, live = [], []
    for step in range(3):
        loss = engine(torch.randn(2 * world, 16, generator=g)[mine]).square().mean()
        if step == 0 and rank == 0:
            def boom(module, args):
                raise ValueError("boom")

            handle = model[-1].register_forward_pre_hook(boom)
            try:
                with torch.no_grad():
                    model(torch.randn(2, 16))
            except ValueError:
                errors.append("boom")
            finally:
                handle.remove()
        try:
            engine.backward(loss)
            engine.step()
        except zero3.ZeroDivergenceError:
            errors.append(f"divergence at step {step}")
        live.append(engine.coordinator.metrics.live_numel)
    engine.coordinator.check_valid()
    return {"errors": errors, "live": live}


def test_a_divergence_raised_at_a_gather_leaves_nothing_counted_live(pools):
    r0, r1 = pools.get(2).run(an_eval_raises_on_one_rank, {"param_persistence_threshold": 0})
    assert r0["errors"] == ["boom", "divergence at step 0"] and r1["errors"] == ["divergence at step 0"], (r0, r1)
    assert r0["live"] == r1["live"] == [0, 0, 0], (r0, r1)
