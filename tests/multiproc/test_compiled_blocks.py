"""Compiled blocks (zero3.compile_blocks) on 2 gloo ranks: the example GPT trained 5 steps with each Block
compiled equals the eager zero3 run and a single-process reference; nothing recompiles after the first
step, and zero3 gathers at block boundaries only (docs/compile.md)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import zero3
from gpt import GPT, Block, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

PER_RANK = 2
STEPS = 5
CFG = GPTConfig(block_size=16)
TOL = 1e-5


def _compile_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def train(backend: str | None, checkpoint: str | None = None) -> dict:
    """5 steps of zero3 (``backend`` None: eager; else compiled blocks) beside a single-process reference."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(block_size=CFG.block_size, checkpoint=checkpoint)
    torch.manual_seed(0)
    ref = GPT(GPTConfig(block_size=CFG.block_size))  # no checkpointing: a reference independent of zero3's
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(cfg)
    if backend is not None:
        zero3.compile_blocks(model, [Block], backend=backend)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1),
                              {"param_persistence_threshold": 0})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    losses, ref_losses, counts = [], [], []
    for step in range(STEPS):
        x, y = synthetic_batch(step, PER_RANK * world, cfg)
        xs, ys = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        loss = engine(xs, ys)
        engine.backward(loss)
        engine.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        counts.append(_compile_counts())
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
        assert engine.coordinator.live_params == [], "parameters left gathered after a step"
    params = list(engine.module.parameters())
    with zero3.GatheredParameters(params):
        final = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    trace = engine.coordinator.last_trace
    block_ids = {f"h.{i}": tuple(sorted(p.ds_id for p in b.parameters())) for i, b in enumerate(engine.module.h)}
    gathers = {ev.module: ev.params for ev in trace.events if ev.kind.name == "PRE_FORWARD"}
    return {"losses": losses, "ref_losses": ref_losses, "params": final,
            "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()},
            "counts": counts, "modules": trace.modules, "block_ids": block_ids, "gathers": gathers}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_compiled_blocks_equal_eager_and_single_process(pools):
    pool = pools.get(2)
    eager = pool.run(train, None)
    compiled = pool.run(train, "aot_eager")
    for e, c in zip(eager, compiled):
        for run in (e, c):  # both equal the single-process reference
            assert max(abs(a - b) for a, b in zip(run["losses"], run["ref_losses"])) < TOL, run["losses"]
            assert _max_diff(run["params"], run["ref_params"]) < TOL
        assert max(abs(a - b) for a, b in zip(c["losses"], e["losses"])) < TOL, (c["losses"], e["losses"])
        assert _max_diff(c["params"], e["params"]) < TOL
        # Compiled once (one graph for both Blocks), during the first step; no graph break, no recompile.
        assert c["counts"][0]["graphs"] == 1 and c["counts"][0]["graph_breaks"] == 0, c["counts"]
        assert all(n == c["counts"][0] for n in c["counts"][1:]), c["counts"]
        assert e["counts"][-1]["frames"] == 0  # the eager run compiled nothing
        # zero3 gathers each Block as one unit at its boundary (the last step's recorded trace): no
        # event of a module inside a Block, and each Block's PRE_FORWARD gathers all its parameters.
        assert not [m for m in c["modules"] if m.startswith("h.") and m.count(".") > 1], c["modules"]
        assert "h.0.attn.c_attn" in e["modules"]
        for name, ids in c["block_ids"].items():
            assert c["gathers"][name] == ids, name


def test_compiled_blocks_with_zero3_activation_checkpointing(pools):
    """A checkpointed Block runs its compiled forward twice (no-grad, then the recompute): one graph
    per grad mode, nothing more after the first step, and the results of the eager run."""
    pool = pools.get(2)
    eager = pool.run(train, None, "zero3")
    compiled = pool.run(train, "aot_eager", "zero3")
    for e, c in zip(eager, compiled):
        assert max(abs(a - b) for a, b in zip(c["losses"], e["losses"])) < TOL, (c["losses"], e["losses"])
        assert _max_diff(c["params"], e["params"]) < TOL
        assert _max_diff(c["params"], c["ref_params"]) < TOL
        assert c["counts"][0]["graphs"] == 2 and all(n == c["counts"][0] for n in c["counts"][1:]), c["counts"]
