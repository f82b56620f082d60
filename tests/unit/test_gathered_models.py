"""GatheredParameters over parameters of several models (runtime/gathered.py): one nested context per
model. What must stay refused or all-or-nothing there, at world size 1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero3
from zero3 import ZeroConfigError, ZeroStateError


def _engine() -> tuple[nn.Module, zero3.Engine]:
    with zero3.Init():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})


def test_fwd_module_with_another_engine_s_parameter_is_refused_and_both_engines_still_run():
    """Registering B's weight as an external parameter of A's module broke every later forward of A
    ('missing from trace.params')."""
    a, ea = _engine()
    b, eb = _engine()
    with pytest.raises(ZeroConfigError, match=r"fwd_module=.*several models.*nothing was registered"):
        zero3.GatheredParameters([a[2].weight, b[2].weight], fwd_module=a[2])
    x = torch.randn(2, 8)
    for engine in (ea, eb):
        engine.backward(engine(x).sum())
        engine.step()


def test_a_refused_new_shape_in_one_model_publishes_nothing_of_the_others():
    """The parts exited in turn: B's write was kept while A's (a new shape after initialize) was refused."""
    a, _ = _engine()
    b, _ = _engine()
    with zero3.GatheredParameters([a[0].weight, a[2].weight]):
        a_before = [a[0].weight.detach().clone(), a[2].weight.detach().clone()]
    with zero3.GatheredParameters([b[0].weight]):
        b_before = b[0].weight.detach().clone()
    with pytest.raises(ZeroStateError, match=r"0.weight was given data of shape \(20, 8\)"):
        with zero3.GatheredParameters([a[0].weight, a[2].weight, b[0].weight], modifier_rank=0), torch.no_grad():
            b[0].weight.add_(1)
            a[2].weight.add_(1)
            a[0].weight.data = torch.zeros(20, 8)
    with zero3.GatheredParameters([a[0].weight, a[2].weight, b[0].weight]):
        assert torch.equal(b[0].weight, b_before)
        assert torch.equal(a[2].weight, a_before[1]) and torch.equal(a[0].weight, a_before[0])


def test_the_guard_s_hint_about_modules_added_after_initialize_appears_only_inside_a_forward():
    with zero3.Init():
        model = nn.Sequential(nn.Linear(8, 16))
    with pytest.raises(ZeroStateError) as plain:
        model[0].weight.norm()
    assert "no zero3.initialize has taken" not in str(plain.value)


def test_discarded_writes_in_two_models_are_both_reported_and_everything_is_released():
    """The first model's error made the second model's context skip its own check: one write unreported."""
    a, ea = _engine()
    b, eb = _engine()
    with pytest.raises(ZeroStateError) as err:
        with zero3.GatheredParameters([a[2].weight, b[0].weight]), torch.no_grad():
            a[2].weight.add_(1)
            b[0].weight.add_(1)
    assert str(err.value).count("changed inside the context") == 2, err.value
    assert not ea.coordinator.live_params and not eb.coordinator.live_params


@pytest.mark.parametrize("threshold", [0, 10])  # every parameter partitioned; the biases kept gathered
def test_a_timm_style_ema_through_state_dict_copies_follows_torch(threshold):
    """Probe 36H: inside ``GatheredParameters(..., modifier_rank=0)`` ``state_dict()`` hands out copies of
    the partitioned parameters, and timm's EMA (``ev.copy_(...)`` over ``ema.state_dict().values()``,
    the dict dropped inside the block) wrote into them: the EMA never moved, or moved in its persistent
    parameters only. A written copy is taken into its parameter before the block publishes."""
    config = {"param_persistence_threshold": threshold}
    torch.manual_seed(0)
    with zero3.Init():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    torch.manual_seed(1)
    with zero3.Init():
        ema = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    zero3.initialize(ema, None, config)
    with zero3.GatheredParameters(list(model.parameters()) + list(ema.parameters())):
        ref, ref_ema = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        ref.load_state_dict(model.state_dict())
        ref_ema.load_state_dict(ema.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for _ in range(3):
        engine.backward(engine(x).pow(2).sum())
        engine.step()
        ref(x).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            with zero3.GatheredParameters(list(ema.parameters()) + list(model.parameters()), modifier_rank=0):
                for ev, mv in zip(ema.state_dict().values(), model.state_dict().values()):
                    ev.copy_(0.8 * ev + 0.2 * mv)
            for ev, mv in zip(ref_ema.state_dict().values(), ref.state_dict().values()):
                ev.copy_(0.8 * ev + 0.2 * mv)
    with zero3.GatheredParameters(list(ema.parameters())):
        for k, v in ema.state_dict().items():
            torch.testing.assert_close(v, ref_ema.state_dict()[k], rtol=1e-6, atol=1e-7, msg=k)
    # without modifier_rank such a write is discarded, and said so, as a write through the parameter is
    with pytest.raises(ZeroStateError, match=r"0\.weight.*changed inside the context.*modifier_rank=0"):
        with zero3.GatheredParameters(list(ema.parameters())):
            ema.state_dict()["0.weight"].zero_()
    with zero3.GatheredParameters(list(ema.parameters())):  # kept its values; an unwritten copy says nothing
        assert torch.equal(ema.state_dict()["0.weight"], ref_ema[0].weight)


def test_a_copy_written_beside_a_direct_write_is_refused_and_nested_blocks_take_a_copy_once():
    """Review 36R2: the written copy went into the parameter over a direct ``mul_`` made after it (the
    direct write lost, silently); an enclosing block took the copy an inner modifier block had already
    published (over a later direct write), or, without modifier_rank, called it a discarded write."""
    model, _ = _engine()
    with zero3.GatheredParameters(list(model.parameters())):
        w0 = model[0].weight.detach().clone()
    with torch.no_grad():
        with pytest.raises(ZeroStateError, match=r"0\.weight was written both through a state_dict\(\) copy and "
                                                 r"directly.*nothing of the block's parameters of this model was "
                                                 r"published"):
            with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
                model.state_dict()["0.weight"].add_(1.0)
                model[0].weight.mul_(2.0)
        with zero3.GatheredParameters(list(model.parameters())):
            assert torch.equal(model[0].weight, w0)
        with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):  # as torch: 2 * (w0 + 1)
            with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
                model.state_dict()["0.weight"].add_(1.0)
            model[0].weight.mul_(2.0)
        with zero3.GatheredParameters(list(model.parameters())):  # read-only outside: kept, nothing raised
            with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
                model.state_dict()["0.weight"].sub_(2.0)
        with zero3.GatheredParameters(list(model.parameters())):
            torch.testing.assert_close(model[0].weight, 2 * (w0 + 1) - 2, rtol=0, atol=1e-6)


def test_a_persistent_copy_written_in_a_read_only_block_is_kept_as_a_direct_write_is():
    """Review 36R2: at world size 1 under bf16 a persistent parameter's state_dict() entry is a copy (its
    storage holds every shard); written inside a block without modifier_rank it was dropped silently, where
    a direct write to the parameter is kept (taken at the next step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0),
                              {"param_persistence_threshold": 20, "bf16": {"enabled": True}})
    bias = model[0].bias.detach().clone()
    with torch.no_grad(), zero3.GatheredParameters(list(model.parameters())):
        entry = model.state_dict()["0.bias"]
        assert entry.data_ptr() != model[0].bias.data_ptr()  # a copy here
        entry.add_(1.0)
    engine.backward(engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum())
    engine.step()
    torch.testing.assert_close(model[0].bias.float(), bias.float() + 1, rtol=0, atol=1e-2)


