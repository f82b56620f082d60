"""The one persistence rule (planning/persistence.py): ``zero3.Init`` and the engine decide alike."""

from __future__ import annotations

import collections
import tempfile

import pytest

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import zero3
from zero3.planning.persistence import MemoryBudget, PersistenceRule, choose_persistent


@given(numels=st.lists(st.integers(0, 500), max_size=30), param_threshold=st.integers(0, 600),
       model_threshold=st.integers(0, 3000))
def test_the_rule_is_greedy_in_order_under_both_thresholds(numels, param_threshold, model_threshold) -> None:
    chosen = choose_persistent(numels, param_threshold, model_threshold)
    assert all(n <= param_threshold for n, c in zip(numels, chosen) if c)
    assert sum(n for n, c in zip(numels, chosen) if c) <= model_threshold
    left = model_threshold
    for n, c in zip(numels, chosen):  # greedy: a small parameter is left out only when the cap is used up
        assert c == (n <= param_threshold and n <= left)
        left -= n if c else 0
    rule = PersistenceRule(param_threshold, model_threshold)
    assert [rule.admit(n) for n in numels] == chosen  # one at a time (Init) == all at once (the engine)


def test_persistent_shards_stay_in_memory_without_using_up_max_in_cpu() -> None:
    budget = MemoryBudget(10)
    assert [budget.stays(p, n) for p, n in [(True, 50), (False, 6), (False, 6), (True, 1), (False, 4)]] == \
        [True, True, False, True, True]


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=6),
       param_threshold=st.integers(0, 150), model_threshold=st.integers(0, 300), max_in_cpu=st.integers(0, 200))
