"""The default process group, from the launcher's environment: `init_distributed` (public as
``zero3.init_distributed`` and, with DeepSpeed's signature, ``deepspeed.init_distributed``) and
`ensure_default_group`, which ``zero3.Init`` and ``zero3.initialize`` call.

torchrun (and DeepSpeed's launcher) set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``LOCAL_RANK``; from those the group is made with the backend the machine has (nccl with CUDA, else
gloo). A script launched so that never calls ``init_process_group`` would otherwise run a world of one
process on every rank, each training the whole model alone, so `Init` and `initialize` set the group up
themselves when ``WORLD_SIZE`` > 1, and refuse when they cannot.

[Note: the flight recorder and resident memory]
torch's c10d flight recorder keeps a ring of the last collectives (``TORCH_FR_BUFFER_SIZE`` entries,
read once, when the first process group is made) for hang dumps. Each entry is a few small heap
allocations that live until the ring overwrites them; zero3 issues tens of collectives per step, and
on glibc those long-lived small chunks land in the holes that freed gathered weights and gradients
leave, so the heap cannot reuse the holes and grows without bound: the example GPT on 2 gloo ranks
gained about 100 MiB of RSS per rank in 2,000 steps with the recorder on, and stayed flat with it off
(benchmarks/bench_soak.py; docs/performance.md). zero3 therefore makes ``TORCH_FR_BUFFER_SIZE=0`` the
default wherever it can decide before the first group exists and no NCCL hang dump is at stake: on
importing zero3 in a torch build without CUDA, and when zero3 makes the default group with gloo.
Setting ``TORCH_FR_BUFFER_SIZE`` (or ``TORCH_NCCL_TRACE_BUFFER_SIZE``) yourself always wins.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ZeroConfigError

logger = logging.getLogger(__name__)

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FLIGHT_RECORDER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_warned_flight_recorder = False  # warn_if_flight_recorder_on: once per process
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def launched() -> bool:
    """Whether a launcher set this process's place in a world (``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world_size() -> int:
    """``WORLD_SIZE`` as the launcher set it (1 when unset)."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ZeroConfigError(f"WORLD_SIZE={value!r} in the environment is not a number") from None


def flight_recorder_off_by_default() -> bool:
    """Turn torch's flight recorder off for process groups made from now on, unless the user chose
    ([Note: the flight recorder and resident memory]). Returns whether this call turned it off."""
    if any(v in os.environ for v in FLIGHT_RECORDER_VARS):
        return False
    os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
    return True


def cpu_only_build() -> bool:
    """Whether this torch was built without CUDA and ROCm (so without NCCL)."""
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


def backend_of(group: Any = None) -> str:
    """The backend zero3's tensors meet in ``group``: its name, or, for a group of one backend per
    device (``init_process_group()`` without a backend names it "undefined"; a group made with
    ``backend="cpu:gloo"`` names it so), the CUDA device's when CUDA is available, else the CPU's:
    what `init_distributed` would have chosen."""
    name = dist.get_backend(group)
    if ":" not in name and name != "undefined":
        return name
    by_device = dict(entry.split(":", 1) for entry in dist.get_backend_config(group).split(",") if ":" in entry)
    return by_device.get("cuda" if torch.cuda.is_available() and "cuda" in by_device else "cpu", name)


def warn_if_flight_recorder_on(who: str) -> None:
    """One warning when the default group is gloo and may record every collective."""
    global _warned_flight_recorder
    if _warned_flight_recorder or not group_exists() or backend_of() != "gloo" or not flight_recorder_may_be_on():
        return
    _warned_flight_recorder = True
    logger.warning("%s: torch's flight recorder may be on for this gloo group (TORCH_FR_BUFFER_SIZE is not 0): "
                   "its entries fragment glibc's heap, so RSS grows by about 100 MiB per 2,000 steps on a small "
                   "model; set TORCH_FR_BUFFER_SIZE=0 before creating the process group (or import zero3 first)", who)


def flight_recorder_may_be_on() -> bool:
    """Whether the groups of this process may record collectives: neither variable says 0."""
    value = next((os.environ[v] for v in FLIGHT_RECORDER_VARS if v in os.environ), None)
    return value is None or value.strip() != "0"


def init_distributed(backend: str | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                     init_method: str | None = None, rank: int = -1, world_size: int = -1,
                     verbose: bool = True) -> None:
    """Create the default process group unless one exists (then a no-op).

    ``backend``: default nccl when CUDA is available, else gloo (with nccl the CUDA device becomes
    ``LOCAL_RANK``'s). ``rank``/``world_size`` (with ``init_method``) override the environment.
    Without a launcher the world is this one process.

    Raises:
        ZeroConfigError: ``RANK`` and ``WORLD_SIZE`` are set but not ``MASTER_ADDR``/``MASTER_PORT``.
    """
    if dist.is_initialized():
        if verbose:
            logger.info("zero3: torch.distributed already initialized (backend %s, rank %d of %d)",
                        dist.get_backend(), dist.get_rank(), dist.get_world_size())
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if backend == "gloo" and flight_recorder_off_by_default():
        logger.debug("zero3: TORCH_FR_BUFFER_SIZE=0 for the gloo group it makes (process_group.py)")
    if rank >= 0 and world_size > 0:
        dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout, rank=rank,
                                world_size=world_size)
    elif launched() or init_method is not None:
        missing = [v for v in LAUNCHER_VARS if v not in os.environ]
        if missing and init_method is None:
            raise ZeroConfigError(f"init_distributed: {', '.join(missing)} not set (RANK and WORLD_SIZE are); launch "
                                  "with torchrun, which sets all of " + ", ".join(LAUNCHER_VARS))
        dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout)
    else:
        # No launcher: one process is the whole world (DeepSpeed would try MPI discovery here).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    atexit.register(_destroy)
    if verbose:
        logger.info("zero3: initialized torch.distributed (backend %s, rank %d of %d)", backend, dist.get_rank(),
                    dist.get_world_size())


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (torch's tensor parallelism, FSDP2)."""
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def group_of_mesh(group: Any, who: str) -> Any:
    """``group`` as a process group: a one-dimensional ``DeviceMesh`` stands for its group (FSDP2 users
    pass one: probe 38F got torch's "not registered, please create group with new_group"); a mesh of
    several dimensions is refused naming the one to take. Anything else is returned as it is."""
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(group, DeviceMesh):
        return group
    if group.ndim == 1:
        return group.get_group()
    names = group.mesh_dim_names or ()
    dp = [n for n in names if n.lower() in ("dp", "data", "data_parallel", "fsdp", "dp_shard", "dp_replicate")]
    # review 38R4: the first name was named, a pipeline dimension in a ("pp", "dp") mesh
    pick = f'mesh["{dp[0]}"]' if len(dp) == 1 else f"mesh[<the data-parallel dimension: one of {names}>]" if names \
        else "mesh[<the data-parallel dimension>]"
    raise ZeroConfigError(f"{who}(group=...) got a {group.ndim}-dimensional DeviceMesh {tuple(group.shape)}: zero3 "
                          f"shards over one process group; pass the data-parallel dimension's, {pick}.get_group()")


def ensure_default_group(who: str) -> None:
    """Before ``who`` (``zero3.Init``, ``zero3.initialize``) reads its group: with no process group
    and a launcher's ``WORLD_SIZE`` > 1, make the default group from the environment (one INFO line
    says so). A world of one (no launcher, or ``WORLD_SIZE`` 1) needs no group.

    Raises:
        ZeroConfigError: ``WORLD_SIZE`` > 1 but ``RANK``, ``MASTER_ADDR`` or ``MASTER_PORT`` is not
            set (each missing one is named).
    """
    if group_exists() or launched_world_size() <= 1:
        warn_if_flight_recorder_on(who)
        return
    missing = [v for v in LAUNCHER_VARS if v not in os.environ]
    if missing or not dist.is_available():
        raise ZeroConfigError(
            f"{who}: WORLD_SIZE={os.environ['WORLD_SIZE']} but no process group exists and "
            + (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set" if missing
               else "torch.distributed is not available")
            + ", so the default group cannot be made from the environment; launch with torchrun (which sets "
            + ", ".join(LAUNCHER_VARS) + ") or call torch.distributed.init_process_group first")
    init_distributed(verbose=False)
    logger.info("zero3: %s found no process group; initialized torch.distributed from the launcher's environment "
                "(backend %s, rank %d of %d)", who, dist.get_backend(), dist.get_rank(), dist.get_world_size())


def _destroy() -> None:
    """At exit, before the interpreter tears down what is left: collect the engines a script left in
    reference cycles (and their communication work) while the group still exists, then destroy the
    group this module made. Otherwise gloo may abort the process at exit ("terminate called")."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
