"""`ZeroConfig`: every knob of the runtime in one typed, validated, immutable object.

Budgets are counted in parameter *elements* (as DeepSpeed counts them) unless the field name says
``bytes``. ``from_dict`` accepts our field names or a DeepSpeed config (``zero_optimization`` with
``stage3_*`` keys), so an existing DeepSpeed JSON carries over.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from .errors import ZeroConfigError

logger = logging.getLogger(__name__)

ReduceImpl = Literal["auto", "reduce_scatter", "all_reduce"]
DtypeName = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """Configuration of the ZeRO-3 runtime. Defaults equal DeepSpeed's where the knob exists there."""

    prefetch_bucket_size: int = 50_000_000
    """Elements prefetched ahead of use (in flight or gathered but not yet used). 0 disables prefetch."""

    max_live_parameters: int = 1_000_000_000
    """Hard cap on gathered, non-persistent parameter elements alive on a rank, demand fetches included.
    Exceeded only when the modules running at that moment need more by themselves."""

    max_reuse_distance: int = 1_000_000_000
    """Keep a parameter after use if its next use comes within this many gathered elements."""

    param_persistence_threshold: int = 100_000
    """Parameters with at most this many elements stay gathered for the whole run."""

    model_persistence_threshold: int = sys.maxsize
    """Cap on the total elements kept persistent (greedy, in ``named_parameters`` order)."""

    max_live_bytes: int | None = None
    """Byte form of ``max_live_parameters``; when set, budgets are counted in bytes instead."""

    max_reuse_distance_bytes: int | None = None
    """Byte form of ``max_reuse_distance`` (used when ``max_live_bytes`` is set)."""

    prefetch_bucket_bytes: int | None = None
    """Byte form of ``prefetch_bucket_size`` (used when ``max_live_bytes`` is set)."""

    overlap_comm: bool = True
    """Issue all-gathers asynchronously (side CUDA stream on GPU, ``async_op`` on CPU)."""

    reduce_bucket_size: int = 500_000_000
    """Gradient elements collected before one reduce-scatter is issued."""

    allgather_bucket_size: int = 500_000_000
    """Largest number of elements gathered by one collective; larger fetches are split."""

    reduce_scatter_impl: ReduceImpl = "auto"
    """How gradients are reduced: ``reduce_scatter``, ``all_reduce`` then slice, or ``auto``
    (all-reduce on gloo, where it was measured faster; reduce-scatter elsewhere)."""

    max_traces: int = 4
    """How many recorded step traces are cached (keyed by how the step began)."""

    verify_collectives: bool | None = None
    """Before each gather or reduction, ranks exchange a 3-integer header and all raise
    ``ZeroDivergenceError`` if they are not about to run the same collective, instead of hanging
    (ranks that run different modules). ``None``: on for gloo, off for NCCL (it costs a host sync)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_field(f, getattr(self, f.name))
        if self.max_traces < 1:
            raise ZeroConfigError(f"max_traces must be >= 1, got {self.max_traces!r}")

    @property
    def budgets_in_bytes(self) -> bool:
        return self.max_live_bytes is not None

    # -- construction from dicts and files -------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ZeroConfig":
        """Build from our field names, or from a DeepSpeed config dict (``zero_optimization`` ...)."""
        if not isinstance(d, dict):
            raise ZeroConfigError(f"config must be a dict, got {type(d).__name__}")
        if "zero_optimization" in d or any(k in _DEEPSPEED_TOP_LEVEL for k in d):
            return cls(**_from_deepspeed(d))
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ZeroConfigError(_unknown_key_message(key, known))
        return cls(**{k: _coerce(k, v) for k, v in d.items()})

    @classmethod
    def from_json(cls, path: str | Path) -> "ZeroConfig":
        with open(path) as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ZeroConfigError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "ZeroConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_field(f: dataclasses.Field, value: Any) -> None:
    ann = f.type
    name = f.name
    if ann in ("int", int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ZeroConfigError(f"{name} must be an int >= 0, got {value!r} ({type(value).__name__})")
        if value < 0:
            raise ZeroConfigError(f"{name} must be >= 0, got {value!r}")
    elif ann in ("int | None",):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ZeroConfigError(f"{name} must be None or an int >= 0, got {value!r}")
    elif ann == "bool | None":
        if value is not None and not isinstance(value, bool):
            raise ZeroConfigError(f"{name} must be None or a bool, got {value!r}")
    elif ann in ("bool", bool):
        if not isinstance(value, bool):
            raise ZeroConfigError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    elif ann == "ReduceImpl":
        allowed = get_args(ReduceImpl)
        if value not in allowed:
            raise ZeroConfigError(f"{name} must be one of {allowed}, got {value!r}")


def _coerce(key: str, value: Any) -> Any:
    """JSON configs write big counts as floats (``5e8``); accept those when they are integral."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _unknown_key_message(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown config key {key!r}{hint} Known keys: {', '.join(sorted(known))}"


# DeepSpeed ``zero_optimization`` keys mapped onto ours.
_DEEPSPEED_ZERO_KEYS = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "overlap_comm": "overlap_comm",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
}
# DeepSpeed keys we understand but that change nothing here (logged, not an error).
_DEEPSPEED_ZERO_IGNORED = {
    "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
    "sub_group_size", "stage3_gather_16bit_weights_on_model_save", "log_trace_cache_warnings",
    "elastic_checkpoint", "ignore_unused_parameters", "load_from_fp32_weights",
}
_DEEPSPEED_TOP_LEVEL = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown",
    "bf16", "fp16", "zero_allow_untested_optimizer", "prescale_gradients", "communication_data_type",
}


def _from_deepspeed(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ours = {f.name for f in fields(ZeroConfig)}
    for key, value in d.items():
        if key == "zero_optimization":
            continue
        if key in _DEEPSPEED_TOP_LEVEL:
            logger.info("zero3: DeepSpeed key %r is not used by ZeroConfig; ignored", key)
            continue
        if key in ours:
            out[key] = _coerce(key, value)
            continue
        raise ZeroConfigError(_unknown_key_message(key, ours | _DEEPSPEED_TOP_LEVEL | {"zero_optimization"}))
    zero = d.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ZeroConfigError(f"zero_optimization must be a dict, got {zero!r}")
    stage = zero.get("stage", 3)
    if stage != 3:
        raise ZeroConfigError(f"zero_optimization.stage must be 3 (zero3 implements stage 3 only), got {stage!r}")
    for key, value in zero.items():
        if key == "stage":
            continue
        if key in _DEEPSPEED_ZERO_KEYS:
            out[_DEEPSPEED_ZERO_KEYS[key]] = _coerce(key, value)
        elif key in _DEEPSPEED_ZERO_IGNORED:
            logger.info("zero3: zero_optimization.%s has no effect in zero3; ignored", key)
        elif key in ours:
            out[key] = _coerce(key, value)
        else:
            known = set(_DEEPSPEED_ZERO_KEYS) | _DEEPSPEED_ZERO_IGNORED | ours | {"stage"}
            raise ZeroConfigError("zero_optimization: " + _unknown_key_message(key, known))
    return out


def resolve_config(config: ZeroConfig | dict | str | Path | None) -> ZeroConfig:
    """Accept a ZeroConfig, a dict, a JSON path, or None (defaults)."""
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        return config
    if isinstance(config, dict):
        return ZeroConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return ZeroConfig.from_json(config)
    raise ZeroConfigError(f"config must be a ZeroConfig, dict, JSON path or None, got {type(config).__name__}")


__all__ = ["ZeroConfig", "resolve_config"]
