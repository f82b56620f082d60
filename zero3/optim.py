"""The optimizer over shards: re-pointing a user's ``torch.optim`` optimizer, global-norm clipping."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from .errors import ZeroConfigError, ZeroStateError
from .param import ZeroParameter


def shard_optimizer(optimizer: Any, params: Iterable[ZeroParameter]) -> torch.optim.Optimizer:
    """Point ``optimizer`` at the shards of ``params`` (or build one from a factory).

    A ``torch.optim.Optimizer`` built over the full parameters keeps its class, param groups and
    hyperparameters: each group's parameters are replaced by their shards in place, so schedulers
    and references the user holds keep working. A callable is called with the param groups
    (``[{"params": shards}]``) and must return an optimizer. State exists only for this rank's shard.
    """
    params = list(params)
    by_id = {id(p): p._zero.shard for p in params}
    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.state) > 0:
            raise ZeroStateError(
                "the optimizer already has state (it has stepped); build it over model.parameters() and "
                "pass it to zero3.initialize before any step")
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                if id(p) in by_id:
                    new.append(by_id[id(p)])
                elif any(p is s for s in by_id.values()):
                    new.append(p)
                else:
                    raise ZeroConfigError(
                        f"optimizer parameter of shape {tuple(p.shape)} is not a parameter of the model "
                        "given to zero3.initialize")
            group["params"] = new
        return optimizer
    if callable(optimizer):
        shards = [p._zero.shard for p in params if p.requires_grad]
        opt = optimizer([{"params": shards}])
        if not isinstance(opt, torch.optim.Optimizer):
            raise ZeroConfigError(f"optimizer factory must return a torch.optim.Optimizer, got {type(opt).__name__}")
        return opt
    raise ZeroConfigError(
        f"optimizer must be a torch.optim.Optimizer, a callable(param_groups) -> Optimizer, or None; "
        f"got {type(optimizer).__name__}")


def clip_grad_norm_(engine_or_model: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradient shards by the global norm over all ranks; returns that norm.

    Equals ``torch.nn.utils.clip_grad_norm_`` on the full (unpartitioned) model's gradients. A
    collective: call it on every rank, after backward and before ``engine.step()``.
    """
    engine = _engine_of(engine_or_model)
    engine.reducer.flush()
    grads = [p._zero.shard.grad for p in engine.params if p._zero.shard.grad is not None]
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == math.inf:
        local = max((g.abs().max() for g in grads), default=torch.zeros((), device=device)).float()
        total = engine.comm.all_reduce(local.clone(), op=dist.ReduceOp.MAX)
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local += g.float().abs().pow(norm_type).sum()
        total = engine.comm.all_reduce(local).pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def _engine_of(obj: Any) -> Any:
    from .engine import Engine

    if isinstance(obj, Engine):
        return obj
    if isinstance(obj, nn.Module):
        engine = obj.__dict__.get("_zero3_engine")
        if engine is not None:
            return engine
    raise ZeroStateError(f"expected a zero3 Engine or a model passed to zero3.initialize, got {type(obj).__name__}")
