"""Modules that read their parameters or inputs, or run their backward, their own way, at world size 1
against the plain module (probes 37A, 37E)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import zero3

from _reference import twins


def _train_as_torch(engine, model, ref, ref_opt, shape, run=lambda m, x: m(x), weights=True) -> None:
    """3 steps of ``model`` under ``engine`` and of ``ref`` with ``ref_opt`` on the same random batches of
    ``shape``: the losses, and with ``weights`` every parameter after them, must match."""
    for _ in range(3):
        x = torch.randn(*shape)
        loss = run(model, x).square().mean()
        engine.backward(loss)
        engine.step()
        ref_loss = run(ref, x).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    if weights:
        with zero3.GatheredParameters(list(model.parameters())):
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class _Attention(nn.Module):
    """MultiheadAttention reads ``out_proj.weight`` without calling ``out_proj`` (an external parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.m = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.m(h, h, h, need_weights=False)[0]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_attention_sees_one_tensor_as_query_key_and_value_and_trains_as_torch_under_a_checkpoint(checkpointed):
    """From the second step the module's inputs were each wrapped apart (its external parameter makes it
    close by an autograd node on its inputs), so ``query is key`` was false: the packed path was left,
    and torch's checkpoint refused its recompute (CheckpointError: different metadata) at threshold 0."""
    ref, model = twins(_Attention)
    seen = []
    model.m.register_forward_pre_hook(lambda m, args, kwargs: seen.append((args[0] is args[1], args[1] is args[2])),
                                      with_kwargs=True)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    run = (lambda m, x: torch_checkpoint.checkpoint(m, x, use_reentrant=False)) if checkpointed else (lambda m, x: m(x))
    _train_as_torch(engine, model, ref, ref_opt, (2, 5, 8), run, weights=False)
    assert set(seen) == {(True, True)}


class _Reversible(torch.autograd.Function):
    """A reversible block (RevNet, Reformer): nothing saved but the output; the backward rebuilds the input
    and runs ``f`` and ``g`` again with a backward of their own. The parameters are passed in, so autograd
    knows them, and get None: their gradients come from the nested backwards."""

    @staticmethod
    def forward(ctx, x, f, g, *params):
        x1, x2 = x.chunk(2, -1)
        with torch.no_grad():
            y1 = x1 + f(x2)
            y2 = x2 + g(y1)
        ctx.f, ctx.g = f, g
        y = torch.cat([y1, y2], -1)
        ctx.save_for_backward(y.detach())
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        y1, y2 = y.chunk(2, -1)
        dy1, dy2 = dy.chunk(2, -1)
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            gy1 = ctx.g(y1)
            torch.autograd.backward(gy1, dy2)
        with torch.no_grad():
            x2 = y2 - gy1
            dx1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_()
            torch.autograd.backward(ctx.f(x2), dx1)
        return (torch.cat([dx1, dy2 + x2.grad], -1), None, None) + (None,) * (len(ctx.needs_input_grad) - 3)


class _RevBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.g = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Reversible.apply(x, self.f, self.g, *self.f.parameters(), *self.g.parameters())


@pytest.mark.parametrize("threshold", [0, 10**6])
def test_reversible_layers_whose_function_takes_the_parameters_train_as_torch(threshold):
    """After a nested backward reduced a parameter's gradient and released it, the outer graph's
    AccumulateGrad for it (an input of the Function, given None) fired zero3's hook, whose read of
    ``p.grad`` hit the guard meant for user code: ZeroStateError at threshold 0 (probe 37E)."""
    ref, model = twins(lambda: nn.Sequential(nn.Linear(8, 8), _RevBlock(), _RevBlock(), nn.Linear(8, 2)))
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": threshold})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    _train_as_torch(engine, model, ref, ref_opt, (4, 8))


class _Mlp(nn.Module):
    """A transformer MLP over (batch, time, features): F.linear of a 3-D input returns a view of its matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.relu_()  # ReLU(inplace=True)
        y = self.proj(h)
        y *= 0.5
        return y


class _ScaledInput(nn.Module):
    """A frozen weight (LoRA-like) and a trainable scale applied to its own input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(8, 8) * 0.3, requires_grad=False)  # its own: its inputs get wrapped
        self.scale = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(self.scale)
        return x @ self.base.t()


def test_in_place_writes_on_outputs_that_are_views_train_as_torch():
    """An in-place op on a view output rebases it, taking the hooked node out of the graph: the weight was
    not gathered for its backward ('setStorage ... storage of size 0'), at threshold 0, and with the
    default config for layers over the threshold (probe 37N)."""
    ref, model = twins(_Mlp)
    engine = zero3.initialize(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                              {"param_persistence_threshold": 0})
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    _train_as_torch(engine, model, ref, ref_opt, (2, 5, 8))


def test_a_module_whose_inputs_are_wrapped_writing_its_input_in_place_is_refused_before_it_writes():
    """Its inputs are wrapped (a frozen parameter of its own), and torch refuses an in-place op on them.
    Handed back detached they took the write, and a caller using the input again (s(h) + h) got gradients
    off torch's by 0.3 with no error (review 37R4): refused, the input unchanged (docs/api.md)."""
    model = nn.Sequential(nn.Linear(8, 8), _ScaledInput())
    zero3.initialize(model, None, {"param_persistence_threshold": 0})
    with pytest.raises(RuntimeError, match="modified inplace"):
        model(torch.randn(2, 8))


def test_jit_trace_over_gathered_parameters_and_a_module_torch_ao_swapped_in_are_refused_by_name():
    """torch.jit.trace at threshold 0 met the first gather's collective, which raised as a failed collective
    and closed the engine's group (at 2 ranks); a module swapped in by quantize_dynamic(inplace=True) kept
    zero3's hooks and every forward raised a TypeError from them (probe 37X). An all-persistent model
    traces as torch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    x = torch.randn(2, 8)
    with pytest.raises(zero3.ZeroStateError, match=r"torch.jit.trace reached module 0.*consolidated_state_dict"):
        torch.jit.trace(model, (x,), check_trace=False)
    engine.backward(model(x).sum())  # the engine trains on
    engine.step()
    torch.manual_seed(0)
    kept = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    zero3.initialize(kept, None)  # every parameter persistent: nothing to gather
    fresh = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    zero3.initialize(fresh, None)
    with pytest.raises(zero3.ZeroStateError, match=r"torch.export reached module '0'.*consolidated_state_dict"):
        torch.export.export(fresh, (x,))  # it said the parameter was registered after initialize
    torch.testing.assert_close(torch.jit.trace(kept, (x,), check_trace=False)(x), kept(x))
    torch.ao.quantization.quantize_dynamic(kept, {nn.Linear}, dtype=torch.qint8, inplace=True)
    with pytest.raises(zero3.ZeroStateError, match=r"module 0 was replaced by another that kept its zero3 hooks"):
        kept(x)
