"""`zero3.Init`'s process-global patches: installing them and giving torch's functions back.

[Note: Init's patches are process-wide, the open Init is per context]
While an `Init` block is open, ``__init__`` of every ``nn.Module`` subclass is wrapped (and that of
classes defined meanwhile, through ``nn.Module.__init_subclass__``), ``nn.Module.apply``,
``parametrize.register_parametrization`` and ``WeightNorm.apply`` are replaced, and a global
parameter-registration hook is on. Those are process-wide, so they are counted process-wide under a
lock: the first block opened in the process (in any thread) installs them, and the last one to close
restores torch's (or whatever was in place before). Which `Init` is open stays per context (init.py's
``_STACK`` and this module's ``_BUILDING``, ContextVars): every replacement passes straight through in a
thread with no block of its own open, so a module built there is a plain module. Counted per context
instead, two threads' overlapping blocks left the patches on for good (each saved, as "originals", what
was installed when it entered) and the first to close unwrapped the other's classes (probe 38A F4).
"""

from __future__ import annotations

import contextvars
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn
from torch.nn.modules import module as module_mod
from torch.nn.utils import parametrize
from torch.nn.utils.weight_norm import WeightNorm

from .parametrize_routes import route_parametrizations


@dataclass(frozen=True)
class Replacements:
    """What `Init` puts in place of torch's functions; each acts for the `Init` open in the calling context."""

    on_param_registered: Callable[[nn.Module, str, Any], None]  # the global parameter-registration hook
    apply: Callable  # nn.Module.apply
    register_parametrization: Callable  # called with the function it replaced first
    weight_norm_apply: Callable  # called with the replaced WeightNorm.apply's function first
    built: Callable[[nn.Module, bool], None]  # a module's outermost __init__ returned (True: no other is building)


@dataclass(eq=False)
class _Patches:
    handles: list[Any]
    apply: Callable
    init_subclass: Any
    inits: dict[type, tuple[Callable, Callable]]  # class -> (its original __init__, our wrapper of it)
    register_parametrization: Callable  # torch's, given back on exit
    weight_norm_apply: Any  # torch's (deprecated) WeightNorm.apply staticmethod, given back on exit


_LOCK = threading.Lock()
_installed: _Patches | None = None
_open = 0  # contexts with an Init open, process-wide

# In a context with an Init open: id(module) -> nesting of its __init__ wrappers (None: no Init open here).
_BUILDING: contextvars.ContextVar[dict[int, int] | None] = contextvars.ContextVar("zero3_init_building", default=None)


def open_patches(replacements: Replacements) -> contextvars.Token:
    """The calling context's outermost `Init` opens: install the patches if none is open in the process.
    Returns the token for `close_patches`."""
    global _installed, _open
    with _LOCK:
        if _open == 0:
            _installed = _install(replacements)
        _open += 1
    return _BUILDING.set({})


def close_patches(token: contextvars.Token) -> None:
    """The calling context's outermost `Init` closes: the last one open in the process restores torch's."""
    global _installed, _open
    try:
        _BUILDING.reset(token)
    finally:
        with _LOCK:
            _open -= 1
            if _open == 0 and _installed is not None:
                _remove(_installed)
                _installed = None
                route_parametrizations()  # skipped while the patches were on (an initialize inside: review 37R2)


def _install(replacements: Replacements) -> _Patches:
    handles = [module_mod.register_module_parameter_registration_hook(replacements.on_param_registered)]
    patches = _Patches(handles=handles, apply=nn.Module.apply,
                       init_subclass=nn.Module.__dict__.get("__init_subclass__"), inits={},
                       register_parametrization=parametrize.register_parametrization,
                       weight_norm_apply=WeightNorm.__dict__["apply"])
    for cls in _all_subclasses(nn.Module):
        _wrap_init(cls, patches, replacements.built)

    def __init_subclass__(cls: type, **kwargs: Any) -> None:  # classes defined while Init is active
        super(nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
        _wrap_init(cls, patches, replacements.built)

    nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
    nn.Module.apply = replacements.apply  # type: ignore[method-assign]
    parametrize.register_parametrization = functools.partial(replacements.register_parametrization,
                                                             patches.register_parametrization)
    WeightNorm.apply = staticmethod(functools.partial(replacements.weight_norm_apply,  # type: ignore[method-assign]
                                                      patches.weight_norm_apply.__func__))
    return patches


def _remove(patches: _Patches) -> None:
    for h in patches.handles:
        h.remove()
    nn.Module.apply = patches.apply  # type: ignore[method-assign]
    parametrize.register_parametrization = patches.register_parametrization
    WeightNorm.apply = patches.weight_norm_apply  # type: ignore[method-assign]
    if patches.init_subclass is None:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = patches.init_subclass  # type: ignore[assignment]
    for cls, (orig, wrapper) in patches.inits.items():
        if cls.__dict__.get("__init__") is wrapper:  # else something wrapped it since: that chain stays
            cls.__init__ = orig  # type: ignore[misc]


def _wrap_init(cls: type, patches: _Patches, built: Callable[[nn.Module, bool], None]) -> None:
    """Wrap ``cls.__init__`` so a module is partitioned the moment its outermost ``__init__`` returns.

    The wrapper acts for whichever Init is open in the calling context and passes straight through when
    none is: a decorator may wrap it while an Init is open (transformers' ``use_experts_implementation``
    on a MoE class first imported inside one), and that chain outlives the Init, which gives back the
    original only where the wrapper is still the class's own ``__init__``."""
    orig = cls.__dict__.get("__init__")
    if orig is None or cls in patches.inits or getattr(orig, "_zero3_wrapped", False):
        return

    @functools.wraps(orig)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        building = _BUILDING.get()
        if building is None:
            orig(self, *args, **kwargs)
            return
        key = id(self)
        building[key] = building.get(key, 0) + 1
        try:
            orig(self, *args, **kwargs)
        finally:
            depth = building.pop(key) - 1
            if depth:
                building[key] = depth
        if not depth:
            built(self, not building)

    __init__._zero3_wrapped = True  # type: ignore[attr-defined]
    try:
        cls.__init__ = __init__  # type: ignore[misc]
    except (TypeError, AttributeError):
        return
    patches.inits[cls] = (orig, __init__)


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], list(cls.__subclasses__())
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out
