"""The 16-bit model: DeepSpeed's ``save_16bit_model`` and the state dict Accelerate and the Hugging
Face Trainer take when they save a ZeRO-3 model (``_zero3_consolidated_16bit_state_dict``). Functions
of a `zero3.engine.Engine` (passed in; this module does not import it)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..comm.communicator import Kind, Tag
from ..errors import ZeroConfigError
from .live_state_dict import consolidated_state_dict

logger = logging.getLogger("zero3.engine")


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
    """`Engine.save_16bit_model`: `sixteen_bit_state_dict`, written by the engine
    group's rank 0 (global rank 0 or not); every rank returns once it is there."""
    state = sixteen_bit_state_dict(engine, exclude_frozen_parameters)
    if engine.rank == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(state, path)
        logger.info("zero3: saved the 16-bit model (%d tensors) to %s", len(state), path)
    engine.comm.agree(Tag(Kind.AGREE, f"save_16bit_model {path}"))
    return True
