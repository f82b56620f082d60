"""``deepspeed.init_distributed``: DeepSpeed's signature over `zero3.init_distributed`
(comm/process_group.py), which makes the default process group from the launcher's environment."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from ..comm.process_group import DEFAULT_TIMEOUT, launched
from ..comm.process_group import init_distributed as _init_distributed
from ..errors import ZeroConfigError

__all__ = ["init_distributed", "launched"]


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
    if dist_init_required is False and not dist.is_initialized():
        raise ZeroConfigError("init_distributed(dist_init_required=False) but no process group exists; "
                              "initialize torch.distributed first or leave dist_init_required unset")
    _init_distributed(dist_backend, timeout, init_method, rank, world_size, verbose)
