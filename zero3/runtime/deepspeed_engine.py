"""DeepSpeed's engine names with their meaning, apart from the engine's own API: the ranks, the batch
keys, the gradient norm and loss scale, and the 16-bit model that frameworks save (DeepSpeed's
``save_16bit_model``, and the two calls Accelerate and the Hugging Face Trainer make when saving a
ZeRO-3 model). `zero3.engine.Engine` inherits them; ``self`` is that engine."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.live_state_dict import consolidated_state_dict
from ..comm.communicator import Kind, Tag
from ..errors import ZeroConfigError

logger = logging.getLogger("zero3.engine")


class DeepSpeedEngineNames:
    """DeepSpeed's engine attributes that are views of zero3's state."""

    context: Any
    config: Any
    rank: int
    world_size: int
    loss_scaler: Any
    gradient_accumulation_steps: Callable[[], int]

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole world (``engine.rank`` is its data-parallel rank)."""
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else self.rank

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

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm the last clipping computed (``gradient_clipping`` in ``step()``, or
        `clip_grad_norm_`); None before any. Unlike DeepSpeed, no norm is computed without clipping."""
        norm = self.context.optimizer.global_grad_norm if self.context.optimizer is not None else None
        return float(norm) if norm is not None else None

    def save_16bit_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the consolidated model, each parameter in its own (16-bit under bf16/fp16) dtype, as a
        ``torch.save`` state dict at ``save_dir/save_filename``. A collective: every rank takes part in
        the gathers, the engine group's rank 0 writes, and every rank returns (True) once it is there."""
        return save_16bit_model(self, os.path.join(os.fspath(save_dir), save_filename), exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``stage3_gather_16bit_weights_on_model_save``: whether a framework's save should
        gather the 16-bit weights (`_zero3_consolidated_16bit_state_dict`); Accelerate and the
        Hugging Face Trainer ask it before saving, and save a sharded checkpoint when it is False."""
        return self.config.training.gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """DeepSpeed's name, as Accelerate and the Hugging Face Trainer call it: the state dict
        `save_16bit_model` writes, on the engine group's rank 0; None on the other ranks (a collective)."""
        state = sixteen_bit_state_dict(self, exclude_frozen_parameters)
        return state if self.rank == 0 else None

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale ``engine.backward`` applies now (1.0 without fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because of an fp16 overflow."""
        return self.context.optimizer.skipped_steps if self.context.optimizer is not None else 0


def sixteen_bit_state_dict(engine: Any, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
    """The state dict of `save_16bit_model`: the fp32 masters gathered onto the engine's rank 0 (of its
    group) and cast to each parameter's dtype (tied parameters stay one tensor); buffers and extra
    state as the module holds them; {} on the other ranks. Refused with tensor parallelism (before any
    collective, on every rank), as ``save_pretrained`` is: rank 0 held model-parallel rank 0's slices
    alone, as if they were the model."""
    if engine.context.model_parallel is not None:
        raise ZeroConfigError("save_16bit_model with tensor parallelism: every model-parallel rank holds other slices, "
                              "and one file from rank 0 would hold model-parallel rank 0's alone; use save_checkpoint "
                              "and python -m zero3.consolidate --model-parallel-rank R (one state dict per rank), or "
                              "engine.consolidated_state_dict() (this model-parallel rank's slices, on its data-parallel "
                              "rank 0); nothing was written")
    full = consolidated_state_dict(engine.context, rank0_only=True)  # on the group's first rank (probe 25D)
    params = dict(engine.module.named_parameters(remove_duplicate=False))
    by_param: dict[int, torch.Tensor] = {}  # one tensor per parameter, under each name it has
    state = {}
    for key, value in full.items():
        p = params.get(key)
        if p is None:
            state[key] = value
        elif p.requires_grad or not exclude_frozen_parameters:
            state[key] = by_param.setdefault(id(p), value.to(p.dtype))
    return state


def save_16bit_model(engine: Any, path: str, exclude_frozen_parameters: bool = False) -> bool:
    """`DeepSpeedEngineNames.save_16bit_model`: `sixteen_bit_state_dict`, written by the engine
    group's rank 0 (global rank 0 or not); every rank returns once it is there."""
    state = sixteen_bit_state_dict(engine, exclude_frozen_parameters)
    if engine.rank == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(state, path)
        logger.info("zero3: saved the 16-bit model (%d tensors) to %s", len(state), path)
    engine.comm.agree(Tag(Kind.AGREE, f"save_16bit_model {path}"))
    return True
