"""The process's RNG states as a checkpoint stores them (one entry per rank in the metadata's ``rng``).

The model-parallel tracker comes from `zero3.activation.rng`, which imports only torch: storing its
states does not pull in activation checkpointing's runtime (hooks, communicator).
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from ..activation.rng import get_cuda_rng_tracker


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: torch's CPU and (initialised) CUDA generators, Python's, numpy's
    when numpy is imported, and the model-parallel tracker's."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "rng_tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what `capture_rng_state` returned (the parts present, as far as this process has them)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "rng_tracker" in state:
        get_cuda_rng_tracker().set_states(state["rng_tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


__all__ = ["capture_rng_state", "restore_rng_state"]
