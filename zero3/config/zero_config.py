"""`ZeroConfig`: every knob of the runtime in one typed, validated, immutable object, made of sections.

``ZeroConfig(max_live_parameters=5, dtype="bf16")`` takes every knob by its flat name and files it
under its section (`flat.SECTION_OF`); the runtime reads ``config.budget.max_live_parameters``.
``from_dict`` accepts our flat names or a DeepSpeed config (``zero_optimization`` with ``stage3_*``
keys, translated by `zero3.config.deepspeed`), so an existing DeepSpeed JSON carries over.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ZeroConfigError
from .fields import KnobValues, did_you_mean, unknown_key_message
from .flat import FLAT_NAMES, SECTION_OF, SECTIONS, coerce_flat, group_by_section
from .json_file import read_config_file
from .sections import OFFLOAD_SECTION_KEYS, BudgetConfig, CommConfig, OffloadConfig, PrecisionConfig
from .training import ActivationCheckpointingConfig, TrainingConfig
from . import deepspeed as deepspeed_config


@dataclass(frozen=True, slots=True, init=False)
class ZeroConfig:
    """Configuration of the ZeRO-3 runtime. Defaults equal DeepSpeed's where the knob exists there.

    Construct it with flat keyword arguments (``ZeroConfig(max_live_parameters=5)``), with sections
    (``ZeroConfig(budget=BudgetConfig(...))``), or both: flat knobs then change the given sections.
    """

    budget: BudgetConfig
    """What the coordinator may keep gathered, prefetch and remember."""

    comm: CommConfig
    """Buckets, transports, collective checks and ZeRO++ of gathers and reductions."""

    precision: PrecisionConfig
    """Shard, gather and reduction dtypes and fp16 loss scaling."""

    offload: OffloadConfig
    """Where shards and optimizer state live (device, CPU, NVMe)."""

    training: TrainingConfig
    """Accumulation, clipping, config-built optimizer and scheduler, timing logs, leaf modules."""

    activation_checkpointing: ActivationCheckpointingConfig | None
    """DeepSpeed's ``activation_checkpointing`` section, read by ``zero3.checkpointing.configure(mpu,
    deepspeed_config=...)``; ``zero3.initialize`` configures activation checkpointing from it when it is
    given (docs/activation_checkpointing.md). None: the section is absent."""

    def __init__(self, *, budget: BudgetConfig | None = None, comm: CommConfig | None = None,
                 precision: PrecisionConfig | None = None, offload: OffloadConfig | None = None,
                 training: TrainingConfig | None = None,
                 activation_checkpointing: ActivationCheckpointingConfig | dict | None = None,
                 **knobs: Any) -> None:
        for name in knobs:
            if name not in SECTION_OF:
                raise TypeError(f"ZeroConfig() got an unexpected keyword argument {name!r}"
                                + did_you_mean(name, FLAT_NAMES))
        given = {"budget": budget, "comm": comm, "precision": precision, "offload": offload, "training": training}
        for section, changes in group_by_section(knobs).items():
            cls, base = SECTIONS[section], given[section]
            if base is None:
                value = cls(**changes)
            elif not isinstance(base, cls):
                raise ZeroConfigError(f"{section} must be a {cls.__name__}, got {base!r}")
            else:
                value = dataclasses.replace(base, **changes) if changes else base
            object.__setattr__(self, section, value)
        _check_budget_alone(self.budget, self.comm)
        _check_step_in_backward(self)
        if self.comm.zero_quantized_gradients and self.precision.reduce_dtype != "fp32":
            raise ZeroConfigError(f"reduce_dtype={self.precision.reduce_dtype!r} (DeepSpeed's communication_data_type) "
                                  "is not used with zero_quantized_gradients, whose messages carry int8/int4 blocks "
                                  "summed in fp32: remove one of them")
        if activation_checkpointing is not None:
            activation_checkpointing = ActivationCheckpointingConfig.from_dict(activation_checkpointing)
        object.__setattr__(self, "activation_checkpointing", activation_checkpointing)

    # -- construction from dicts and files -------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ZeroConfig":
        """Build from our flat names, or from a DeepSpeed config dict (``zero_optimization``, ``bf16``,
        ...: `deepspeed.is_deepspeed_dict`), whose booleans take 0/1 too; a flat config's take true/false only."""
        if not isinstance(d, dict):
            raise ZeroConfigError(f"config must be a dict, got {type(d).__name__}")
        if deepspeed_config.is_deepspeed_dict(d):
            values, spelled = deepspeed_config.translate_spelled(d)
            try:
                return cls(**values)
            except ZeroConfigError as exc:
                raise deepspeed_config.as_written(exc, spelled) from exc.__cause__
        out = KnobValues()
        for key, value in d.items():
            if key in OFFLOAD_SECTION_KEYS and isinstance(value, dict):  # DeepSpeed's {device, ...} form
                OffloadConfig.read_section(value, key, out, lax_bool=False)  # a flat config: true/false only
            elif key == deepspeed_config.UNTESTED_OPTIMIZER:  # DeepSpeed's own key, read as DeepSpeed reads it
                deepspeed_config.read_untested_optimizer(value, out)
            elif key in FLAT_NAMES:
                out.set(key, coerce_flat(key, value), key)
            elif isinstance(value, dict):
                raise ZeroConfigError(deepspeed_config.unknown_section_message(key))
            else:
                raise ZeroConfigError(unknown_key_message(key, FLAT_NAMES))
        try:
            return cls(**out.values)
        except ZeroConfigError as exc:  # naming an offload section's key as written (review 38R2)
            raise deepspeed_config.as_written(exc, out.spelled) from exc.__cause__

    @classmethod
    def from_json(cls, path: str | Path) -> "ZeroConfig":
        """Build from a config file: JSON with the comments and trailing commas DeepSpeed's (hjson)
        reader accepts (`zero3.config.json_file`)."""
        return cls.from_dict(read_config_file(path))

    def replace(self, **changes: Any) -> "ZeroConfig":
        """A copy with ``changes`` (flat knobs or whole sections), validated."""
        sections = {name: getattr(self, name) for name in SECTIONS}
        return ZeroConfig(**{**sections, "activation_checkpointing": self.activation_checkpointing, **changes})

    def for_world_size(self, world_size: int) -> "ZeroConfig":
        """This config with the batch sizes fixed for ``world_size`` data-parallel ranks
        (`TrainingConfig.for_world_size`); itself when there is nothing to fix."""
        training = self.training.for_world_size(world_size)
        return self if training is self.training else self.replace(training=training)

    def get(self, key: str, default: Any = None) -> Any:
        """A read as of DeepSpeed's ``engine.config`` dict, for frameworks that read it (the Hugging
        Face Trainer asks ``engine.config.get("zero_optimization", {}).get("stage")``):
        ``"zero_optimization"`` gives the stage, 3, and this config's values of DeepSpeed's stage-3 keys
        zero3 maps; a flat knob's name its value; any other key ``default``."""
        if key == "zero_optimization":
            flat = self.to_dict()
            return {"stage": 3, **{ds: flat[ours] for ds, ours in deepspeed_config.ZERO_KEYS.items()},
                    deepspeed_config.GATHER_16BIT: flat["gather_16bit_weights_on_model_save"]}
        return self.to_dict().get(key, default)

    def to_dict(self) -> dict[str, Any]:
        """Every knob by its flat name: what ``from_dict`` reads back into an equal config."""
        out = {name: getattr(getattr(self, section), name) for name, section in SECTION_OF.items()}
        out["activation_checkpointing"] = self.activation_checkpointing
        return out


