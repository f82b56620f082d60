"""hpZ (ZeRO++): the secondary slices a rank keeps of the parameters gathered in a training step.

[Note: hpZ secondary shards]
With ``zero_hpz_partition_size``, every parameter gathered on the training path (the hooks' fetches
and prefetches in a step that began with grad enabled) from its primary shards keeps a secondary
slice once its gather completes: 1/L of it, L the ranks of its secondary group (a node by default;
comm/secondary.py `Secondary`). Any later training-path gather of it in the same step (backward, or
a tied weight's second use) comes from the secondary slices (user gathers and persistent refreshes
always read the primary shards), over the
node's communicator, so it never crosses nodes. The slices are not counted in the live budget;
``metrics.secondary_bytes`` is what they hold, and they are all dropped when the step ends (and a
parameter's as soon as a user rewrites its shards).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..comm.communicator import Tag
from ..metrics import StepMetrics
from ..partition.param import ZeroParameter

if TYPE_CHECKING:
    from ..comm.communicator import Communicator, GatherWork, Secondary


class SecondarySlices:
    """The secondary slices held now, and the gathers that use them (see the module docstring)."""

    def __init__(self, node_comm: Communicator, metrics: StepMetrics) -> None:
        self.node_comm = node_comm
        self.metrics = metrics
        self.keeping = False  # this step keeps secondary slices (a training step)
        self._held: dict[int, ZeroParameter] = {}  # params holding a secondary slice now

    def adopt(self, p: ZeroParameter, secondary: Secondary) -> None:
        """``p``'s gather cut ``secondary``: hold it (instead of any older one)."""
        self.drop([p])
        p._zero.secondary = secondary
        self._held[p._zero.id] = p
        self.metrics.add_secondary(secondary.nbytes)

    def drop(self, params: Iterable[ZeroParameter] | None = None) -> None:
        """Forget the secondary slices of ``params`` (None: all)."""
        for p in list(self._held.values()) if params is None else params:
            if self._held.pop(p._zero.id, None) is not None:
                self.metrics.add_secondary(-p._zero.secondary.nbytes)
                p._zero.secondary = None

    def gather(self, comm: Communicator, params: Sequence[ZeroParameter], tag: Tag, count: bool,
               keep: bool) -> list[GatherWork]:
        """One training-path gather of ``params`` (qwZ codes it when on): those with a secondary slice
        from it, inside the node (at most one gather per slice form, the same split on every rank), the
        rest from their primary shards."""
        if all(p._zero.secondary is None for p in params):
            return [comm.all_gather_params(params, tag, count=count, keep_secondary=keep, quantize=True)]
        works = []
        for quantized in (False, True):
            part = [p for p in params if p._zero.secondary is not None and p._zero.secondary.quantized is quantized]
            if part:
                works.append(self.node_comm.all_gather_secondary(part, _subtag(tag, part)))
        primary = [p for p in params if p._zero.secondary is None]
        if primary:
            works.append(comm.all_gather_params(primary, _subtag(tag, primary), count=count, keep_secondary=keep,
                                                quantize=True))
        return works


def _subtag(tag: Tag, params: Sequence[ZeroParameter]) -> Tag:
    """``tag`` for the part ``params`` of a gather that was split."""
    return Tag(tag.kind, tag.label, tuple(p._zero.id for p in params))
