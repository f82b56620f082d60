"""Validation and coercion of config fields by their declared types.

Every section of `ZeroConfig` is a frozen dataclass whose annotations are the real types
(``int``, ``float | None``, ``Literal[...]``...). ``check_fields`` reads them with
``typing.get_type_hints`` and refuses a value of the wrong type, naming the key, the value and what
is allowed; each section adds its bounds in ``__post_init__``. ``coerce`` turns what JSON can write
(``5e8``, lists) into the declared type before construction.
"""

from __future__ import annotations

import difflib
import functools
import math
import reprlib
import types
import typing
from dataclasses import fields
from typing import Any, Literal, Union

from ..errors import ZeroConfigError


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of every field of ``cls`` (cached: classes do not change)."""
    return typing.get_type_hints(cls)


def _split_optional(tp: Any) -> tuple[Any, bool]:
    """(the type inside ``X | None``, True), or (``tp``, False) when None is not allowed."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """An int or float (not a bool) that a float holds finitely: ``10**400``, which JSON can write,
    is not one (``math.isfinite`` would raise OverflowError on it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


_SHORT = reprlib.Repr()
_SHORT.maxlong = 40  # ``10**400`` shown as 1000...000, not 401 digits


def shown(value: Any) -> str:
    """``repr(value)``, shortened for a huge int (in an error message)."""
    return _SHORT.repr(value) if _is_int(value) else repr(value)


_AUTO_HINT = " ('auto' is what Hugging Face's Trainer fills in before DeepSpeed reads the config: give the value)"
_TRAINER_FILLS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "gradient_clipping"}  # the keys the Trainer turns from "auto" into values


def check_value(name: str, tp: Any, value: Any, least: int = 0) -> None:
    """Raise `ZeroConfigError` unless ``value`` is of type ``tp``. Counts (``int``) must also be >=
    ``least`` (its section's bound, so every message about one knob states the same one), amounts
    (``float``) >= 0; other bounds are the section's ``__post_init__``'s job."""
    inner, optional = _split_optional(tp)
    if optional and value is None:
        return
    hint = _AUTO_HINT if isinstance(value, str) and value == "auto" and name in _TRAINER_FILLS else ""
    if inner is int:
        if optional and not _is_int(value):
            raise ZeroConfigError(f"{name} must be None or an int >= {least}, got {value!r}{hint}")
        if not _is_int(value):
            raise ZeroConfigError(f"{name} must be an int >= {least}, got {value!r} ({type(value).__name__}){hint}")
        elif value < least:
            raise ZeroConfigError(f"{name} must be >= {least}, got {value!r}")
    elif inner is float:
        if not is_finite_number(value):
            kind = "int too large for a float" if _is_int(value) else type(value).__name__
            raise ZeroConfigError(f"{name} must be a finite number >= 0, got {shown(value)} ({kind}){hint}")
        if value < 0:
            raise ZeroConfigError(f"{name} must be >= 0, got {value!r}")
    elif inner is bool:
        if not isinstance(value, bool):
            if optional:
                raise ZeroConfigError(f"{name} must be None or a bool, got {value!r}")
            raise ZeroConfigError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    elif inner is str:
        if value == "auto":  # DeepSpeed's config model drops it: no path at all (review 38R2: ./auto was made)
            raise ZeroConfigError(f"{name} must be a path, got 'auto' (DeepSpeed reads 'auto' as no value, and this "
                                  "key has no default to take): give a directory")
        if not isinstance(value, str) or not value:
            raise ZeroConfigError(f"{name} must be None or a non-empty path string, got {value!r}"
                                  if optional else f"{name} must be a non-empty string, got {value!r}")
    elif typing.get_origin(inner) is Literal:
        allowed = typing.get_args(inner)
        if value not in allowed:
            raise ZeroConfigError(f"{name} must be one of {allowed}, got {value!r}")
    elif typing.get_origin(inner) is tuple:
        if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
            raise ZeroConfigError(f"{name} must be a list of non-empty strings, got {value!r}")
    elif isinstance(inner, type) and not isinstance(value, inner):
        allowed = f"None or a {inner.__name__}" if optional else f"a {inner.__name__}"
        raise ZeroConfigError(f"{name} must be {allowed}, got {value!r}")


def check_fields(obj: Any, prefix: str = "", skip: frozenset[str] = frozenset(), counts: tuple[str, ...] = ()) -> None:
    """`check_value` on every field of the dataclass ``obj`` except ``skip`` (checked by the caller);
    the ``counts`` must be at least 1, other ints >= 0. ``prefix`` goes before each name in messages
    (``activation_checkpointing.``)."""
    types_ = field_types(type(obj))
    for f in fields(obj):
        if f.name not in skip:
            check_value(prefix + f.name, types_[f.name], getattr(obj, f.name), 1 if f.name in counts else 0)


