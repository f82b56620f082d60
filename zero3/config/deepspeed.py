"""DeepSpeed's config keys translated into zero3's flat knob names.

`zero3.ZeroConfig.from_dict` hands a dict here when it is DeepSpeed's (a ``zero_optimization``
section, or a top-level key DeepSpeed has and zero3's flat names do not: `is_deepspeed_dict`);
`translate` returns the keyword arguments of ``ZeroConfig(...)``. Keys zero3 understands but that
change nothing here are logged at INFO; keys that would change behaviour zero3 lacks are refused by
name.

It lives in the config layer, not in `zero3.deepspeed` beside DeepSpeed's other names, because that
package imports the engine, and the config layer (read by every other layer, and by the offline
``python -m zero3.consolidate``) must not pull the runtime in.
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

from .fields import KnobValues, check_ignored, did_you_mean, unknown_key_message
from .flat import FLAT_NAMES, coerce_flat
from .sections import OFFLOAD_SECTION_KEYS, OffloadConfig
from ..errors import ZeroConfigError

# The config's logger, as before the translation moved here, so log filters keep working.
logger = logging.getLogger("zero3.config")

# DeepSpeed ``zero_optimization`` keys mapped onto ours.
ZERO_KEYS = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "overlap_comm": "overlap_comm",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "sub_group_size": "sub_group_size",
}
GATHER_16BIT = "stage3_gather_16bit_weights_on_model_save"  # a boolean read as DeepSpeed reads it (below)
GATHER_16BIT_OLD = "stage3_gather_fp16_weights_on_model_save"  # DeepSpeed's older name, still read there
# DeepSpeed's deprecated offload booleans, read there as {"device": "cpu"} sections when true.
CPU_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
# DeepSpeed keys we understand but that change nothing here (logged, not an error).
ZERO_IGNORED = {
    "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
    "log_trace_cache_warnings", "elastic_checkpoint", "ignore_unused_parameters", "load_from_fp32_weights",
    "memory_efficient_linear",  # DeepSpeed's Init patches F.linear to save its inputs lean; zero3.Init has no patch
    "cpu_offload_use_pin_memory",  # deprecated in DeepSpeed, and read there by nothing
}
TOP_LEVEL = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown",
    "bf16", "fp16", "zero_allow_untested_optimizer", "prescale_gradients", "communication_data_type",
    "bfloat16", "activation_checkpointing", "aio", "data_types", "zero_force_ds_cpu_optimizer",
}
# ZeRO++ keys of ``zero_optimization`` that are also our knobs' names.
ZERO_PLUS_PLUS = {"zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size"}
# Top-level keys whose value is a dict: DeepSpeed's sections, and ours (offload in DeepSpeed's form).
SECTIONS = {"zero_optimization", "bf16", "bfloat16", "fp16", "optimizer", "scheduler", "activation_checkpointing",
            "aio", "data_types", *OFFLOAD_SECTION_KEYS}
# Top-level DeepSpeed keys whose value is one of our knobs, under the same name.
_SAME_NAME = {"gradient_accumulation_steps", "gradient_clipping", "optimizer", "scheduler",
              "activation_checkpointing", "wall_clock_breakdown", "steps_per_print", "train_batch_size",
              "train_micro_batch_size_per_gpu"}
_PRECISION_KEYS = {"bf16", "bfloat16", "fp16", "communication_data_type"}

_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16",
                  "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
# DeepSpeed ``fp16`` section keys mapped onto ours; ``enabled`` selects dtype="fp16".
_FP16_KEYS = {
    "loss_scale": "loss_scale", "initial_scale_power": "initial_scale_power",
    "loss_scale_window": "loss_scale_window", "hysteresis": "hysteresis",
    "consecutive_hysteresis": "consecutive_hysteresis", "min_loss_scale": "min_loss_scale",
}
_FP16_IGNORED = {"auto_cast", "fp16_master_weights_and_grads"}
# Of those, the ones whose "on" would change what training computes: refused when on, accepted off.
_REFUSED_WHEN_ON = {
    "auto_cast": "zero3 does not cast the model's inputs to fp16 (pass them in fp16, or use torch.autocast)",
    "fp16_master_weights_and_grads": "zero3 keeps fp32 master weights and gradient shards under fp16",
    "bf16_master_weights_and_grads": "zero3 keeps fp32 master weights and gradient shards under bf16",
    "bf16_optimizer_states": "zero3 keeps the optimizer's state in fp32",
    "check_grad_overflow": "zero3 does not check bf16 steps for inf/nan (only fp16 skips steps)",
}
_BF16_IGNORED = {"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                 "bf16_optimizer_states"}
# DeepSpeed's ``aio`` section: only the thread count means something here.
_AIO_IGNORED = {"block_size", "queue_depth", "single_submit", "overlap_events", "intra_op_parallelism"}


# DeepSpeed features zero3 does not implement, and what DeepSpeed's own example configs write when
# they are off: accepted off (logged), refused on, by name. A section is off when its ``enabled``
# is false or absent (DeepSpeed's default for each of these).
_OFF_SECTIONS = {
    "flops_profiler": "the FLOPs profiler", "tensorboard": "TensorBoard logging", "wandb": "Weights & Biases logging",
    "csv_monitor": "CSV logging", "comet": "Comet logging", "elasticity": "elastic training",
    "comms_logger": "the communication logger", "autotuning": "the autotuner", "amp": "NVIDIA apex AMP",
    "compression_training": "compression training", "curriculum_learning": "curriculum learning",
    "data_efficiency": "data efficiency", "nebula": "Nebula checkpointing",
    "hybrid_engine": "the hybrid engine (DeepSpeed-Chat's inference kernels inside training)",
    "torch_autocast": "torch.autocast inside the engine (wrap your forward in torch.autocast instead: zero3 trains "
                      "exactly under it)",
}
_RAW_ENABLED = {"torch_autocast", "amp"}  # sections whose "enabled" DeepSpeed reads unconverted (get_scalar_param)
_OFF_KEYS = {  # key: (what it does in DeepSpeed, its off value)
    "memory_breakdown": ("a memory report at every step (zero3.see_memory_usage(msg, force=True) is zero3's)", False),
    "dump_state": ("a dump of the engine's state at initialize", False),
    "sparse_gradients": ("sparse embedding gradients", False),
    "gradient_predivide_factor": ("dividing gradients by a factor before the sum and by world/factor after "
                                  "(zero3 sums, then divides once in reduce_dtype)", 1.0),
}


UNTESTED_OPTIMIZER = "zero_allow_untested_optimizer"


def read_untested_optimizer(value: Any, out: KnobValues) -> None:
    """DeepSpeed's ``zero_allow_untested_optimizer`` as DeepSpeed reads it, in either format: 0/1 and
    "yes"/"off" too (by their meaning); None or "auto": the default."""
    check_ignored(UNTESTED_OPTIMIZER, UNTESTED_OPTIMIZER, value)
    if value is not None and value != "auto":
        out.set(UNTESTED_OPTIMIZER, not _lax_false(value), UNTESTED_OPTIMIZER)


def is_deepspeed_dict(d: dict[str, Any]) -> bool:
    """Whether ``d`` is written in DeepSpeed's keys (else in zero3's flat names): it has a
    ``zero_optimization`` section or a top-level key DeepSpeed has and zero3's flat names do not
    (``bf16``, ``fp16``, ``aio``, ``flops_profiler``, ...). The keys both have
    (``gradient_accumulation_steps``, ``optimizer``, ``steps_per_print``, ...) decide nothing beside a
    key of zero3's names alone, so a dict of zero3's names that holds one is still a flat config,
    whose booleans take true/false only (probe 38D F2); a dict of those shared keys alone is DeepSpeed's."""
    def deepspeeds(k: Any) -> bool:
        return k in TOP_LEVEL or k in _OFF_SECTIONS or k in _OFF_KEYS or k == "checkpoint"

    if "zero_optimization" in d or any(k not in FLAT_NAMES and deepspeeds(k) for k in d):
        return True
    # Only keys both have (a stage-0 DeepSpeed file: review 38R2): DeepSpeed's reading, a superset of the
    # flat one for those keys; one key of zero3's names alone (``overlap_comm``) makes it flat.
    return bool(d) and all(deepspeeds(k) for k in d)


