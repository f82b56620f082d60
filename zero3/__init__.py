"""zero3: a small, explainable ZeRO stage-3 parameter-partitioning runtime for PyTorch.

The package is in layers (docs/design.md has the map): ``planning`` and ``partition`` at the bottom,
``comm``, ``offload``, ``optim`` and ``runtime`` above them, ``checkpoint`` and ``activation`` on top,
``deepspeed`` for DeepSpeed's names. What is imported here is the public API.
"""

import sys as _sys

from .activation import checkpointing
from .checkpoint import pretrained
from .checkpoint.hf_load import from_pretrained
from .accessors import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
from .checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from .comm.process_group import init_distributed
from .comm import process_group as _process_group
from .config import ZeroConfig
from .engine import Engine, clip_grad_norm_, initialize
from .errors import (ConcurrentForwardError, ZeroCommunicationError, ZeroConfigError, ZeroDivergenceError, ZeroError,
                     ZeroStateError)
from .runtime.gathered import GatheredParameters, register_external_parameter
from .runtime.init import Init
from .runtime.compile import compile_blocks
from .runtime.leaf import set_leaf_modules
from .memory import see_memory_usage
from .metrics import StepMetrics
from .partition.param import ZeroParameter, is_partitioned
from .partition.param import is_partitioned as is_zero_param
from .optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR
from .optim.precision import LossScaler
from .partition.state import ParamStatus

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "ConcurrentForwardError",
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
    "compile_blocks",
    "from_pretrained",
    "init_distributed",
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
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "see_memory_usage",
    "set_leaf_modules",
]

# DeepSpeed's and earlier zero3's module names stay importable: ``import zero3.checkpointing``.
_sys.modules[__name__ + ".checkpointing"] = checkpointing
_sys.modules[__name__ + ".pretrained"] = pretrained

# A torch build without CUDA has no NCCL hang dumps to keep; its gloo groups made after this import
# do not run torch's flight recorder (process_group.py [Note: the flight recorder and resident memory]).
if _process_group.cpu_only_build() and not _process_group.group_exists():
    _process_group.flight_recorder_off_by_default()
