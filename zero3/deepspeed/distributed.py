"""``deepspeed.init_distributed``: the default process group, from the launcher's environment.

torchrun (and DeepSpeed's launcher) set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``;
from those the group is made with the backend the machine has (nccl with CUDA, else gloo). A plain
``python script.py`` (none of them set) gets a world of one process, so a DeepSpeed script runs
unchanged on one machine without a launcher.
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
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def launched() -> bool:
    """Whether a launcher set this process's place in a world (``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta = DEFAULT_TIMEOUT, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Create the default process group unless one exists (then a no-op), DeepSpeed's signature.

    ``dist_backend``: default nccl when CUDA is available, else gloo. ``rank``/``world_size`` (with
    ``init_method``) override the environment. Without a launcher the world is this one process
    (where DeepSpeed tries MPI discovery; ``auto_mpi_discovery`` is accepted and unused). With nccl,
    the CUDA device becomes ``LOCAL_RANK``'s. ``dist_init_required=False``: a group must exist already.

    Raises:
        ZeroConfigError: ``RANK`` and ``WORLD_SIZE`` are set but not ``MASTER_ADDR``/``MASTER_PORT``;
            or ``dist_init_required=False`` and no group exists.
    """
    del auto_mpi_discovery, config, distributed_port  # DeepSpeed's: the config plays no part here; torchrun gives the port
    if dist.is_initialized():
        if verbose:
            logger.info("zero3: torch.distributed already initialized (backend %s, rank %d of %d)",
                        dist.get_backend(), dist.get_rank(), dist.get_world_size())
        return
    if dist_init_required is False:
        raise ZeroConfigError("init_distributed(dist_init_required=False) but no process group exists; "
                              "initialize torch.distributed first or leave dist_init_required unset")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
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


def _destroy() -> None:
    """At exit, before the interpreter tears down what is left: collect the engines a script left in
    reference cycles (and their communication work) while the group still exists, then destroy the
    group this module made. Otherwise gloo may abort the process at exit ("terminate called")."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
