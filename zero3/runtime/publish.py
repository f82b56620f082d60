"""Gathered full values written back into the shards: what ``GatheredParameters(modifier_rank=...)``
publishes, what torch's ``load_state_dict`` copied into kept-gathered parameters, and DeepSpeed's
``param.partition(has_been_updated=True)``; and a new shape, partitioned anew before ``initialize``
and refused after it ([Note: a new shape before initialize] in gathered.py). ``ctx`` is the
parameters' `RuntimeContext` (not imported: context.py calls in here).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ZeroStateError
from ..partition import sharding
from ..partition.param import ZeroParameter, raw_data, update_shard_from_full

published: dict[int, int] = {}
"""How often each parameter (by ``ds_id``) was written back here: a ``GatheredParameters`` without
``modifier_rank`` around such a write does not take that change for a discarded write."""


def count_publish(p: ZeroParameter) -> None:
    """``p``'s gathered data was written through to its shards on every rank: see ``published``."""
    published[p._zero.id] = published.get(p._zero.id, 0) + 1


def reshaped_ids(params: list[ZeroParameter]) -> set[int]:
    """The ``ds_id`` of each of ``params`` whose gathered data has another shape than its own."""
    return {p._zero.id for p in params if raw_data(p).shape != p._zero.shape}


def write_updated(ctx: Any, params: list[ZeroParameter], what: str) -> None:
    """Every rank changed the gathered full data of ``params`` the same way (``what`` names the call):
    a new shape is partitioned anew before ``initialize`` and refused after it, nothing written; then
    peers stop reading shared shards (inside a step) and the shards and masters take the values."""
    reshaped = reshaped_ids(params)
    if reshaped and ctx.module is not None:
        refuse_reshape(ctx, [p for p in params if p._zero.id in reshaped], what)
    ctx.comm.shards_will_change()
    into_shards(ctx, params, reshaped)


def into_shards(ctx: Any, params: list[ZeroParameter], reshaped: frozenset[int] | set[int] = frozenset(),
                finer: dict[int, torch.Tensor] | None = None) -> None:
    """The gathered full data of ``params`` (the same on every rank) is their new value: this rank's
    shards and masters take it (those in ``reshaped``, by ``ds_id``, are partitioned anew; a master
    whose full value ``finer`` holds, by ``ZeroParam.id``, takes that instead of its shard's), and a
    context without ``modifier_rank`` around this does not take it for a discarded write."""
    with ctx.resident(params, write=True):  # shards read in too: unchanged ones are left alone
        for p in params:
            z = p._zero
            count_publish(p)
            if z.id in reshaped:
                repartition(ctx, p)  # gathered.py [Note: a new shape before initialize]
                continue
            update_shard_from_full(p)
            if finer and z.id in finer and z.master is not None:
                z.master.copy_(sharding.shard_tensor(finer[z.id].detach().to(z.master.device), z.world_size, z.rank))
    ctx.coordinator.drop_secondaries(params)  # all of them, on every rank: the same hpZ split


def repartition(ctx: Any, p: ZeroParameter) -> None:
    """Partition the gathered ``p`` anew with its data's new shape; the live gauge follows its size
    (gathered and not persistent, it is in the coordinator's live set)."""
    z = p._zero
    numel, nbytes = z.numel, z.nbytes
    ctx.store.repartition(p, raw_data(p))
    if not z.persistent:
        ctx.metrics.add_live(z.numel - numel, z.nbytes - nbytes)


def refuse_reshape(ctx: Any, params: list[ZeroParameter], what: str, raise_: bool = True, refresh: bool = True) -> None:
    """A new shape that is not written back (an engine holds the parameters, or ``GatheredParameters``
    has no ``modifier_rank``): give them back their own shape (the shards are untouched; a gathered
    copy that another holder keeps has uninitialised values until gathered again, persistent ones
    at once unless not ``refresh``: the caller restores them), then raise unless not ``raise_``.
    ``what`` names the call."""
    name, new_shape, old_shape = params[0]._zero.name, tuple(raw_data(params[0]).shape), tuple(params[0]._zero.shape)
    for p in params:
        z = p._zero
        with torch._C.DisableTorchFunctionSubclass():
            p.data = z.shard[: z.numel].view(z.shape) if z.aliased else \
                torch.empty(z.shape, dtype=z.dtype, device=raw_data(p).device)
        z.flat = None
    if refresh and any(p._zero.persistent and not p._zero.aliased for p in params):
        ctx.coordinator.refresh_persistent()  # kept gathered: their values again, from the shards
    if not raise_:
        return
    if what == "GatheredParameters without modifier_rank":
        raise ZeroStateError(
            f"{what}: {name} was given data of shape {new_shape} (its shape is {old_shape}); without "
            "modifier_rank changes are discarded. Pass modifier_rank=0 to keep the new shape (before "
            "zero3.initialize); the parameter keeps its shape and values")
    raise ZeroStateError(
        f"{what}: {name} was given data of shape {new_shape} (its shape is {old_shape}) "
        "(Hugging Face's resize_token_embeddings does this), after zero3.initialize: its optimizer state, "
        "buffers and plans have the old size. Resize before zero3.initialize, inside "
        "`with zero3.GatheredParameters([model.get_input_embeddings().weight, "
        "model.get_output_embeddings().weight], modifier_rank=0):`; the parameter keeps its shape and values")
