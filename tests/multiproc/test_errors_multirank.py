"""Bad input on several ranks: every rank gets the same clear error, nothing hangs."""

from __future__ import annotations

import pytest
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
