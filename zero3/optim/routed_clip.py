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

torch's other clipping functions get the same look (probe 25B found both silently wrong):
- ``get_total_norm`` over the gradients of an engine's shards returns the global norm (any of the
  parameters: the norm of the full gradients of those), with fp16 in true units (the window's
  gradients are unscaled first, as ``clip_grad_norm_`` does). ``clip_grads_with_norm_`` then scales the
  shards elementwise by torch's own code, which is right once the norm is. Over the shards themselves
  (a parameter norm for a log) it returns the full parameters' norm. ``norm_type`` 0 and -inf are
  refused. With the optimizer step in backward no gradient shard is left after the backward, so
  there is nothing to recognise: the list is empty and torch's call returns 0 (as it does for an
  empty list); ``clip_grad_value_`` over the shards is refused there.
- ``clip_grad_value_`` over shards clamps elementwise, which shards allow; with fp16 it unscales the
  window's gradients first, or it clamped loss-scaled gradients (the clip value divided by the scale).
Both want the window's last gradients, as ``zero3.clip_grad_norm_`` does.
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
from ..comm.model_parallel import is_tensor_parallel
from .grad_norm import global_grad_norm

_CONTEXTS: list[weakref.ref] = []  # every engine's context, while it lives
_TORCH_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_
_TORCH_TOTAL_NORM = torch.nn.utils.get_total_norm  # clip_grad._get_total_norm, which torch's clip calls itself
_TORCH_CLIP_VALUE = torch.nn.utils.clip_grad.clip_grad_value_
_ZERO3_CLIP: list[Callable[..., torch.Tensor]] = []  # zero3.clip_grad_norm_, set by the first `route_clip`


def route_clip(ctx: Any, zero3_clip: Callable[..., torch.Tensor]) -> None:
    """Let torch's ``clip_grad_norm_`` find ``ctx``'s shards (an `initialize`); installs the routing
    once, with ``zero3_clip`` (``zero3.clip_grad_norm_``) as the clip it routes to."""
    _CONTEXTS[:] = [r for r in _CONTEXTS if r() is not None]
    _CONTEXTS.append(weakref.ref(ctx))
    if not _ZERO3_CLIP:
        _ZERO3_CLIP.append(zero3_clip)
        for name, routed in (("clip_grad_norm_", clip_grad_norm_), ("clip_grad_value_", clip_grad_value_)):
            setattr(torch.nn.utils, name, routed)
            setattr(torch.nn.utils.clip_grad, name, routed)
        torch.nn.utils.get_total_norm = get_total_norm


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


def get_total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None) -> torch.Tensor:
    given = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    grads = _grad_owners()
    params = [grads.get(id(t)) for t in given]
    of_grads = any(p is not None for p in params)
    if not of_grads:  # the shards themselves (a parameter norm for a log): the full parameters' norm
        shards = _shard_owners()
        params = [shards.get(id(t)) for t in given]
        if not any(p is not None for p in params):
            return _TORCH_TOTAL_NORM(given, norm_type, error_if_nonfinite, foreach)
    ctx = _one_engine(params, "get_total_norm", "a zero3 optimizer's shards or their gradients")
    norm_type = float(norm_type)  # torch takes "inf" too
    if not norm_type > 0:
        raise ZeroConfigError(f"torch.nn.utils.get_total_norm over a zero3 optimizer's shards: norm_type must be a "
                              f"number > 0 or inf, got {norm_type}")
    if of_grads:
        _window_complete(ctx, "get_total_norm")
    else:
        ctx.require_states("get_total_norm", ("lp_params", "hp_params"))  # not offloaded (engine.offload_states)
    total = global_grad_norm([(t, is_tensor_parallel(p)) for t, p in zip(given, params)], norm_type, ctx.comm,
                             ctx.comm.device, ctx.model_parallel)  # a tensor given twice counts twice, as torch's
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
                           "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    return total


def clip_grad_value_(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
    tensors = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = _shard_owners()
    params = [owners.get(id(t)) for t in tensors]
    if any(p is not None for p in params):
        ctx = _one_engine(params, "clip_grad_value_", "a zero3 optimizer's shards (from its param_groups)")
        if ctx.optimizer is not None and ctx.optimizer.backward_step is not None:
            raise ZeroStateError(
                "torch.nn.utils.clip_grad_value_ with offload_optimizer_step_in_backward: the optimizer steps during "
                "the backward and drops the gradient shards, so there is nothing to clip; nothing was changed")
        if ctx.optimizer is not None and ctx.optimizer.scaler is not None:
            _window_complete(ctx, "clip_grad_value_ with fp16")  # unscaled once, at the window's end
    return _TORCH_CLIP_VALUE(tensors, clip_value, foreach)


def _one_engine(params: list[Any], what: str, kind: str) -> Any:
    """The one engine whose tensors ``params`` (their owners, None for another tensor) all are."""
    ctxs = {id(p._zero.ctx): p._zero.ctx for p in params if p is not None}
    if len(ctxs) > 1 or not all(p is not None for p in params):
        raise ZeroStateError(
            f"torch.nn.utils.{what} got tensors of which some are {kind} and some are not (or of two engines): "
            "zero3 measures its shards over every rank's, which cannot be mixed with local tensors. Call it once "
            "per engine and once for the other tensors; nothing was changed")
    return next(iter(ctxs.values()))


def _window_complete(ctx: Any, what: str) -> None:
    """The gradients of the accumulation window are complete here, reduced, and (fp16) unscaled."""
    ctx.require_states(what, ("lp_grads",))
    ctx.finish_gradients()
    if not ctx.window_ends():
        raise ZeroStateError(
            f"torch.nn.utils.{what} over a zero3 optimizer's shards after {ctx.window_position()}: the gradients "
            "are not complete yet. Call it when engine.is_gradient_accumulation_boundary(); nothing was changed")
    if ctx.optimizer is not None:
        ctx.optimizer.unscale_()


# Pickled by reference under torch's names, which are these functions once routed (see the Note).
for _routed, _torch in ((clip_grad_norm_, _TORCH_CLIP), (get_total_norm, _TORCH_TOTAL_NORM),
                        (clip_grad_value_, _TORCH_CLIP_VALUE)):
    if _torch.__name__ == _routed.__name__:
        _routed.__module__, _routed.__qualname__ = _torch.__module__, _torch.__qualname__
    _routed.__doc__ = (_torch.__doc__ or "") + "\n\nzero3: over an engine's optimizer shards, by the global " \
        "gradients (zero3/optim/routed_clip.py)."


def _grad_owners() -> dict[int, Any]:
    """id of the gradient of each shard and master tensor a live engine's optimizer steps -> its parameter."""
    return {id(g): p for t, p in _tensors_of_engines() if (g := t.grad) is not None}


def _shard_owners() -> dict[int, Any]:
    """id of each shard and master tensor an optimizer of a live engine steps -> its parameter."""
    return {id(t): p for t, p in _tensors_of_engines()}


def _tensors_of_engines() -> list[tuple[torch.Tensor, Any]]:
    """Each shard and master tensor of a live engine's parameters, with the parameter."""
    out = []
    for ref in _CONTEXTS:
        ctx = ref()
        if ctx is not None and ctx.attached:
            for p in ctx.params:
                out.append((p._zero.shard, p))
                out.append((p._zero.train_tensor, p))
    return out
