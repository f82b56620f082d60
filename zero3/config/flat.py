"""The flat names: which section of `ZeroConfig` holds each knob.

Users write every knob by its flat name (``ZeroConfig(max_live_parameters=5)``, ``{"dtype":
"bf16"}``), as DeepSpeed's keys are flat within their sections; the runtime reads it from its
section (``config.budget.max_live_parameters``). This table is the one place that knows which."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from .fields import coerce, field_types
from .sections import BudgetConfig, CommConfig, OffloadConfig, PrecisionConfig
from .training import TrainingConfig

# ZeroConfig's attribute -> the section's class.
SECTIONS: dict[str, type] = {"budget": BudgetConfig, "comm": CommConfig, "precision": PrecisionConfig,
                             "offload": OffloadConfig, "training": TrainingConfig}
# Flat knob name -> the attribute of ZeroConfig holding its section.
SECTION_OF: dict[str, str] = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
# Every flat name a dict or ZeroConfig(...) accepts; activation_checkpointing is a section of its own.
FLAT_NAMES: frozenset[str] = frozenset(SECTION_OF) | {"activation_checkpointing"}


def coerce_flat(name: str, value: Any, lax_bool: bool = False) -> Any:
    """``value`` as the type of the knob ``name`` (see `fields.coerce`); unchanged for a name that is
    not a knob (its error comes later, with the name) and for the activation_checkpointing section."""
    section = SECTION_OF.get(name)
    if section is None:
        return value
    return coerce(field_types(SECTIONS[section])[name], value, lax_bool)


def group_by_section(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{name: value}`` of knobs as ``{section: {name: value}}``; every name must be a knob."""
    out: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for name, value in flat.items():
        out[SECTION_OF[name]][name] = value
    return out

