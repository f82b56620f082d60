"""The message of a computation refused on a partitioned parameter (param.py `_guard`): what zero3
saw, and what to do instead. Cold path only: it runs once a use is refused, never on a gathered call.

[Note: a use that skipped zero3's hooks]
zero3 gathers a module's parameters in its forward pre-hook, which runs only when the module is
called: ``model(x)``. A root that owns a parameter of its own (GPT-2's bare ``wpe``) called as
``model.forward(x)``, user code calling ``model.head.forward(h)``, or a forward pre-hook registered
on the module with ``prepend=True`` after ``zero3.initialize`` (it runs before zero3's) read the
parameter while no hook of the engine had run, and the error advised GatheredParameters or
register_external_parameter, neither of which fits (probe 33U). The refusal now looks at the
Python stack for such a call: a ``forward`` of a module holding the parameter that was not entered
through ``nn.Module.__call__``, or ``__call__`` of such a module still before its ``forward``.
"""

from __future__ import annotations

import sys
from types import CodeType, FrameType
from typing import Any

import torch
from torch import nn


def _on_stack(code: CodeType) -> bool:
    """Whether a frame running ``code`` is below the caller's."""
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def in_module_call() -> bool:
    """Whether a module's forward is running (a frame of ``nn.Module._call_impl`` below this one)."""
    return _on_stack(nn.Module._call_impl.__code__)


def _holds(module: Any, p: Any) -> bool:
    return isinstance(module, nn.Module) and any(q is p for q in module.parameters())


def skipped_hooks_advice(p: Any) -> str | None:
    """Why ``p`` is not gathered when the use came from a module whose hooks did not run for it: its
    ``forward`` called directly, or a pre-hook of it that runs before zero3's ([Note: a use that
    skipped zero3's hooks]); None when no such frame is on the stack."""
    root = getattr(p._zero.ctx, "module", None)
    if root is None:  # no engine: no hooks to skip
        return None
    call_code = nn.Module._call_impl.__code__
    frames: list[FrameType] = []
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        frames.append(f)
        f = f.f_back
    forwards = _forward_codes(root)
    for i, f in enumerate(frames):
        if f.f_code is call_code:
            module = _first_argument(f)
        else:
            module = _module_running(f, forwards.get(f.f_code), p)
        if not _holds(module, p):
            continue
        name = next((n for n, m in root.named_modules() if m is module), None)
        what = f"model.{name}" if name else "model" if name == "" else type(module).__name__
        if f.f_code is call_code:  # in __call__ but not in its forward: a hook of the module
            return (f"it is read by a hook of {'the model' if name == '' else what} that runs outside zero3's: "
                    "a forward pre-hook registered with "
                    "prepend=True after zero3.initialize runs before zero3's pre-hook gathers the module's "
                    "parameters, a forward hook runs after zero3's releases them. Register a pre-hook without "
                    "prepend=True (it then runs after zero3's), or gather inside the hook with "
                    "`with zero3.GatheredParameters(params):`")
        # a forward reached through a decorator or super().forward() is still inside its module's __call__
        if not any(g.f_code is call_code and _first_argument(g) is module for g in frames[i + 1:]):
            return (f"{what}.forward was called directly, which skips the module's __call__ and with it "
                    f"zero3's hooks: call `module(x)` (here `{what}(...)`, not `{what}.forward(...)`), so "
                    "zero3's hooks gather its parameters")
        return None  # entered through __call__: the generic advice fits
    return None


def _first_argument(f: FrameType) -> object:
    """The frame's first argument (``self`` of ``nn.Module._call_impl``)."""
    code = f.f_code
    return f.f_locals.get(code.co_varnames[0]) if code.co_argcount else None


def _forward_codes(root: nn.Module) -> dict[CodeType, list[nn.Module]]:
    """The code of each module's ``forward`` (through decorators, static and class methods, an
    assigned function), with the modules that run it. A frame is a module's forward by its code, not
    its name (probe 38B: ``def forward(s, x)``; review 38R1: ``forward(*args)``, a static forward, a free
    function named forward)."""
    out: dict[CodeType, list[nn.Module]] = {}
    for m in root.modules():
        fn = getattr(type(m), "forward", None)
        fn = getattr(fn, "__func__", fn)
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        code = getattr(fn, "__code__", None)
        if isinstance(code, CodeType):
            out.setdefault(code, []).append(m)
    return out


def _module_running(f: FrameType, modules: list[nn.Module] | None, p: Any) -> nn.Module | None:
    """The module whose forward frame ``f`` is (its instance when the frame holds it, else the one
    module of that code that holds ``p``), or None when ``f`` runs no module's forward."""
    if not modules:
        return None
    first = _first_argument(f)
    if any(m is first for m in modules):
        return first  # type: ignore[return-value]
    holding = [m for m in modules if _holds(m, p)]
    return holding[0] if len(holding) == 1 else None


def _in_multi_grad_hook() -> bool:
    """Whether torch's ``register_multi_grad_hook`` is on the stack (it calls ``view_as`` on each tensor)."""
    return _on_stack(torch.autograd.graph.register_multi_grad_hook.__code__)


def _parametrization_on_stack() -> str | None:
    """The name of torch's ``parametrizations.weight_norm``/``spectral_norm``/``orthogonal`` running below
    the caller, if one is: each reads the weight before it registers (spectral_norm's power iteration)."""
    from torch.nn.utils import parametrizations
    codes = {getattr(parametrizations, n).__code__: n for n in ("weight_norm", "spectral_norm", "orthogonal")}
    f: FrameType | None = sys._getframe(2)
    while f is not None and f.f_code not in codes:
        f = f.f_back
    return None if f is None else codes[f.f_code]


