"""A module's post-backward taken from its parameters' gradients (hooks.py [Note: post-backward from
the gradients]): which modules use it, that it releases during the backward, and that modules it
does not fit (called twice, frozen or tied parameters, external ones) still train like plain torch."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import zero3
from zero3 import ParamStatus
from zero3.runtime import hooks as hooks_module

from _reference import LinearReadingItsWeightLate, step_alongside, train_both
from gpt import GPT, GPTConfig, synthetic_batch

NO_PERSIST = {"param_persistence_threshold": 0}
ON_DEMAND = {"param_persistence_threshold": 0, "prefetch_bucket_size": 0, "max_reuse_distance": 0}


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def _by_grads(engine: zero3.Engine) -> dict[str, bool]:
    return {rec.name: rec.by_grads for rec in engine.hooks._records.values() if rec.params}


def test_only_modules_whose_parameters_are_all_their_own_are_closed_by_their_gradients() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16)
    model = GPT(cfg)
    engine = zero3.initialize(model, _adamw(model.parameters()), NO_PERSIST)
    x, y = synthetic_batch(0, 2, cfg)
    engine(x, y).backward()
    engine.step()
    flags = _by_grads(engine)
    tied = {name for name, m in model.named_modules() if getattr(m, "weight", None) is model.wte.weight}
    assert len(tied) == 2  # the token embedding and the output head share one weight
    for name, closed in flags.items():
        assert closed is (name not in tied), name
    assert sum(flags.values()) > 10


def test_a_chain_releases_each_layer_during_the_backward_not_at_its_end() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    engine = zero3.initialize(model, _adamw(model.parameters()), ON_DEMAND)
    seen: list[list[ParamStatus]] = []

    def at_layer0_backward(grad: torch.Tensor) -> None:  # runs just before layer 0's backward node
        seen.append([p.ds_status for layer in model[1:] for p in layer.parameters()])

    x = torch.randn(3, 4)
    h = model[0](x)
    h.register_hook(at_layer0_backward)
    model[2](model[1](h)).sum().backward()
    engine.step()
    assert seen == [[ParamStatus.NOT_AVAILABLE] * 4]  # layers 1 and 2 have their gradients: released


def test_the_first_layer_is_closed_by_its_gradients_before_the_backward_ends(caplog) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    engine = zero3.initialize(model, None, NO_PERSIST)
    with caplog.at_level(logging.DEBUG, logger="zero3"):
        model(torch.randn(3, 4)).sum().backward()
    kinds = [r.getMessage().split(" params=")[0] for r in caplog.records if r.getMessage().startswith("zero3::trace")]
    assert kinds[-1] == "zero3::trace post_backward (0)"
    engine.step()


class _Twice(nn.Module):
    """One Linear applied twice in a forward: two calls, one AccumulateGrad per parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.shared(torch.tanh(self.shared(self.inp(x))))))