def _unimplemented(key: str, value: Any) -> None:
    """A DeepSpeed feature zero3 lacks: accepted when off, refused naming it when on. A section is on
    when any ``enabled`` in it, at any depth, reads true as DeepSpeed's config models read a bool
    (``compression_training`` and ``data_efficiency`` turn on per technique); the three raw scalars
    DeepSpeed reads unconverted, so any truthy value is on."""
    if key in _OFF_SECTIONS:
        what = _OFF_SECTIONS[key]
        off = _lax_false(value) or (isinstance(value, dict) and not _any_enabled(value))
        if key in _RAW_ENABLED:  # DeepSpeed reads their "enabled" raw: "false" is a true value there
            off = not value or (isinstance(value, dict) and not value.get("enabled", False))
        fix = f"set every {key} 'enabled' to false or remove the section"
    elif key == "checkpoint":
        what = "checkpoint options beyond DeepSpeed's defaults (zero3's checkpoints: docs/checkpoints.md)"
        off = isinstance(value, dict) and all(_checkpoint_default(k, v) for k, v in value.items())
        fix = ("leave tag_validation at Warn or Ignore and load_universal, use_node_local_storage, "
               "parallel_write.pipeline_stage false, or remove it")
    else:
        what, default = _OFF_KEYS[key]
        if isinstance(default, bool):  # read raw by DeepSpeed: "false" is a true value there
            off = not value
        else:
            off = isinstance(value, (int, float)) and not isinstance(value, bool) and value == default
        fix = f"set it to {default!r} or remove it"
    if not off:
        raise ZeroConfigError(f"{key}={value!r} turns on {what}, a DeepSpeed feature zero3 does not implement; {fix}")
    logger.info("zero3: DeepSpeed key %r is off; zero3 does not implement it", key)


