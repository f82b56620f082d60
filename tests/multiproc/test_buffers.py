"""Module buffers across ranks (runtime/buffers.py): rank 0's at ``initialize``; with
``broadcast_buffers`` the same as torch's DDP (whose default it is) on the same ranks and batches; without
it, each rank's running statistics follow its own batches, as in DeepSpeed and FSDP2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zero3

pytestmark = pytest.mark.multiproc


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.l2 = nn.Linear(16, 2)
        self.register_buffer("drawn", torch.randn(5))  # differs per rank when the seeds do

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.bn(self.l1(x))) + self.drawn[:2]


def _same(t: torch.Tensor) -> bool:
    ts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(ts, t.contiguous())
    return all(torch.equal(ts[0], u) for u in ts[1:])


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))


def buffers_against_ddp(broadcast: bool) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # a different model per rank: initialize takes rank 0's
    model = Net()
    torch.manual_seed(100)
    ref = DDP(Net(), broadcast_buffers=broadcast)  # DDP also starts from rank 0's module
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"param_persistence_threshold": 0, "broadcast_buffers": broadcast})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    start_same = _same(model.drawn) and torch.equal(model.drawn, ref.module.drawn)
    for step in range(3):
        x = _batch(step)
        if step == 1:  # two forwards in one step: DDP takes rank 0's buffers before each
            x2 = _batch(step + 10)
            engine.backward((engine(x) + engine(x2)).pow(2).mean())
            (ref(x) + ref(x2)).pow(2).mean().backward()
        else:
            engine.backward(engine(x).pow(2).mean())
            ref(x).pow(2).mean().backward()
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 1:  # each rank's own statistics now, before anything broadcasts them again
            mid = max((a - b).abs().max().item() for a, b in zip(
                [model.bn.running_mean, model.bn.running_var], [ref.module.bn.running_mean, ref.module.bn.running_var]))
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, ref_out = engine(torch.ones(2, 8)), ref(torch.ones(2, 8))
    stats = [model.bn.running_mean, model.bn.running_var]
    ref_stats = [ref.module.bn.running_mean, ref.module.bn.running_var]
    result = {
        "start_same": start_same,
        "stats_same_across_ranks": all(_same(t) for t in stats),
        "out_same_across_ranks": _same(out),
        "stats_vs_ddp": max((a - b).abs().max().item() for a, b in zip(stats, ref_stats)),
        "out_vs_ddp": (out - ref_out).abs().max().item(),
        "weights_vs_ddp": max((zero3.safe_get_full_fp32_param(p) - q.detach()).abs().max().item()
                              for p, q in zip(model.parameters(), ref.module.parameters())),
        "batches_tracked": int(model.bn.num_batches_tracked),
        "mid_vs_ddp": mid,
    }
    engine.remove_hooks()
    return result


def test_broadcast_buffers_matches_ddp(pools):
    for r in pools.get(2).run(buffers_against_ddp, True, timeout=120):
        assert r["start_same"]
        assert r["stats_same_across_ranks"] and r["out_same_across_ranks"]
        assert r["stats_vs_ddp"] <= 1e-6 and r["out_vs_ddp"] <= 1e-5 and r["weights_vs_ddp"] <= 1e-6, r
        assert r["batches_tracked"] == 4
        assert r["mid_vs_ddp"] <= 1e-6, r


def test_without_broadcast_each_rank_keeps_its_own_statistics_as_ddp_without_it(pools):
    for r in pools.get(2).run(buffers_against_ddp, False, timeout=120):
        assert r["start_same"]  # initialize: rank 0's, as DDP's construction
        assert not r["stats_same_across_ranks"] and not r["out_same_across_ranks"]
        assert r["mid_vs_ddp"] <= 1e-6
        assert r["stats_vs_ddp"] <= 1e-6 and r["out_vs_ddp"] <= 1e-5 and r["weights_vs_ddp"] <= 1e-6, r


def expanded_buffer() -> dict:
    """An expanded buffer (stride 0) cannot be written by anything (DDP's own broadcast raises on it):
    zero3 leaves it alone and syncs the others."""
    torch.manual_seed(100 + dist.get_rank())
    model = Net()
    model.register_buffer("ones", torch.ones(1, 2).expand(3, 2))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"broadcast_buffers": True})
    engine.backward(engine(_batch(0)).pow(2).mean())
    engine.step()
    model.eval()
    with torch.no_grad():
        engine(_batch(1))  # the first forward after one with gradients takes rank 0's statistics
    same = _same(model.drawn) and _same(model.bn.running_mean)
    alone = model.ones.stride() == (0, 1) and torch.equal(model.ones, torch.ones(3, 2))
    engine.remove_hooks()
    return {"same": same, "alone": alone}


def test_an_expanded_buffer_is_left_alone(pools):
    for r in pools.get(2).run(expanded_buffer, timeout=60):
        assert r["same"] and r["alone"], r


def buffers_of_byte_dtypes() -> dict:
    """float8 and uint16 buffers, different on each rank: gloo carries neither dtype, and initialize's
    broadcast of rank 0's values failed as a collective timeout that closed the group (probe 35C)."""
    rank = dist.get_rank()
    model = nn.Linear(4, 4)
    model.register_buffer("u16", torch.tensor([1, 2, 60000 + rank], dtype=torch.uint16))
    model.register_buffer("f8", torch.tensor([0.5, 1.0 + rank]).to(torch.float8_e4m3fn))
    model.register_buffer("f32", torch.full((2,), float(rank)))
    zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    return {"u16": model.u16.tolist(), "f8": model.f8.float().tolist(), "f32": model.f32.tolist()}


def test_buffers_of_dtypes_gloo_does_not_carry_take_rank_0s_values(pools):
    for r in pools.get(2).run(buffers_of_byte_dtypes, timeout=60):
        assert r == {"u16": [1, 2, 60000], "f8": [0.5, 1.0], "f32": [0.0, 0.0]}, r
