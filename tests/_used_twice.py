"""A model whose recompute gathers a weight again after its gradient is final (the step in backward's
hazard: optim/backward_step.py [Note: optimizer step in backward])."""

from __future__ import annotations

from torch import nn

import zero3


class UsedTwice(nn.Module):
    """``m`` runs in a checkpointed region with its output detached, then again with a gradient: its
    gradient is final after the second use's backward, before the region's recompute runs ``m``
    again, gathering it anew."""

    def __init__(self) -> None:
        super().__init__()
        self.m = nn.Linear(8, 8)
        self.n = nn.Linear(8, 8)

    def region(self, x):
        return self.n(self.m(x).detach())

    def forward(self, x):
        return self.m(zero3.checkpointing.checkpoint(self.region, x)).square().mean()