def _lax_false(v: Any) -> bool:
    """``v`` reads false as a bool in DeepSpeed's config models (pydantic's lax mode)."""
    return v is None or v is False or (type(v) in (int, float) and v == 0) or (
        isinstance(v, str) and v.strip().lower() in ("0", "off", "f", "false", "n", "no"))


def _any_enabled(d: dict[str, Any]) -> bool:
    return any((k == "enabled" and not _lax_false(v)) or (isinstance(v, dict) and _any_enabled(v))
               for k, v in d.items())


def _checkpoint_default(key: str, value: Any) -> bool:
    if key == "tag_validation":
        return isinstance(value, str) and value.lower() in ("warn", "ignore")
    if key == "parallel_write":
        return isinstance(value, dict) and all(k == "pipeline_stage" and _lax_false(v) for k, v in value.items())
    return key in ("load_universal", "use_node_local_storage") and _lax_false(value)


def unknown_section_message(key: str) -> str:
    """The error for a top-level key holding a dict that names no section: a misspelled section
    (``zero_optimizaton``) is compared with the section names, not with every knob."""
    return (f"unknown config section {key!r}{did_you_mean(key, SECTIONS)} "
            f"Known sections: {', '.join(sorted(SECTIONS))}")


def _enabled(section: str, value: Any) -> bool:
    if not isinstance(value, dict):
        raise ZeroConfigError(f"{section} must be a dict such as {{'enabled': true}}, got {value!r}")
    enabled = value.get("enabled", False)
    if enabled is None or (type(enabled) is int and enabled in (0, 1)):  # DeepSpeed: None is off, 1 on
        return bool(enabled)
    if not isinstance(enabled, bool):
        if enabled == "auto":
            hint = "'auto' is what Hugging Face's Trainer fills in before DeepSpeed reads the config: replace it"
        elif isinstance(enabled, str):
            hint = "DeepSpeed versions read a string differently (older ones take \"false\" as on): write"
        else:
            hint = "write"
        raise ZeroConfigError(f"{section}.enabled must be a bool, got {enabled!r} ({type(enabled).__name__}); "
                              f"{hint} true or false (0 or 1 pass too)")
    return enabled