_WRAPPERS = (  # (a file of torch's that reads every parameter, what it is, what works instead)
    (("torch", "nn", "parallel", "distributed.py"), "torch's DistributedDataParallel wrapping the zero3 model",
     "do not wrap it: zero3 already reduces its gradients over the data-parallel ranks (pass the group to "
     "zero3.initialize)"),
    (("torch", "distributed", "fsdp"), "torch's FSDP (fully_shard) wrapping the zero3 model",
     "do not wrap it: zero3 already shards its parameters, gradients and optimizer state"),
    (("torch", "distributed", "checkpoint"), "torch.distributed.checkpoint reading the zero3 model's state dict",
     "save with engine.save_checkpoint(dir) (any world size loads it) or engine.consolidated_state_dict() (a "
     "full state dict for dcp.save or torch.save); docs/checkpoints.md"),
)


def _wrapper_on_stack(p: Any) -> str | None:
    """What to say when one of torch's wrappers or checkpoint helpers (`_WRAPPERS`) is reading ``p``'s
    model below the caller (a frame of its files holding a module that holds ``p``: review 38R4, a
    DDP-wrapped student using a zero3 teacher's weight was told the teacher was wrapped), else None."""
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        parts = f.f_code.co_filename.replace("\\", "/").split("/")
        for path, what, instead in _WRAPPERS:
            n = len(path)
            if any(tuple(parts[i:i + n]) == path for i in range(len(parts) - n + 1)) and _holds_in_frame(f, p):
                return f"{what} reads every parameter, which zero3 keeps partitioned; {instead}. Nothing was changed"
        f = f.f_back
    return None


def _holds_in_frame(f: FrameType, p: Any) -> bool:
    """Whether a module the frame works on (a local, or a local's ``.module``: DDP's) holds ``p``."""
    for value in list(f.f_locals.values()):
        for m in (value, getattr(value, "module", None)) if isinstance(value, nn.Module) else (value,):
            if isinstance(m, nn.Module) and _holds(m, p):
                return True
    return False


def partitioned_use_message(which: str, what: str, target: Any) -> str:
    """The error for a use of a partitioned parameter outside every specific case param.py `_guard`
    names: the call that skipped zero3's hooks where there was one, else the ways to gather it."""
    building = _parametrization_on_stack()
    if building is not None:  # probe 37A: the advice was a GatheredParameters block the registration then refused
        if target is not None and getattr(target._zero.ctx, "attached", False):
            return (f"parametrizations.{building} of {which} after zero3.initialize: the parameter would move into a "
                    "new module that has none of the hooks installed at initialize, so nothing would gather it. "
                    "Register parametrizations before zero3.initialize (on the built model, or inside zero3.Init); "
                    "nothing was changed")
        return (f"parametrizations.{building} of {which} while it is partitioned: it reads the weight before it "
                "registers. Register it inside `with zero3.GatheredParameters(list(module.parameters()), "
                "modifier_rank=0):` (a collective: on every rank alike) before zero3.initialize, or inside zero3.Init")
    if _in_multi_grad_hook():  # probe 34H: the user saw a 'view_as' they never wrote, and advice for forwards
        return (f"torch.autograd.graph.register_multi_grad_hook over partitioned parameter {which}: torch reads "
                "each tensor (view_as) to find its gradient node. Register it inside "
                "`with zero3.GatheredParameters(params):` (it then fires as torch's, with this rank's gradients "
                "before zero3 reduces them), or use p.register_post_accumulate_grad_hook on each parameter")
    wrapper = _wrapper_on_stack(target) if target is not None else None
    if wrapper is not None:  # probe 38F: the user saw a 'detach' or 'stride' they never wrote, and advice for forwards
        return f"parameter {which} is used by {what} while it is partitioned: {wrapper}"
    skipped = skipped_hooks_advice(target) if target is not None and target._zero.ctx is not None else None
    if skipped is not None:
        return f"parameter {which} is used by {what} while it is partitioned, outside zero3's hooks: {skipped}"
    if target is not None and getattr(target._zero.ctx, "module", False) is None and in_module_call():
        return (  # probe 34C: the cause came last, after the generic advice, and named one case of two
            f"parameter {which} is used by {what} while it is partitioned, and no zero3.initialize has taken it: "
            "its module is not in the module tree of the model given to zero3.initialize (held in a plain "
            "Python list or dict instead of nn.ModuleList or nn.ModuleDict), or was built under a zero3.Init "
            "block of its own and put into the model after zero3.initialize. Either way it has no zero3 hooks "
            "and its forward cannot gather it: register the module in the model (an attribute, nn.ModuleList, "
            "nn.ModuleDict) before zero3.initialize")
    return (
        f"parameter {which} is used by {what} while it is partitioned. zero3 gathers a "
        "module's parameters only while that module runs. Outside a forward, wrap the code in "
        "`with zero3.GatheredParameters(params):` (add modifier_rank=0 to change them; a loss term computed "
        "there may be backpropagated after the block, unless activation checkpointing recomputes it: then "
        "backpropagate it inside the block); if another "
        "module's forward uses it, call zero3.register_external_parameter(module, param). To save the "
        "model, use engine.consolidated_state_dict() or engine.save_checkpoint() (a Hugging Face model: "
        "engine.save_pretrained(dir), not model.save_pretrained); to load a full state "
        "dict (model.load_state_dict), zero3.pretrained.load_state_dict(model, state_dict). Do not wrap a "
        "zero3 model in torch's DDP or FSDP: zero3 already shards it and reduces its gradients.")
