"""The Engine at world size 1 against a plain torch model trained identically."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero3
from zero3 import ParamStatus, ZeroConfigError, ZeroStateError

from _reference import step_both
from gpt import GPT, GPTConfig, synthetic_batch
from zero3.planning.trace_cache import LONG_EVENTS, LONG_FACTOR

CFG = GPTConfig(block_size=16)

NO_PERSIST = {"param_persistence_threshold": 0}
RTOL, ATOL = 1e-6, 1e-7
BATCH = 4
STEPS = 3


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def _gathered(p: nn.Parameter) -> torch.Tensor:
    with zero3.GatheredParameters([p]):
        return p.detach().clone()



def _train_alongside(ref, ref_opt, engine, steps):
    """Train the reference and the engine on the same batches; losses must match every step."""
    for step in range(steps):
        x, y = synthetic_batch(step, BATCH, CFG)
        step_both(ref, ref_opt, engine, x, y, rtol=RTOL)

def _assert_same_params(model: nn.Module, ref: nn.Module) -> None:
    params = dict(model.named_parameters())
    assert params.keys() == dict(ref.named_parameters()).keys()
    for name, r in ref.named_parameters():
        torch.testing.assert_close(_gathered(params[name]), r.detach(), rtol=RTOL, atol=ATOL, msg=name)


def _assert_nothing_gathered(engine: zero3.Engine) -> None:
    """After a step: no non-persistent parameter is gathered, and the books agree."""
    assert engine.coordinator.live_params == []
    engine.coordinator.check_valid()
    for p in engine.params:
        expected = ParamStatus.AVAILABLE if p.ds_persist else ParamStatus.NOT_AVAILABLE
        assert p.ds_status is expected, p.ds_summary()


def _gpt_pair(cfg: GPTConfig = CFG, make_opt: Callable = adamw, zcfg=NO_PERSIST):
    """A plain GPT with its optimizer, and an identical copy under zero3 with its engine."""
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    engine = zero3.initialize(model, make_opt(model.parameters()), zcfg)
    return ref, make_opt(ref.parameters()), model, engine


# -- full training loop with clipping --------------------------------------------------------------
@pytest.mark.parametrize("zcfg", [NO_PERSIST, None], ids=["threshold0", "default_threshold"])
@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
def test_gpt_with_adamw_and_clipping_matches_the_reference(zcfg, checkpoint):
    cfg = GPTConfig(block_size=16, checkpoint=checkpoint)
    ref, ref_opt, model, engine = _gpt_pair(cfg, zcfg=zcfg)
    max_norm = 0.5
    clipped = 0
    for step in range(STEPS):
        x, y = synthetic_batch(step, BATCH, cfg)
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()

        loss = engine(x, y)
        engine.backward(loss)
        norm = zero3.clip_grad_norm_(engine, max_norm)
        engine.step()

        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=0)
        clipped += bool(ref_norm > max_norm)
        _assert_nothing_gathered(engine)
    assert clipped > 0  # clipping really changed the update at least once
    _assert_same_params(model, ref)


def test_clip_grad_norm_accepts_the_model_and_inf_norm():
    ref, _, model, engine = _gpt_pair()
    x, y = synthetic_batch(0, BATCH, CFG)
    ref(x, y).backward()
    engine.backward(engine(x, y))
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=float("inf"))
    norm = zero3.clip_grad_norm_(model, 1e-3, norm_type=float("inf"))
    torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=0)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for p in engine.params:
        torch.testing.assert_close(p.ds_tensor.grad, ref_grads[p._zero.name].reshape(-1), rtol=RTOL, atol=1e-9)


def test_clip_grad_norm_rejects_an_uninitialized_model():
    with pytest.raises(ZeroStateError, match="got Linear"):
        zero3.clip_grad_norm_(nn.Linear(2, 2), 1.0)


# -- loops ------------------------------------------------------------------------------------------
def test_plain_loop_equals_the_reference():
    ref, ref_opt, model, engine = _gpt_pair()
    for step in range(STEPS):
        x, y = synthetic_batch(step, BATCH, CFG)
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        engine.step()
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
        _assert_nothing_gathered(engine)
    _assert_same_params(model, ref)


def test_accumulating_two_forwards_in_one_backward_matches_the_reference():
    ref, ref_opt, model, engine = _gpt_pair()
    for step in range(2):
        (x1, y1), (x2, y2) = synthetic_batch(2 * step, BATCH, CFG), synthetic_batch(2 * step + 1, BATCH, CFG)
        ref_loss = ref(x1, y1) + ref(x2, y2)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = engine(x1, y1) + engine(x2, y2)
        engine.backward(loss)
        engine.step()
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
        _assert_nothing_gathered(engine)
    _assert_same_params(model, ref)


def test_accumulating_two_backwards_before_one_step_matches_the_reference():
    ref, ref_opt, model, engine = _gpt_pair()
    for step in range(2):
        for micro in range(2):
            x, y = synthetic_batch(2 * step + micro, BATCH, CFG)
            ref_loss = ref(x, y) / 2
            ref_loss.backward()
            loss = engine(x, y) / 2
            engine.backward(loss)
            torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
        ref_opt.step()
        ref_opt.zero_grad()
        engine.step()
        _assert_nothing_gathered(engine)
    _assert_same_params(model, ref)


# -- module shapes the hooks must handle ----------------------------------------------------------
class _CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))  # same module, second call in one forward
        return self.out(h).pow(2).mean()


class _OwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.proj = nn.Parameter(torch.randn(6, 6) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale  # the root's own parameters, used directly
        return F.linear(torch.tanh(h), self.proj).pow(2).mean()


@pytest.mark.parametrize("build", [_CalledTwice, _OwnParameter], ids=["module_called_twice", "own_parameter"])
@pytest.mark.parametrize("plain_loop", [False, True], ids=["engine_loop", "plain_loop"])
def test_small_model_trains_like_the_reference(build, plain_loop):
    torch.manual_seed(0)
    ref = build()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), NO_PERSIST)
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        ref_loss = ref(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(x) if plain_loop else engine(x)
        loss.backward()
        engine.step()
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=0)
        _assert_nothing_gathered(engine)
    _assert_same_params(model, ref)


# -- budgets and buckets change scheduling, never the numbers ---------------------------------
BUDGETS = {
    "tight_live_budget": {"param_persistence_threshold": 0, "max_live_parameters": 5_000,
                          "max_reuse_distance": 0, "prefetch_bucket_size": 3_000},
    "zero_budgets": {"param_persistence_threshold": 0, "max_live_parameters": 0, "prefetch_bucket_size": 0},
}  # buckets and overlap_comm change nothing at world size 1: test_gpt_parity.py runs them at 3 ranks


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_budget_and_bucket_settings_train_like_the_reference(name):
    ref, ref_opt, model, engine = _gpt_pair(zcfg=BUDGETS[name])
    for step in range(4):  # past the first step, where a recorded trace may take over
        x, y = synthetic_batch(step, BATCH, CFG)
        step_both(ref, ref_opt, engine, x, y, rtol=RTOL)
        _assert_nothing_gathered(engine)
    _assert_same_params(model, ref)


@pytest.mark.parametrize("zcfg", [NO_PERSIST, None], ids=["threshold0", "default_threshold"])
def test_frozen_params_weights_changed_after_initialize_and_extra_forwards_match_the_reference(zcfg):
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref.wpe.weight.requires_grad_(False)
    model.wpe.weight.requires_grad_(False)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, eps=1e-6)
    engine = zero3.initialize(model, lambda groups: torch.optim.AdamW(groups, lr=1e-2, eps=1e-6), zcfg)
    # change weights after initialize: the optimizer must step from the new values
    with torch.no_grad():
        ref.h[0].mlp.c_fc.weight.mul_(2.0)
        ref.ln_f.weight.add_(0.5)
    changed = [model.h[0].mlp.c_fc.weight, model.ln_f.weight]
    with zero3.GatheredParameters(changed, modifier_rank=0), torch.no_grad():
        model.h[0].mlp.c_fc.weight.mul_(2.0)
        model.ln_f.weight.add_(0.5)
    _assert_nothing_gathered(engine)
    for step in range(STEPS):
        x, y = synthetic_batch(step, BATCH, CFG)
        # a "validation" forward with grad enabled and no backward must not disturb training
        torch.testing.assert_close(engine(x, y), ref(x, y), rtol=RTOL, atol=0)
        step_both(ref, ref_opt, engine, x, y, rtol=RTOL)
        _assert_nothing_gathered(engine)
    _assert_same_params(model, ref)
    assert torch.equal(_gathered(model.wpe.weight), ref.wpe.weight.detach())


def test_engine_zero_grad_discards_accumulated_gradients():
    ref, ref_opt, model, engine = _gpt_pair(make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))
    x, y = synthetic_batch(0, BATCH, CFG)
    engine.backward(engine(x, y))  # thrown away
    engine.zero_grad()
    assert engine.memory_report()["grad_shard_bytes"] == 0
    x, y = synthetic_batch(1, BATCH, CFG)
    ref_loss = ref(x, y)
    ref_loss.backward()
    ref_opt.step()
    engine.backward(engine(x, y))
    engine.step()
    _assert_same_params(model, ref)


# -- optimizers -------------------------------------------------------------------------------------
OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-6),
    "adamw_weight_decay": lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-6, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_other_optimizers_match_the_reference(name):
    make = OPTIMIZERS[name]
    ref, ref_opt, model, engine = _gpt_pair(make_opt=make)
    _train_alongside(ref, ref_opt, engine, STEPS)
    _assert_same_params(model, ref)


def test_optimizer_keeps_its_object_class_and_hyperparameters():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.07, momentum=0.5)
    engine = zero3.initialize(model, opt, NO_PERSIST)
    assert engine.optimizer is opt
    assert opt.param_groups[0]["lr"] == 0.07 and opt.param_groups[0]["momentum"] == 0.5
    shards = {id(p.ds_tensor) for p in engine.params}
    assert {id(t) for t in opt.param_groups[0]["params"]} == shards


def test_optimizer_factory_matches_the_reference():
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, lambda groups: torch.optim.SGD(groups, lr=0.1), NO_PERSIST)
    assert isinstance(engine.optimizer, torch.optim.SGD)
    _train_alongside(ref, ref_opt, engine, STEPS)
    _assert_same_params(model, ref)


def test_an_optimizer_that_has_stepped_is_taken_and_trains_on_like_torch():
    """Stepped state (SGD's momentum) given to initialize was refused ('already has state'); it is
    sliced to the shards now (tests/unit/test_plain_optimizer_state.py checks loaded state too)."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for o, m in ((ref_opt, ref), (opt, model)):
        m(*synthetic_batch(0, BATCH, CFG)).backward()
        o.step()
        o.zero_grad()
    engine = zero3.initialize(model, opt, NO_PERSIST)
    _train_alongside(ref, ref_opt, engine, STEPS)
    _assert_same_params(model, ref)


def test_optimizer_over_foreign_parameters_is_rejected():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.SGD(list(model.parameters()) + [nn.Parameter(torch.zeros(7, 3))], lr=0.1)
    with pytest.raises(ValueError, match=r"shape \(7, 3\) is not a parameter of the model"):
        zero3.initialize(model, opt, NO_PERSIST)
    assert all(type(p) is nn.Parameter for p in model.parameters())  # refused before anything changed
    assert all(not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("bad,pattern", [
    (lambda groups: "not an optimizer", "factory must return a torch.optim.Optimizer, got str"),
    (42, "optimizer must be a torch.optim.Optimizer.*got int"),
])
def test_invalid_optimizer_argument_is_rejected(bad, pattern):
    with pytest.raises(ZeroConfigError, match=pattern):
        zero3.initialize(GPT(CFG), bad, NO_PERSIST)


# -- evaluation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("zcfg", [NO_PERSIST, None], ids=["threshold0", "default_threshold"])
def test_eval_under_no_grad_gives_the_reference_outputs_and_gathers_nothing(zcfg):
    ref, _, model, engine = _gpt_pair(zcfg=zcfg)
    ref.eval()
    model.eval()
    x, _ = synthetic_batch(7, BATCH, CFG)
    with torch.no_grad():
        expected = ref(x)
        out = engine(x)
        out_plain = model(x)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out_plain, expected, rtol=RTOL, atol=ATOL)
    assert not out.requires_grad
    _assert_nothing_gathered(engine)


def test_forwards_with_grad_and_no_backward_are_not_planned_and_training_follows_its_trace():
    """Probe 32Q: forwards with grad on and no backward (an evaluation without no_grad) join the next
    step's trace; planning that one-off order cost the first step after 100 of them 38-73x a steady
    step. It is not planned now (planning/trace_cache.py), and the steps after it follow the trace
    they followed before, with the reference's numbers."""
    ref, ref_opt, model, engine = _gpt_pair()
    _train_alongside(ref, ref_opt, engine, STEPS)
    coord = engine.coordinator
    records = coord.record_count
    x, _ = synthetic_batch(9, BATCH, CFG)
    events = len(coord.last_trace.events)
    for _ in range(2 * (LONG_EVENTS + LONG_FACTOR * events) // events + 1):  # a forward: about half a step's
        torch.testing.assert_close(model(x), ref(x), rtol=RTOL, atol=ATOL)
    _train_alongside(ref, ref_opt, engine, 1)  # the step the forwards joined
    assert coord.record_count == records and coord.steps.cache.long_count == 1
    assert coord.steps.diverged  # it left the trace once its first forward was done
    for _ in range(2):
        _train_alongside(ref, ref_opt, engine, 1)
        assert coord.record_count == records and not coord.steps.diverged
    _assert_same_params(model, ref)
    _assert_nothing_gathered(engine)


def test_a_dispatch_mode_sees_the_model_s_ops_only_and_mutation_on_saved_tensors_trains_as_torch():
    """Probe 34H: zero3's backward work (gathers into saved parameters, reductions) ran under the
    user's dispatch modes; under torch's allow_mutation_on_saved_tensors(), which clones a saved
    tensor before an in-place op on it, autograd got half-gathered clones in some runs (gradients
    1e8-1e24 off, or "illegal status change AVAILABLE -> INFLIGHT"). Now a mode sees the ops torch's
    own model runs, forward and backward, and that mode trains as torch does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    ref, ref_opt, model, engine = _gpt_pair(make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))
    for step in range(3):
        x, y = synthetic_batch(step, BATCH, CFG)
        seen = []
        for m in (ref, model):
            with Ops() as mode:
                loss = m(x, y)
                loss.backward()
            seen.append(mode.ops)
        assert seen[0] == seen[1], step
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            ref_loss, loss = ref(x, y), model(x, y)
            ref_loss.backward()
            loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        ref_opt.step()
        ref_opt.zero_grad()
        engine.step()
    _assert_same_params(model, ref)


def test_register_multi_grad_hook_over_partitioned_parameters_is_refused_naming_the_way_that_works():
    """Probe 34H: it was refused as a 'view_as' the user never wrote, with advice for forwards."""
    ref, ref_opt, model, engine = _gpt_pair(make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))
    calls = {"ref": 0, "zero3": 0}
    with pytest.raises(ZeroStateError, match=r"register_multi_grad_hook over partitioned parameter .* inside "
                                             r"`with zero3.GatheredParameters\(params\):`"):
        torch.autograd.graph.register_multi_grad_hook(list(model.parameters()), lambda gs: None)
    torch.autograd.graph.register_multi_grad_hook(list(ref.parameters()), lambda gs: calls.update(ref=calls["ref"] + 1))
    with zero3.GatheredParameters(list(model.parameters())):
        torch.autograd.graph.register_multi_grad_hook(list(model.parameters()),
                                                      lambda gs: calls.update(zero3=calls["zero3"] + 1))
    _train_alongside(ref, ref_opt, engine, 2)
    assert calls == {"ref": 2, "zero3": 2}


def test_inference_engine_without_optimizer_matches_the_reference_across_steps():
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    engine = zero3.initialize(model, None, NO_PERSIST)
    assert engine.optimizer is None
    for step in range(2):
        x, _ = synthetic_batch(step, BATCH, CFG)
        with torch.no_grad():
            torch.testing.assert_close(engine(x), ref(x), rtol=RTOL, atol=ATOL)
        engine.step()  # nothing to step: must not change or leave gathered anything
        _assert_nothing_gathered(engine)
    _assert_same_params(model, ref)


# -- lifecycle ------------------------------------------------------------------------------------------
def test_after_every_step_no_non_persistent_parameter_is_gathered():
    _, _, _, engine = _gpt_pair(zcfg={"param_persistence_threshold": 2_000})
    persistent = {p._zero.name for p in engine.params if p.ds_persist}
    assert persistent and len(persistent) < len(engine.params)  # a mix of both kinds
    for step in range(STEPS):
        x, y = synthetic_batch(step, BATCH, CFG)
        engine.backward(engine(x, y))
        _assert_nothing_gathered(engine)  # also right after backward
        engine.step()
        _assert_nothing_gathered(engine)
        assert engine.global_steps == step + 1


def test_remove_hooks_leaves_parameters_partitioned_and_forward_raises_until_gathered():
    ref, _, model, engine = _gpt_pair(zcfg=None)  # default threshold: everything persistent
    assert all(p.ds_status is ParamStatus.AVAILABLE for p in model.parameters())
    engine.remove_hooks()
    assert all(p.ds_status is ParamStatus.NOT_AVAILABLE for p in model.parameters())
    x, _ = synthetic_batch(0, BATCH, CFG)
    with pytest.raises(ZeroStateError, match=r"wte\.weight.*GatheredParameters"):
        model(x)
    with torch.no_grad():
        with zero3.GatheredParameters(list(model.parameters())):
            out = model(x)
        expected = ref(x)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    assert all(p.ds_status is ParamStatus.NOT_AVAILABLE for p in model.parameters())


def test_initialize_after_remove_hooks_trains_again():
    ref, ref_opt, model, engine = _gpt_pair()
    engine.remove_hooks()
    engine = zero3.initialize(model, adamw(model.parameters()), NO_PERSIST)
    _train_alongside(ref, ref_opt, engine, 2)
    _assert_same_params(model, ref)


def test_initialize_retried_after_a_late_refusal_trains_like_torch():
    """A refusal found after the model was partitioned (a scheduler's per-group list of the wrong
    length) left the default threshold's persistence marks; the retry under threshold 0 kept gathered
    copies it never refreshed and trained on stale weights."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    with pytest.raises(ZeroConfigError, match="warmup_max_lr"):
        zero3.initialize(model, None, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6}},
                                       "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}})
    engine = zero3.initialize(model, adamw(model.parameters()), NO_PERSIST)
    _train_alongside(ref, adamw(ref.parameters()), engine, 3)
    _assert_same_params(model, ref)


def test_initialize_twice_on_one_model_raises():
    torch.manual_seed(0)
    model = GPT(CFG)
    zero3.initialize(model, None, NO_PERSIST)
    with pytest.raises(ZeroStateError, match="already called on this model"):
        zero3.initialize(model, None, NO_PERSIST)


def test_parameter_added_after_initialize_is_reported_on_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3))
    engine = zero3.initialize(model, None, NO_PERSIST)
    model[0].late = nn.Parameter(torch.zeros(2, 5))
    with pytest.raises(ZeroStateError, match=r"parameter 'late' of module '0' with shape \(2, 5\) is not partitioned"):
        engine(torch.randn(1, 3))