def _section(section: str, value: dict[str, Any], mapped: dict[str, str], ignored: set[str]) -> dict[str, Any]:
    """``{key: value}`` of the keys of ``section`` that map onto our knobs; logs the ignored ones."""
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key == "enabled":
            continue
        if key in mapped:
            out[key] = coerce_flat(mapped[key], v, lax_bool=True)
        elif key in ignored:
            check_ignored(f"{section}.{key}", key, v)
            if key in _REFUSED_WHEN_ON and v not in (False, None, 0):
                raise ZeroConfigError(f"{section}.{key}={v!r} is not supported: {_REFUSED_WHEN_ON[key]}; set it to "
                                      "false or leave it out")
            logger.info("zero3: DeepSpeed key %s.%s has no effect in zero3; ignored", section, key)
        else:
            raise ZeroConfigError(f"{section}: " + unknown_key_message(key, set(mapped) | ignored | {"enabled"}))
    return out


def _precision(d: dict[str, Any], out: KnobValues) -> None:
    """dtype, loss-scaling and reduce-dtype knobs from DeepSpeed's ``bf16``/``fp16`` sections and
    ``communication_data_type``. Settings inside a section that is not enabled are ignored."""
    bf16 = [k for k in ("bf16", "bfloat16") if k in d and _enabled(k, d[k])]
    if bf16 == ["bfloat16"] and "bf16" in d:  # probe 36K2: DeepSpeed reads bf16 alone then, and trains fp32
        raise ZeroConfigError("bf16.enabled is false and bfloat16.enabled (its old spelling) is true: DeepSpeed reads "
                              "bf16 alone (fp32), this reads as bf16; keep one of the two sections")
    for k in ("bf16", "bfloat16"):
        if k in d:
            _section(k, d[k], {}, _BF16_IGNORED)
    fp16 = "fp16" in d and _enabled("fp16", d["fp16"])
    if bf16 and fp16:
        raise ZeroConfigError(f"{bf16[0]}.enabled and fp16.enabled are both true; enable one of them")
    if bf16:
        out.set("dtype", "bf16", f"{bf16[0]}.enabled")
    if "fp16" in d:
        scaling = _section("fp16", d["fp16"], _FP16_KEYS, _FP16_IGNORED)
        if fp16:
            out.set("dtype", "fp16", "fp16.enabled")
            for key, value in scaling.items():
                out.set(_FP16_KEYS[key], value, f"fp16.{key}")
    if "communication_data_type" in d and d["communication_data_type"] is not None:
        name = d["communication_data_type"]
        if not isinstance(name, str) or name.lower() not in _DTYPE_ALIASES:  # DeepSpeed lower-cases it ("BF16")
            raise ZeroConfigError(f"communication_data_type must be one of {sorted(_DTYPE_ALIASES)}, got {name!r}")
        out.set("reduce_dtype", _DTYPE_ALIASES[name.lower()], "communication_data_type")


def _aio(value: Any, out: KnobValues) -> None:
    """DeepSpeed's ``aio`` section: ``thread_count`` sets ``aio_thread_count``; GPUDirect is refused."""
    if not isinstance(value, dict):
        raise ZeroConfigError(f"aio must be a dict such as {{'thread_count': 1}}, got {value!r}")
    for key, v in value.items():
        if key == "thread_count":
            out.set("aio_thread_count", coerce_flat("aio_thread_count", v), "aio.thread_count")
        elif key == "use_gds":
            if v:
                raise ZeroConfigError("aio.use_gds (GPUDirect Storage) is not supported by zero3; swap files "
                                      "are read into host buffers. Remove it or set it to false")
        elif key in _AIO_IGNORED:  # DeepSpeed reads them unchecked
            logger.info("zero3: DeepSpeed key aio.%s has no effect in zero3; ignored", key)
        else:
            raise ZeroConfigError("aio: " + unknown_key_message(key, _AIO_IGNORED | {"thread_count", "use_gds"}))


