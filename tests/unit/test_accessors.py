"""The safe_get/safe_set accessors at world size 1: what they return, and the errors they raise."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from gpt import GPT, GPTConfig, synthetic_batch
from torch import nn

import zero3
from zero3 import ZeroStateError

CFG = GPTConfig(block_size=16)
FULL = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_local_fp32_param", "safe_get_local_grad"]
STATE = ["safe_get_full_optimizer_state", "safe_get_local_optimizer_state"]



@pytest.fixture
def trained():
    """A bf16 engine after one step and one more backward (gradients, masters and moments exist)."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), {"dtype": "bf16"})
    for step in range(2):
        x, y = synthetic_batch(step, 2, CFG)
        engine.backward(engine(x, y))
        if step == 0:
            engine.step()
    return engine


@pytest.mark.parametrize("name", FULL + STATE + ["safe_set_full_fp32_param", "safe_set_local_fp32_param"])
def test_accessor_on_a_plain_parameter_raises_naming_the_fix(name):
    p = nn.Parameter(torch.zeros(3, 2))
    args = {"safe_set_full_fp32_param": (p, torch.ones(3, 2)), "safe_set_local_fp32_param": (p, torch.ones(6))}
    args.update({n: (p, "exp_avg") for n in STATE})
    with pytest.raises(ZeroStateError, match=r"\(3, 2\)\) is not partitioned by zero3.*zero3\.Init"):
        getattr(zero3, name)(*args.get(name, (p,)))


def test_partitioned_param_without_an_engine_gives_its_weight_but_no_grad_or_state():
    with zero3.Init():
        torch.manual_seed(0)
        m = nn.Linear(4, 3)
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    assert torch.equal(zero3.safe_get_full_fp32_param(m.weight), ref.weight.detach())
    with pytest.raises(ZeroStateError, match="belongs to no engine"):
        zero3.safe_get_full_grad(m.weight)
    with pytest.raises(ZeroStateError, match="belongs to no engine"):
        zero3.safe_get_full_optimizer_state(m.weight, "exp_avg")


def test_full_and_local_accessors_agree_and_return_fp32_copies(trained):
    for p in trained.params:
        full = zero3.safe_get_full_fp32_param(p)
        assert full.dtype == torch.float32 and full.shape == p.ds_shape
        assert torch.equal(zero3.safe_get_local_fp32_param(p), full.reshape(-1))  # world 1: all of it
        assert torch.equal(full.reshape(-1), trained.master_shard(p)[: p.ds_numel])
        grad = zero3.safe_get_full_grad(p)
        assert torch.equal(zero3.safe_get_local_grad(p), grad.reshape(-1))
        for key in ("exp_avg", "exp_avg_sq"):
            state = zero3.safe_get_full_optimizer_state(p, key)
            assert torch.equal(state.reshape(-1), trained.optimizer_state(p)[key][: p.ds_numel])
            assert torch.equal(zero3.safe_get_local_optimizer_state(p, key), state.reshape(-1))
        full.add_(1.0)  # a copy: the master is untouched
        assert not torch.equal(zero3.safe_get_full_fp32_param(p), full)


def test_set_full_param_writes_master_and_shard_and_a_persistent_gathered_copy():
    torch.manual_seed(0)
    model = GPT(CFG)
    zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                     {"dtype": "bf16", "param_persistence_threshold": 10**6})
    p = model.ln_f.weight
    assert p.ds_persist
    value = torch.linspace(-1, 1, p.ds_numel).reshape(p.ds_shape) / 3
    zero3.safe_set_full_fp32_param(p, value)
    assert torch.equal(zero3.safe_get_full_fp32_param(p), value)
    assert torch.equal(p.ds_tensor, value.to(torch.bfloat16).reshape(-1))
    assert torch.equal(p.detach(), value.to(torch.bfloat16))  # the gathered persistent copy follows
    with pytest.raises(ValueError, match=r"shape \(2,\) does not match"):
        zero3.safe_set_full_fp32_param(p, torch.zeros(2))