def test_parameter_registered_in_the_root_forward_is_named_with_the_root():
    """Probe 34C: a lazy parameter made in the root's forward was refused as "parameter of module ''
    with shape (8,)", advising zero3.Init to a model built under it."""

    class Lazy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            if getattr(self, "w2", None) is None:
                self.register_parameter("w2", nn.Parameter(torch.full((8,), 0.5)))
            return self.lin(x) * self.w2

    with zero3.Init():
        model = Lazy()
    engine = zero3.initialize(model, None, NO_PERSIST)
    engine(torch.randn(2, 8))
    with pytest.raises(ZeroStateError, match=r"parameter 'w2' of module '<root>' with shape \(8,\) is not partitioned: "
                                             r"it was registered after zero3.initialize.*Register it before initialize"):
        engine(torch.randn(2, 8))


def test_plain_loop_forward_that_raises_leaves_nothing_gathered():
    torch.manual_seed(0)

    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.b(x)
            return F.linear(x, self._hidden[0])  # not registered: raises ZeroStateError

    model = Failing()
    model._hidden = [model.a.weight]
    engine = zero3.initialize(model, None, NO_PERSIST)
    with pytest.raises(ZeroStateError, match=r"a\.weight"):
        model(torch.randn(2, 4))
    assert engine.coordinator.live_params == []
    with pytest.raises(ZeroStateError, match=r"a\.weight"):
        model.a.weight + 1


