"""Issue 19 items 1, 3 and 8 in one process: a launcher's ``WORLD_SIZE`` > 1 without the environment
to make the default group is refused (naming what is missing) instead of running a world of one;
the config digest and the named differences the ranks agree on; verification on by default."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3
from zero3 import ZeroConfig, ZeroConfigError
from zero3.comm.agreement import agree_on_config, config_digest, differing_keys
from zero3.comm.settings import CommSettings


@pytest.fixture
def two_ranks_without_master(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert not dist.is_initialized()


def test_init_with_world_size_two_and_no_master_address_names_what_is_missing(two_ranks_without_master):
    with pytest.raises(ZeroConfigError, match=r"zero3.Init: WORLD_SIZE=2 but no process group exists and "
                                              r"MASTER_ADDR, MASTER_PORT are not set"):
        zero3.Init()
    assert not dist.is_initialized()


def test_initialize_with_world_size_two_and_no_rank_names_it_and_leaves_the_model(monkeypatch,
                                                                                 two_ranks_without_master):
    monkeypatch.delenv("RANK")
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    with pytest.raises(ZeroConfigError, match=r"zero3.initialize: .*RANK, MASTER_ADDR, MASTER_PORT are not set"):
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not dist.is_initialized() and not zero3.is_partitioned(model.weight)
    assert torch.equal(model.weight.detach(), before)


def test_a_world_of_one_needs_no_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with zero3.Init():
        model = nn.Linear(4, 4)
    assert zero3.initialize(model).world_size == 1 and not dist.is_initialized()


def test_a_world_size_that_is_not_a_number_is_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ZeroConfigError, match="WORLD_SIZE='two'"):
        zero3.Init()


def test_init_distributed_is_public():
    assert "init_distributed" in zero3.__all__ and callable(zero3.init_distributed)


def test_equal_configs_have_equal_digests_and_a_changed_knob_changes_it():
    a = ZeroConfig.from_dict({"max_live_parameters": 10, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    b = ZeroConfig.from_dict({"optimizer": {"params": {"lr": 1e-3}, "type": "AdamW"}, "max_live_parameters": 10})
    assert config_digest(a) == config_digest(b)
    assert config_digest(a) != config_digest(a.replace(max_live_parameters=11))


def test_differing_keys_names_every_key_that_is_not_the_same_everywhere():
    dicts = [{"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 5, "c": 3}, {"a": 1, "b": 2}]
    assert differing_keys(dicts) == ["b", "c"]
    assert differing_keys([{"a": 1}, {"a": 1}]) == []


def test_one_rank_raises_its_own_config_error():
    err = ZeroConfigError("bad")
    with pytest.raises(ZeroConfigError, match="bad") as info:
        agree_on_config(None, None, err, "zero3.Init")
    assert info.value is err
    agree_on_config(None, ZeroConfig(), None, "zero3.Init")


def test_verification_is_on_by_default_and_false_turns_it_off():
    assert CommSettings().verify is True and CommSettings(verify=None).verify is True  # type: ignore[arg-type]
    assert CommSettings.from_config(ZeroConfig()).verify is True
    assert CommSettings.from_config(ZeroConfig(verify_collectives=False)).verify is False
    assert CommSettings.model_parallel(ZeroConfig()).verify is True


def test_each_ranks_swap_directory_may_differ_and_nothing_else():
    a = ZeroConfig(offload_optimizer="nvme", offload_optimizer_nvme_path="/tmp/rank0")
    assert config_digest(a) == config_digest(a.replace(offload_optimizer_nvme_path="/tmp/rank1"))
    assert config_digest(a) != config_digest(a.replace(offload_optimizer="cpu", offload_optimizer_nvme_path=None))
