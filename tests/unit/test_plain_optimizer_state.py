"""An optimizer state saved by a plain torch run (full-size moments) is refused by a zero3
optimizer's ``load_state_dict`` before anything changes; before, it loaded and the next step failed
on a shape mismatch inside the optimizer (optim/rank_state.py [Note: per-rank optimizer state])."""

from __future__ import annotations

import copy

import pytest
import torch

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(block_size=16, n_layer=2, n_embd=32, n_head=2)


def test_a_plain_runs_optimizer_state_is_refused_and_changes_nothing():
    torch.manual_seed(0)
    plain = GPT(CFG)
    model = copy.deepcopy(plain)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    plain(*synthetic_batch(0, 2, CFG)).backward()
    plain_opt.step()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0})
    with pytest.raises(zero3.ZeroStateError, match=r"state 'exp_avg' of parameter 0 has shape \(\d+, 32\), but .*shard "
                                                    r"of shape \(\d+,\).*nothing was loaded"):
        opt.load_state_dict(plain_opt.state_dict())
    assert len(opt.state) == 0
    engine.backward(engine(*synthetic_batch(0, 2, CFG)))
    engine.step()
    own = opt.state_dict()
    assert own["zero3"] == {"rank": 0, "world_size": 1}
    opt.load_state_dict(own)  # its own state loads


def test_with_the_optimizer_state_on_nvme_state_dict_and_load_are_refused(tmp_path):
    """Between steps the state lives on the drive: ``state_dict()`` handed out empty tensors (0-byte
    storages of the right shape), which ``torch.save`` wrote without a word."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0,
                                           "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}})
    engine.backward(engine(*synthetic_batch(0, 2, CFG)))
    engine.step()
    with pytest.raises(zero3.ZeroStateError, match=r"state_dict\(\): with offload_optimizer on NVMe.*save_checkpoint"):
        opt.state_dict()
    with pytest.raises(zero3.ZeroStateError, match=r"load_state_dict\(\): with offload_optimizer on NVMe.*nothing was"):
        opt.load_state_dict({"state": {}, "param_groups": opt.param_groups})
    engine.backward(engine(*synthetic_batch(1, 2, CFG)))
    assert engine.step()


def test_while_offload_states_holds_the_state_on_nvme_state_dict_and_load_are_refused(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0})
    engine.backward(engine(*synthetic_batch(0, 2, CFG)))
    engine.step()
    saved = opt.state_dict()
    engine.offload_states(device="nvme", nvme_path=str(tmp_path))
    with pytest.raises(zero3.ZeroStateError, match=r"state_dict\(\): the optimizer state is out of memory.*reload_states"):
        opt.state_dict()
    with pytest.raises(zero3.ZeroStateError, match=r"load_state_dict\(\): the optimizer state is out of memory.*nothing"):
        opt.load_state_dict(saved)
    engine.reload_states()
    again = opt.state_dict()
    assert all(torch.equal(again["state"][i]["exp_avg"], saved["state"][i]["exp_avg"]) for i in saved["state"])
    opt.load_state_dict(saved)