class _Frozen(nn.Module):
    """A module with one frozen and one trainable parameter: not closed by its gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.a.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _mse(m: nn.Module, batch: tuple) -> torch.Tensor:
    return (m(batch[0]) - batch[1]).pow(2).mean()


def _trained(make, seed: int, zcfg: dict) -> tuple[nn.Module, zero3.Engine, list[tuple]]:
    """A model from ``make`` trained 3 steps under zero3 beside an identical plain copy (`train_both`)."""
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)) for _ in range(3)]
    return model, train_both(ref, model, zcfg, batches, _mse), batches


@pytest.mark.parametrize("zcfg", [NO_PERSIST, ON_DEMAND], ids=["prefetch", "on_demand"])
def test_a_module_called_twice_closes_both_calls_and_trains_like_plain_torch(zcfg) -> None:
    model, engine, batches = _trained(_Twice, 1, zcfg)
    assert _by_grads(engine)["shared"] is True
    closed = []
    real = engine.hooks._post_backward
    engine.hooks._post_backward = lambda call: (closed.append(call.record.name), real(call))[1]
    _mse(model, batches[0]).backward()
    assert closed.count("shared") == 2
    assert all(p.ds_status is ParamStatus.NOT_AVAILABLE for p in model.parameters())
    engine.step()


@pytest.mark.parametrize("zcfg", [NO_PERSIST, ON_DEMAND], ids=["prefetch", "on_demand"])
def test_a_module_with_a_frozen_parameter_keeps_the_input_wrapper_and_trains_like_plain_torch(zcfg, monkeypatch) -> None:
    model, engine, batches = _trained(_Frozen, 2, zcfg)
    assert _by_grads(engine) == {"a": True, "b": True}  # the record qualifies; each call checks requires_grad
    calls = []
    real = hooks_module._wrap_inputs
    monkeypatch.setattr(hooks_module, "_wrap_inputs",
                        lambda call, hooks, args, kwargs: (calls.append(call.record.name), real(call, hooks, args, kwargs))[1])
    _mse(model, batches[0]).backward()
    engine.step()
    assert calls == ["a"]  # its frozen bias gets no gradient, so its inputs are wrapped


def test_data_replaced_while_gathered_is_what_the_next_gather_fills() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    engine = zero3.initialize(model, None, NO_PERSIST)
    x = torch.randn(3, 4)
    with torch.no_grad():
        model(x)  # every parameter has been gathered once: its flat view is kept
    w = model[1].weight
    with zero3.GatheredParameters([w], modifier_rank=0):
        w.data = torch.full((2, 4), 0.5)
    with zero3.GatheredParameters([w]):
        assert torch.equal(w.detach(), torch.full((2, 4), 0.5))
    with torch.no_grad():
        out = model(x)
    with zero3.GatheredParameters([model[0].weight, model[0].bias, model[1].bias]):
        h = model[0](x)
        expected = h @ torch.full((4, 2), 0.5) + model[1].bias.detach()
    torch.testing.assert_close(out, expected)
    assert engine.coordinator.live_params == []


class _Peek(nn.Module):
    """Its forward reads its child's weight outside the child's forward: an automatic external
    parameter, found in the middle of a call that had been set to close by its own gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        h = h * self.scale + nn.functional.linear(h, self.lin.weight)  # its backward needs the weight
        return self.out(torch.tanh(h))


@pytest.mark.parametrize("zcfg", [NO_PERSIST, ON_DEMAND], ids=["prefetch", "on_demand"])
def test_a_parameter_found_mid_forward_falls_back_and_trains_like_plain_torch(zcfg) -> None:
    _, engine, _ = _trained(_Peek, 3, zcfg)
    assert _by_grads(engine)[""] is False  # the root now gathers lin.weight too: wrapped from then on
    assert _by_grads(engine)["lin"] is True


@pytest.mark.parametrize("where", ["own", "root"])
def test_a_backward_hook_reading_a_weight_sees_torchs_values(where):
    """own: a full backward hook runs when the module's input gradients are ready, after its
    weight's gradient: closed by that gradient, the weight was released and the hook's read refused
    (a weight-norm logger); such a module keeps the input-side post-backward. root: the root's hook
    reading a child's weight runs after that child's backward released it: gathered again for the
    read ([Note: a parameter read after its module's backward]), each step."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    seen: dict[str, list[float]] = {"torch": [], "zero3": []}
    ref, model = build(), build()
    for name, m in (("torch", ref), ("zero3", model)):
        hooked = m[2] if where == "own" else m
        hooked.register_full_backward_hook(lambda mod, gi, go, out=seen[name], m=m: out.append(
            m[2].weight.detach().norm().item()))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    step_alongside(ref, torch.optim.SGD(ref.parameters(), lr=0.1), engine,
                   [torch.randn(4, 16, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(3)],
                   lambda out: out.pow(2).mean())
    assert len(seen["zero3"]) == 3
    torch.testing.assert_close(seen["zero3"], seen["torch"], rtol=1e-6, atol=0)


class _CustomOpModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = LinearReadingItsWeightLate(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("zcfg", [NO_PERSIST, ON_DEMAND], ids=["prefetch", "on_demand"])
def test_a_custom_op_reading_its_modules_weight_in_the_backward_trains_like_plain_torch(zcfg, caplog) -> None:
    """[Note: a parameter read after its module's backward]: the weight is gathered again where the
    node reads it; from the next step its module is closed by its inputs' gradients instead."""
    with caplog.at_level(logging.INFO, logger="zero3"):
        _, engine, _ = _trained(_CustomOpModel, 4, zcfg)
    assert _by_grads(engine) == {"a": True, "b": False, "out": True}
    late = [r.getMessage() for r in caplog.records if "after its module's backward ended" in r.getMessage()]
    assert late == ["zero3: b.weight is read in the backward after its module's backward ended; gathered again for "
                    "the read"]  # once: later steps release b after that node





def test_a_late_read_through_data_trains_like_plain_torch() -> None:
    def make():
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), LinearReadingItsWeightLate(6, through_data=True), nn.Tanh(),
                             nn.Linear(6, 3))

    _trained(make, 6, ON_DEMAND)


