"""zero3: a small, explainable ZeRO stage-3 parameter-partitioning runtime for PyTorch."""

from .config import ZeroConfig
from .engine import Engine, initialize
from .errors import ZeroConfigError, ZeroDivergenceError, ZeroError, ZeroStateError
from .init import GatheredParameters, Init, register_external_parameter
from .metrics import StepMetrics
from .optim import clip_grad_norm_
from .param import ZeroParameter, is_partitioned
from .state import ParamStatus

__all__ = [
    "Engine",
    "GatheredParameters",
    "Init",
    "ParamStatus",
    "StepMetrics",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroDivergenceError",
    "ZeroError",
    "ZeroParameter",
    "ZeroStateError",
    "clip_grad_norm_",
    "initialize",
    "is_partitioned",
    "register_external_parameter",
]
