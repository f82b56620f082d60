"""Where each parameter shard lives, as ``offload_param`` asks (decided once, at initialize)."""

from __future__ import annotations

from collections.abc import Sequence

from ..offload.nvme import ShardTier
from ..offload.residence import ShardStore
from ..partition.param import ZeroParameter


def place_shards(store: ShardStore, tier: ShardTier | None, params: Sequence[ZeroParameter]) -> None:
    """Put every shard in the tier ``offload_param`` asks for: CPU memory (pinned if asked, with
    CUDA), or the drive (``tier``), except persistent parameters and the first
    ``offload_param_max_in_cpu`` elements (in parameter order; planning/persistence.py
    `MemoryBudget`, as ``zero3.Init`` decides), which stay in memory. Shards already on the drive
    (written by ``zero3.Init(remote_device="nvme")``) are adopted, or read back when they belong in
    memory. Call after the persistent parameters are chosen."""
    in_memory = store.placement.in_memory_budget()
    for p in sorted(params, key=lambda q: q._zero.id):
        z = p._zero
        if store.placement.params_on_host:
            store.place_on_host(p)
        if tier is None:
            continue
        if in_memory.stays(z.persistent, z.shard_numel):
            tier.keep(p)
        else:
            tier.offload(p)
    if tier is not None:
        tier.flush()
