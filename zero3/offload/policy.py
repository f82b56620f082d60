"""Placement: where parameter shards, fp32 masters and optimizer state live, and how new weights get back.

With ``offload_optimizer="cpu"`` (unless the dtype is fp32 and the parameter shards are offloaded
too: then the optimizer steps on the shards) each param group's fp32 master buffer (optim/optimizer.py
[Note: flat master buffers]) is a separate CPU allocation, pinned when asked and CUDA exists. The
master gradients accumulate there, the optimizer creates its moments next to the masters (so on the
CPU too) and steps there; after the step the masters are copied explicitly into the parameter-shard
buffer on the parameters' device. On a CPU-only machine both buffers are CPU tensors, yet two
allocations with an explicit copy, so the tests run the same path.

``offload_optimizer="nvme"`` is the same on the CPU side, with each master a tensor of its own that,
like the optimizer's per-element state, lives in a swap file between steps (nvme.py, and optim/optimizer.py
[Note: streamed optimizer step]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..planning.persistence import MemoryBudget

if TYPE_CHECKING:
    from ..config import ZeroConfig


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    """Where every piece of model state lives, decided once from the config: parameter shards
    (device, host memory or the drive, pinned or not, how many stay in memory, the pool they are
    read into), fp32 masters and optimizer state (next to the shards, host memory or the drive),
    and the swap directories. Everything that places state asks it instead of reading config fields."""

    param_device: str = "none"  # offload_param: "none", "cpu" or "nvme"
    param_pin_memory: bool = False
    param_nvme_path: str = ""
    param_buffer_count: int = 5  # the NVMe read pool: buffers ...
    param_buffer_size: int = 100_000_000  # ... of this many elements of the config dtype
    param_max_in_cpu: int = 1_000_000_000  # NVMe tier: shard elements that stay in memory
    optimizer_device: str = "none"  # offload_optimizer: where masters and optimizer state live
    optimizer_pin_memory: bool = False  # pin the CPU masters
    optimizer_nvme_path: str = ""
    optimizer_staged_step: bool = True  # the drive's optimizer step writes second regions (rollback)
    step_in_backward: bool = False  # sub-groups of the optimizer step run in the window's last backward
    aio_threads: int = 1
    mixed_precision: bool = False  # a config dtype other than fp32: shards are cast, masters separate

    @classmethod
    def from_config(cls, config: ZeroConfig) -> PlacementPolicy:
        return cls(param_device=config.offload.offload_param, param_pin_memory=config.offload.offload_param_pin_memory,
                   param_nvme_path=config.offload.offload_param_nvme_path or "",
                   param_buffer_count=config.offload.offload_param_buffer_count,
                   param_buffer_size=config.offload.offload_param_buffer_size,
                   param_max_in_cpu=config.offload.offload_param_max_in_cpu,
                   optimizer_device=config.offload.offload_optimizer,
                   optimizer_pin_memory=config.offload.offload_optimizer_pin_memory,
                   optimizer_nvme_path=config.offload.offload_optimizer_nvme_path or "",
                   optimizer_staged_step=config.offload.offload_optimizer_staged_step,
                   step_in_backward=config.offload.offload_optimizer_step_in_backward,
                   aio_threads=config.offload.aio_thread_count, mixed_precision=config.precision.dtype != "fp32")

    def swap_directories(self) -> list[str]:
        """The directories the swap files of parameters and optimizer state go to."""
        return list(dict.fromkeys(path for on, path in ((self.params_on_drive, self.param_nvme_path),
                                                        (self.optimizer_device == "nvme", self.optimizer_nvme_path)) if on))

    # -- parameter shards ----------------------------------------------------------------------------
    @property
    def params_on_host(self) -> bool:
        return self.param_device == "cpu"

    @property
    def params_on_drive(self) -> bool:
        return self.param_device == "nvme"

    def in_memory_budget(self) -> MemoryBudget:
        """NVMe tier: the budget of shard elements that stay in CPU memory instead (``max_in_cpu``)."""
        return MemoryBudget(self.param_max_in_cpu)

    @property
    def pin_param_shards(self) -> bool:
        """CPU shards (and the flat shard buffers on the CPU) are pinned: asked for, and CUDA exists."""
        return self.param_pin_memory and torch.cuda.is_available()

    # -- masters and optimizer state -----------------------------------------------------------------
    @property
    def optimizer_offloaded(self) -> bool:
        """Masters and optimizer state live on the CPU side (in CPU memory, or behind it on NVMe)."""
        return self.optimizer_device in ("cpu", "nvme")

    @property
    def optimizer_on_drive(self) -> bool:
        """Masters and optimizer state live on the drive between steps."""
        return self.optimizer_device == "nvme"

    @property
    def staged_step(self) -> bool:
        """The optimizer step is staged on the drive, and so rolled back on every rank if it fails on one."""
        return self.optimizer_on_drive and self.optimizer_staged_step

    @property
    def separate_masters(self) -> bool:
        """fp32 masters apart from the shards: under mixed precision, and when the optimizer is
        offloaded but the shards are not (offloaded shards already live on the CPU side, where the
        optimizer steps)."""
        return self.mixed_precision or (self.optimizer_offloaded and self.param_device == "none")

    @property
    def pin_masters(self) -> bool:
        return self.optimizer_pin_memory and torch.cuda.is_available()

    def alloc_master(self, numel: int, shard_device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed buffer for masters (fp32, fp64 for fp64 shards): on the CPU (pinned if asked and CUDA
        exists) when offloading, else next to the parameter shards."""
        if not self.optimizer_offloaded:
            return torch.zeros(numel, dtype=dtype, device=shard_device)
        return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=self.pin_masters)

    @staticmethod
    def copy_back(low: torch.Tensor, master: torch.Tensor) -> None:
        """Cast-and-copy the masters into the parameter-shard buffer. From pinned memory the copy is
        non-blocking; it is ordered on the current stream before the next all-gather, whose side
        stream waits for the current one (comm/streams.py [Note: streams and buffer lifetime])."""
        low.copy_(master, non_blocking=master.is_pinned())

    # -- engine.offload_states -----------------------------------------------------------------------
    def states_nvme_path(self, explicit: str | None) -> str:
        """The directory of offload_states(device="nvme")'s swap file: the one passed, else the
        parameters', else the optimizer's ("" when none is set)."""
        return explicit or self.param_nvme_path or self.optimizer_nvme_path
