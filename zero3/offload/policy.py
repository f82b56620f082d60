"""Optimizer offload: where the fp32 master buffers live, and how new weights get back.

With ``offload_optimizer="cpu"`` each param group's fp32 master buffer (optim.py
[Note: flat master buffers]) is a separate CPU allocation, pinned when asked and CUDA exists. The
master gradients accumulate there, the optimizer creates its moments next to the masters (so on the
CPU too) and steps there; after the step the masters are copied explicitly into the parameter-shard
buffer on the parameters' device. On a CPU-only machine both buffers are CPU tensors, yet two
allocations with an explicit copy, so the tests run the same path.

``offload_optimizer="nvme"`` is the same on the CPU side, with each master a tensor of its own that,
like the optimizer's per-element state, lives in a swap file between steps (swap.py, and optim.py
[Note: streamed optimizer step]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import ZeroConfig


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    """Where master shards and optimizer state live (``device``) and whether to pin them."""

    device: str = "none"
    pin_memory: bool = False

    @classmethod
    def from_config(cls, config: ZeroConfig) -> OffloadPolicy:
        return cls(device=config.offload.offload_optimizer, pin_memory=config.offload.offload_optimizer_pin_memory)

    @property
    def enabled(self) -> bool:
        """Masters and optimizer state live on the CPU side (in CPU memory, or behind it on NVMe)."""
        return self.device in ("cpu", "nvme")

    @property
    def nvme(self) -> bool:
        return self.device == "nvme"

    def alloc_master(self, numel: int, shard_device: torch.device) -> torch.Tensor:
        """A zeroed fp32 buffer for masters: on the CPU (pinned if asked and CUDA exists) when
        offloading, else next to the parameter shards."""
        if not self.enabled:
            return torch.zeros(numel, dtype=torch.float32, device=shard_device)
        pin = self.pin_memory and torch.cuda.is_available()
        return torch.zeros(numel, dtype=torch.float32, device="cpu", pin_memory=pin)

    @staticmethod
    def copy_back(low: torch.Tensor, master: torch.Tensor) -> None:
        """Cast-and-copy the masters into the parameter-shard buffer. From pinned memory the copy is
        non-blocking; it is ordered on the current stream before the next all-gather, whose side
        stream waits for the current one (comm.py [Note: streams and buffer lifetime])."""
        low.copy_(master, non_blocking=master.is_pinned())