# -- memory report -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("zcfg", [NO_PERSIST, None], ids=["threshold0", "default_threshold"])
def test_memory_report_equals_a_hand_computation(zcfg):
    ref, _, _, engine = _gpt_pair(zcfg=zcfg)
    full = sum(p.numel() * 4 for p in ref.parameters())  # fp32, tied weight counted once
    persistent = sum(p.ds_numel * 4 for p in engine.params if p.ds_persist)
    expected = {"param_shard_bytes": full, "grad_shard_bytes": 0, "optimizer_state_bytes": 0, "master_bytes": 0,
                "full_param_bytes": full, "gathered_param_bytes": persistent,
                "persistent_param_bytes": persistent, "offloaded_bytes": 0, "nvme_bytes": 0, "nvme_file_bytes": 0, "swap_buffer_bytes": 0,
                "secondary_param_bytes": 0}
    assert engine.memory_report() == expected

    x, y = synthetic_batch(0, BATCH, CFG)
    engine.backward(engine(x, y))
    assert engine.memory_report() == {**expected, "grad_shard_bytes": full}

    engine.step()  # AdamW: exp_avg + exp_avg_sq per element; the 0-d step counter is not counted
    assert engine.memory_report() == {**expected, "optimizer_state_bytes": 2 * full}


def test_an_engine_and_its_model_are_freed_without_remove_hooks():
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), NO_PERSIST)
    model(torch.randn(3, 4)).sum().backward()
    engine.step()
    ref = weakref.ref(engine)
    del engine, model
    gc.collect()
    assert ref() is None, "a reference cycle through C++-held hooks keeps the engine alive"


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_frozen_params_under_activation_checkpointing_train_like_the_reference(mode):
    """DeepSpeed's users hit this combination (PEFT + checkpointing + ZeRO-3): recompute must see the
    frozen weights gathered, and frozen weights get no gradient."""
    cfg = GPTConfig(block_size=16, checkpoint=mode)
    torch.manual_seed(0)
    ref = GPT(cfg)
    for name, p in ref.named_parameters():
        if ".attn." in name:
            p.requires_grad_(False)
    model = copy.deepcopy(ref)
    ref_opt = adamw([p for p in ref.parameters() if p.requires_grad])
    engine = zero3.initialize(model, adamw([p for p in model.parameters() if p.requires_grad]),
                              {**NO_PERSIST, "max_reuse_distance": 0, "prefetch_bucket_size": 3000})
    for step in range(3):
        x, y = synthetic_batch(step, BATCH, cfg)
        step_both(ref, ref_opt, engine, x, y, rtol=RTOL)
        assert engine.coordinator.live_params == []
    _assert_same_params(model, ref)


