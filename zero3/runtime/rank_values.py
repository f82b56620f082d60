"""What `zero3.Init` partitions must be the same full tensor on every rank; where it is not, rank 0's wins.

[Note: values that differ between ranks under sync="rng"]
Under ``sync="rng"`` (the default) `Init` broadcasts rank 0's torch RNG state on entry, and every
rank draws the same full tensors and keeps its own slice of them, with no broadcast per parameter.
That holds only for values drawn from torch's default generators. Code that draws elsewhere (numpy,
its own ``torch.Generator``, a per-rank ``torch.manual_seed`` inside the block) gives each rank
other values, and each rank kept its slice of its own: a gathered parameter was rank 0's first
slice beside rank 1's second, a tensor no rank drew (found on 2 ranks: a GPT 0.30-3.98 away from
DDP's, which starts from rank 0's weights, as DeepSpeed's ``Init`` does by broadcasting each one).

So before a full value becomes shards (a new parameter, a write while building, a ``.data``
assignment), every rank takes one integer per tensor (a sum of its bytes as 64-bit words: equal for
equal tensors, and in practice different for different ones); the ranks exchange a digest of them
(four integers, one collective without a header exchange), and only where digests differ every
integer; every tensor whose integers differ is broadcast from rank 0 first, with a warning naming
them and ``sync="broadcast"`` (the first time in an Init context; then at DEBUG). What every rank
drew alike costs the exchange only.
"""

from __future__ import annotations

import logging
import weakref
import zlib
from typing import Any, Sequence

import torch

from ..comm.tags import Kind, Tag
from ..errors import ZeroDivergenceError

logger = logging.getLogger(__name__)

_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the contexts that warned once already (then: debug)


def bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s bytes read as int64 words (wrapping), then of the bytes past the last whole
    word: no copy of ``t`` (a sum of an int32 view widens the whole tensor to int64 first: twice the
    memory of a module `Init` is building, measured)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = b.numel() // 8 * 8
    tail = b[n:].sum(dtype=torch.int64)
    if not n:
        return tail
    if b.storage_offset() % 8 == 0:
        return b[:n].view(torch.int64).sum() + tail
    return torch.stack([c.sum(dtype=torch.int64) for c in b[:n].split(1 << 20)]).sum() + tail


def take_rank0_where_ranks_differ(ctx: Any, named: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Make each full tensor in ``named`` rank 0's where the ranks' differ (in place, a broadcast
    each); returns their names. A collective over ``ctx``'s group (one small all-gather), which
    every rank calls with the same names in the same order; nothing at world size 1."""
    named = [(name, t) for name, t in named if not t.is_meta]  # no values yet (a from_pretrained's meta build)
    if ctx.world_size == 1 or not named:
        return []
    comm = ctx.comm
    sums = torch.stack([bit_sum(t) for _, t in named])
    label = f"zero3.Init values of {named[0][0]}" + (f" and {len(named) - 1} more" if len(named) > 1 else "")
    # Fast path: one unverified exchange of a fixed-size digest (the count, two weighted sums of the
    # integers, a checksum of the names, shapes and dtypes); only where digests differ does every integer travel.
    # on the sums' device, never the default one (a meta default device inside the Init block)
    weights = torch.arange(1, len(named) + 1, dtype=torch.int64, device=sums.device)
    layout = zlib.crc32("\0".join(f"{name}{tuple(t.shape)}{t.dtype}" for name, t in named).encode())
    digest = torch.stack([torch.tensor(len(named), device=sums.device), sums.sum(), (sums * weights).sum(),
                          torch.tensor(layout, device=sums.device)])
    rows = comm.all_gather_digest(digest.to(comm.device), Tag(Kind.TENSOR_GATHER, label)).cpu()
    if bool((rows == rows[0]).all()):
        return []
    if not bool((rows[:, 0] == rows[0, 0]).all() and (rows[:, 3] == rows[0, 3]).all()):
        raise ZeroDivergenceError(
            f"zero3.Init: the ranks built different parameters at the same point ({label} on rank "
            f"{ctx.rank}): every rank must build the same model in the same order")
    every = comm.all_gather_tensor(sums.to(comm.device), Tag(Kind.TENSOR_GATHER, label)).cpu()
    differ = (every != every[0]).any(dim=0).tolist()
    names: list[str] = []
    for (name, t), d in zip(named, differ):
        if d:
            buf = t if t.is_contiguous() else t.contiguous()
            got = comm.broadcast(buf, 0, Tag(Kind.BROADCAST, f"zero3.Init value of {name}"))
            if got is not t:
                t.copy_(got)
            names.append(name)
    if names:
        log = logger.debug if ctx in _WARNED else logger.warning
        _WARNED.add(ctx)
        log(
            "zero3.Init: %s differed between ranks when partitioned: drawn outside torch's default generator "
            "(numpy, a torch.Generator of its own, or a seed set per rank inside the block), or left as torch.empty's "
            "memory for a later init to fill (Hugging Face's post_init does so for Mixtral's and Qwen2-MoE's "
            "routers and fused experts: harmless, that init then writes the same values on every rank); each "
            "now has rank 0's values, as DeepSpeed's Init gives. Init(sync='broadcast') takes rank 0's values for "
            "every parameter without this check", ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else ""))
    return names
