"""torch.nn modules that read their parameters, or their inputs, their own way, at world size 1 against
the plain module (probe 37A)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import zero3

from _reference import twins


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
    for step in range(3):
        x = torch.randn(2, 5, 8)
        loss = run(model, x).square().mean()
        engine.backward(loss)
        engine.step()
        ref_loss = run(ref, x).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(seen) == {(True, True)}
