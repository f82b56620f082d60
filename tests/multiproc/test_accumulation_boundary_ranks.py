"""``engine.set_gradient_accumulation_boundary`` on two ranks: windows of changing sizes train as
one process accumulating the concatenated micro-batches, and ranks that disagree on where a window
ends get an error that says so (DeepSpeed's engine hangs there)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3
from zero3 import ZeroDivergenceError

from _reference import twins

pytestmark = pytest.mark.multiproc

WINDOWS = [2, 3, 1]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def windows_against_one_process() -> float:
    """Each rank's micro-batch is its half of a batch of 6 rows; the reference accumulates the whole
    batches' mean losses (zero3 averages the ranks' gradients). The largest weight difference after."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_mlp)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0, "gradient_accumulation_steps": 2})
    g, rows = torch.Generator().manual_seed(3), 3
    mine = slice(rows * rank, rows * (rank + 1))
    for size in WINDOWS:
        for k in range(size):
            x = torch.randn(rows * world, 8, generator=g)
            (ref(x).pow(2).mean() / 2).backward()
            engine.set_gradient_accumulation_boundary(k == size - 1)
            engine.backward(model(x[mine]).pow(2).mean())
            assert engine.step() is (k == size - 1)
        ref_opt.step()
        ref_opt.zero_grad()
    assert engine.global_steps == len(WINDOWS)
    with zero3.GatheredParameters(list(model.parameters())):
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def ranks_disagreeing_on_the_boundary() -> str:
    torch.manual_seed(0)
    with zero3.Init():
        model = _mlp()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    engine.set_gradient_accumulation_boundary(dist.get_rank() == 0)
    engine.backward(engine(torch.randn(3, 8)).pow(2).mean())
    try:
        engine.step()
        engine.backward(engine(torch.randn(3, 8)).pow(2).mean())
        engine.step()
    except ZeroDivergenceError as exc:
        engine.remove_hooks()
        return str(exc)
    return "no error"


def test_windows_set_by_the_override_train_as_one_process_over_the_concatenated_batches(pools):
    for diff in pools.get(2).run(windows_against_one_process):
        assert diff < 1e-5, diff


def test_ranks_that_end_a_window_at_different_steps_are_told_so(pools):
    for message in pools.get(2).run(ranks_disagreeing_on_the_boundary):
        assert "Rank(s) [0] are at engine.step()'s optimizer step and the others are not" in message, message
        assert "set_gradient_accumulation_boundary" in message
