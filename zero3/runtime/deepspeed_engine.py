"""DeepSpeed's engine names that are views of zero3's state, apart from the engine's own API: the
local rank, the batch keys, the gradient norm and loss scale, and whether frameworks should gather
the 16-bit model when they save. `zero3.engine.Engine` inherits them (``self`` is that engine) and
keeps the names that reach further (``global_rank``, the 16-bit model itself:
checkpoint/sixteen_bit.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import ZeroConfigError


class DeepSpeedEngineNames:
    """DeepSpeed's engine attributes that are views of zero3's state."""

    context: Any
    config: Any
    rank: int
    world_size: int
    loss_scaler: Any
    gradient_accumulation_steps: Callable[[], int]

    @property
    def local_rank(self) -> int:
        """This process's rank on its node: ``LOCAL_RANK`` as torchrun sets it, else 0."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def zero_optimization_stage(self) -> int:
        return 3

    def train_micro_batch_size_per_gpu(self) -> int:
        """The config's ``train_micro_batch_size_per_gpu`` (DeepSpeed's batch keys)."""
        micro = self.config.training.train_micro_batch_size_per_gpu  # fixed at initialize from any two of the three
        if micro is None:
            raise ZeroConfigError("engine.train_micro_batch_size_per_gpu(): the config does not give the micro-batch "
                                  "size; set train_micro_batch_size_per_gpu (or train_batch_size) in it")
        return int(micro)

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks: micro-batch x accumulation x ranks."""
        return self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() * self.world_size

    @property
    def global_samples(self) -> int:
        """Samples over every data-parallel rank at the optimizer steps so far (skipped ones included, as
        DeepSpeed counts them): `train_batch_size` per step; saved in checkpoints."""
        self.train_micro_batch_size_per_gpu()  # refused by name when the config gives no batch size
        return self.context.global_samples

    def was_step_applied(self) -> bool:
        """Whether the last ``engine.step()`` stepped the optimizer: False between accumulation boundaries,
        without an optimizer, and when an fp16 overflow skipped it (DeepSpeed's)."""
        return self.context.step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm the last clipping computed (``gradient_clipping`` in ``step()``, or
        `clip_grad_norm_`); None before any. Unlike DeepSpeed, no norm is computed without clipping."""
        norm = self.context.optimizer.global_grad_norm if self.context.optimizer is not None else None
        return float(norm) if norm is not None else None

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``stage3_gather_16bit_weights_on_model_save``: whether a framework's save should
        gather the 16-bit weights (`_zero3_consolidated_16bit_state_dict`); Accelerate and the
        Hugging Face Trainer ask it before saving, and save a sharded checkpoint when it is False."""
        return self.config.training.gather_16bit_weights_on_model_save

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale ``engine.backward`` applies now (1.0 without fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because of an fp16 overflow."""
        return self.context.optimizer.skipped_steps if self.context.optimizer is not None else 0
