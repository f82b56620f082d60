"""Shared test helpers: one training step of a plain reference and of a zero3 engine on the same batch,
one engine step on this rank's part of a batch, training both on a list of batches, and a copy of an
engine's master shards and optimizer state."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

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


def step_my_part(engine, x: torch.Tensor, y: torch.Tensor) -> float:
    """One engine step on this rank's equal part of the batch ``x, y`` (the whole batch every rank
    draws alike); returns the loss averaged over the ranks, what one process on the batch reports."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    n = x.shape[0] // world
    loss = engine(x[n * rank:n * (rank + 1)], y[n * rank:n * (rank + 1)])
    engine.backward(loss)
    engine.step()
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / world


def twins(build: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """``build()`` twice from ``seed``: plainly (the reference) and under ``zero3.Init`` (partitioned)."""
    torch.manual_seed(seed)
    ref = build()
    torch.manual_seed(seed)
    with zero3.Init():
        model = build()
    return ref, model


def snapshot(engine: zero3.Engine) -> dict[str, torch.Tensor]:
    """Every master shard and optimizer state tensor of ``engine`` on this rank, copied, by name."""
    out = {}
    for p in engine.params:
        out[p._zero.name] = engine.master_shard(p).clone()
        for k, v in engine.optimizer_state(p).items():
            out[f"{p._zero.name}/{k}"] = v.clone()
    return out


def train_both(ref: nn.Module, model: nn.Module, zcfg: dict, batches: list[Any],
               loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> zero3.Engine:
    """Train ``ref`` plainly and ``model`` under zero3 (world size 1, AdamW with ``eps=1e-6``) on the
    same batches: the losses must match at every step, nothing may stay gathered after a step, and
    the final weights must match."""
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, eps=1e-6)
    engine = zero3.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                       lr=1e-2, eps=1e-6), zcfg)
    for batch in batches:
        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        engine.step()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-6, atol=1e-7)
        assert engine.coordinator.live_params == []
    assert_same_weights(model, ref)
    return engine


def assert_same_weights(model: nn.Module, ref: nn.Module) -> None:
    """``model``'s parameters, gathered, equal ``ref``'s in order (fp32 reduction-order noise aside)."""
    with zero3.GatheredParameters(list(model.parameters())):
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7, msg=name)


class _ReadsModuleWeight(torch.autograd.Function):
    """A custom op whose backward reads its module's weight without taking it as an input (as fused
    kernels written against ``ctx.module`` do): the node runs after that weight's gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        ctx.module = module
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        weight = ctx.module.weight.data if ctx.module.through_data else ctx.module.weight
        return grad * weight.diagonal(), None


class LinearReadingItsWeightLate(nn.Linear):
    """A square Linear whose input goes through `_ReadsModuleWeight` first (reading ``.weight``, or
    with ``through_data`` its ``.data``, as loggers and fused kernels often do)."""

    def __init__(self, n: int, through_data: bool = False) -> None:
        super().__init__(n, n)
        self.through_data = through_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_ReadsModuleWeight.apply(x, self))


def step_alongside(ref: nn.Module, ref_opt: torch.optim.Optimizer, engine: zero3.Engine,
                   inputs: list[torch.Tensor], loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """One step of the plain reference and one of the engine per input (the whole input on each:
    world size 1); nothing may stay gathered after a step."""
    for x in inputs:
        loss_fn(ref(x)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(loss_fn(engine(x)))
        engine.step()
        assert engine.coordinator.live_params == []


def train_alike(engine: zero3.Engine, model: nn.Module, ref: nn.Module, ref_opt: torch.optim.Optimizer,
                steps: int = 2) -> None:
    """``steps`` steps of ``model`` under ``engine`` (a plain ``loss.backward()``, ``engine.step()``) and of
    ``ref`` with ``ref_opt`` on the same random (4, 8) batches: the losses must match."""
    for _ in range(steps):
        x = torch.randn(4, 8)
        loss = model(x).square().mean()
        loss.backward()
        engine.step()
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-6, atol=1e-7)
