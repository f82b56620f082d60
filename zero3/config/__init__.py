"""`ZeroConfig` and its sections: every knob of the runtime, typed, validated and immutable.

``zero3.config`` keeps its names: ``ZeroConfig``, ``resolve_config``, ``ActivationCheckpointingConfig``,
``OptimizerSpec``, ``SchedulerSpec``; the sections are ``BudgetConfig``, ``CommConfig``,
``PrecisionConfig``, ``OffloadConfig`` and ``TrainingConfig``. DeepSpeed's key names are translated
in `zero3.config.deepspeed`.
"""

from .sections import BudgetConfig, CommConfig, OffloadConfig, PrecisionConfig
from .training import ActivationCheckpointingConfig, OptimizerSpec, SchedulerSpec, TrainingConfig
from .zero_config import ZeroConfig, resolve_config

__all__ = ["ActivationCheckpointingConfig", "BudgetConfig", "CommConfig", "OffloadConfig", "OptimizerSpec",
           "PrecisionConfig", "SchedulerSpec", "TrainingConfig", "ZeroConfig", "resolve_config"]
