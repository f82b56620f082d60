"""Model parallelism beside ZeRO-3: what zero3 reads from a Megatron-style model-parallel unit (``mpu``).

zero3 partitions parameters over the data-parallel group only. A tensor-parallel layer's parameter
is already this rank's slice of the full weight (Megatron builds it so), and zero3 splits that slice
further over the data-parallel ranks that hold the same slice. Three things need the model-parallel
group as well:

- gradient-norm clipping (optim.clip_shards): a tensor-parallel parameter (attribute
  ``tensor_model_parallel`` or ``model_parallel`` set, as Megatron marks them) is a different slice
  on every model-parallel rank, so its squares are summed over that group too; a replicated one
  (LayerNorm, a row-parallel layer's bias) holds the same values on every model-parallel rank and is
  counted once, on model-parallel rank 0 (Megatron's rule);
- checkpoints (zero3/checkpoint/): one set of files per model-parallel rank;
- activation checkpointing (activation/checkpointing.py): partitioned activations are gathered over it.

Megatron's unit has grown two sets of names over time; both work: ``get_tensor_model_parallel_group``
/ ``_rank`` / ``_world_size`` (preferred when present, as DeepSpeed does) or ``get_model_parallel_group``
/ ``_rank`` / ``_world_size``. Pipeline parallelism is not supported and is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .communicator import Communicator, Kind, Tag
from .settings import CommSettings
from ..config import ZeroConfig
from ..errors import ZeroConfigError
from ..metrics import StepMetrics

logger = logging.getLogger(__name__)

_NAMES = (("get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
           "get_tensor_model_parallel_world_size"),
          ("get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size"))


@dataclass(eq=False)
class ModelParallel:
    """This rank's model-parallel group as zero3 uses it; ``comm`` runs zero3's collectives over it."""

    group: Any
    world_size: int
    rank: int
    comm: Communicator

    @classmethod
    def from_mpu(cls, mpu: Any, config: ZeroConfig, dp_group: Any, metrics: StepMetrics,
                 dp_comm: Communicator | None = None) -> ModelParallel | None:
        """The engine's view of ``mpu``'s model-parallel group; None when it names none or it has one
        rank (nothing differs from plain data parallelism then). Its communicator runs on a process group of its
        own with ``collective_timeout`` and verifies as ``verify_collectives`` says, like the
        data-parallel one; it counts into ``metrics`` (the step's)."""
        found = model_parallel_group(mpu)
        if found is None or found[1] == 1:
            return None
        group, world, rank = found
        check_orthogonal(dp_group, group)
        if dp_comm is not None:
            check_layout(dp_comm, mpu, rank, world)
        comm = Communicator(group, CommSettings.model_parallel(config), metrics=metrics, world_size=world, rank=rank)
        logger.info("zero3: model-parallel rank %d of %d beside ZeRO-3 data parallelism", rank, world)
        return cls(group=group, world_size=world, rank=rank, comm=comm)


def data_parallel_group(mpu: Any) -> Any:
    """The data-parallel group of ``mpu`` (the group zero3 partitions over)."""
    get = getattr(mpu, "get_data_parallel_group", None)
    if get is None:
        raise ZeroConfigError(f"mpu {type(mpu).__name__} has no get_data_parallel_group(); pass a Megatron-style "
                              "model-parallel unit, or data_parallel_group=")
    return get()


def model_parallel_group(mpu: Any) -> tuple[Any, int, int] | None:
    """(group, world size, rank) of ``mpu``'s tensor/model-parallel group, checked against torch's
    view; None when the unit names no model-parallel group at all (data parallelism only).

    Raises:
        ZeroConfigError: the unit has only part of a set of names, asks for pipeline parallelism, or
            reports a rank or size that is not the group's.
    """
    names = next((n for n in _NAMES if all(callable(getattr(mpu, a, None)) for a in n)), None)
    if names is None:
        partial = [a for n in _NAMES for a in n if callable(getattr(mpu, a, None))]
        if not partial:
            return None
        raise ZeroConfigError(
            f"mpu {type(mpu).__name__} has {', '.join(partial)} but not a whole set: zero3 needs "
            "get_tensor_model_parallel_group/_rank/_world_size or get_model_parallel_group/_rank/_world_size")
    pipeline = getattr(mpu, "get_pipeline_model_parallel_world_size", None)
    if callable(pipeline) and pipeline() > 1:
        raise ZeroConfigError(f"mpu reports pipeline-model-parallel world size {pipeline()}; zero3 supports "
                              "tensor (model) parallelism beside ZeRO-3, not pipeline parallelism")
    group, rank, world = (getattr(mpu, a)() for a in names)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1 or not isinstance(rank, int) \
            or not 0 <= rank < world:
        raise ZeroConfigError(f"mpu.{names[1]}() = {rank!r} and mpu.{names[2]}() = {world!r} are not a rank "
                              "and a world size")
    if world > 1 and dist.is_available() and dist.is_initialized():
        g = group if group is not None else dist.group.WORLD
        seen = (dist.get_rank(g), dist.get_world_size(g))
        if seen != (rank, world):
            raise ZeroConfigError(f"mpu.{names[0]}() is a group where this process is rank {seen[0]} of {seen[1]}, "
                                  f"but mpu.{names[1]}() / {names[2]}() say {rank} of {world}")
    return group, world, rank


def check_orthogonal(dp_group: Any, mp_group: Any) -> None:
    """A rank's data-parallel and model-parallel groups share only that rank (else the unit is wrong)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    dp = set(dist.get_process_group_ranks(dp_group if dp_group is not None else dist.group.WORLD))
    mp = set(dist.get_process_group_ranks(mp_group if mp_group is not None else dist.group.WORLD))
    if dp & mp != {dist.get_rank()}:
        raise ZeroConfigError(f"the data-parallel group (ranks {sorted(dp)}) and the model-parallel group (ranks "
                              f"{sorted(mp)}) of rank {dist.get_rank()} must share exactly that rank; check the "
                              "mpu's groups")


def check_layout(dp_comm: Communicator, mpu: Any, mp_rank: int, mp_world: int) -> None:
    """Every rank of this rank's data-parallel group holds the same model-parallel slice (the same
    model-parallel rank), and the two kinds of groups tile the world (pipeline parallelism is refused).
    `check_orthogonal` sees only this rank: data-parallel groups that pair tensor-parallel rank 0 of one
    group with rank 1 of another passed it, and zero3 then averaged gradients of different slices and
    gave ranks another rank's slice. Decided on what every rank of the group sent (one exchange), so
    all of them raise alike."""
    problem = None
    if dist.is_available() and dist.is_initialized() and dp_comm.world_size * mp_world != dist.get_world_size():
        problem = (f"its data-parallel group has {dp_comm.world_size} ranks and its model-parallel group {mp_world}, "
                   f"which do not tile the {dist.get_world_size()} ranks")
    size = getattr(mpu, "get_data_parallel_world_size", None)
    if problem is None and callable(size) and size() != dp_comm.world_size:
        problem = f"mpu.get_data_parallel_world_size() = {size()!r}, but its data-parallel group has {dp_comm.world_size} ranks"
    seen = dp_comm.exchange_objects((mp_rank, mp_world, problem), Tag(Kind.OBJECTS, "model-parallel layout"))
    problem = next((p for _, _, p in seen if p is not None), None)
    if problem is None and len({(r, w) for r, w, _ in seen}) > 1:
        problem = ("its data-parallel group holds model-parallel ranks " + ", ".join(str(r) for r, _, _ in seen)
                   + "; every rank of a data-parallel group must hold the same model-parallel slice")
    if problem is not None:
        raise ZeroConfigError(f"the model-parallel unit's groups are wrong: {problem}; the model is as it was")


def is_tensor_parallel(p: torch.Tensor) -> bool:
    """Whether ``p`` is a slice that differs across model-parallel ranks (Megatron's attributes)."""
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))
