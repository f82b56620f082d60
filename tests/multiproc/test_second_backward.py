"""Several losses over one forward, each with its own backward (the first with ``retain_graph=True``):
every module's backward gathers its parameters again and the gradients add up as torch adds them
(runtime/hooks.py [Note: a second backward]), on 2 gloo ranks against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero3
from _reference import twins
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

CFG = GPTConfig(block_size=16, n_layer=2, n_embd=32, n_head=2)
MOE = GPTConfig(block_size=4, n_layer=2, n_embd=32, n_head=2, n_experts=4)


def _losses(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    return ce, 0.01 * logits.float().pow(2).mean()


def two_backwards(threshold: int, moe: bool = False, steps: int = 3) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MOE if moe else CFG
    ref, model = twins(lambda: GPT(cfg))
    if moe:  # each MoE is reduced as one unit (a leaf module): the second backward counts its call again
        zero3.set_leaf_modules(model, ["MoE"])
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6),
                              {"param_persistence_threshold": threshold, "prefetch_bucket_size": 3000,
                               "max_reuse_distance": 0})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, eps=1e-6)
    gathers = []
    for step in range(steps):
        x, y = synthetic_batch(step, 2 * world, cfg)
        ce, reg = _losses(engine(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2])
        before = engine.metrics.allgather_numel
        ce.backward(retain_graph=True)
        reg.backward()
        gathers.append(engine.metrics.allgather_numel - before)
        engine.step()
        total = sum(sum(_losses(ref(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2])) for r in range(world)) / world
        total.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with zero3.GatheredParameters(list(model.parameters())):
        worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    numel = sum(p.numel() for p in ref.parameters())
    return {"worst": worst, "gathers": gathers, "numel": numel, "live": len(engine.coordinator.live_params)}


@pytest.mark.parametrize("threshold,moe", [(0, False), (10**6, False), (0, True)])  # partitioned / kept gathered
def test_two_losses_with_a_backward_each_train_as_in_one_process(pools, threshold, moe):
    for r in pools.get(2).run(two_backwards, threshold, moe, timeout=120):
        assert r["worst"] < 1e-5, r
        assert r["live"] == 0, r  # both backwards released what they gathered
        if threshold == 0:  # the second backward gathered the weights again (wte is tied: gathered once)
            assert all(g > r["numel"] for g in r["gathers"]), r


def _penalized(model, x: torch.Tensor) -> torch.Tensor:
    """WGAN-GP's loss shape: the output plus a penalty on the gradient of the output by the input,
    whose backward runs through the graph of that gradient (create_graph=True)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.mean() + (g.norm(dim=1) - 1).pow(2).mean()


def _critic() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


def gradient_penalty(how: str, steps: int = 3) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_critic)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6),
                              {"param_persistence_threshold": 10**6 if how == "persistent" else 0})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, eps=1e-6)
    out: dict = {}
    for step in range(steps):
        x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step))
        mine = x[4 * rank:4 * rank + 4]
        if how == "refused" and step == 0:
            try:
                _penalized(engine, mine).backward()
            except zero3.ZeroStateError as exc:
                out["error"] = str(exc)
            out["live_after_refusal"] = len(engine.coordinator.live_params)
            continue  # nothing was reduced: the next steps (as the error advises) train as if it never ran
        if how in ("gathered", "refused"):
            with zero3.GatheredParameters(list(model.parameters())):
                _penalized(engine, mine).backward()
        else:
            _penalized(engine, mine).backward()
        engine.step()
        (sum(_penalized(ref, x[4 * r:4 * r + 4]) for r in range(world)) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with zero3.GatheredParameters(list(model.parameters())):
        out["worst"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return out


@pytest.mark.parametrize("how", ["refused", "gathered", "persistent"])
def test_a_gradient_penalty_is_refused_on_released_parameters_and_exact_on_kept_ones(pools, how):
    for r in pools.get(2).run(gradient_penalty, how, timeout=120):
        assert r["worst"] < 1e-5, r
        if how == "refused":
            assert "create_graph=True" in r["error"] and "GatheredParameters" in r["error"], r
            assert r["live_after_refusal"] == 0, r


class _Expert(torch.nn.Module):
    """A leaf module whose parameter ``g`` only rank 0's tokens reach (``uses_g``), as an expert no
    token of another rank was routed to."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.g = torch.nn.Parameter(torch.full((8,), 1.1))
        self.uses_g = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(h))
        return h * self.g if self.uses_g else h


class _TwiceThroughExpert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.e, self.l2 = torch.nn.Linear(8, 8), _Expert(), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.e(self.e(self.l0(x))))


def leaf_called_twice(mode: str, steps: int = 2) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_TwiceThroughExpert)
    zero3.set_leaf_modules(model, [_Expert])
    model.e.uses_g = rank == 0
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"param_persistence_threshold": 0, "max_reuse_distance": 0})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def losses(m, r: int, step: int) -> list[torch.Tensor]:
        x1, x2 = (torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * r + i)) for i in (0, 1))
        if mode == "retain":
            out = m(x1)
            return [out.square().mean(), out.abs().mean()]
        first = m(x1)
        if mode == "no_grad between":
            with torch.no_grad():
                m(x2 * 2)
            return [first.square().mean()]
        return [first.square().mean(), m(x2).abs().mean()]  # two forwards, then two backwards

    for step in range(steps):
        parts = losses(model, rank, step)
        for i, loss in enumerate(parts):
            loss.backward(retain_graph=i + 1 < len(parts))
        engine.step()
        for r in range(world):
            ref.e.uses_g = r == 0
            for i, loss in enumerate(losses(ref, r, step)):
                (loss / world).backward(retain_graph=True)
        ref_opt.step()
        ref_opt.zero_grad()
    with zero3.GatheredParameters(list(model.parameters())):
        return {"worst": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))}


@pytest.mark.parametrize("mode", ["two backwards", "no_grad between", "retain"])
def test_a_leaf_module_called_twice_is_reduced_once_per_backward_with_its_gradients(pools, mode):
    """A leaf called twice per forward, over two backwards, a no_grad forward between, or a retained
    graph: an end of step (the first backward's, or the no_grad forward's) reset its call count, so its
    unit was reduced before its gradients existed (or they were dropped: weights 2.8e-2 off), and with a
    parameter only one rank used, the ranks issued different collectives (review of round 23)."""
    for r in pools.get(2).run(leaf_called_twice, mode, timeout=120):
        assert r["worst"] < 1e-6, r