def _data_types(value: Any) -> None:
    """DeepSpeed's ``data_types`` section: ``grad_accum_dtype`` may only say what zero3 does (gradient
    shards accumulate in fp32); another dtype is refused, not dropped."""
    if not isinstance(value, dict):
        raise ZeroConfigError(f"data_types must be a dict such as {{'grad_accum_dtype': 'fp32'}}, got {value!r}")
    for key, v in value.items():
        if key != "grad_accum_dtype":
            raise ZeroConfigError("data_types: " + unknown_key_message(key, {"grad_accum_dtype"}))
        if v is not None and (not isinstance(v, str) or _DTYPE_ALIASES.get(v.lower().removeprefix("torch.")) != "fp32"):
            raise ZeroConfigError(f"data_types.grad_accum_dtype={v!r} is not supported: zero3 accumulates gradients "
                                  "in fp32 shards under every precision; set it to 'fp32' or leave it out")


def _zero_optimization(zero: Any, out: KnobValues) -> None:
    """Our knobs from DeepSpeed's ``zero_optimization`` section (stage 3 only)."""
    if not isinstance(zero, dict):
        raise ZeroConfigError(f"zero_optimization must be a dict, got {zero!r}")
    stage = zero.get("stage", 3)
    if type(stage) is not int or stage != 3:
        raise ZeroConfigError(f"zero_optimization.stage must be 3 (zero3 implements stage 3 only), got {stage!r}")
    for old, new in CPU_OFFLOAD.items():
        if old in zero and new in zero:  # DeepSpeed refuses the pair too, whatever the values
            raise ZeroConfigError(f"zero_optimization.{old} (DeepSpeed's deprecated name) and zero_optimization.{new} "
                                  f"are both given; keep {new} only")
    for key, value in zero.items():
        spelled = f"zero_optimization.{key}"
        if key == "stage":
            continue
        if key in ZERO_KEYS:
            if value == "auto":  # DeepSpeed's config model drops "auto" (OpenRLHF passes it on): the default
                logger.info("zero3: %s is 'auto': zero3's default, as DeepSpeed takes its own", spelled)
                continue
            out.set(ZERO_KEYS[key], coerce_flat(ZERO_KEYS[key], value, lax_bool=True), spelled)
        elif key in (GATHER_16BIT, GATHER_16BIT_OLD):  # 0/1, "yes"/"off" too; None or "auto": the default
            check_ignored(spelled, GATHER_16BIT, value)
            if value is not None and value != "auto":
                out.set("gather_16bit_weights_on_model_save", not _lax_false(value), spelled)
        elif key in CPU_OFFLOAD:  # DeepSpeed's deprecated spelling of an offload section
            check_ignored(spelled, key, value)
            if value is not None and value != "auto" and not _lax_false(value):
                OffloadConfig.read_section({"device": "cpu"}, f"zero_optimization.{CPU_OFFLOAD[key]}", out,
                                           lax_bool=True)
        elif key in OFFLOAD_SECTION_KEYS:
            OffloadConfig.read_section(value, spelled, out, lax_bool=True)
        elif key in ZERO_IGNORED:
            check_ignored(spelled, key, value)
            if key == "load_from_fp32_weights" and value is not None and _lax_false(value):
                raise ZeroConfigError(f"{spelled}={value!r} is not supported: DeepSpeed then rebuilds the fp32 "
                                      "masters from the 16-bit weights when a checkpoint loads; zero3 always loads "
                                      "its checkpoints' fp32 masters. Set it to true or leave it out")
            logger.info("zero3: zero_optimization.%s has no effect in zero3; ignored", key)
        elif key == "zero_optimization":  # pasted one level too deep (review 38R2)
            raise ZeroConfigError(f"{spelled}: 'zero_optimization' inside zero_optimization: the section is "
                                  "nested twice; its keys belong directly in the top-level zero_optimization")
        elif key in TOP_LEVEL or key in _OFF_SECTIONS or key in _OFF_KEYS or key == "checkpoint":
            raise ZeroConfigError(f"{spelled}: {key!r} is a top-level key of a DeepSpeed config, not a "
                                  "zero_optimization one; move it out of zero_optimization")
        elif key in FLAT_NAMES:
            out.set(key, coerce_flat(key, value, lax_bool=True), spelled)
        else:
            known = (set(ZERO_KEYS) | {GATHER_16BIT, GATHER_16BIT_OLD} | set(CPU_OFFLOAD) | ZERO_IGNORED | ZERO_PLUS_PLUS | {"stage"}
                     | set(OFFLOAD_SECTION_KEYS))
            raise ZeroConfigError("zero_optimization: " + unknown_key_message(key, known, "DeepSpeed ")
                                  + "; zero3's own knob names are read here too")


