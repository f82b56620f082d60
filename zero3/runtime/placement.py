"""Where each parameter shard lives, as ``offload_param`` asks (decided once, at initialize)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import ZeroConfig
from ..offload.nvme import ShardTier
from ..partition.param import ZeroParameter
from ..planning.persistence import MemoryBudget


def place_shards(config: ZeroConfig, tier: ShardTier | None, params: Sequence[ZeroParameter]) -> None:
    """Put every shard in the tier ``offload_param`` asks for: CPU memory (pinned if asked, with
    CUDA), or the drive (``tier``), except persistent parameters and the first
    ``offload_param_max_in_cpu`` elements (in parameter order; planning/persistence.py
    `MemoryBudget`, as ``zero3.Init`` decides), which stay in memory. Shards already on the drive
    (written by ``zero3.Init(remote_device="nvme")``) are adopted, or read back when they belong in
    memory. Call after the persistent parameters are chosen."""
    pin = config.offload_param_pin_memory and torch.cuda.is_available()
    in_memory = MemoryBudget(config.offload_param_max_in_cpu)
    for p in sorted(params, key=lambda q: q._zero.id):
        z = p._zero
        if config.offload_param == "cpu" and (z.shard.device.type != "cpu" or (pin and not z.shard.is_pinned())):
            z.replace_shard(z.shard.detach().to("cpu").pin_memory() if pin else z.shard.detach().to("cpu"))
        if tier is None:
            continue
        if in_memory.stays(z.persistent, z.shard_numel):
            tier.keep(p)
        else:
            tier.offload(p)
    if tier is not None:
        tier.flush()
