"""Parameters that autograd saved inside ``GatheredParameters``, gathered again when a backward needs them.

[Note: a saved parameter outlives its gather]
A term built inside ``GatheredParameters`` (a regulariser ``0.1 * w.pow(2).sum()``, a penalty on
``w.t() @ w``) makes autograd save ``w``, or a view of it, for the backward. The block's exit
releases ``w`` (its storage is resized to 0 bytes), and a backward that runs that node after the
exit read freed memory: a segfault on every rank. Within a running step the block keeps its
parameters gathered until the step ends (gathered.py [Note: a loss term from GatheredParameters]),
and a module whose backward closes by its parameters' gradients holds them until the term's
gradient arrived; the term's own ``backward()`` after the model's, or one after the block but with
no forward of the module between, had nothing that gathered ``w`` again.

So while a block is open, a saved-tensors hook (`SavedParams`) marks every
tensor that is one of the block's parameters or a view of one. When the backward unpacks it and
the parameter is no longer gathered, it is gathered for the user again (exact values, a
collective: every rank runs the same backward, so every rank unpacks the same tensors in the same
order), copied, and released at once: the node computes with the copy, which autograd frees after
it, so nothing stays gathered or pinned, even when that backward raises. What torch refuses is
refused too: if the parameter's values changed between the pack and the unpack (an optimizer step,
or a write published by ``GatheredParameters(modifier_rank=...)`` or a load), torch's backward
would raise that the tensor was modified by an in-place operation, and so does this one, naming the
parameter. The values are compared by a fingerprint taken at the pack (the sum of their bytes as
64-bit words, rank_values.py), and the ranks agree on the outcome (one small all-reduce beside the
gather), so every rank raises or none does. A parameter found gathered at the unpack (its module's
backward holds it, or the next forward's) is used as it is, unchecked.
Other saved tensors are passed to the hooks that were active around the
block (``torch.autograd.graph.save_on_cpu``, an outer block's), or kept as they are.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import ZeroStateError
from ..partition.param import ZeroParameter, raw_data
from ..partition.state import ParamStatus
from ..comm.tags import Kind, Tag
from .rank_values import bit_sum

try:  # the hooks active when a block opens: tensors that are not ours go to them
    from torch._C._autograd import _top_saved_tensors_default_hooks as _top_hooks
except ImportError:  # pragma: no cover - a torch without it: no guard, the crash stays possible
    _top_hooks = None


@dataclass(eq=False, slots=True)
class _Saved:
    """A block's parameter (or a view of one) as autograd saved it, with a fingerprint of its values then."""

    tensor: torch.Tensor
    param: "weakref.ref[ZeroParameter]"  # weakly: a graph that saved a view must not keep a dropped parameter
    bits: torch.Tensor  # `bit_sum` of the parameter's full values when it was saved


@dataclass(eq=False, slots=True)
class _Outer:
    """What the hooks around the block packed, and their unpack."""

    packed: Any
    unpack: Callable[[Any], torch.Tensor]


class SavedParams:
    """Saved-tensors hooks for one ``GatheredParameters`` block (see the Note): ``with`` it around
    the block's body."""

    def __init__(self, ctx: Any, params: list[ZeroParameter]) -> None:
        self.ctx = ctx
        # Weakly: every graph built in the block holds these hooks (its nodes keep the unpack hook), and
        # a parameter the model drops (weight_norm's original weight) must go with the model's references.
        self.params: "weakref.WeakValueDictionary[int, ZeroParameter]" = weakref.WeakValueDictionary(
            (id(p), p) for p in params if not p._zero.persistent)
        outer = _top_hooks(False)
        self.outer: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = outer
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @staticmethod
    def available() -> bool:
        """Whether the hooks can be installed here (torch can have saved-tensors hooks disabled)."""
        return _top_hooks is not None and torch._C._autograd._saved_tensors_hooks_is_enabled()

    def __enter__(self) -> None:
        self._hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> Any:
        p = self.params.get(id(t))
        if p is None and t._base is not None:
            p = self.params.get(id(t._base))
            if p is not None and t.dtype != p.dtype:  # a dtype view: not one `_unpack` can rebuild
                p = None
        if p is not None:
            return _Saved(t, weakref.ref(p), bit_sum(raw_data(p)))
        if self.outer is not None:
            return _Outer(self.outer[0](t), self.outer[1])
        # Detached: an op that saves its own output (exp, tanh) would otherwise hold that output, whose
        # grad_fn holds the hook's result: a cycle through autograd's C++ that the collector cannot see,
        # so the graph, and a cached AccumulateGrad of the old shape, lived on. Torch re-attaches the
        # grad_fn when it unpacks.
        return t.detach()

    def _unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is _Outer:
            return saved.unpack(saved.packed)
        if type(saved) is not _Saved:
            return saved
        p = saved.param()
        if p is None or p._zero.status is ParamStatus.AVAILABLE:  # dropped (nothing drives it now), or gathered
            return saved.tensor
        ctx = self.ctx
        ctx.coordinator.gather_for_user([p])
        try:  # a copy, so that nothing stays gathered (or pinned, if this backward raises) after this node
            full = raw_data(p)
            changed = (bit_sum(full) != saved.bits).to(torch.int64).reshape(1)
            ctx.comm.all_reduce(changed, Tag(Kind.ALL_REDUCE, f"saved {p._zero.name} unchanged"), op="max")
            if changed.item():
                raise ZeroStateError(
                    f"a tensor computed from {p._zero.name} inside zero3.GatheredParameters was saved for the "
                    "backward, and the parameter's values changed since (an optimizer step, or a write published "
                    "into its shards) on some rank; torch refuses this backward too (a tensor needed for gradient "
                    "computation was modified by an inplace operation). Run the backward of that term before the "
                    "change")
            t = saved.tensor
            copy = full.clone(memory_format=torch.contiguous_format)
            if t is p:
                return copy
            return copy.as_strided(t.size(), t.stride(), t.storage_offset() - full.storage_offset())
        finally:
            ctx.coordinator.release_for_user([p])
