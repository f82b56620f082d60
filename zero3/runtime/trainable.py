"""The trainable set is fixed at ``initialize``: a parameter frozen then and unfrozen later is refused.

[Note: unfreezing after initialize]
``initialize`` decides which parameters train: each one with ``requires_grad`` then gets a gradient
hook that reduces its gradient into its shard (hooks.py), and under mixed precision or offload an
fp32 master in the optimizer's flat buffers (optim/optimizer.py [Note: flat master buffers]). A
parameter frozen then gets neither, so a later ``requires_grad_(True)`` (staged unfreezing) would
leave it as it was while torch trains it: nothing reduces its gradient into its shard.
So the first forward with gradients after such a change is refused, before anything runs.

Freezing after ``initialize`` needs nothing: the parameter's gradient stops, and torch's optimizers
skip a parameter without one (tests/multiproc/test_trainable.py checks both against torch).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ZeroStateError
from ..partition.param import ZeroParameter


class FrozenAtInstall:
    """The parameters frozen when the hooks were installed; `check` refuses any that now require grad."""

    def __init__(self, params: Iterable[ZeroParameter]) -> None:
        self.params = [p for p in params if not p.requires_grad]

    def check(self) -> None:
        """Raise if one of them requires grad now (call before a forward with gradients begins)."""
        unfrozen = [p for p in self.params if p.requires_grad]
        if not unfrozen:
            return
        names = ", ".join(p._zero.name or p._zero.summary() for p in unfrozen[:4])
        more = f" and {len(unfrozen) - 4} more" if len(unfrozen) > 4 else ""
        raise ZeroStateError(
            f"{len(unfrozen)} parameter(s) frozen (requires_grad=False) when zero3.initialize built the engine "
            f"now require grad: {names}{more}. zero3 sets up gradient reduction and the optimizer's shards "
            "for the parameters trainable at initialize, so these would never train. Make them trainable "
            "before zero3.initialize (and in the optimizer); to hold one fixed for a while, freeze it right after "
            "zero3.initialize and unfreeze it later, which trains as torch does. "
            "Nothing ran: set requires_grad_(False) again to go on as before")
