"""A hypothesis property of [Note: unfreezing after initialize] (runtime/trainable.py), in one process:
after a step with the flags ``initialize`` saw, any change of ``requires_grad`` is refused exactly when
it unfreezes a parameter frozen at ``initialize``; a refused forward changes nothing, and every other
change steps as torch does (frozen parameters stay, momentum and weight decay included)."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import zero3

LAYERS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(6, 6) for _ in range(LAYERS)])


def _set(model: nn.Module, trainable: list[bool]) -> None:
    for layer, flag in zip(model, trainable):
        for p in layer.parameters():
            p.requires_grad_(flag)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(3, 6, generator=torch.Generator().manual_seed(step))


@settings(max_examples=25, deadline=None)
@given(at_init=st.lists(st.booleans(), min_size=LAYERS, max_size=LAYERS),
       later=st.lists(st.booleans(), min_size=LAYERS, max_size=LAYERS))
def test_a_change_of_requires_grad_is_refused_exactly_when_it_unfreezes(at_init, later):
    ref = _model()
    model = copy.deepcopy(ref)  # before initialize: a plain copy
    for m in (ref, model):
        _set(m, at_init)
    opt_args = dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), **opt_args)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), **opt_args), {"param_persistence_threshold": 0})
    try:
        if any(at_init):  # one step with the flags initialize saw (momentum for the later ones)
            engine.backward(engine(_batch(0)).pow(2).mean())
            engine.step()
            ref(_batch(0)).pow(2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        _set(model, later)
        unfreezes = any(b and not a for a, b in zip(at_init, later))
        before = [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
        refused = False
        try:
            out = engine(_batch(1))
        except zero3.ZeroStateError as exc:
            assert "frozen (requires_grad=False) when zero3.initialize" in str(exc)
            refused = True
        assert refused == unfreezes
        if refused:
            assert all(torch.equal(a, zero3.safe_get_full_fp32_param(p)) for a, p in zip(before, model.parameters()))
            _set(model, at_init)  # as the message says: freeze them again and go on
            later = at_init
            out = engine(_batch(1))
        _set(ref, later)
        if any(later):
            engine.backward(out.pow(2).mean())
            engine.step()
            ref(_batch(1)).pow(2).mean().backward()
            ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(zero3.safe_get_full_fp32_param(p), q.detach(), rtol=0, atol=1e-6)
    finally:
        engine.remove_hooks()