def test_a_second_pass_over_the_state_dict_sees_the_first_and_a_block_that_raised_publishes_nothing():
    """Review 36R3: three passes of writes through state_dict() in one block gave one pass's result (each
    pass copied the old values); an outer block published the copy written in an inner one that raised."""
    model, _ = _engine()
    with zero3.GatheredParameters(list(model.parameters())):
        w0 = model[0].weight.detach().clone()
    with torch.no_grad():
        with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
            for _ in range(3):
                model.state_dict()["0.weight"].mul_(0.5)
        with zero3.GatheredParameters(list(model.parameters())):
            torch.testing.assert_close(model[0].weight, w0 / 8, rtol=0, atol=0)
        with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
            with pytest.raises(RuntimeError, match="inside"):
                with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
                    model.state_dict()["0.weight"].zero_()
                    raise RuntimeError("an error inside the inner block")
        with zero3.GatheredParameters(list(model.parameters())):
            torch.testing.assert_close(model[0].weight, w0 / 8, rtol=0, atol=0)


def test_a_conflict_stays_through_later_copies_and_an_exited_block_s_copies_are_gone():
    """Review 36R4: a third state_dict() after a copy write and a direct write took a later copy and
    refreshed the conflicting record, so the exit published the first copy alone; and while an unrelated
    block was open, the copies of a block that had exited stayed recorded (200 EMA blocks held 200 copies
    of the model) and a dict of that block, written later, was taken by the next block over the model."""
    from zero3.runtime import handed_copies

    model, _ = _engine()
    other, _ = _engine()
    with zero3.GatheredParameters(list(model.parameters())):
        w0 = model[0].weight.detach().clone()
    with torch.no_grad():
        with pytest.raises(ZeroStateError, match="written both through a state_dict"):
            with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
                model.state_dict()["0.weight"].add_(1.0)
                model[0].weight.mul_(2.0)
                model.state_dict()["0.weight"].add_(10.0)
                model.state_dict()
        with pytest.raises(ZeroStateError, match=r"or through another copy\) inside the block, which write came last"):
            with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):  # torch: the last written wins
                first, second = model.state_dict(), model.state_dict()
                second["0.weight"].fill_(2.0)
                first["0.weight"].fill_(1.0)
        with zero3.GatheredParameters(list(other.parameters())):  # an unrelated block, open throughout
            for _ in range(3):
                with zero3.GatheredParameters(list(model.parameters())):
                    kept = model.state_dict()
            assert not handed_copies._BY_PARAM
            kept["0.weight"].zero_()  # the user's own dict now, outside any block of the model
            with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):
                model.state_dict()
        with zero3.GatheredParameters(list(model.parameters())):
            assert torch.equal(model[0].weight, w0)


def test_a_parameter_named_several_times_is_gathered_once_and_released_at_the_end():
    """The fetch dedups by id now (a scan per entry took 3.9 s to enter a block of 16k tensors); still once each."""
    model, engine = _engine()
    w, b = model[0].weight, model[2].bias
    before = engine.coordinator.metrics.demand_fetches
    with zero3.GatheredParameters([w, w, b, w, b]):
        assert engine.coordinator.metrics.demand_fetches - before == 2
        assert w.shape == (16, 8) and b.shape == (4,)
    assert w.ds_status == b.ds_status == zero3.ParamStatus.NOT_AVAILABLE
