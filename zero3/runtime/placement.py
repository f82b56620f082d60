"""Where each parameter shard lives, as ``offload_param`` asks (decided once, at initialize)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..comm.communicator import Communicator
from ..comm.shared import SlotSpec
from ..offload.nvme import ShardTier
from ..offload.residence import ShardStore
from ..partition.param import ZeroParameter, raw_data
from ..partition.state import ParamStatus, Residence

logger = logging.getLogger(__name__)


def place_shards(store: ShardStore, tier: ShardTier | None, params: Sequence[ZeroParameter]) -> None:
    """Put every shard in the tier ``offload_param`` asks for: CPU memory (pinned if asked, with
    CUDA), or the drive (``tier``), except persistent parameters and the first
    ``offload_param_max_in_cpu`` elements (in parameter order; planning/persistence.py
    `MemoryBudget`, as ``zero3.Init`` decides), which stay in memory. Shards already on the drive
    (written by ``zero3.Init(remote_device="nvme")``) are adopted, or read back when they belong in
    memory. Call after the persistent parameters are chosen."""
    in_memory = store.placement.in_memory_budget()
    kept = on_drive = persistent = 0
    for p in sorted(params, key=lambda q: q._zero.id):
        z = p._zero
        if store.placement.params_on_host:
            store.place_on_host(p)
        if tier is None:
            continue
        if in_memory.stays(z.persistent, z.shard_numel):
            tier.keep(p)
            kept += z.shard_numel
            persistent += z.persistent
        else:
            tier.offload(p)
            on_drive += 1
    if tier is not None:
        tier.flush()
        if params and not on_drive and persistent == len(params):
            logger.warning("zero3: offload_param='nvme' but every parameter is persistent (kept gathered, its shard in "
                           "memory: param_persistence_threshold, model_persistence_threshold or memory_budget), so "
                           "nothing goes to the drive")
        elif params and not on_drive:  # DeepSpeed's default max_in_cpu keeps a model of 1e9 elements off the drive
            logger.warning("zero3: offload_param='nvme' but every parameter shard of this rank (%d elements) stays in "
                           "CPU memory: offload_param_max_in_cpu=%d (persistent parameters stay too); set max_in_cpu "
                           "below that (0: every non-persistent shard) to use the drive", kept,
                           store.placement.param_max_in_cpu)


def share_shards(comm: Communicator, store: ShardStore, tier: ShardTier | None,
                 params: Sequence[ZeroParameter]) -> int:
    """``allgather_impl="shm"`` (comm/shared.py [Note: shared shards]): move every shard that can into
    this rank's shared-memory arena, so peers on this node gather it by reading it there. A
    collective: call on every rank, after `place_shards` and before the optimizer takes the shards.
    A shard can when it is in plain CPU memory, gathered into storage of its own dtype, and no shard
    goes to the drive. Under mixed precision (or optimizer offload) the optimizer then leaves the
    shards in their slots and casts its fp32 masters into them one by one, instead of moving them
    into a flat buffer (optim/optimizer.py [Note: flat master buffers]). Returns how many moved."""
    if comm.config.allgather_impl != "shm" or comm.world_size == 1:
        return 0
    if tier is not None:
        return 0  # the same on every rank: one config
    movable = [p for p in sorted(params, key=lambda q: q._zero.id) if _movable(p)]
    specs = [SlotSpec(p._zero.id, p._zero.shard_numel, p._zero.shard.dtype) for p in movable]
    shared = comm.share_shards(specs)
    if shared is None:
        return 0
    for p, spec in zip(movable, specs):
        slot = shared.slot(spec)
        slot.copy_(p._zero.shard)
        store.rebind(p, slot)
    shared.adopt(movable)
    return len(movable)


def _movable(p: ZeroParameter) -> bool:
    z = p._zero
    return (z.status is ParamStatus.NOT_AVAILABLE and z.residence is Residence.HOST and z.shard.device.type == "cpu"
            and z.shard.dtype == raw_data(p).dtype and z.swap is None)