BUDGET_KNOBS = ("max_live_parameters", "max_reuse_distance", "prefetch_bucket_size", "param_persistence_threshold",
                "model_persistence_threshold", "max_live_bytes", "max_reuse_distance_bytes", "prefetch_bucket_bytes")
"""The knobs ``memory_budget`` chooses (with ``reduce_bucket_size``): none may be set beside it."""


def _check_budget_alone(budget: BudgetConfig, comm: CommConfig) -> None:
    """``memory_budget`` chooses the budget knobs, so one set beside it (to a value other than its
    default: a default cannot be told from unset) is refused rather than silently overridden."""
    if budget.memory_budget is None:
        return
    defaults_b, defaults_c = BudgetConfig(), CommConfig()
    given = [k for k in BUDGET_KNOBS if getattr(budget, k) != getattr(defaults_b, k)]
    if comm.reduce_bucket_size != defaults_c.reduce_bucket_size:
        given.append("reduce_bucket_size")
    if given:
        raise ZeroConfigError(f"memory_budget chooses {', '.join(given)} itself; remove "
                              f"{'it' if len(given) == 1 else 'them'} or remove memory_budget")


def _check_step_in_backward(config: "ZeroConfig") -> None:
    """The optimizer step in backward changes parameters before the last gradient exists, so what
    needs every gradient first is refused beside it."""
    if not config.offload.offload_optimizer_step_in_backward:
        return
    if config.training.gradient_clipping > 0:
        raise ZeroConfigError(
            f"offload_optimizer_step_in_backward=True cannot be used with gradient_clipping="
            f"{config.training.gradient_clipping!r}: clipping by the global norm needs every gradient before "
            "any parameter steps; set gradient_clipping=0 or remove step_in_backward")
    if config.precision.dtype == "fp16":
        raise ZeroConfigError(
            "offload_optimizer_step_in_backward=True cannot be used with dtype='fp16': the overflow check "
            "needs every gradient before any parameter steps (a skipped step could not be undone); use "
            "bf16 or fp32, or remove step_in_backward")


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

