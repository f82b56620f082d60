"""The global norm of gradient shards, and clipping by it: every rank's shards together are the
full model's gradients, so a norm over them is a sum over ranks (one all-reduce)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..comm.communicator import Communicator, Kind, Tag
from ..comm.model_parallel import ModelParallel


def global_grad_norm(grads: Sequence[tuple[torch.Tensor, bool]], norm_type: float, comm: Communicator,
                     device: torch.device, model_parallel: ModelParallel | None = None) -> torch.Tensor:
    """The ``norm_type``-norm of the full gradients whose shards ``grads`` are (on every rank).

    ``grads`` pairs each shard with whether its parameter is tensor-parallel. The norm is over the
    full model: the shards' powers are summed over the data-parallel ranks (``comm``) and, with
    ``model_parallel``, over the model-parallel ranks too, where a replicated parameter (the same on
    every model-parallel rank) is counted only on model-parallel rank 0. Accumulated in fp32 (fp64 when a
    gradient is fp64), reduced on ``device`` (where the collectives run). A collective: every rank calls it.
    """
    norm_type = float(norm_type)
    tensors = [g for g, _ in grads]
    gdev = tensors[0].device if tensors else device
    # fp64 when a gradient is (an fp64 model's norm in fp32 was 5e-8 off torch's, probe 31J); the same on
    # every rank, whose shards share their dtypes
    acc = torch.float64 if any(g.dtype == torch.float64 for g in tensors) else torch.float32
    tag = Tag(Kind.ALL_REDUCE, "gradient norm (clipping)")
    mp_tag = Tag(Kind.ALL_REDUCE, "gradient norm (clipping, model-parallel)")
    if norm_type == math.inf:
        local = max((g.abs().max().to(acc) for g in tensors), default=torch.zeros((), dtype=acc, device=gdev))
        total = comm.all_reduce(local.to(device, copy=True), tag, op="max")
        if model_parallel is not None:
            total = model_parallel.comm.all_reduce(total.to(model_parallel.comm.device), mp_tag, op="max").to(device)
        return total
    counted = [g for g, parallel in grads if model_parallel is None or parallel or model_parallel.rank == 0]
    local = torch.zeros((), dtype=acc, device=gdev)
    for g in counted:
        local += g.to(acc).abs().pow(norm_type).sum()
    total = comm.all_reduce(local.to(device), tag)
    if model_parallel is not None:
        total = model_parallel.comm.all_reduce(total.to(model_parallel.comm.device), mp_tag).to(device)
    return total.pow(1.0 / norm_type)


def clip_shards(grads: Sequence[tuple[torch.Tensor, bool]], max_norm: float, norm_type: float,
                comm: Communicator, device: torch.device, model_parallel: ModelParallel | None = None) -> torch.Tensor:
    """Scale the gradient shards so their global ``norm_type``-norm is at most ``max_norm``; return it
    (`global_grad_norm`)."""
    total = global_grad_norm(grads, norm_type, comm, device, model_parallel)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g, _ in grads:
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total