def test_late_reads_hold_one_parameter_at_a_time_within_the_live_cap() -> None:
    """A root backward hook reading every weight in turn (a weight-norm logger): each read's
    parameter is released once its view is gone, so the reads stay within max_live_parameters
    (they kept every one until the step ended, the whole model, over the cap)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ref = copy.deepcopy(model)
    layer = 32 * 32 + 32
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "param_persistence_threshold": 0, "max_live_parameters": 3 * layer, "prefetch_bucket_size": 0})
    seen: dict[str, list] = {"torch": [], "zero3": [], "live": []}

    def logger_hook(name):
        def hook(m, grad_in, grad_out):
            for p in m.parameters():
                seen[name].append(p.detach().norm().item())  # a view (detach), then a read of it
                if name == "zero3":
                    seen["live"].append(engine.coordinator.metrics.live_numel)
        return hook

    ref.register_full_backward_hook(logger_hook("torch"))
    model.register_full_backward_hook(logger_hook("zero3"))
    step_alongside(ref, torch.optim.SGD(ref.parameters(), lr=0.1), engine,
                   [torch.randn(4, 32, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(2)],
                   lambda out: out.pow(2).mean())
    torch.testing.assert_close(seen["zero3"], seen["torch"], rtol=1e-6, atol=0)
    assert max(seen["live"]) <= 3 * layer, seen["live"]


@pytest.mark.parametrize("hook", ["full_backward_hook", "full_backward_pre_hook"])
def test_a_hook_that_runs_first_in_the_backward_reads_torchs_weights(hook) -> None:
    """With inputs that need no gradient (a batch of data) the root's full backward hook runs first
    in the backward, as does a backward pre-hook, before any of zero3's: the read was refused."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    seen: dict[str, list[float]] = {"torch": [], "zero3": []}
    ref, model = build(), build()
    for name, m in (("torch", ref), ("zero3", model)):
        getattr(m, f"register_{hook}")(lambda mod, *grads, out=seen[name]: out.append(mod[2].weight.norm().item()))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), NO_PERSIST)
    step_alongside(ref, torch.optim.SGD(ref.parameters(), lr=0.1), engine,
                   [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)],
                   lambda out: out.pow(2).mean())
    torch.testing.assert_close(seen["zero3"], seen["torch"], rtol=1e-6, atol=0)


def test_late_reads_of_several_parameters_in_one_op_and_views_kept_past_the_step() -> None:
    """One op over several released parameters (a foreach norm, a concatenation) gathers them all
    (it recursed); a view a late read hands out is a copy, which a logger may keep past the step (a
    view's storage was emptied under it: a segfault)."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    seen: dict[str, list] = {"torch": [], "zero3": []}
    kept: dict[str, list[torch.Tensor]] = {"torch": [], "zero3": []}

    def log(name):
        def hook(mod, grad_in, grad_out):
            seen[name].append(torch.stack(torch._foreach_norm(list(mod.parameters()))).sum().item())
            seen[name].append(torch.cat([mod[2].weight.flatten(), mod[4].weight.flatten()]).sum().item())
            kept[name].append(mod[4].weight.detach())
        return hook

    ref, model = build(), build()
    ref.register_full_backward_hook(log("torch"))
    model.register_full_backward_hook(log("zero3"))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), NO_PERSIST)
    for i in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i), requires_grad=True)
        ref(x).pow(2).mean().backward()
        engine.backward(engine(x).pow(2).mean())
        torch.testing.assert_close(kept["zero3"][-1], kept["torch"][-1], rtol=1e-6, atol=0)
        ref_opt.step()
        ref_opt.zero_grad()
        engine.step()
        assert engine.coordinator.live_params == []
    torch.testing.assert_close(seen["zero3"], seen["torch"], rtol=1e-6, atol=1e-6)
    assert kept["zero3"][0].norm().item() > 0  # a copy of the step's weight, readable after the step


def test_late_reads_in_a_second_backward_with_a_gradient_inside_and_across_two_engines() -> None:
    """A backward pre-hook in the second backward of a retained graph runs before any of zero3's
    hooks, in a step that already ended (refused); a gradient computed inside a hook saves the weight
    in its graph (the storage was emptied under it); one op over two engines' weights (refused)."""
    def build(n_in):
        torch.manual_seed(n_in)
        return nn.Sequential(nn.Linear(n_in, 8), nn.Tanh(), nn.Linear(8, 8))

    seen: dict[str, list[float]] = {"torch": [], "zero3": []}
    refs, models = (build(4), build(8)), (build(4), build(8))
    for name, (a, b) in (("torch", refs), ("zero3", models)):
        def pre(mod, grad_out, out=seen[name], other=a):
            out.append(torch.cat([mod[2].weight.flatten(), other[2].weight.flatten()]).sum().item())

        def full(mod, grad_in, grad_out, out=seen[name]):
            with torch.enable_grad():
                probe = torch.ones(3, 8, requires_grad=True)
                out.append(torch.autograd.grad((probe @ mod[2].weight).pow(2).sum(), probe)[0].sum().item())
        b.register_full_backward_pre_hook(pre)
        b.register_full_backward_hook(full)
    opts = [torch.optim.SGD(list(refs[0].parameters()) + list(refs[1].parameters()), lr=0.1)]
    engines = [zero3.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), NO_PERSIST) for m in models]
    for i in range(2):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(i))
        for nets in (refs, models):
            out = nets[1](nets[0](x))
            out.pow(2).mean().backward(retain_graph=True)
            out.abs().mean().backward()
        opts[0].step()
        opts[0].zero_grad()
        for e in engines:
            e.step()
            assert e.coordinator.live_params == []
    assert len(seen["zero3"]) == len(seen["torch"]) == 8
    torch.testing.assert_close(seen["zero3"], seen["torch"], rtol=1e-6, atol=1e-6)


