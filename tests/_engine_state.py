"""What a rank's engine holds per parameter, read through the tiers (NVMe included), for exact
comparisons between runs in the multi-rank tests."""

from __future__ import annotations

import torch

import zero3


def engine_state(engine: zero3.Engine) -> dict[str, torch.Tensor]:
    """Copies of every parameter's shard, fp32 master and per-parameter optimizer state, by name."""
    out = {}
    for p in engine.params:
        with engine.context.resident([p]):  # masters and moments may live on the drive between steps
            out[f"{p._zero.name}/shard"] = p._zero.shard.detach().clone()
            out[f"{p._zero.name}/master"] = engine.master_shard(p).clone()
            for k, v in engine.optimizer_state(p).items():
                out[f"{p._zero.name}/{k}"] = v.clone()
    return out


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same keys and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