def coerce(tp: Any, value: Any, lax_bool: bool = False) -> Any:
    """What JSON writes, as the declared type ``tp``: an integral float (``5e8``) for a count, an
    int for a float field (``"gradient_clipping": 1``), a list for a tuple; with ``lax_bool`` (a
    DeepSpeed key, whose config model reads 0/1 as a bool: probe 34B) 0 or 1 for a bool. Anything
    else is returned unchanged, for `check_value` to judge."""
    inner, _ = _split_optional(tp)
    if lax_bool and inner is bool and type(value) is int and value in (0, 1):
        return bool(value)
    if inner is float:
        return float(value) if _is_int(value) and is_finite_number(value) else value  # 10**400: refused later
    if typing.get_origin(inner) is tuple and isinstance(value, list):
        return tuple(value)
    if isinstance(value, float) and value.is_integer() and _takes_int(tp):  # a count, a stage, a budget: not a bool
        return int(value)  # or a string, whose refusal names the float written (probe 36K2)
    return value


def _takes_int(tp: Any) -> bool:
    """Whether a field of type ``tp`` takes an int: ``int``, a Literal of one, or a union holding either."""
    if tp is int:
        return True
    if typing.get_origin(tp) is typing.Literal:
        return any(type(a) is int for a in typing.get_args(tp))
    return typing.get_origin(tp) in (Union, types.UnionType) and any(_takes_int(a) for a in typing.get_args(tp))


def did_you_mean(key: Any, known: set[str] | frozenset[str]) -> str:
    """``; did you mean 'y'?`` with the known name closest to ``key``, or "" when none is close (or
    ``key`` is not a string)."""
    if not isinstance(key, str):
        return ""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


# DeepSpeed's type of each of its keys that has no effect in zero3 (logged and ignored): a value
# DeepSpeed's config models would refuse is refused here too, a mistake in the config either way.
# They read leniently (pydantic's lax mode: 0/1 and "yes"/"off" for a bool, 4.0 for an int) and
# drop "auto"; the aio section's keys are read unchecked.
_IGNORED_INTS = {"buffer_count"}
_IGNORED_BOOLS = {
    "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
    "stage3_gather_16bit_weights_on_model_save", "log_trace_cache_warnings", "elastic_checkpoint",
    "ignore_unused_parameters", "load_from_fp32_weights", "fast_init", "pipeline_read", "pipeline_write",
    "pipeline", "auto_cast", "fp16_master_weights_and_grads", "immediate_grad_update", "check_grad_overflow",
    "bf16_master_weights_and_grads", "bf16_optimizer_states", "prescale_gradients", "zero_allow_untested_optimizer",
    "memory_efficient_linear", "zero_force_ds_cpu_optimizer", "cpu_offload", "cpu_offload_param",
    "cpu_offload_use_pin_memory",
}
_READ_BOOLS = {"stage3_gather_16bit_weights_on_model_save", "zero_allow_untested_optimizer", "cpu_offload",
               "cpu_offload_param"}  # checked so, and read
_LAX_BOOL_WORDS = {"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"}


def check_ignored(spelled: str, key: str, value: Any) -> None:
    """Refuse a value of a no-effect DeepSpeed key that DeepSpeed would refuse (``spelled``: the
    key's full name in the config)."""
    if value is None or value == "auto":
        return
    if key in _IGNORED_BOOLS and not (isinstance(value, bool) or (type(value) is int and value in (0, 1)) or (
            isinstance(value, str) and value.lower() in _LAX_BOOL_WORDS)):
        effect = "" if key in _READ_BOOLS else "; it has no effect in zero3"
        raise ZeroConfigError(f"{spelled} must be a boolean as DeepSpeed reads it (true/false, 0/1, \"yes\"/\"no\"{effect}"
                              f"), got {value!r} ({type(value).__name__})")
    if key in _IGNORED_INTS and not ((type(value) is int or (isinstance(value, float) and value.is_integer()))
                                     and value >= 0):
        raise ZeroConfigError(f"{spelled} must be a whole number >= 0 as DeepSpeed reads it (it has no effect in "
                              f"zero3), got {value!r} ({type(value).__name__})")


def unknown_key_message(key: Any, known: set[str] | frozenset[str], kind: str = "") -> str:
    """``unknown config key 'x'; did you mean 'y'?`` and the known keys (``kind``: e.g. "DeepSpeed ");
    a key that is not a string (``{1: 2}`` from Python) is named with its type."""
    what = "" if isinstance(key, str) else f" ({type(key).__name__}: config keys are strings)"
    return (f"unknown config key {shown(key)}{what}{did_you_mean(key, known)} Known {kind}keys: "
            f"{', '.join(sorted(known))}")


class KnobValues:
    """The knobs one config dict sets, each with how it was spelled there. One knob can be spelled
    several ways (``max_live_parameters``, ``zero_optimization.stage3_max_live_parameters``,
    ``offload_param.pin_memory``); two spellings with different values are refused, naming both,
    instead of letting whichever comes last win."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.spelled: dict[str, str] = {}  # knob -> its first spelling

    def set(self, knob: str, value: Any, spelled: str) -> None:
        if knob in self.values and self.values[knob] != value:
            raise ZeroConfigError(f"{knob} is given twice with different values: as {self.spelled[knob]} "
                                  f"({self.values[knob]!r}) and as {spelled} ({value!r}); keep one of them")
        self.values[knob] = value
        self.spelled.setdefault(knob, spelled)
