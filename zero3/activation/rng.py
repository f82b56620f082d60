"""The model-parallel RNG tracker (DeepSpeed's ``get_cuda_rng_tracker``): named RNG states that model
code forks into, one process-wide tracker.

Its own module so that what saves or restores RNG states (sharded checkpoints, the offline
``python -m zero3.consolidate``) needs only torch, not activation checkpointing's runtime (hooks,
communicator). Activation checkpointing (`zero3.activation.checkpointing`) saves and restores the
tracker's states around a recompute; a sharded checkpoint stores them with the other RNG states.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The tracker state `model_parallel_cuda_manual_seed` adds (DeepSpeed's and Megatron's name)."""


class RNGStatesTracker:
    """Named RNG states that model code can switch to (Megatron's ``CudaRNGStatesTracker``).

    ``add(name, seed)`` creates a state; ``with tracker.fork(name):`` runs code on it (dropout inside
    a tensor-parallel region draws a different mask on every model-parallel rank) and stores where it
    got to. It tracks the CUDA generator of the current device when CUDA is available, else the CPU
    generator. `checkpoint` saves and restores these states with the others.
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: set[int] = set()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def reset(self) -> None:
        """Forget every state and seed."""
        self._states = {}
        self._seeds = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map (the states themselves are never modified in place)."""
        return dict(self._states)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace every state by ``states`` (from `get_states`)."""
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``; the current RNG state is not touched.

        Raises:
            ValueError: ``name`` or ``seed`` is already tracked.
        """
        if seed in self._seeds:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another state")
        if name in self._states:
            raise ValueError(f"RNG tracker: a state named {name!r} already exists")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self._seeds.add(seed)
        self._states[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the body on state ``name``, keep where it got to, then restore the previous state.

        Raises:
            ValueError: no state ``name`` (call `add` or `model_parallel_cuda_manual_seed` first).
        """
        if name not in self._states:
            raise ValueError(f"RNG tracker: no state named {name!r} (tracked: {sorted(self._states)}); add it "
                             "first, e.g. with zero3.checkpointing.model_parallel_cuda_manual_seed(seed)")
        outer = self._get()
        self._set(self._states[name])
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(outer)


CudaRNGStatesTracker = RNGStatesTracker  # DeepSpeed's name for the class

_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's RNG tracker (DeepSpeed's name; it tracks the CPU generator without CUDA)."""
    return _TRACKER


__all__ = ["CudaRNGStatesTracker", "MODEL_PARALLEL_RNG", "RNGStatesTracker", "get_cuda_rng_tracker"]
