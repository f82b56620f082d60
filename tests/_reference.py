"""Shared test helpers: one training step of a plain reference and of a zero3 engine on the same batch,
and a copy of an engine's master shards and optimizer state."""

from __future__ import annotations

import torch

import zero3


def step_both(ref, ref_opt, engine, x, y, rtol: float) -> torch.Tensor:
    """Step the reference, then the engine; their losses must match to ``rtol``. Returns the loss."""
    ref_loss = ref(x, y)
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    return loss


def snapshot(engine: zero3.Engine) -> dict[str, torch.Tensor]:
    """Every master shard and optimizer state tensor of ``engine`` on this rank, copied, by name."""
    out = {}
    for p in engine.params:
        out[p._zero.name] = engine.master_shard(p).clone()
        for k, v in engine.optimizer_state(p).items():
            out[f"{p._zero.name}/{k}"] = v.clone()
    return out
