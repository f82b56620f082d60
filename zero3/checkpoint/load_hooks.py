"""A model's own ``load_state_dict`` hooks, run by `zero3.pretrained.load_state_dict` where torch's
``load_state_dict`` runs them (probe 29D: a pre-hook that renames a legacy checkpoint's keys was
skipped, so ``strict=False`` loaded nothing and said only that every key was missing or unexpected).

The pre-hooks (``register_load_state_dict_pre_hook`` and the older ``_register_...``) run first, each
module's in torch's order (a module before its children), on a copy of the state dict, which they
may change. The post-hooks run after the load with the missing and unexpected keys. zero3's own hooks
(runtime/gathered.py `load_hooks`, for torch's path) are left out. A class's own
``_load_from_state_dict`` (BatchNorm's, a user's) is not run: zero3 copies each rank's slice itself
(docs/api.md)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable

from torch import nn

from ..errors import ZeroStateError
from ..runtime.gathered import refuse_assign, write_back_loaded


def _own(hook: Any) -> bool:
    fn = getattr(hook, "hook", hook)  # torch's _WrappedHook keeps the function as .hook
    return fn is refuse_assign or (isinstance(fn, functools.partial) and fn.func is write_back_loaded)


def pre_hooks(module: nn.Module) -> list[tuple[str, Callable[..., Any]]]:
    """(prefix, hook) of every pre-hook of ``module``'s tree that is not zero3's, in torch's order."""
    return [(prefix + "." if prefix else "", h) for prefix, m in module.named_modules()
            for h in m._load_state_dict_pre_hooks.values() if not _own(h)]


def post_hooks(module: nn.Module) -> list[tuple[nn.Module, Callable[..., Any]]]:
    return [(m, h) for m in module.modules() for h in m._load_state_dict_post_hooks.values() if not _own(h)]


def run_pre_hooks(module: nn.Module, source: Any, strict: bool) -> Any:
    """``source`` after the model's pre-hooks: a new dict when it is a mapping; a path is refused when
    there are hooks (they rewrite a dict; a file is read slice by slice and never held whole)."""
    hooks = pre_hooks(module)
    if not hooks:
        return source
    if not isinstance(source, Mapping):
        raise ZeroStateError(
            f"the model has load_state_dict pre-hooks ({hooks[0][0] or 'the root'}...), which rewrite an in-memory "
            f"state dict; zero3.pretrained.load_state_dict reads {source!r} slice by slice and cannot run them. "
            "Load the file into a dict (safetensors.torch.load_file or torch.load) and pass the dict; nothing was loaded")
    state_dict = dict(source)
    metadata = getattr(source, "_metadata", None) or {}
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []
    for prefix, hook in hooks:
        hook(state_dict, prefix, metadata.get(prefix[:-1], {}), strict, missing, unexpected, errors)
    if errors:
        raise ZeroStateError("a load_state_dict pre-hook reported: " + "; ".join(errors) + "; nothing was loaded")
    return state_dict


def run_post_hooks(module: nn.Module, missing: list[str], unexpected: list[str]) -> None:
    """Each post-hook with torch's ``_IncompatibleKeys`` of the load (the hook may read or clear them;
    under ``strict`` a key missing was refused before anything loaded, so it cannot excuse one)."""
    keys = nn.modules.module._IncompatibleKeys(missing, unexpected)
    for m, hook in post_hooks(module):
        out = hook(m, keys)
        if out is not None:
            raise ZeroStateError(f"a load_state_dict post-hook of {type(m).__name__} returned {out!r}; torch "
                                 "requires it to return None (it may change the key lists in place)")