def test_an_in_place_write_in_a_late_read_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    model.register_full_backward_hook(lambda m, gi, go: m[1].weight.data.mul_(0.5))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), NO_PERSIST)
    with pytest.raises(zero3.ZeroStateError, match=r"1\.weight .* is used by 'mul_' in the backward after its "
                                                    r"module's backward ended .*a write there would be lost"):
        engine.backward(engine(torch.randn(3, 6, requires_grad=True)).sum())
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    model.register_full_backward_hook(lambda m, gi, go: torch.mul(m[1].weight, 0.5, out=m[1].weight))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), NO_PERSIST)
    with pytest.raises(zero3.ZeroStateError, match=r"used by 'mul' in the backward .*a write there would be lost"):
        engine.backward(engine(torch.randn(3, 6, requires_grad=True)).sum())
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 3))
    model.register_full_backward_hook(lambda m, gi, go: m[1].weight.detach().mul_(0.5))  # into a copy: refused
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), NO_PERSIST)
    with pytest.raises(RuntimeError, match=r"Inplace update to inference tensor outside InferenceMode"):
        engine.backward(engine(torch.randn(3, 6, requires_grad=True)).sum())


def test_a_late_read_with_the_step_in_backward_is_refused_naming_the_parameter() -> None:
    torch.manual_seed(0)
    model = _CustomOpModel()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "param_persistence_threshold": 0, "sub_group_size": 36,
        "offload_optimizer": {"device": "none", "step_in_backward": True}})
    with pytest.raises(zero3.ZeroStateError, match=r"parameter b\.weight .* in the backward after its module's "
                       r"backward ended .*offload_optimizer_step_in_backward"):
        engine.backward(engine(torch.randn(3, 6)).sum())
    assert engine.coordinator.live_params == []


def test_a_view_saved_outside_autograd_still_fails_at_threshold_0() -> None:
    """What the late read does not cover ([Note: a parameter read after its module's backward]): a
    node that saved ``weight.detach()`` reads the emptied storage itself. The leaf-module workaround
    the docs give trains like torch."""
    class Detached(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x @ self.weight.detach())

    def make():
        return nn.Sequential(nn.Linear(6, 6), Detached(6, 6), nn.Linear(6, 3))

    torch.manual_seed(0)
    model = make()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), NO_PERSIST)
    with pytest.raises(RuntimeError, match="storage of size 0"):
        engine.backward(_mse(model, (torch.randn(5, 6), torch.randn(5, 3))))
    engine.remove_hooks()

    def make_leaf():
        m = make()
        zero3.set_leaf_modules(m, [Detached])
        return m

    _trained(make_leaf, 5, NO_PERSIST)
