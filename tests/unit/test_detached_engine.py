"""An engine whose hooks were removed, and a model another engine manages: what a user meets there is
refused by name or made safe (each of these was a silent wrong result, a crash or an obscure error)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero3
from zero3 import ZeroStateError

TIGHT = {"param_persistence_threshold": 0, "max_live_parameters": 0, "max_reuse_distance": 0,
         "prefetch_bucket_size": 0}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _engine(model: nn.Module, cfg: dict | None = None) -> zero3.Engine:
    return zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), TIGHT if cfg is None else cfg)


def test_every_training_call_of_an_engine_after_remove_hooks_is_refused_by_name():
    model = _model()
    engine = _engine(model)
    loss = engine(torch.randn(2, 8)).sum()
    engine.backward(loss)
    engine.step()
    pending = engine(torch.randn(2, 8)).sum()
    engine.remove_hooks()
    for what, call in [("engine.backward()", lambda: engine.backward(pending)), ("engine.step()", engine.step),
                       ("engine.forward()", lambda: engine(torch.randn(2, 8))),
                       ("engine.offload_states()", engine.offload_states)]:
        with pytest.raises(ZeroStateError, match=rf"{what.replace('(', '[(]').replace(')', '[)]')} after "
                                                 r"engine.remove_hooks\(\)"):
            call()
    with pytest.raises(ZeroStateError, match=r"engine.generation\(\) after engine.remove_hooks"):
        with engine.generation():
            pass
    with pytest.raises(ZeroStateError, match="clip_grad_norm_ of an engine whose hooks were removed"):
        zero3.clip_grad_norm_(engine, 1.0)
    with pytest.raises(ZeroStateError, match="clip_grad_norm_ of the parameters of an engine whose hooks were removed"):
        zero3.clip_grad_norm_(model.parameters(), 1.0)
    assert engine.global_steps == 1
    again = _engine(model)
    engine.remove_hooks()  # a second removal by the old engine leaves the new one alone
    again(torch.randn(2, 8))


def test_a_backward_through_a_forward_from_before_remove_hooks_is_refused():
    model = _model()
    engine = _engine(model)
    pending = engine(torch.randn(2, 8)).sum()
    engine.remove_hooks()
    with pytest.raises(ZeroStateError, match="through a forward run before engine.remove_hooks"):
        pending.backward()
    assert all(p.grad is None for p in model.parameters())


def test_remove_hooks_brings_offloaded_states_back_so_a_new_engine_trains_on_them(tmp_path):
    model, plain = _model(), _model()
    engine = _engine(model)
    x = torch.randn(2, 8)
    want = plain(x)
    assert engine.offload_states(device="nvme", nvme_path=str(tmp_path)) > 0  # CPU offload moves nothing here
    engine.remove_hooks()  # crashed (a gather from freed storage) once the next engine ran
    engine2 = _engine(model)
    assert torch.equal(engine2(x), want)
    loss = engine2(x).sum()
    engine2.backward(loss)
    engine2.step()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(x).sum().backward()
    opt.step()
    with zero3.GatheredParameters(list(model.parameters())):
        assert all(torch.allclose(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_initialize_refuses_a_wrapper_or_a_part_of_a_model_another_engine_manages():
    inner = _model()
    _engine(inner)
    with pytest.raises(ZeroStateError, match="submodule 'inner' is already managed by an engine"):
        _engine(nn.ModuleDict({"inner": inner}))
    with pytest.raises(ZeroStateError, match="parameter 'weight' belongs to an engine over another model"):
        _engine(inner[0])


def test_gradients_left_on_the_parameters_before_initialize_do_not_reach_the_first_step():
    model, plain = _model(), _model()
    x = torch.randn(2, 8)
    model(x).sum().backward()  # a plain backward before the engine exists
    engine = _engine(model)
    engine.optimizer.zero_grad()
    engine.backward(engine(x).sum())
    engine.step()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(x).sum().backward()  # and torch's optimizer.zero_grad() before it would have dropped the first
    opt.step()
    with zero3.GatheredParameters(list(model.parameters())):
        assert all(torch.allclose(a, b) for a, b in zip(model.parameters(), plain.parameters()))


def test_the_drop_of_stale_gradients_is_logged(caplog):
    model = _model()
    model(torch.randn(2, 8)).sum().backward()
    with caplog.at_level(logging.WARNING, logger="zero3"):
        _engine(model)
    assert "parameters ['0.weight', '0.bias', '2.weight'] ... hold gradients from an earlier backward" in caplog.text
    assert all(p.grad is None for p in model.parameters())


def test_after_remove_hooks_the_gradients_left_in_shards_can_be_cleared_as_in_torch():
    """A backward, then remove_hooks: no engine steps the shards' gradients any more, so p.grad = None
    and model.zero_grad() are the user's again (they were refused, pointing at an accessor that
    refuses a parameter of no engine)."""
    model = _model()
    engine = _engine(model)
    engine.backward(engine(torch.randn(2, 8)).sum())
    with pytest.raises(ZeroStateError, match="safe_set_full_grad"):
        model[0].weight.grad = None  # while the engine would step them: refused
    engine.remove_hooks()
    model[0].weight.grad = None
    model.zero_grad()
    assert model[0].weight.grad is None


@pytest.mark.parametrize("offload", [None, "cpu", "nvme"])
def test_a_bf16_model_initialized_again_after_remove_hooks_keeps_its_fp32_masters(offload, tmp_path):
    """The new engine's masters were seeded from the bf16 shards: the trained fp32 masters rounded to bf16,
    8.4e-4 off (probe 31H). On the drive (nvme) the old masters are not read back: rounded, as before."""
    torch.manual_seed(0)
    with zero3.Init():
        model = _model()
    cfg = {"param_persistence_threshold": 0, "dtype": "bf16"}
    if offload is not None:
        cfg["offload_optimizer"] = {"device": offload, "nvme_path": str(tmp_path)} if offload == "nvme" else offload
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), cfg)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 8, generator=g).bfloat16()).float().square().mean())
        engine.step()
    before = [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    assert any(not torch.equal(b, b.bfloat16().float()) for b in before)  # finer than bf16: the case that matters
    engine.remove_hooks()
    again = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), cfg)
    after = [zero3.safe_get_full_fp32_param(p) for p in model.parameters()]
    if offload == "nvme":
        assert all(torch.equal(a, b.bfloat16().float()) for a, b in zip(after, before))
    else:
        assert all(torch.equal(a, b) for a, b in zip(after, before))
    again.backward(again(torch.randn(4, 8, generator=g).bfloat16()).float().square().mean())
    again.step()


@pytest.mark.parametrize("before,after", [("cpu", None), ("none", "cpu"), ("cpu", "cpu")])
def test_a_new_engine_without_the_earlier_engines_offloaded_masters_steps_the_weights(before, after):
    """An engine with offload_optimizer cpu, removed, then one without: the new engine's gradients went
    to the old engine's CPU masters (train_tensor), and the weights never moved: 0.024 off torch after
    3 SGD steps (review 31RD)."""
    model = _model()
    zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     {"param_persistence_threshold": 0, "offload_optimizer": {"device": before}}).remove_hooks()
    cfg: dict = {"param_persistence_threshold": 0}
    if after is not None:
        cfg["offload_optimizer"] = {"device": after}
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(3, 8, generator=g)
        engine.backward(engine(x).square().mean())
        engine.step()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with zero3.GatheredParameters(list(model.parameters())):
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
