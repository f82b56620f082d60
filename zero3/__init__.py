"""zero3: a small, explainable ZeRO stage-3 parameter-partitioning runtime for PyTorch."""

from . import checkpointing, pretrained
from .accessors import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_optimizer_state,
)
from .checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from .config import ZeroConfig
from .engine import Engine, clip_grad_norm_, initialize
from .errors import ZeroCommunicationError, ZeroConfigError, ZeroDivergenceError, ZeroError, ZeroStateError
from .init import GatheredParameters, Init, register_external_parameter
from .leaf import set_leaf_modules
from .memory import see_memory_usage
from .metrics import StepMetrics
from .param import ZeroParameter, is_partitioned
from .param import is_partitioned as is_zero_param
from .schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR
from .precision import LossScaler
from .state import ParamStatus

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "Engine",
    "GatheredParameters",
    "Init",
    "LossScaler",
    "ParamStatus",
    "StepMetrics",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroConfig",
    "ZeroCommunicationError",
    "ZeroConfigError",
    "ZeroDivergenceError",
    "ZeroError",
    "ZeroParameter",
    "ZeroStateError",
    "checkpointing",
    "clip_grad_norm_",
    "initialize",
    "is_partitioned",
    "is_zero_param",
    "pretrained",
    "register_external_parameter",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_optimizer_state",
    "see_memory_usage",
    "set_leaf_modules",
]
