"""One training step of a plain reference and of a zero3 engine on the same batch."""

from __future__ import annotations

import torch


def step_both(ref, ref_opt, engine, x, y, rtol: float) -> torch.Tensor:
    """Step the reference, then the engine; their losses must match to ``rtol``. Returns the loss."""
    ref_loss = ref(x, y)
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=0)
    return loss
