"""``zero3.see_memory_usage``: one line of resident memory and model state, DeepSpeed's name.

Resident memory is what the process holds (RSS and the machine's available memory on CPU;
allocated, reserved and their peaks on CUDA); model state is what zero3's engines in this process
hold, by tier: the in-memory tiers count only bytes in memory, and ``offloaded`` counts what lives in
an offload tier (host memory with CPU offload, or NVMe, shown apart). On CPU, RSS includes what glibc keeps after frees; measure with
``MALLOC_MMAP_THRESHOLD_=131072`` set for the process to see live tensors (docs/debugging.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from .runtime.context import LIVE_CONTEXTS

logger = logging.getLogger("zero3.memory")

_OWN_TIERS = ("master_bytes", "optimizer_state_bytes")  # an engine's own, not its model's
_TIERS = ("gathered_param_bytes", "param_shard_bytes", "master_bytes", "optimizer_state_bytes", "grad_shard_bytes",
          "offloaded_bytes", "nvme_bytes")


def see_memory_usage(message: str, force: bool = False, *, all_ranks: bool = False) -> dict[str, Any] | None:
    """Log one line (logger ``zero3.memory``, INFO) with resident memory and model-state bytes by tier.

    As in DeepSpeed, nothing happens unless ``force`` is true (so calls can stay in code), and only
    rank 0 logs unless ``all_ranks``. Returns the figures as a dict (None when not forced).
    """
    if not force:
        return None
    figures: dict[str, Any] = {"message": message}
    figures.update(_resident())
    state = dict.fromkeys(_TIERS, 0)
    # Engines managing their models first: an engine whose hooks were removed and whose parameters a
    # new engine took over (the same model, or one wrapping it) shares them (counted once) and adds
    # only its own optimizer.
    contexts = sorted(LIVE_CONTEXTS, key=lambda c: not c.attached)
    counted: set[int] = set()  # id() of the parameters counted so far
    for ctx in contexts:
        ids = {id(p) for p in ctx.params}
        shared = not counted.isdisjoint(ids)
        counted |= ids
        for key, value in ctx.memory_report().items():
            if key in state and not (shared and key not in _OWN_TIERS):
                state[key] += value
    state["optimizer_state_bytes"] -= state["master_bytes"]  # reported apart
    figures.update(state)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if all_ranks or rank == 0:
        logger.info("%s | %s | model state: gathered %s, shards %s, masters %s, optimizer %s, gradients %s, "
                    "offloaded %s (NVMe %s)", message, _resident_text(figures), *(_mib(state[k]) for k in _TIERS))
    return figures


def _resident() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/self/statm") as fh:
            out["rss_bytes"] = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    out["available_bytes"] = int(line.split()[1]) * 1024
    except OSError:  # not Linux: no RSS figures
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["cuda_reserved_bytes"] = torch.cuda.memory_reserved()
        out["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def _resident_text(f: dict[str, Any]) -> str:
    parts = []
    if "rss_bytes" in f:
        parts.append(f"RSS {_mib(f['rss_bytes'])}, available {_mib(f.get('available_bytes', 0))}")
    if "cuda_allocated_bytes" in f:
        parts.append(f"CUDA allocated {_mib(f['cuda_allocated_bytes'])} (peak {_mib(f['cuda_max_allocated_bytes'])}), "
                     f"reserved {_mib(f['cuda_reserved_bytes'])} (peak {_mib(f['cuda_max_reserved_bytes'])})")
    return "; ".join(parts) or "resident memory unknown"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
