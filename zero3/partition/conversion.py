"""``model.to(...)``, ``.cuda()``, ``.half()`` and torch's other module conversions on a model with
partitioned parameters.

[Note: module conversions]
Every conversion torch offers on a module (``to``, ``cuda``, ``cpu``, ``half``, ``float``,
``double``, ``bfloat16``, ``type``, ...) goes through ``nn.Module._apply(fn)``, which calls ``fn``
on each parameter and assigns the result to ``param.data``, children first. On a zero3 parameter
that cannot be right: the shards (and the optimizer's view of them) stay as they were, so converting
the full tensor either fails (a partitioned parameter refuses every op) or, for a persistent
parameter, silently trains a full copy in one dtype against shards in another. Worse, the failure
came halfway: the persistent parameters of the modules visited first were already converted.

So, once zero3 has partitioned a parameter, ``nn.Module._apply`` is wrapped (`install`). At the
outermost call on a module that holds zero3 parameters, ``fn`` is first tried on a small probe
tensor of each such parameter's dtype, device and number of dimensions:

- If ``fn`` leaves every one of them as it is (``model.to(device)`` on the device the model is on,
  ``model.float()`` of an fp32 model, the habitual ``model.to(device)`` of a training script),
  torch's ``_apply`` runs with the zero3 parameters handed back unchanged: buffers and plain
  parameters are converted as torch converts them, zero3's are not touched.
- If it would change one (another dtype, device or memory layout), it is refused before anything
  is converted, naming the parameter, the change and the way zero3 offers it (the config's
  ``bf16``/``fp16`` for precision, the device under ``zero3.Init`` for placement).

While a model is built under ``zero3.Init``, a conversion that changes a parameter goes to Init's own
handling (it gathers the parameter around the op and re-partitions the result); one that changes
nothing hands the parameters back there too, where Init used to gather them and keep them gathered
until the next module was built. A layout change (``memory_format=torch.channels_last``) is refused
there as everywhere: Init would re-partition the converted tensor into flat shards, and every gather
would hand back the contiguous layout the user asked to leave.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ZeroStateError
from .param import ZeroParameter, construction_handler, converting

_original_apply: Callable[..., nn.Module] | None = None


def building() -> bool:
    """Whether a ``zero3.Init`` block is open in this context: its handler is set and says its block is
    live (one left from another context stays set here, and says not: review 38R3)."""
    handler = construction_handler.get()
    return handler is not None and getattr(handler, "live", lambda: True)()


def install() -> None:
    """Wrap ``nn.Module._apply`` (once per process; called when zero3 partitions a parameter)."""
    global _original_apply
    if _original_apply is not None:
        return
    _original_apply = nn.Module._apply
    nn.Module._apply = _checked_apply  # type: ignore[method-assign]


def _checked_apply(self: nn.Module, fn: Callable[[torch.Tensor], Any], recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` that never converts a zero3 parameter ([Note: module conversions])."""
    original = _original_apply
    assert original is not None
    if converting.get():
        return original(self, fn, recurse)
    params = self.parameters() if recurse else self._parameters.values()
    zero = [p for p in params if p is not None and isinstance(p, ZeroParameter)]
    if not zero:
        return original(self, fn, recurse)
    _refuse_future_flags(self, fn)
    change = _first_change(fn, zero)
    if change is not None:
        p, what = change
        if building() and not what.startswith("layout"):
            return original(self, fn, recurse)  # building under Init: it converts and re-partitions
        raise ZeroStateError(
            f"{_call_name(self, fn)} would change {p._zero.summary()} {what}. zero3 holds each parameter as "
            "shards made when it partitioned the model, and the optimizer steps on them; converting the "
            f"full tensor would leave them behind. {_HOW[what.split()[0]]} Nothing was converted.")
    keep = {id(p) for p in zero}

    def convert(t: torch.Tensor) -> Any:
        return t if id(t) in keep else fn(t)

    token = converting.set(True)
    try:
        return original(self, convert, recurse)
    finally:
        converting.reset(token)


def _refuse_future_flags(module: nn.Module, fn: Callable[..., Any]) -> None:
    if torch.__future__.get_swap_module_params_on_conversion() or \
            torch.__future__.get_overwrite_module_params_on_conversion():
        raise ZeroStateError(
            f"{_call_name(module, fn)} with torch.__future__.set_swap_module_params_on_conversion(True) or "
            "set_overwrite_module_params_on_conversion(True): torch would replace each parameter object, "
            "and zero3's partitioned parameters must stay the objects it tracks. Turn the flag off for "
            "this call; nothing was converted")


def _first_change(fn: Callable[[torch.Tensor], Any],
                  params: list[ZeroParameter]) -> tuple[ZeroParameter, str] | None:
    """The first of ``params`` that ``fn`` would change, and how; None if it changes none."""
    seen: dict[tuple[torch.dtype, torch.device, int], str | None] = {}
    for p in params:
        key = (p.dtype, p.device, p.dim())
        if key not in seen:
            seen[key] = _change(fn, *key)
        if seen[key] is not None:
            return p, seen[key]  # type: ignore[return-value]
    return None


_HOW = {
    "dtype": "For bf16 or fp16 training set the config's \"bf16\": {\"enabled\": true} or \"fp16\" section "
             "(the optimizer keeps fp32 masters); to build the model in another dtype, pass "
             "zero3.Init(dtype=...).",
    "device": "Choose the device when the model is partitioned: build it under "
              "`with torch.device(device), zero3.Init():` (or move a plain model before "
              "zero3.initialize); shards go to CPU or NVMe with the config's offload_param "
              "(or Init(remote_device=...)).",
    "layout": "zero3 gathers every parameter contiguous (no layout survives partitioning by zero3.Init "
              "or zero3.initialize); keep the parameters contiguous and convert the inputs instead.",
}


def _change(fn: Callable[[torch.Tensor], Any], dtype: torch.dtype, device: torch.device, dim: int) -> str | None:
    """What ``fn`` does to a tensor of this dtype, device and rank: None if nothing."""
    probe = torch.zeros((2,) * dim, dtype=dtype, device=device)
    with torch.no_grad():
        out = fn(probe)
    if not isinstance(out, torch.Tensor):
        return f"dtype {dtype} into a {type(out).__name__}"
    if out.dtype != dtype:
        return f"dtype {dtype} to {out.dtype}"
    if out.device != device:
        return f"device {device} to {out.device}"
    if out.stride() != probe.stride():
        return f"layout strides {probe.stride()} to {out.stride()}"
    return None


def _call_name(module: nn.Module, fn: Callable[..., Any]) -> str:
    """``model.half()`` from ``Module.half.<locals>.<lambda>``; else ``Module._apply(fn)``."""
    match = re.match(r"Module\.(\w+)\.<locals>", getattr(fn, "__qualname__", ""))
    what = f"{match.group(1)}()" if match else "_apply(fn)"
    return f"{type(module).__name__}.{what}"
