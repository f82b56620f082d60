"""Every collective's verification header carries the step it belongs to (issue 19, item 4).

A rank that catches an exception from its own forward and goes on to the next batch is one step
ahead of the others. With every parameter persistent its forward issues no collective, so before the
step was counted nothing noticed: rank 0's step k was reduced with rank 1's batch k+1 for as many
steps as the run lasted. Now the aborted step counts on the rank that aborted it, the next
reduction's header names another step than the other ranks', and every rank raises
`ZeroDivergenceError` naming both steps, before any optimizer step on mixed gradients.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

TIMEOUT = 4.0
POOL_TIMEOUT = 90
CFG = GPTConfig(block_size=16)


class CaughtOnce(GPT):
    fail = False

    def forward(self, idx, targets=None):
        if self.fail:
            self.fail = False
            raise ValueError("bad batch")
        return super().forward(idx, targets)


def _snapshot(engine) -> list[torch.Tensor]:
    return [p._zero.train_tensor.detach().clone() for p in engine.params] + \
        [p._zero.shard.detach().clone() for p in engine.params]


def catch_and_go_on(accumulation: int) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    with zero3.Init():
        model = CaughtOnce(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6),
                              {"collective_timeout": TIMEOUT, "param_persistence_threshold": 10**9,
                               "gradient_accumulation_steps": accumulation})
    batch = 0

    def micro_step() -> None:
        nonlocal batch
        x, y = synthetic_batch(batch * 7 + rank, 2, CFG)
        batch += 1
        try:
            loss = engine(x, y)
        except ValueError:
            return  # the user's loop skips the bad batch and goes on
        engine.backward(loss)
        engine.step()

    for _ in range(3 * accumulation):
        micro_step()
    before = _snapshot(engine)
    steps_before = engine.global_steps
    model.fail = rank == 1
    t0 = time.monotonic()
    out: dict = {"error": None}
    try:
        for _ in range(4 * accumulation):
            micro_step()
    except zero3.ZeroError as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    out["seconds"] = time.monotonic() - t0
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _snapshot(engine)))
    out["optimizer_steps"] = engine.global_steps - steps_before
    return out


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_rank_that_catches_its_forward_error_and_goes_on_is_caught_at_the_next_reduction(pools, accumulation):
    results = pools.get(2).run(catch_and_go_on, accumulation, timeout=POOL_TIMEOUT)
    for rank, r in enumerate(results):
        assert r["error"] == "ZeroDivergenceError", (rank, r)
        steps = {int(s) for s in re.findall(r"rank \d: step (\d+)", r["message"])}
        assert len(steps) == 2, r["message"]  # both steps named
        assert "rank 1 raised ValueError: bad batch in its forward" in r["message"], r["message"]
        assert r["seconds"] < TIMEOUT + 2.5, r
        assert r["unchanged"], "a shard changed"
        assert r["optimizer_steps"] == 0