def as_written(exc: ZeroConfigError, spelled: dict[str, str]) -> ZeroConfigError:
    """``exc`` (a section's error, which names zero3's flat knob) naming the key as the config wrote
    it (``zero_optimization.stage3_prefetch_bucket_size``; probe 29B)."""
    msg = str(exc)
    for knob, key in spelled.items():
        if key != knob and msg.startswith(knob + " "):
            return type(exc)(key + msg[len(knob):])
    return exc


def translate(d: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``ZeroConfig(...)`` that the DeepSpeed config ``d`` means."""
    return translate_spelled(d)[0]


def translate_spelled(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """`translate`, and how the config spelled each knob it sets (for `as_written`)."""
    out = KnobValues()
    _precision(d, out)
    for key, value in d.items():
        if key == "zero_optimization" or key in _PRECISION_KEYS:
            continue
        if key == "steps_per_print" and isinstance(value, float) and value == math.inf:
            out.set(key, sys.maxsize, key)  # Accelerate writes inf to keep DeepSpeed quiet: never
        elif key in _SAME_NAME:
            out.set(key, coerce_flat(key, value, lax_bool=True), key)
        elif key == "aio":
            _aio(value, out)
        elif key == "data_types":
            _data_types(value)
        elif key == UNTESTED_OPTIMIZER:
            read_untested_optimizer(value, out)
        elif key in TOP_LEVEL:
            check_ignored(key, key, value)
            logger.info("zero3: DeepSpeed key %r is not used by ZeroConfig; ignored", key)
        elif key in _OFF_SECTIONS or key in _OFF_KEYS or key == "checkpoint":
            _unimplemented(key, value)
        elif key in OFFLOAD_SECTION_KEYS and isinstance(value, dict):
            OffloadConfig.read_section(value, key, out, lax_bool=True)
        elif key in FLAT_NAMES:
            out.set(key, coerce_flat(key, value, lax_bool=True), key)
        elif isinstance(value, dict):
            raise ZeroConfigError(unknown_section_message(key))
        else:
            raise ZeroConfigError(unknown_key_message(key, TOP_LEVEL | {"zero_optimization"}, "DeepSpeed ")
                                  + "; zero3's own knob names are read here too")
    _zero_optimization(d.get("zero_optimization", {}), out)
    _check_disabled_sections(d, d.get("dtype", (d.get("zero_optimization") or {}).get("dtype")))
    return out.values, out.spelled


def _check_disabled_sections(d: dict[str, Any], dtype: Any) -> None:
    """A flat ``dtype`` (zero3's knob) beside the DeepSpeed section of that precision turned off:
    which one was meant cannot be told (and the section's own settings were dropped with it)."""
    for section in ("fp16", "bf16", "bfloat16"):
        if dtype is not None and _DTYPE_ALIASES[section] == dtype and section in d and not _enabled(section, d[section]):
            raise ZeroConfigError(f"dtype={dtype!r} contradicts {section}.enabled=false; keep one of them "
                                  f"({section}.enabled=true to train in {dtype})")
