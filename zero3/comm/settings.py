"""The settings of one communicator, in one frozen, validated record built from a `ZeroConfig`'s
``comm`` section (the user's knobs, `zero3.config.CommConfig`) and the communicator's role: the
engine's own group (ZeRO++ codings, hpZ, the collective timeout), ``zero3.Init``'s, or the
model-parallel group's; the config agreement and activation checkpointing build theirs directly."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from ..config import ZeroConfig
from ..errors import ZeroConfigError

REDUCE_IMPLS = ("auto", "reduce_scatter", "all_reduce", "p2p", "shm")
GATHER_IMPLS = ("auto", "all_gather", "p2p", "shm")


@dataclass(frozen=True, slots=True)
class CommSettings:
    """How a `Communicator` moves bytes.

    Attributes:
        overlap: issue parameter gathers and reductions asynchronously (side stream on CUDA).
        bucket_numel: largest number of elements one parameter all-gather moves.
        reduce_impl: ``reduce_scatter``, ``all_reduce`` (then slice), ``p2p`` (pairwise sends and
            receives, then a local sum), ``shm`` (p2p whose parts pass through shared memory while
            the gathers' window is open, comm/shared_reduce.py) or ``auto`` (on gloo: shm where the
            gathers are shm and qgZ is off, else p2p; reduce-scatter elsewhere).
        allgather_impl: ``all_gather``, ``p2p``, ``shm`` (same-node shards read from shared memory
            during steps, comm/shared.py; p2p otherwise) or ``auto`` (on gloo: shm when every rank
            is on one node and neither qwZ nor hpZ is on, else p2p; all-gather elsewhere).
        verify: verify every collective (verify.py), on every backend: unverified, ranks that issue
            different collectives of the same size mix their data silently. None reads as True.
        timeout_s: when > 0 and world size > 1, collectives run on a process group of their own
            with this timeout (a rank that stops taking part is reported instead of waited for).
        plans: how many epoch plans to remember.
        quantize_weights: parameter gathers carry blockwise int8 values and a scale per block
            (codec.py); the gathered weights are dequantized, shards stay exact.
        quantize_gradients: 8 or 4: reduction messages carry blockwise int8/int4 values; each is
            dequantized before it is added, so nothing accumulates; 0: off.
        quant_block: elements per quantization block.
        hpz_partition_size: ranks per hpZ secondary group as ``zero_hpz_partition_size`` asks
            (1: off, -1: the ranks of a node); the communicator resolves it against its ranks' nodes.
    """

    overlap: bool = True
    bucket_numel: int = 1 << 62
    reduce_impl: Literal["auto", "reduce_scatter", "all_reduce", "p2p", "shm"] = "auto"
    allgather_impl: Literal["auto", "all_gather", "p2p", "shm"] = "auto"
    verify: bool = True
    timeout_s: float = 0.0
    plans: int = 8
    quantize_weights: bool = False
    quantize_gradients: int = 0
    quant_block: int = 512
    hpz_partition_size: int = 1

    def __post_init__(self) -> None:
        if self.reduce_impl not in REDUCE_IMPLS:
            raise ZeroConfigError(f"reduce_impl must be one of {REDUCE_IMPLS}, got {self.reduce_impl!r}")
        if self.allgather_impl not in GATHER_IMPLS:
            raise ZeroConfigError(f"allgather_impl must be one of {GATHER_IMPLS}, got {self.allgather_impl!r}")
        if self.quantize_gradients not in (0, 4, 8):
            raise ZeroConfigError(f"quantize_gradients must be 0, 4 or 8, got {self.quantize_gradients!r}")
        if self.quant_block < 1:
            raise ZeroConfigError(f"quant_block must be >= 1, got {self.quant_block!r}")
        if not (self.hpz_partition_size == -1 or self.hpz_partition_size >= 1):
            raise ZeroConfigError(f"hpz_partition_size must be -1 or >= 1, got {self.hpz_partition_size!r}")
        if self.timeout_s < 0:
            raise ZeroConfigError(f"timeout_s must be >= 0, got {self.timeout_s!r}")
        object.__setattr__(self, "verify", self.verify is not False)  # on unless turned off
        object.__setattr__(self, "bucket_numel", max(1, int(self.bucket_numel)))
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        object.__setattr__(self, "plans", max(1, int(self.plans)))

    @classmethod
    def from_config(cls, cfg: ZeroConfig, own_group: bool = True) -> CommSettings:
        """The data-parallel communicator's settings. ``own_group``: the engine's communicator, on a
        process group of its own with ``collective_timeout`` and ZeRO++'s wire codings and hpZ
        groups; False for ``zero3.Init``, which uses the caller's group and sends exact values."""
        return cls(overlap=cfg.comm.overlap_comm, bucket_numel=cfg.comm.allgather_bucket_size,
                   reduce_impl=cfg.comm.reduce_scatter_impl, allgather_impl=cfg.comm.allgather_impl,
                   verify=cfg.comm.verify_collectives, timeout_s=cfg.comm.collective_timeout if own_group else 0.0,
                   plans=2 * cfg.budget.max_traces + 2, quantize_weights=cfg.comm.zero_quantized_weights and own_group,
                   quantize_gradients=cfg.comm.quantized_gradient_bits if cfg.comm.zero_quantized_gradients and own_group
                   else 0, quant_block=cfg.comm.quantization_block_size,
                   hpz_partition_size=cfg.comm.zero_hpz_partition_size if own_group else 1)

    @classmethod
    def model_parallel(cls, cfg: ZeroConfig) -> CommSettings:
        """The model-parallel group's settings: blocking, verified and timed out like the data-parallel one."""
        return cls(overlap=False, verify=cfg.comm.verify_collectives, timeout_s=cfg.comm.collective_timeout, plans=4)

    def replace(self, **changes: object) -> CommSettings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
