"""Bad input on several ranks: every rank gets the same clear error, nothing hangs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3

pytestmark = pytest.mark.multiproc


def group_mismatch() -> str:
    rank = dist.get_rank()
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    with zero3.Init():
        model = nn.Linear(8, 8)
    try:
        zero3.initialize(model, None, group=groups[rank])
    except zero3.ZeroConfigError as exc:
        return str(exc)
    return "no error"


def group_without_this_rank() -> list[str]:
    """Probe 29C: ``dist.new_group([0])`` is GroupMember.NON_GROUP_MEMBER on rank 1, where torch says
    world size -1 and zero3 raised "nodes must name the node of each of the -1 ranks, got []"."""
    g = dist.new_group([0])
    said = []
    for how in ("Init", "initialize"):
        try:
            if how == "Init":
                with zero3.Init(group=g):
                    nn.Linear(8, 8)
            else:
                model = nn.Linear(8, 8)
                zero3.initialize(model, None, group=g)
            said.append("no error")
        except zero3.ZeroConfigError as exc:
            said.append(str(exc))
    return said


def optimizer_reused() -> str:
    """Probe 30B: the optimizer of an engine whose hooks were removed, given to a new engine over the same
    model, holds the old engine's shards: refused with a bare "not a parameter of the model"."""
    import torch

    model = nn.Linear(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0})
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    engine.remove_hooks()
    try:
        zero3.initialize(model, opt, {"param_persistence_threshold": 0})
        said = "no error"
    except zero3.ZeroConfigError as exc:
        said = str(exc)
    zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    return said


def initialize_twice() -> str:
    model = nn.Linear(8, 8)
    zero3.initialize(model, None)
    try:
        zero3.initialize(model, None)
    except zero3.ZeroStateError as exc:
        return str(exc)
    return "no error"


def test_model_built_with_one_group_and_trained_with_another_raises_on_every_rank(pools):
    for msg in pools.get(2).run(group_mismatch):
        assert "world size 2" in msg and "world size 1" in msg, msg
        assert "the same mpu= to both" in msg, msg  # probe 30E: an mpu given to one of them is the usual cause


def test_a_rank_outside_the_group_it_passes_is_told_so(pools):
    inside, outside = pools.get(2).run(group_without_this_rank)
    assert inside == ["no error", "no error"]
    for msg in outside:
        assert "this rank (global rank 1) is not a member of the process group" in msg, msg


def test_an_optimizer_reused_for_a_new_engine_is_refused_saying_to_make_a_new_one(pools):
    for msg in pools.get(2).run(optimizer_reused):
        assert "not a parameter of the model" in msg and "give the new engine a new optimizer" in msg, msg


def test_initialize_twice_raises_on_every_rank(pools):
    for msg in pools.get(2).run(initialize_twice):
        assert "already called" in msg, msg


class _SparseLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 8) * 0.3)
        self.lin = nn.Linear(8, 8)

    def forward(self, idx: torch.Tensor, sparse: bool) -> torch.Tensor:
        return self.lin(nn.functional.embedding(idx, self.table, sparse=sparse))


class _LeafThenHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.leaf = _SparseLeaf()
        self.out = nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor, sparse: bool = False) -> torch.Tensor:
        return self.out(torch.tanh(self.leaf(idx, sparse))).pow(2).mean()


def refused_at_backward_end() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = _LeafThenHead(), _LeafThenHead()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    zero3.set_leaf_modules(model, [_SparseLeaf])
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0})
    g = torch.Generator().manual_seed(3)
    mine = slice(4 * rank, 4 * rank + 4)
    refused = ""
    try:
        model(torch.randint(0, 10, (4 * world, 3), generator=g)[mine], True).backward()
    except zero3.ZeroStateError as exc:
        refused = str(exc)
    engine.zero_grad()
    left = [n for n, p in model.named_parameters() if zero3.safe_get_full_grad(p) is not None]
    for _ in range(3):
        idx = torch.randint(0, 10, (4 * world, 3), generator=g)
        (sum(ref(idx[4 * r:4 * r + 4]) for r in range(world)) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(idx[mine]).backward()
        engine.step()
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"refused": refused, "left": left, "diff": diff}


def test_a_backward_refused_at_its_end_leaves_no_gradient_to_the_next_step(pools):
    """A leaf module's sparse gradient is refused as its unit lands, at the backward's end. Probe 35B:
    the head's gradients, queued before it, stayed in the reducer past ``engine.zero_grad()`` and were
    summed into the next backward's (9e-3 relative off torch's weights after 3 AdamW steps)."""
    for r in pools.get(2).run(refused_at_backward_end):
        assert "sparse" in r["refused"], r
        assert r["left"] == [] and r["diff"] < 1e-6, r


def refused_before_anything_changes(tmp: str) -> dict:
    """Probe 35F: refusals that came after the model was partitioned, or on one rank alone."""
    import zero3.offload.swapfile as swapfile
    rank = dist.get_rank()
    said: dict = {}
    # a swap directory one rank cannot make: that rank raised alone, after partitioning; the others waited
    makedirs = swapfile.os.makedirs

    def refusing(path, *args, **kwargs):
        if rank == 1 and "swap" in str(path):
            raise PermissionError(13, "Permission denied")
        return makedirs(path, *args, **kwargs)

    model = nn.Linear(4, 4)
    swapfile.os.makedirs = refusing
    try:
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         {"offload_optimizer": {"device": "nvme", "nvme_path": f"{tmp}/swap"}})
    except zero3.ZeroConfigError as exc:
        said["swap"] = str(exc)
    finally:
        swapfile.os.makedirs = makedirs
    said["swap_model_untouched"] = not zero3.is_zero_param(model.weight)
    # modifier_rank given differently on the ranks: each broadcast from its own, and both waited
    model = nn.Linear(4, 4)
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    try:
        with zero3.GatheredParameters([model.weight], modifier_rank=rank):
            pass
    except zero3.ZeroConfigError as exc:
        said["modifier"] = str(exc)
    # a parameter built under Init over another group: refused after the others were partitioned
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
    with zero3.Init(data_parallel_group=alone[rank]):
        head = nn.Linear(4, 2)
    model = nn.Sequential(nn.Linear(4, 4), head)
    try:
        zero3.initialize(model, None)
    except zero3.ZeroConfigError as exc:
        said["group"] = str(exc)
    said["group_model_untouched"] = not zero3.is_zero_param(model[0].weight)
    zero3.initialize(model, None, group=alone[rank])  # the retry with Init's group
    return said


def test_refusals_come_on_every_rank_before_the_model_changes(pools, tmp_path):
    for r in pools.get(2).run(refused_before_anything_changes, str(tmp_path)):
        assert "the config is invalid on rank 1: cannot create the swap directory" in r["swap"], r
        assert "differs between ranks (rank 0: 0, rank 1: 1)" in r["modifier"], r
        assert "parameter '1.weight' was partitioned over a group of world size 1" in r["group"], r
        assert r["swap_model_untouched"] and r["group_model_untouched"], r