def test_init_and_the_engine_keep_the_same_shards_in_memory(sizes, param_threshold, model_threshold,
                                                             max_in_cpu) -> None:
    """A model built under ``zero3.Init(remote_device="nvme")`` has on the drive exactly the shards
    that initialize would have put there: the persistent ones (the engine's choice) and the first
    ``max_in_cpu`` elements stay in memory, as Init decided while building."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"param_persistence_threshold": param_threshold, "model_persistence_threshold": model_threshold,
               "offload_param": {"device": "nvme", "nvme_path": tmp, "max_in_cpu": max_in_cpu,
                                 "buffer_size": 1000}}
        torch.manual_seed(0)
        with zero3.Init(config_dict_or_path=cfg):
            model = nn.Sequential(*[nn.Linear(i, o) for i, o in sizes])
        built_in_memory = {name for name, p in model.named_parameters() if p._zero.swap is None}
        engine = zero3.initialize(model, None, cfg)
        persistent = {p._zero.name for p in engine.coordinator.persistent}
        in_memory = {name for name, p in model.named_parameters() if p._zero.swap is None}
        assert persistent <= in_memory
        assert built_in_memory == in_memory
        expected = choose_persistent([p.ds_numel for p in model.parameters()], param_threshold, model_threshold)
        assert persistent == {name for (name, _), c in zip(model.named_parameters(), expected) if c}
        engine.remove_hooks()


def test_parameter_data_replaced_at_world_size_1_is_taken_into_the_shard_it_viewed():
    """At world size 1 a kept-gathered parameter is a view of its shard (the step needs no refresh).
    ``p.data = t`` (torch's vector_to_parameters) broke the view: the forwards used t for ever while
    the optimizer stepped the old shard. The step takes t and views the shard again: like torch."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    ref, model = build(), build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), {})
    assert all(p._zero.aliased for p in model.parameters())
    with torch.no_grad():
        for net in (ref, model):
            vector_to_parameters(parameters_to_vector(net.parameters()) * 0.5, net.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(((model(x) - y) ** 2).mean())
        engine.step()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(zero3.safe_get_full_fp32_param(a), b.detach(), rtol=1e-6, atol=1e-7)


def _aliased_mlp(cfg: dict) -> tuple[nn.Module, zero3.Engine]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
    assert all(p._zero.aliased for p in model.parameters())
    return model, engine


def test_at_world_size_1_writes_reach_the_master_and_a_refresh_or_a_context_settles_a_replaced_data():
    """World size 1, parameters viewing their shards. (1) bf16: an in-place write reaches the bf16
    shard only; the step (lr 0) must take it into the fp32 master, not copy the master back over it.
    (2) p.data = t, then refresh_from_masters: the shards win, as a gather's would at world size 2.
    (3) p.data = t inside GatheredParameters(modifier_rank=0): t is the new value of shard and master."""
    model, engine = _aliased_mlp({"bf16": {"enabled": True}})
    nn.init.zeros_(model[0].weight)
    engine.backward(engine(torch.randn(2, 8).bfloat16()).float().sum())
    engine.step()
    assert zero3.safe_get_full_fp32_param(model[0].weight).abs().max() == 0
    assert model[0].weight.abs().max() == 0

    model, engine = _aliased_mlp({})
    kept = zero3.safe_get_full_fp32_param(model[0].weight)
    model[0].weight.data = torch.full((16, 8), 0.1)
    engine.refresh_from_masters()
    assert torch.equal(model[0].weight.detach(), kept)
    with zero3.GatheredParameters([model[0].weight], modifier_rank=0):
        model[0].weight.data = torch.full((16, 8), 0.25)
    assert torch.equal(zero3.safe_get_full_fp32_param(model[0].weight), torch.full((16, 8), 0.25))
    assert torch.equal(model[0].weight.detach(), torch.full((16, 8), 0.25))


def test_an_evaluation_only_script_under_inference_mode_still_runs():
    """Built, initialized and run under torch.inference_mode(): the parameters are inference tensors,
    so initialize stays in inference mode there (it leaves it only for parameters that can train)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.inference_mode():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        zero3.initialize(model, None, {"param_persistence_threshold": 0})
        x = torch.randn(3, 8)
        got, want = model(x), ref(x)
    torch.testing.assert_close(got, want)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.lin2 = nn.Linear(4, 4)
        self.lin2.scale = self.scale  # one parameter under two names

    def forward(self, x):
        return self.lin2(self.lin(x) * self.scale) * self.lin2.scale


@pytest.mark.parametrize("bf16", [False, True])
def test_a_persistent_parameter_is_itself_in_the_state_dict_and_writes_through_it_reach_the_model(bf16) -> None:
    """Probe 34C: ``state_dict(keep_vars=True)`` gave copies of persistent parameters (not the
    parameters, tied names untied) and ``state_dict()`` copies instead of views, so torch's in-place
    writes through a state dict were lost (the forward 1.73 off torch's)."""
    torch.manual_seed(0)
    ref = _Tied()
    torch.manual_seed(0)
    model = _Tied()
    config = {"bf16": {"enabled": True}} if bf16 else {}
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), config)
    kept = model.state_dict(keep_vars=True)
    assert all(kept[n] is p for n, p in model.named_parameters(remove_duplicate=False))
    for m in (ref, model):
        with torch.no_grad():
            m.state_dict(keep_vars=True)["lin.bias"].zero_()
            (m.state_dict(keep_vars=True) if bf16 and m is model else m.state_dict())["scale"].fill_(2.0)
    if bf16:  # at world size 1 a persistent bf16 copy views one buffer of every shard: a copy of its own size,
        # else torch.save writes the whole buffer (review 34RA); writes through it do not reach the model
        sd = model.state_dict()
        entry = sd["lin.bias"]
        assert entry.untyped_storage().nbytes() == 4 * 2 and entry.data_ptr() != model.lin.bias.data_ptr()
    x = torch.randn(2, 4)
    out = engine(x.to(torch.bfloat16) if bf16 else x).float()
    torch.testing.assert_close(out, ref(x), rtol=2e-2 if bf16 else 1e-6, atol=2e-2 if bf16 else 1e-6)
    engine.backward(out.sum())
    engine.step()  # lr 0: the masters take the writes (bf16; fp32 at world size 1: the copy views them)
    assert torch.equal(zero3.safe_get_full_fp32_param(model.lin.bias), torch.zeros(4))
    assert torch.equal(zero3.safe_get_full_fp32_param(model.scale), 2 * torch.ones(4))
    for dest in ({}, collections.OrderedDict()):  # review 34RC: a plain dict was refused, a reused one stale
        model.state_dict(destination=dest)
        with torch.no_grad():
            model.lin.bias.add_(1.0)
        assert torch.equal(model.state_dict(destination=dest)["lin.bias"], model.lin.bias.detach())