def test_set_full_param_inside_a_reading_gathered_block_is_kept_without_a_discard_warning(caplog):
    """docs/mixed_precision.md names safe_set_full_fp32_param as the way to set a parameter gathered
    only for now; inside GatheredParameters without modifier_rank it was kept (shards and masters took
    it) but the block's exit warned that the change was discarded (review 33RD)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"param_persistence_threshold": 0})
    p = model.lm_head.weight if hasattr(model, "lm_head") else next(model.parameters())
    value = torch.linspace(-1, 1, p.ds_numel).reshape(p.ds_shape) / 3
    with caplog.at_level("WARNING", logger="zero3"):
        with zero3.GatheredParameters([p]):
            zero3.safe_set_full_fp32_param(p, value)
            assert torch.equal(p.detach(), value)  # what a forward in the block computes with
    assert not [r for r in caplog.records if "discarded" in r.getMessage()], caplog.text
    assert torch.equal(zero3.safe_get_full_fp32_param(p), value)


def test_set_full_optimizer_state_then_step_uses_it(trained):
    p = trained.module.ln_f.bias
    zero3.safe_set_full_optimizer_state(p, torch.full(p.ds_shape, 0.25), "exp_avg")
    assert torch.equal(zero3.safe_get_full_optimizer_state(p, "exp_avg"), torch.full(p.ds_shape, 0.25))
    zero3.safe_set_local_optimizer_state(p, torch.full((p.ds_numel,), 0.5), "exp_avg")
    assert torch.equal(zero3.safe_get_local_optimizer_state(p, "exp_avg"), torch.full((p.ds_numel,), 0.5))
    grad = zero3.safe_get_full_grad(p).clone()  # the fixture's pending backward
    trained.step()  # AdamW: exp_avg = 0.9 * 0.5 + 0.1 * grad, from the value set
    torch.testing.assert_close(zero3.safe_get_full_optimizer_state(p, "exp_avg"), 0.9 * 0.5 + 0.1 * grad)


def test_set_local_param_writes_this_ranks_slice_and_refresh_from_masters_is_harmless(trained):
    p = trained.module.h[0].ln_1.bias
    zero3.safe_set_local_fp32_param(p, torch.arange(p.ds_numel, dtype=torch.float32))
    trained.refresh_from_masters()
    assert torch.equal(zero3.safe_get_full_fp32_param(p), torch.arange(p.ds_numel, dtype=torch.float32))
    with pytest.raises(ValueError, match="owns 32 elements on this rank, got 3"):
        zero3.safe_set_local_fp32_param(p, torch.zeros(3))


def test_missing_or_non_elementwise_optimizer_state_is_named(trained):
    p = trained.params[0]
    with pytest.raises(KeyError, match=r"no optimizer state 'momentum_buffer'; it has \['exp_avg', 'exp_avg_sq', "
                                       r"'step'\]"):
        zero3.safe_get_full_optimizer_state(p, "momentum_buffer")
    with pytest.raises(ZeroStateError, match="'step' .* is not per-element"):
        zero3.safe_get_full_optimizer_state(p, "step")


def test_an_engine_without_an_optimizer_says_so_when_asked_for_optimizer_state():
    """Probe 34G: it said 'none yet (the optimizer has not stepped, or the parameter is frozen)'."""
    model = GPT(CFG)
    zero3.initialize(model, None, {})
    with pytest.raises(KeyError, match="no optimizer state 'exp_avg'; it has none: its engine has no optimizer"):
        zero3.safe_get_full_optimizer_state(model.ln_f.weight, "exp_avg")


def test_before_the_first_step_there_is_no_state_and_after_the_step_no_gradient():
    torch.manual_seed(0)
    model = GPT(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"dtype": "bf16"})
    with pytest.raises(KeyError, match="none yet"):
        zero3.safe_get_full_optimizer_state(model.ln_f.weight, "exp_avg")
    x, y = synthetic_batch(0, 2, CFG)
    engine.backward(engine(x, y))
    assert zero3.safe_get_full_grad(model.ln_f.weight) is not None
    engine.step()
    assert zero3.safe_get_full_grad(model.ln_f.weight) is None
    assert zero3.safe_get_local_grad(model.ln_f.weight) is None


def test_after_remove_hooks_weights_still_read_from_masters_but_grads_raise(trained):
    p = trained.params[0]
    master = zero3.safe_get_full_fp32_param(p)
    trained.remove_hooks()
    assert torch.equal(zero3.safe_get_full_fp32_param(p), master)
    with pytest.raises(ZeroStateError, match="belongs to no engine"):
        zero3.safe_get_full_grad(p)


def test_param_grad_between_backward_and_step_refuses_plain_torch_readers():
    """Between a backward and the step a gradient lives in its shard's ``.grad``, never in
    ``param.grad``: ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` would clip nothing and
    return 0, and ``model.zero_grad()`` would drop nothing. Both raise, naming zero3's calls; before
    any backward, after the step and after ``engine.zero_grad()``, ``param.grad`` is None as in torch."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0})
    assert all(p.grad is None for p in model.parameters())  # no backward yet
    x, y = synthetic_batch(0, 2, CFG)
    engine.backward(engine(x, y))
    with pytest.raises(ZeroStateError, match=r"param.grad of .*gradient exists.*zero3\.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ZeroStateError, match=r"model\.zero_grad\(\) drops nothing"):
        model.zero_grad()
    ref(x, y).backward()  # what the error points to gives torch's answer on the unpartitioned model
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    got = zero3.clip_grad_norm_(model, 0.5)
    assert want > 0.5 and torch.allclose(got, want, rtol=1e-5), (got, want)
    engine.step()
    assert all(p.grad is None for p in model.parameters())  # the step used them
    engine.backward(engine(*synthetic_batch(1, 2, CFG)))
    engine.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # dropped: None is the truth again


@pytest.mark.parametrize("how", ["persistent", "held"])
def test_param_grad_of_a_parameter_kept_gathered_is_refused_too(how):
    """A persistent parameter (or one ``GatheredParameters`` holds) stays gathered, torch's own class,
    and its gradient goes into its shard too: ``torch.nn.utils.clip_grad_norm_`` over a model whose
    every parameter is kept gathered clipped nothing and returned 0, silently. After the backward its
    ``.grad`` reads are refused the same way; the next forward sees torch's class again."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    threshold = 10**9 if how == "persistent" else 0
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": threshold})
    x, y = synthetic_batch(0, 2, CFG)
    held = zero3.GatheredParameters(list(model.parameters())) if how == "held" else contextlib.nullcontext()
    with held:
        engine.backward(engine(x, y))
        assert all(type(p) is not torch.nn.Parameter for p in model.parameters())
        with pytest.raises(ZeroStateError, match=r"param.grad of .*gradient exists.*zero3\.clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(ZeroStateError, match=r"model\.zero_grad\(\) drops nothing"):
            model.zero_grad()
        ref(x, y).backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        got = zero3.clip_grad_norm_(model, 0.5)
        assert want > 0.5 and torch.allclose(got, want, rtol=1e-5), (got, want)
    engine.step()
    assert all(p.grad is None for p in model.parameters())
    loss = engine(*synthetic_batch(1, 2, CFG))
    if how == "persistent":
        assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # no guard in the forward
    engine.backward(loss)
    engine.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_zero3_clip_grad_norm_takes_model_parameters_and_refuses_a_part():
    """torch's habit, ``clip_grad_norm_(model.parameters(), ...)``, works with zero3's function; a
    single tensor or one layer's parameters used to clip the whole engine (torch would clip only
    them): refused, nothing clipped."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0})
    x, y = synthetic_batch(0, 2, CFG)
    engine.backward(engine(x, y))
    ref(x, y).backward()
    for part in (model.wte.weight, list(model.h[0].parameters())):
        with pytest.raises(ZeroStateError, match=r"got \d+ of its \d+ trainable parameters.*nothing was clipped"):
            zero3.clip_grad_norm_(part, 0.5)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)  # nothing was clipped before: same norm
    got = zero3.clip_grad_norm_(model.parameters(), 0.5)
    assert want > 0.5 and torch.allclose(got, want, rtol=1e-5), (got, want)
    with pytest.raises(ZeroStateError, match="not all zero3 parameters of one engine"):
        zero3.clip_grad_norm_(list(ref.parameters()), 0.5)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_setting_an_fp32_value_on_a_copy_with_no_master_says_it_is_rounded(dtype, caplog):
    """Probe 26C: docs/api.md's EMA recipe under a bf16 config kept the EMA in bf16 (an engine without
    an optimizer has no fp32 master), so its 0.001-sized steps rounded away without a word. The set
    says so once; an fp32 copy keeps the value exactly."""
    import zero3.accessors as accessors
    accessors._ROUNDED.clear()
    torch.manual_seed(0)
    ema = nn.Linear(8, 8)
    zero3.initialize(ema, None, {"dtype": dtype})
    w = zero3.safe_get_full_fp32_param(ema.weight)
    moved = w + 1e-4 * torch.ones_like(w)  # far below bf16's step at these magnitudes (~4e-3 at 0.5)
    with caplog.at_level("WARNING", logger="zero3"):
        zero3.safe_set_full_fp32_param(ema.weight, moved)
        zero3.safe_set_local_fp32_param(ema.bias, zero3.safe_get_local_fp32_param(ema.bias))
    said = [r.getMessage() for r in caplog.records if "no fp32 master" in r.getMessage()]
    back = zero3.safe_get_full_fp32_param(ema.weight)
    if dtype == "fp32":
        assert not said
        torch.testing.assert_close(back, moved, rtol=0, atol=0)
    else:
        assert len(said) == 2 and "weight" in said[0] and "bias" in said[1], said
        assert not torch.equal(back, moved)  # rounded, as said


def test_reads_of_an_fp64_parameter_keep_fp64_and_a_get_set_round_trip_changes_nothing():
    """Probe 29A: every read cast to fp32, so an fp64 model's weight, gradient and moments came back
    rounded (1e-8 off torch's) and the EMA recipe's get-then-set moved the weight on each call."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 3).double()
    model = copy.deepcopy(ref)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0})
    x = torch.randn(5, 4, dtype=torch.float64)
    engine.backward(model(x).pow(2).mean())
    ref(x).pow(2).mean().backward()
    assert zero3.safe_get_full_grad(model.weight).dtype == torch.float64
    torch.testing.assert_close(zero3.safe_get_full_grad(model.weight), ref.weight.grad, rtol=1e-14, atol=0)
    torch.testing.assert_close(zero3.safe_get_local_grad(model.weight), ref.weight.grad.reshape(-1),
                               rtol=1e-14, atol=0)
    engine.step()
    saved = engine.consolidated_state_dict(rank0_only=False)
    before = saved["weight"]
    w = zero3.safe_get_full_fp32_param(model.weight)
    assert w.dtype == torch.float64 and torch.equal(w, before)
    assert torch.equal(zero3.safe_get_local_fp32_param(model.weight), before.reshape(-1))
    assert zero3.safe_get_full_optimizer_state(model.weight, "exp_avg_sq").dtype == torch.float64
    zero3.safe_set_full_fp32_param(model.weight, w)
    zero3.safe_set_local_fp32_param(model.bias, zero3.safe_get_local_fp32_param(model.bias))
    after = engine.consolidated_state_dict(rank0_only=False)
    assert torch.equal(after["weight"], before)
    assert torch.equal(after["bias"], saved["bias"])


@pytest.mark.parametrize("threshold", [0, 10**6])
def test_set_local_param_inside_a_step_on_a_gathered_parameter_is_refused_and_changes_nothing(threshold):
    """The modules after it in the step computed with this rank's slice new and the others' old (a MoCo
    momentum update in forward trained 1e-2 off torch at 2 ranks, probe 37H). The full setter works there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": threshold})
    w = model[2].weight
    before = zero3.safe_get_full_fp32_param(w)
    calls = []

    def halve(module, args):
        if w.ds_status is zero3.ParamStatus.AVAILABLE:  # persistent, or gathered ahead (threshold 0)
            calls.append(1)
            zero3.safe_set_local_fp32_param(w, zero3.safe_get_local_fp32_param(w) / 2)

    handle = model[2].register_forward_pre_hook(halve)  # after zero3's, which gathered it
    with pytest.raises(ZeroStateError, match=r"safe_set_local_fp32_param: called inside a step on 2.weight.*"
                                             r"safe_set_full_fp32_param.*Nothing was changed"):
        model(torch.randn(2, 4)).sum().backward()
    assert calls and torch.equal(zero3.safe_get_full_fp32_param(w), before)
    handle.remove()
    engine.backward(model(torch.randn(2, 4)).sum())  # the step after trains
    engine.step()
    assert not torch.equal(zero3.safe_get_full_fp32_param(w), before)
