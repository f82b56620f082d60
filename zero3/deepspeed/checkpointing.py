"""``deepspeed.checkpointing`` names: activation checkpointing and the model-parallel RNG tracker
(zero3/activation/checkpointing.py, zero3/activation/rng.py)."""

from __future__ import annotations

from ..activation.checkpointing import (
    CudaRNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    reset,
)

__all__ = ["CudaRNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
           "model_parallel_cuda_manual_seed", "reset"]
