"""Nodes from torchrun's environment, and the hpZ group size (topology.py); the secondary slices (sharding.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from zero3 import ZeroConfigError
from zero3.partition import sharding
from zero3.comm.topology import AUTO, hpz_group_size, node_identity, node_ids


def test_torchruns_group_rank_tells_two_agents_on_one_host_apart(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "1")
    one = node_identity()
    monkeypatch.setenv("GROUP_RANK", "0")
    assert node_identity() != one
    monkeypatch.delenv("GROUP_RANK")
    assert "/node" not in node_identity()  # ranks a script spawns itself on one host: one node
    assert node_ids(["h/node0", "h/node0", "h/node1", "h/node1"]) == (0, 0, 1, 1)
    assert node_ids(["b", "a", "b"]) == (0, 1, 0)


@pytest.mark.parametrize("requested,nodes,expected", [
    (1, (0, 0, 1, 1), 1),
    (AUTO, (0, 0, 1, 1), 2),
    (AUTO, (0, 0, 0, 0, 1, 1, 1, 1), 4),
    (2, (0, 0, 0, 0, 1, 1, 1, 1), 2),  # smaller than a node: allowed
    (AUTO, (0, 0, 0, 0), 1),  # one node: the secondary group would be the primary one
    (4, (0, 0, 1, 1), 1),
    (AUTO, (0,), 1),
])
def test_hpz_group_size(requested, nodes, expected):
    assert hpz_group_size(requested, nodes) == expected


@pytest.mark.parametrize("requested,nodes,needle", [
    (3, (0, 0, 1, 1), "zero_hpz_partition_size=3 must divide the data-parallel world size 4"),
    (8, (0, 0, 1, 1), "zero_hpz_partition_size=8 must divide"),
    (AUTO, (0, 0, 0, 1), "nodes hold {0: 3, 1: 1} ranks"),
    (AUTO, (0, 1, 0, 1), "consecutive"),
])
def test_hpz_group_size_refuses_layouts_it_cannot_split(requested, nodes, needle):
    with pytest.raises(ZeroConfigError, match=needle.replace("{", r"\{").replace("}", r"\}")):
        hpz_group_size(requested, nodes)


def test_an_explicit_hpz_group_spanning_nodes_is_allowed_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="zero3.comm.topology"):
        assert hpz_group_size(2, (0, 1, 0, 1)) == 2
    assert "cross nodes" in caplog.text


@pytest.mark.parametrize("numel", [1, 5, 37, 296, 1000])
@pytest.mark.parametrize("world,group", [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_secondary_slices_are_whole_primary_shards_and_cover_the_tensor(numel, world, group):
    full = torch.arange(numel, dtype=torch.float32)
    s = sharding.shard_numel(numel, world)
    n = world // group
    pieces = []
    for local in range(group):
        lo, hi = sharding.secondary_range(numel, world, group, local)
        assert sharding.secondary_numel(numel, world, group) == n * s
        primary = torch.cat([sharding.shard_tensor(full, world, local * n + i) for i in range(n)])
        assert torch.equal(primary[: hi - lo], full[lo:hi])  # the same elements as n primary shards
        pieces.append(full[lo:hi])
    assert torch.equal(torch.cat(pieces), full)


def test_secondary_range_refuses_a_group_that_does_not_divide_the_world():
    with pytest.raises(ValueError, match="group_size must divide world_size 4, got 3"):
        sharding.secondary_numel(10, 4, 3)