def test_a_backward_that_raises_does_not_stop_later_steps_from_ending_their_backward():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), NO_PERSIST)

    def boom(grad):
        raise RuntimeError("boom in backward")

    x = torch.randn(3, 4, requires_grad=True)
    x.register_hook(boom)  # fires last: after zero3's hooks queued their end-of-backward callback
    with pytest.raises(RuntimeError, match="boom in backward"):
        model(x).sum().backward()
    engine.step()  # recovers: releases everything, forgets the failed backward
    assert engine.coordinator.live_params == []
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        assert not engine.coordinator.in_step, "the end of backward was not seen"
        assert engine.coordinator.live_params == []
        engine.step()


def test_a_leaf_modules_class_that_names_no_module_is_refused_before_anything_changes():
    torch.manual_seed(0)
    model = GPT(CFG)
    with pytest.raises(ValueError, match=r"leaf_modules: 'Blok' is the class name of no module.*Block"):
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"leaf_modules": ["Blok"]})
    assert all(type(p) is nn.Parameter for p in model.parameters())
    zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"leaf_modules": ["Block"]}).remove_hooks()


@pytest.mark.parametrize("cap", [0, 500])
def test_the_live_cap_holds_between_decode_forwards_and_explain_describes_the_mode(cap):
    """Under ``engine.generation()`` with a cap below every module, the last module's parameters stayed
    gathered after the forward, with no module running (1,536 elements at cap 0 in probe 24D);
    ``max_live_parameters`` is exceeded only while the running modules need more. And
    ``engine.explain()`` said "every fetch so far was on demand, released right after use"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8)).eval()
    plain = copy.deepcopy(model)
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0, "max_live_parameters": cap})
    x = torch.randn(2, 16)
    with torch.no_grad(), engine.generation():
        for _ in range(3):
            torch.testing.assert_close(engine(x), plain(x), rtol=0, atol=0)
            assert engine.metrics.live_numel <= cap
        text = "\n".join(engine.explain())
    assert text.startswith("generation mode: no decode plan fits the live cap"), text
    assert "every fetch so far was on demand" not in text or "outside generation mode" in text, text
    assert engine.metrics.live_numel == 0


def test_modules_called_on_their_own_in_generation_mode_leave_the_decode_plan_as_it_was():
    """Between forwards of the model, submodules called directly (a feature pass) were appended to the
    learnt decode cycle: it grew without bound (5,428 events after 200 passes, 4 s to plan) and the
    plan was lost (18 gathers per forward instead of 3). Events outside the model's forward are no
    part of the cycle now; tokens and outputs stay the plain model's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]).eval()
    plain = copy.deepcopy(model)
    numel = sum(p.numel() for p in model.parameters())
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0, "max_live_parameters": numel // 2})
    x = torch.randn(2, 16)

    def gathers_per_forward(n: int = 3) -> float:
        before = engine.metrics.allgather_calls
        for _ in range(n):
            torch.testing.assert_close(engine(x), plain(x), rtol=0, atol=0)
        return (engine.metrics.allgather_calls - before) / n

    with torch.no_grad(), engine.generation():
        gathers_per_forward()
        planned = gathers_per_forward()
        for _ in range(20):
            torch.testing.assert_close(model[2](x), plain[2](x), rtol=0, atol=0)  # called on its own
        assert gathers_per_forward() == planned
        assert len(engine.coordinator._generation._cycle) == len(model)


