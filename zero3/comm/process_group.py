"""The default process group, from the launcher's environment: `init_distributed` (public as
``zero3.init_distributed`` and, with DeepSpeed's signature, ``deepspeed.init_distributed``) and
`ensure_default_group`, which ``zero3.Init`` and ``zero3.initialize`` call.

torchrun (and DeepSpeed's launcher) set ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``LOCAL_RANK``; from those the group is made with the backend the machine has (nccl with CUDA, else
gloo). A script launched so that never calls ``init_process_group`` would otherwise run a world of one
process on every rank, each training the whole model alone, so `Init` and `initialize` set the group up
themselves when ``WORLD_SIZE`` > 1, and refuse when they cannot.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os

import torch
import torch.distributed as dist

from ..errors import ZeroConfigError

logger = logging.getLogger(__name__)

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
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


def ensure_default_group(who: str) -> None:
    """Before ``who`` (``zero3.Init``, ``zero3.initialize``) reads its group: with no process group
    and a launcher's ``WORLD_SIZE`` > 1, make the default group from the environment (one INFO line
    says so). A world of one (no launcher, or ``WORLD_SIZE`` 1) needs no group.

    Raises:
        ZeroConfigError: ``WORLD_SIZE`` > 1 but ``RANK``, ``MASTER_ADDR`` or ``MASTER_PORT`` is not
            set (each missing one is named).
    """
    if (dist.is_available() and dist.is_initialized()) or launched_world_size() <= 1:
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
