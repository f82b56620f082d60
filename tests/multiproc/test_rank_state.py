"""``optimizer.state_dict()`` of a zero3 optimizer is one rank's shard of the state (optim/rank_state.py
[Note: per-rank optimizer state]): each rank saving and loading its own resumes exactly as an
uninterrupted run on 2 gloo ranks; rank 0's state loaded on rank 1 (a DDP habit, which used to give
rank 1 rank 0's moments without a word) is refused and changes nothing."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

CFG = GPTConfig(block_size=16, n_layer=2, n_embd=32, n_head=2)
CONFIG = {"param_persistence_threshold": 0}


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer, zero3.Engine]:
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    return model, opt, zero3.initialize(model, opt, CONFIG)


def _steps(engine: zero3.Engine, first: int, n: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, first + n):
        x, y = synthetic_batch(step, 2 * world, CFG)
        loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _saved(obj: object) -> object:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def resume(how: str) -> dict:
    rank = dist.get_rank()
    model, opt, engine = _build()
    _steps(engine, 0, 2)
    weights = engine.consolidated_state_dict(rank0_only=False)
    state = _saved(opt.state_dict())
    assert state["zero3"] == {"rank": rank, "world_size": dist.get_world_size()}
    uninterrupted = _steps(engine, 2, 2)
    engine.remove_hooks()

    model, opt, engine = _build()
    zero3.pretrained.load_state_dict(model, weights)
    out: dict = {}
    if how == "rank 0's file on every rank":
        shared = [state]
        dist.broadcast_object_list(shared, src=0)
        try:
            opt.load_state_dict(shared[0])
            out["loaded"] = True
        except zero3.ZeroStateError as exc:
            out["loaded"], out["error"] = False, str(exc)
            out["state_after"] = len(opt.state)
        engine.remove_hooks()
        return out
    opt.load_state_dict(state)
    out["resumed"], out["uninterrupted"] = _steps(engine, 2, 2), uninterrupted
    engine.remove_hooks()
    return out


def test_each_rank_loading_its_own_state_resumes_exactly(pools):
    for r in pools.get(2).run(resume, "own file per rank", timeout=120):
        assert r["resumed"] == r["uninterrupted"], r


def test_rank_0s_state_on_every_rank_is_refused_on_the_others(pools):
    r0, r1 = pools.get(2).run(resume, "rank 0's file on every rank", timeout=120)
    assert r0["loaded"]
    assert not r1["loaded"] and r1["state_after"] == 0
    assert "saved by rank 0 of 2, and this is rank 1 of 2" in r1["error"]
    assert "engine.save_checkpoint" in r1["error"]


def migrate(which: str) -> dict:
    """A plain torch run's ``opt.state_dict()`` after 3 steps, loaded on every rank before
    ``initialize`` (each rank keeps its own slice), resumes like the uninterrupted 6-step torch run."""
    rank, world = dist.get_rank(), dist.get_world_size()
    make = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=3e-3, eps=1e-6),
            "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}[which]
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref_opt = make(ref.parameters())
    plain = []
    for step in range(6):
        loss = ref(*synthetic_batch(step, 2 * world, CFG))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        plain.append(loss.item())
        if step == 2:
            weights, state = _saved(ref.state_dict()), _saved(ref_opt.state_dict())
    torch.manual_seed(1)
    with zero3.Init():
        model = GPT(CFG)
    opt = make(model.parameters())
    opt.load_state_dict(state)
    engine = zero3.initialize(model, opt, CONFIG)
    zero3.pretrained.load_state_dict(engine, weights)
    losses = _steps(engine, 3, 3)
    total = torch.tensor(losses)
    dist.all_reduce(total)
    err = max((zero3.safe_get_full_fp32_param(p) - r.detach()).abs().max().item()
              for p, r in zip(model.parameters(), ref.parameters()))
    engine.remove_hooks()
    return {"rank": rank, "losses": (total / world).tolist(), "plain": plain[3:], "weight_err": err}


@pytest.mark.parametrize("which", ["AdamW", "SGD momentum"])
def test_a_plain_torch_runs_state_loaded_on_every_rank_resumes_like_torch(pools, which):
    """It was refused at initialize ('already has state'); now each rank keeps its slice of it."""
    for r in pools.get(2).run(migrate, which, timeout=120):
        torch.testing.assert_close(r["losses"], r["plain"], rtol=1e-6, atol=1e-6)
        assert r["weight_err"] < 1e-6, r
