"""An optimizer state saved by a plain torch run (full-size moments) is refused by a zero3
optimizer's ``load_state_dict`` before anything changes; before, it loaded and the next step failed
on a shape mismatch inside the optimizer (optim/rank_state.py [Note: per-rank optimizer state])."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import zero3
from _reference import step_both
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


def _loss_weighted_run(directory, steps: int, resume: bool, zero: bool) -> list[float]:
    """A linear model and a plain tensor of per-output loss weights added with add_param_group (a
    learnable loss weighting); zero3 saves at step 3 and resumes into a new engine when ``resume``."""
    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
        engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0}) if zero else None
        w = torch.zeros(3, requires_grad=True)
        opt.add_param_group({"params": [w], "lr": 0.1})
        return model, engine, opt, w

    model, engine, opt, w = build(0)
    losses = []
    for i in range(steps):
        if resume and i == 3:
            engine.save_checkpoint(directory, client_state={"w": w.detach().clone()})
            model, engine, opt, w = build(1)
            _, client = engine.load_checkpoint(directory)
            with torch.no_grad():
                w.copy_(client["w"])
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
        loss = (((engine or model)(x) - y) ** 2).mean(0).mul(w.exp()).sum()
        if engine is not None:
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_state_of_a_plain_tensor_added_to_the_optimizer_survives_a_checkpoint(tmp_path):
    """Its AdamW state was dropped by save_checkpoint (its group's lr was kept), and the resumed run
    left torch's from the first step after the load (2.75094 against 2.76934)."""
    plain = _loss_weighted_run(tmp_path, 6, resume=False, zero=False)
    straight = _loss_weighted_run(tmp_path, 6, resume=False, zero=True)
    resumed = _loss_weighted_run(tmp_path, 6, resume=True, zero=True)
    torch.testing.assert_close(straight, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(resumed, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("zcfg", [
    {"param_persistence_threshold": 0},
    {},  # every parameter persistent
    {"param_persistence_threshold": 0, "bf16": {"enabled": True}},  # fp32 masters in flat buffers
    {"param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}},
    {"param_persistence_threshold": 0, "offload_optimizer": {"device": "nvme"}},
], ids=["threshold 0", "persistent", "bf16", "offload cpu", "offload nvme"])
def test_an_optimizer_whose_constructor_made_its_state_trains_like_torch(zcfg, tmp_path):
    """torch's Adagrad makes ``step`` 0 and ``sum`` for every parameter in its constructor: built over a
    plain model, as a DDP user builds it, ``initialize`` refused it as an optimizer that had stepped.
    The constructor's state is now re-keyed to each shard, sliced; a frozen parameter's is dropped."""
    if zcfg.get("offload_optimizer", {}).get("device") == "nvme":
        zcfg = {**zcfg, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref.wpe.weight.requires_grad_(False)
    model.wpe.weight.requires_grad_(False)
    kw = dict(lr=0.05, initial_accumulator_value=0.3, lr_decay=0.01, eps=1e-6)
    ref_opt = torch.optim.Adagrad(ref.parameters(), **kw)
    opt = torch.optim.Adagrad(model.parameters(), **kw)
    engine = zero3.initialize(model, opt, zcfg)
    bf16 = "bf16" in zcfg
    for step in range(3):
        x, y = synthetic_batch(step, 2, CFG)
        if bf16:  # its forwards differ from torch's fp32 ones: the state is checked below
            engine.backward(engine(x, y))
            engine.step()
        else:
            step_both(ref, ref_opt, engine, x, y, rtol=1e-6)
    if bf16:  # bf16 forwards differ from torch's fp32 ones: the state is the fp32 masters', sliced from 0.3
        for p in engine.params:
            state = engine.optimizer_state(p)
            assert (not state) if not p.requires_grad else (state["sum"].dtype == torch.float32 and
                                                              state["sum"].shape == engine.master_shard(p).shape)
            if p.requires_grad:
                mine = state["sum"][: p._zero.shard_range()[1] - p._zero.shard_range()[0]]
                assert bool((mine >= 0.3).all()) and bool((mine > 0.3).any()), p._zero.name
        return
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(zero3.safe_get_full_fp32_param(p), r.detach(), rtol=1e-5, atol=1e-6, msg=name)
        if p.requires_grad:
            torch.testing.assert_close(zero3.safe_get_full_optimizer_state(p, "sum"), ref_opt.state[r]["sum"],
                                       rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0-d", "(1,)", "(1, 1)"])
def test_constructor_state_of_a_one_element_parameter_is_resharded_too(shape):
    """A parameter of one element has a ``sum`` of one element: it was taken for a step counter and
    kept at the full parameter's shape, against a padded shard (review of round 23)."""
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.s = nn.Parameter(torch.full(shape, 0.9))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.lin(x) * self.s.reshape(-1)[0]).pow(2).mean()

    torch.manual_seed(0)
    ref = Scaled()
    model = copy.deepcopy(ref)
    kw = dict(lr=0.05, initial_accumulator_value=0.3, eps=1e-6)
    ref_opt = torch.optim.Adagrad(ref.parameters(), **kw)
    engine = zero3.initialize(model, torch.optim.Adagrad(model.parameters(), **kw), {"param_persistence_threshold": 0})
    for step in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        ref_loss = ref(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    assert engine.optimizer_state(model.s)["sum"].shape == engine.master_shard(model.s).shape
    torch.testing.assert_close(zero3.safe_get_full_optimizer_state(model.s, "sum"), ref_opt.state[ref.s]["sum"])


_OPTIMIZERS = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=3e-3, eps=1e-6),
               "SGD momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}


def _plain_run(make_opt, frozen: bool) -> tuple[list[float], dict, dict, GPT]:
    """Plain torch, 6 steps: the losses, the weights and ``opt.state_dict()`` after 3, the model."""
    torch.manual_seed(0)
    model = GPT(CFG)
    model.wpe.weight.requires_grad_(not frozen)
    opt = make_opt(model.parameters())
    losses = []
    for step in range(6):
        loss = model(*synthetic_batch(step, 2, CFG))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 2:
            weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    return losses, weights, state, model


@pytest.mark.parametrize("zcfg", [
    {"param_persistence_threshold": 0},
    {"param_persistence_threshold": 0, "init": True, "frozen": True},  # built under zero3.Init, wpe frozen
    {},  # every parameter persistent
    {"param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}},  # separate fp32 masters
    {"param_persistence_threshold": 0, "offload_optimizer": {"device": "nvme"}, "sub_group_size": 3000},
], ids=["threshold 0", "Init, frozen", "persistent", "offload cpu", "offload nvme"])
@pytest.mark.parametrize("which", sorted(_OPTIMIZERS))
def test_a_plain_torch_runs_optimizer_state_loaded_before_initialize_resumes_exactly(zcfg, which, tmp_path):
    """Migrating from plain torch (or DDP, FSDP2's full state dict): ``opt.load_state_dict(sd)`` before
    ``initialize``, the weights with ``zero3.pretrained.load_state_dict``. It was refused ('already has
    state'), and the documented way round it (``safe_set_full_optimizer_state`` after initialize)
    raised KeyError on a fresh engine; the state is now sliced to each shard, and 3 more steps equal
    the uninterrupted 6-step torch run."""
    zcfg = dict(zcfg)
    init, frozen = zcfg.pop("init", False), zcfg.pop("frozen", False)
    if "offload_optimizer" in zcfg and zcfg["offload_optimizer"]["device"] == "nvme":
        zcfg["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    make_opt = _OPTIMIZERS[which]
    losses, weights, state, ref = _plain_run(make_opt, frozen)
    torch.manual_seed(1)  # other initial weights: the loaded ones must win
    with zero3.Init() if init else contextlib.nullcontext():
        model = GPT(CFG)
    model.wpe.weight.requires_grad_(not frozen)
    opt = make_opt(model.parameters())
    opt.load_state_dict(state)
    engine = zero3.initialize(model, opt, zcfg)
    zero3.pretrained.load_state_dict(engine, weights)
    got = _steps_3_to_5(engine)
    torch.testing.assert_close(got, losses[3:], rtol=1e-6, atol=1e-6)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(zero3.safe_get_full_fp32_param(p), r.detach(), rtol=1e-5, atol=1e-6, msg=name)


def _steps_3_to_5(engine) -> list[float]:
    """The losses of the steps after the plain run's three, as the uninterrupted run took them."""
    got = []
    for step in range(3, 6):
        loss = engine(*synthetic_batch(step, 2, CFG))
        engine.backward(loss)
        engine.step()
        got.append(loss.item())
    return got


def test_a_plain_torch_runs_adamw_state_under_bf16_is_kept_in_fp32_on_the_masters():
    """bf16: the loaded state is keyed to each fp32 master and kept in fp32, equal to torch's; the next
    steps follow torch's fp32 run as closely as bf16 forwards do."""
    losses, weights, state, ref = _plain_run(_OPTIMIZERS["AdamW"], frozen=False)
    model = GPT(CFG)
    opt = _OPTIMIZERS["AdamW"](model.parameters())
    opt.load_state_dict(state)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0, "bf16": {"enabled": True}})
    zero3.pretrained.load_state_dict(engine, weights)
    for i, p in enumerate(model.parameters()):
        assert engine.optimizer_state(p)["exp_avg"].dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(zero3.safe_get_full_optimizer_state(p, key), state["state"][i][key]), (i, key)
    got = _steps_3_to_5(engine)
    torch.testing.assert_close(got, losses[3:], rtol=2e-2, atol=0)


def test_optimizer_state_without_an_exact_slice_is_refused_and_changes_nothing():
    """A state loaded for another model (torch's load_state_dict checks no shapes): a momentum buffer
    of shape (8, 6) for a (16, 6) weight has no slice per rank; refused naming the parameter, the key
    and the shape, before the model is partitioned."""
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    other(torch.randn(2, 6)).sum().backward()
    other_opt.step()
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(other_opt.state_dict())
    with pytest.raises(zero3.ZeroStateError, match=r"state 'momentum_buffer' of shape \(8, 6\) for parameter "
                                                    r"0.weight of shape \(16, 6\).*Nothing was changed"):
        zero3.initialize(model, opt, {"param_persistence_threshold": 0})
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert opt.state[model[0].weight]["momentum_buffer"].shape == (8, 6)


def test_a_setter_on_a_fresh_engine_says_how_to_bring_a_state_in():
    """api.md sent users to safe_set_full_optimizer_state after initialize, where no state exists yet
    (probe 32P: 12 of 12 calls raised a bare KeyError); the error names the path that works now."""
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"param_persistence_threshold": 0})
    p = model.wte.weight
    with pytest.raises(KeyError, match=r"none yet.*load it into the optimizer before zero3.initialize"):
        zero3.safe_set_full_optimizer_state(p, torch.zeros(p.ds_shape), "exp_avg")
    del engine
