"""``torch.nn.utils.clip_grad_norm_`` over a zero3 optimizer's tensors clips by the global norm.

zero3 re-points the user's optimizer at this rank's shards (routed_step.py), so the tensors in its
``param_groups`` are 1-D slices of the parameters. Code that clips over them (PyTorch Lightning
clips ``optimizer.param_groups``' tensors, and so do hand-written loops) got torch's function
measuring only this rank's slices: each rank clipped by its own partial norm, a wrong result
without a word. From the first ``initialize`` on, ``torch.nn.utils.clip_grad_norm_`` (the module
attribute, where such code finds it) looks at what it was given: tensors that are all the shards
(or fp32 masters) of one engine's parameters go to ``zero3.clip_grad_norm_`` over those parameters,
which clips by the norm over every rank's gradients (the same as torch's over the full model) and
refuses a part of them; a mix of them with other tensors is refused; anything else is torch's call,
unchanged. A reference to the function taken before the first ``initialize``
(``from torch.nn.utils import clip_grad_norm_`` at import) is torch's own, and still sees slices.
The model's parameters themselves (``model.parameters()``) are refused by their gradient guard
(partition/param.py `_check_grad_read`), as before. The routed function carries torch's module and
name, so pickling ``torch.nn.utils.clip_grad_norm_`` still works (by reference: another process
finds its own); a reference to torch's function taken before the routing no longer pickles (pickle
finds another object under its name).
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from ..errors import ZeroConfigError, ZeroStateError

_CONTEXTS: list[weakref.ref] = []  # every engine's context, while it lives
_TORCH_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_
_ZERO3_CLIP: list[Callable[..., torch.Tensor]] = []  # zero3.clip_grad_norm_, set by the first `route_clip`


def route_clip(ctx: Any, zero3_clip: Callable[..., torch.Tensor]) -> None:
    """Let torch's ``clip_grad_norm_`` find ``ctx``'s shards (an `initialize`); installs the routing
    once, with ``zero3_clip`` (``zero3.clip_grad_norm_``) as the clip it routes to."""
    _CONTEXTS[:] = [r for r in _CONTEXTS if r() is not None]
    _CONTEXTS.append(weakref.ref(ctx))
    if not _ZERO3_CLIP:
        _ZERO3_CLIP.append(zero3_clip)
        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    tensors = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = _shard_owners()
    params = [owners.get(id(t)) for t in tensors]
    if not any(p is not None for p in params):
        return _TORCH_CLIP(tensors, max_norm, norm_type, error_if_nonfinite, foreach)
    if not all(p is not None for p in params):
        raise ZeroStateError(
            "torch.nn.utils.clip_grad_norm_ got tensors of which some are a zero3 optimizer's shards (from its "
            "param_groups) and some are not: zero3 clips its shards by the norm over every rank's gradients, "
            "which cannot be mixed with a local norm. Clip them in two calls, or with zero3.clip_grad_norm_("
            "engine_or_model, max_norm); nothing was clipped")
    ctx = params[0]._zero.ctx
    trainable = {id(p) for p in ctx.params if p.requires_grad}
    given = trainable & {id(p) for p in params}
    if len(given) < len(trainable):
        raise ZeroStateError(
            f"torch.nn.utils.clip_grad_norm_ over the shards of {len(given)} of the engine's {len(trainable)} trainable "
            "parameters (one param group, or an optimizer over a part of the model): zero3 clips by the norm over "
            "every gradient of the engine, in one call, and clipping a part of them by its own norm is not "
            "supported. Clip the tensors of every param group in one call (over all trainable parameters), or "
            "use the config's gradient_clipping; nothing was clipped")
    if error_if_nonfinite:
        raise ZeroConfigError(
            "torch.nn.utils.clip_grad_norm_(..., error_if_nonfinite=True) over a zero3 optimizer's shards: zero3's "
            "clip does not raise on a non-finite norm (it returns it, and fp16 skips the step); call it without "
            "error_if_nonfinite and check the returned norm; nothing was clipped")
    if isinstance(max_norm, torch.Tensor) and max_norm.numel() == 1 or isinstance(max_norm, numbers.Real):
        max_norm = float(max_norm)  # torch takes a 0-d tensor or a numpy number too
    return _ZERO3_CLIP[0](params, max_norm, norm_type)


# Pickled by reference under torch's name, which is this function once routed (see the Note).
clip_grad_norm_.__module__ = _TORCH_CLIP.__module__
clip_grad_norm_.__qualname__ = _TORCH_CLIP.__qualname__
clip_grad_norm_.__doc__ = (_TORCH_CLIP.__doc__ or "") + "\n\nzero3: an engine's optimizer shards are clipped by " \
    "the global norm (zero3/optim/routed_clip.py)."


def _shard_owners() -> dict[int, Any]:
    """id of each shard and master tensor an optimizer of a live engine steps -> its parameter."""
    owners: dict[int, Any] = {}
    for ref in _CONTEXTS:
        ctx = ref()
        if ctx is None or not ctx.attached:
            continue
        for p in ctx.params:
            owners[id(p._zero.shard)] = p
            owners[id(p._zero.train_tensor)] = p
    return owners
