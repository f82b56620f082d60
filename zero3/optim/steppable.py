"""Which optimizers zero3 can step over flat shards.

[Note: optimizers zero3 can step]
zero3 hands the optimizer each rank's flat 1-D shard of every parameter (or its fp32 master). An
optimizer that updates each element from that element's gradient and state (Adam, SGD, RMSprop, ...)
then computes, element by element, what it computes on the full parameter. One that reads the
parameter as a whole does not, and nothing fails: Adafactor keeps an unfactored second moment on a
1-D shard and scales by the shard's RMS, LAMB and LARS scale by a norm over this rank's part of the
parameter, a Shampoo- or Muon-like step finds no matrix. So:

- torch.optim's own classes are known: each updates element by element, except LBFGS (a closure and
  dot products over every parameter) and those of `_WHOLE`, which are refused;
- a class whose name `_WHOLE` or `_WHOLE_NAMES` matches (transformers' Adafactor, LAMB, LARS, Muon,
  Shampoo, Prodigy, ...; or a subclass of one) is refused wherever it comes from, whatever the config
  says: zero3 knows it would train differently. A name list cannot know every optimizer: frameworks
  (Accelerate, the Hugging Face Trainer) set ``zero_allow_untested_optimizer`` for every client
  optimizer, so one outside the list passes there with the WARNING only;
- torch's SparseAdam is refused: zero3 reduces dense gradients;
- any other class is untested: refused unless the config sets ``zero_allow_untested_optimizer``
  (DeepSpeed's key, with DeepSpeed's default, false: DeepSpeed refuses the optimizers outside its own
  list the same way), and then allowed with a one-time WARNING.
"""

from __future__ import annotations

import logging

import torch

from ..errors import ZeroConfigError

logger = logging.getLogger(__name__)

_FACTORED = "keeps its second moment factored over each matrix's rows and columns and scales its step by the " \
            "parameter's RMS (on a flat shard: an unfactored moment and the shard's RMS)"
_NORMED = "scales each parameter's update by norms over the whole parameter (on a shard: over this rank's part of it)"
_MATRIX = "transforms each gradient as a matrix (a flat shard is none)"
_GLOBAL = "adapts its step size from sums over every parameter (on shards: each rank's own, so the ranks would differ)"
_WHOLE = {  # a name part (of the class name, lower case, without "_"): what the optimizer reads
    "adafactor": _FACTORED, "lamb": _NORMED, "lars": _NORMED, "novograd": _NORMED, "lomo": _NORMED,
    "stableadamw": "divides its step by the update's RMS over the whole parameter",
    "adammini": "shares one second moment per block of the parameter",
    "muon": _MATRIX, "shampoo": _MATRIX, "soap": _MATRIX, "galore": _MATRIX, "apollo": _MATRIX,
    "prodigy": _GLOBAL, "dadapt": _GLOBAL,
}
"""Optimizers (from any library) whose update of an element depends on the whole parameter or on all
of them, by a part of their class name: ``Lamb``, ``FusedLamb``, ``LAMB8bit``, ``OnebitLamb``,
``SingleDeviceMuon``, ``Adam_mini``, ``AdafactorBigVision``, ``GaLoreAdamW``, ``APOLLOAdamW``,
``AdaLomo``, ``DAdaptAdam`` ... (review 28X listed the real classes the first list missed)."""
_WHOLE_NAMES = {"came": _FACTORED, "sm3": "keeps its accumulators over the parameter's rows and columns"}
"""The same, by the whole class name (too short to look for inside others)."""

_USE = "Use an optimizer that updates each element from its own state (AdamW, Adam, SGD, Adagrad, RMSprop, ...)"
_warned: set[type] = set()


def _done(factory: bool) -> str:
    return ("; the factory was called with the shards, so the model is partitioned already" if factory
            else "; zero3.initialize changed nothing")


def check_steppable(optimizer: torch.optim.Optimizer, allow_untested: bool, factory: bool = False) -> None:
    """Refuse an optimizer zero3 cannot step right over shards, and one it does not know unless
    ``allow_untested`` (see [Note: optimizers zero3 can step])."""
    cls = type(optimizer)
    name = f"{cls.__name__} ({cls.__module__})"
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ZeroConfigError(
            f"{name}{'' if cls is torch.optim.LBFGS else ' is an LBFGS, which'} steps through a closure that runs the forward and backward again inside its "
            "step, and its line search takes dot products over every parameter; zero3's step takes no closure "
            f"and each rank holds its shards only. {_USE}{_done(factory)}")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ZeroConfigError(f"{name} steps sparse gradients only, and zero3 reduces dense gradient shards (a "
                              f"sparse=True embedding is refused). {_USE}{_done(factory)}")
    for c in cls.__mro__:
        key = c.__name__.lower().replace("_", "")
        why = _WHOLE_NAMES.get(key) or next((w for part, w in _WHOLE.items() if part in key), None)
        if why is not None:
            raise ZeroConfigError(
                f"{name}{'' if c is cls else f' is a {c.__name__}, which'} {why}: zero3 steps each rank's flat 1-D shard of a parameter, so its "
                f"updates would differ from torch's on the full parameter (refused even with "
                f"zero_allow_untested_optimizer). {_USE}{_done(factory)}")
    if cls.__module__ == "torch.optim" or cls.__module__.startswith("torch.optim."):
        return
    if not allow_untested:
        raise ZeroConfigError(
            f"{name} is not one of torch.optim's optimizers, which zero3 knows to update each element from its "
            "own state. zero3 steps each rank's flat 1-D shard of every parameter, so an optimizer that reads a "
            "parameter's shape or takes a norm over it would train differently from torch, without an error. If "
            "yours updates element by element, set \"zero_allow_untested_optimizer\": true in the config (DeepSpeed's "
            f"key; DeepSpeed refuses such an optimizer under ZeRO the same way){_done(factory)}")
    if cls not in _warned:
        _warned.add(cls)
        logger.warning("zero3: untested optimizer %s, allowed by zero_allow_untested_optimizer: zero3 steps flat "
                       "1-D shards, so it trains as it would on the full parameters only if it updates each element "
                       "from its own gradient and state", name)
