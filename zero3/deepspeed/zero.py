"""``deepspeed.zero`` names: Init, GatheredParameters, register_external_parameter, set_z3_leaf_modules."""

from __future__ import annotations

from ..runtime.gathered import GatheredParameters, register_external_parameter
from ..runtime.init import Init
from .utils import set_z3_leaf_modules
from ..partition.param import is_partitioned as is_zero_param

__all__ = ["GatheredParameters", "Init", "is_zero_param", "register_external_parameter", "set_z3_leaf_modules"]