@pytest.mark.parametrize("write", ["in place", "flip"])
def test_a_modifier_block_that_raised_leaves_a_persistent_parameter_and_its_shard_as_they_were(write):
    """At world size 1 a persistent parameter's gathered copy is its shard: a write inside a
    ``modifier_rank`` block that raised reached the shard (and the fp32 master) for good when only a
    fingerprint was kept; now the values from entry are copied back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})  # every parameter persistent
    w = model[0].weight
    with pytest.raises(KeyError), zero3.GatheredParameters([w], modifier_rank=0):
        with torch.no_grad():
            w.mul_(0).add_(7) if write == "in place" else w.copy_(w.flip(0))
        raise KeyError("the load failed halfway")
    torch.testing.assert_close(zero3.safe_get_full_fp32_param(w), plain[0].weight.detach(), rtol=0, atol=0)
    x = torch.randn(4, 8)
    torch.testing.assert_close(engine(x), plain(x), rtol=0, atol=0)


# -- a step between a forward and its backward; a step of a frozen model ----------------------------
@pytest.mark.parametrize("zcfg", [NO_PERSIST, None], ids=["threshold0", "default_threshold"])
def test_a_backward_through_weights_stepped_since_its_forward_raises_as_torch_s(zcfg):
    """Probe 26C: a forward, then the optimizer step, then that forward's backward ran silently on the
    stepped weights (19% off torch's gradient in a GAN loop); torch's in-place step bumps the weights'
    versions, so its backward raises. Now zero3's does the same, and training goes on as torch's."""
    ref, ref_opt, model, engine = _gpt_pair(zcfg=zcfg)
    (x, y), (x2, y2) = synthetic_batch(0, BATCH, CFG), synthetic_batch(1, BATCH, CFG)
    for m, step in ((ref, ref_opt.step), (model, engine.step)):
        m(x, y).backward()
        pending = m(x2, y2)
        step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            pending.backward()
    ref_opt.zero_grad()  # what torch's raised backward accumulated; zero3 drops a raised backward's
    _assert_same_params(model, ref)
    _train_alongside(ref, ref_opt, engine, 2)
    _assert_same_params(model, ref)


def test_engine_step_of_a_model_frozen_after_initialize_changes_nothing_as_torch_s():
    """Probe 26C: a model frozen for a warm-up (requires_grad_(False) after initialize) has no backward
    to wait for; engine.step() refused ("call engine.backward first") where torch's step does nothing."""
    ref, ref_opt, model, engine = _gpt_pair()
    model.requires_grad_(False)
    ref.requires_grad_(False)
    x, y = synthetic_batch(0, BATCH, CFG)
    with torch.no_grad():
        torch.testing.assert_close(engine(x, y), ref(x, y), rtol=RTOL, atol=0)
    assert engine.step() is True
    ref_opt.step()
    _assert_same_params(model, ref)
    model.requires_grad_(True)
    ref.requires_grad_(True)
    _train_alongside(ref, ref_opt, engine, 2)
    _assert_same_params(model, ref)
    engine(x, y)
    with pytest.raises(ZeroStateError, match="no backward reached the model since the last engine.step"):
        engine.step()  # a trainable model with no backward: refused as before


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # b's loss reaches b alone; x needs grad, so b's backward reads b's weight (saved at forward)
        return self.a(torch.tanh(self.body(x))).square().mean(), self.b(x).square().mean()


@pytest.mark.parametrize("zcfg", [NO_PERSIST, None], ids=["threshold0", "default_threshold"])
@pytest.mark.parametrize("left", ["no gradient", "in no optimizer group"])
def test_a_backward_through_weights_the_step_left_alone_runs_as_torch_s(zcfg, left):
    """Reviews 26X and 26Z: the step bumped the version of every trainable weight, then of every one
    with a gradient, so a later backward through a weight the step did not change (it had no
    gradient, or no optimizer group holds it) raised, where torch's step leaves it alone."""
    torch.manual_seed(0)
    ref = _TwoHeads()
    model = copy.deepcopy(ref)

    def opt(m: _TwoHeads) -> torch.optim.Optimizer:
        held = m.parameters() if left == "no gradient" else [*m.body.parameters(), *m.a.parameters()]
        return torch.optim.SGD(held, lr=0.1)

    engine = zero3.initialize(model, opt(model), zcfg)
    ref_opt = opt(ref)
    x = torch.randn(4, 8, requires_grad=True)

    def ref_step() -> None:
        ref_opt.step()
        ref_opt.zero_grad()  # as engine.step() drops the gradients it used

    for m, step in ((ref, ref_step), (model, engine.step)):
        la, lb = m(x)
        if left == "no gradient":
            la.backward()
            step()  # steps body and a; b has no gradient, so it keeps its version
            lb.backward()
        else:
            lb.backward(retain_graph=True)
            la.backward()
            step()  # b has a gradient, but no group holds it: unchanged
            lb.backward()
        step()
    _assert_same_params(model, ref)


def _mlp_pair(zcfg, optimizer: bool = True):
    """A plain MLP (AdamW and a StepLR over it) and its twin under zero3 (the same over the twin)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    model = copy.deepcopy(ref)
    if not optimizer:
        return ref, model, zero3.initialize(model, None, zcfg)
    ref_opt, opt = adamw(ref.parameters()), adamw(model.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return ref, ref_opt, ref_sched, model, zero3.initialize(model, opt, zcfg, lr_scheduler=sched)


@pytest.mark.parametrize("zcfg", [NO_PERSIST, {}], ids=["threshold0", "default_threshold"])
def test_a_step_after_a_backward_over_the_inputs_alone_is_refused_in_every_config(zcfg):
    """Probe 33V (saliency): after torch.autograd.grad(loss, x), which gives no parameter a gradient,
    engine.step() was refused with the default threshold but counted a step (True, global_steps and the
    scheduler advanced, weights unchanged) with threshold 0, whose backward hooks had run. Both refuse
    now, changing nothing; the next ordinary step trains as torch's."""
    ref, ref_opt, ref_sched, model, engine = _mlp_pair(zcfg)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    for net, opt, sched in ((ref, ref_opt, ref_sched), (model, engine, None)):
        F.mse_loss(net(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()
    before = [_gathered(p) for p in model.parameters()]
    xg = x.clone().requires_grad_(True)
    saliency, = torch.autograd.grad(F.mse_loss(model(xg), y), xg)
    assert saliency.abs().sum() > 0
    with pytest.raises(ZeroStateError, match="no backward reached the model since the last engine.step"):
        engine.step()
    assert engine.global_steps == 1 and engine.get_lr() == [ref_sched.get_last_lr()[0]]
    assert all(torch.equal(b, _gathered(p)) for b, p in zip(before, model.parameters()))
    for net, opt, sched in ((ref, ref_opt, ref_sched), (model, engine, None)):
        if sched is not None:
            opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
        if sched is not None:
            sched.step()
    assert engine.global_steps == 2 and engine.get_lr() == [ref_sched.get_last_lr()[0]]
    _assert_same_params(model, ref)


@pytest.mark.parametrize("zcfg", [NO_PERSIST, {}], ids=["threshold0", "default_threshold"])
def test_step_without_an_optimizer_drops_the_gradients_as_torchs_manual_loop_does(zcfg):
    """Probe 33T: without an optimizer, engine.step() kept the gradient shards, so a manual update loop
    (accessor update, then engine.step()) summed every earlier backward into the next: 0.129 off torch's
    weights after 3 steps. The step drops them at the boundary now, as step_shards does."""
    lr = 0.1
    ref, model, engine = _mlp_pair(zcfg, optimizer=False)
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        F.mse_loss(ref(x), y).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(p.grad, alpha=-lr)
                p.grad = None
        F.mse_loss(model(x), y).backward()
        for p in model.parameters():
            zero3.safe_set_local_fp32_param(p, zero3.safe_get_local_fp32_param(p) - lr * zero3.safe_get_local_grad(p))
        assert engine.step() is False
        assert all(zero3.safe_get_local_grad(p) is None for p in model.parameters())
    _assert_same_params(model, ref)


def test_an_interrupt_from_the_scheduler_comes_after_the_step_has_ended():
    """Review 36R3: a KeyboardInterrupt raised by the scheduler's step skipped the step's bookkeeping (an
    Exception's is held until it has run: probe 36M), so global_steps lagged and, at several ranks, the
    persistent parameters' copies kept the old weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def schedule(step: int) -> float:
        if step == 1:
            raise KeyboardInterrupt
        return 1.0

    engine = zero3.initialize(model, opt, {}, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    engine.backward(engine(torch.randn(3, 4)).sum())
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()


def test_explain_of_a_module_covers_its_submodules_parameters_and_a_tied_name_is_a_name():
    """Probe 38I: ``engine.explain(block)`` listed only the decisions taken at the block's own hooks (none: its
    parameters live in its leaves), and a tied weight's second name was "no parameter or module named"."""
    torch.manual_seed(0)
    emb = nn.Embedding(16, 8)
    head = nn.Linear(8, 16, bias=False)
    head.weight = emb.weight
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    model = nn.Sequential(emb, block, head)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"param_persistence_threshold": 0, "max_reuse_distance": 0})
    for _ in range(2):
        engine.backward(engine(torch.randint(0, 16, (2, 4))).square().mean())
        engine.step()
    lines = engine.explain(block)[1:]
    names = {line.split("(")[1].split(")")[0] for line in lines}
    assert names == {"1.0.weight", "1.0.bias", "1.2.weight", "1.2.bias"}, lines
    zero3.register_external_parameter(block[2], emb.weight)  # review 38R4: an external parameter counts too
    names = {line.split("(")[1].split(")")[0] for line in engine.explain(block)[1:]}
    assert "0.weight" in names, names
    assert engine.explain("1") == engine.explain(block)
    assert engine.explain("2.weight") == engine.explain("0.weight") and len(engine.explain("0.weight")) > 1
    with pytest.raises(ZeroConfigError, match="no parameter or module named '2.nope'"):
        engine.explain("2.nope")
