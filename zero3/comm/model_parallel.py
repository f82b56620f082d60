"""Model parallelism beside ZeRO-3: what zero3 reads from a Megatron-style model-parallel unit (``mpu``).

zero3 partitions parameters over the data-parallel group only. A tensor-parallel layer's parameter
is already this rank's slice of the full weight (Megatron builds it so), and zero3 splits that slice
further over the data-parallel ranks that hold the same slice. Three things need the model-parallel
group as well:

- gradient-norm clipping (optim/grad_norm.py): a tensor-parallel parameter (attribute
  ``tensor_model_parallel`` or ``model_parallel`` set, as Megatron marks them) is a different slice
  on every model-parallel rank, so its squares are summed over that group too; a replicated one
  (LayerNorm, a row-parallel layer's bias) holds the same values on every model-parallel rank and is
  counted once, on model-parallel rank 0 (Megatron's rule);
- checkpoints (zero3/checkpoint/): one set of files per model-parallel rank;
- sequence parallelism (runtime/grad.py `sum_over_model_parallel`): a replicated parameter marked
  ``sequence_parallel`` gets part of its gradient on each model-parallel rank, summed over that group;
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
    def from_mpu(cls, mpu: Any, config: ZeroConfig, dp_group: Any, metrics: StepMetrics) -> ModelParallel | None:
        """The engine's view of ``mpu``'s model-parallel group; None when it names none or it has one
        rank (nothing differs from plain data parallelism then). Its communicator runs on a process group of its
        own with ``collective_timeout`` and verifies as ``verify_collectives`` says, like the
        data-parallel one; it counts into ``metrics`` (the step's). The unit is checked on every rank
        together first (`check_mpu`)."""
        group, world, rank = check_mpu(mpu, dp_group)
        if world == 1:
            return None
        comm = Communicator(group, CommSettings.model_parallel(config), metrics=metrics, world_size=world, rank=rank)
        logger.info("zero3: model-parallel rank %d of %d beside ZeRO-3 data parallelism", rank, world)
        return cls(group=group, world_size=world, rank=rank, comm=comm)


def check_mpu(mpu: Any, dp_group: Any) -> tuple[Any, int, int]:
    """``mpu``'s (model-parallel group, world size, rank) after checking the whole layout on every
    rank at once (one exchange over all ranks, so every rank raises alike and none waits in a later
    collective): each rank's unit is well formed (`model_parallel_group`); its data-parallel and
    model-parallel groups share only it; the data-parallel groups, and the model-parallel groups,
    split the ranks into disjoint groups that tile them; every rank of a data-parallel group holds the
    same model-parallel slice; ``get_data_parallel_world_size()`` is its group's size. Seen from one
    rank, data-parallel groups {0, 3} and {1, 2} beside tensor-parallel {0, 1} and {2, 3} passed, and
    training averaged gradients of different slices."""
    found, problem = (None, 1, 0), None
    try:
        found = model_parallel_group(mpu) or (None, 1, 0)
        if dp_group is not None and dist.is_available() and dist.is_initialized():  # first: another group given
            problem = _given_group_problem(mpu, dp_group, sorted(dist.get_process_group_ranks(dp_group)))
        if found[1] > 1 and problem is None:  # (review 35R2: the mpu was blamed for a group it did not give)
            check_orthogonal(dp_group, found[0])
    except ZeroConfigError as exc:
        problem = str(exc)
    if not (dist.is_available() and dist.is_initialized()):
        if problem is not None:
            raise ZeroConfigError(problem)
        return found
    me = dist.get_rank()
    dp = sorted(dist.get_process_group_ranks(dp_group if dp_group is not None else dist.group.WORLD))
    mp = sorted(dist.get_process_group_ranks(found[0])) if found[1] > 1 and problem is None else [me]
    size = getattr(mpu, "get_data_parallel_world_size", None)
    if problem is None and callable(size) and size() != len(dp):
        problem = f"mpu.get_data_parallel_world_size() = {size()!r}, but its data-parallel group has {len(dp)} ranks"
    world = dist.get_world_size()
    comm = Communicator(dist.group.WORLD, CommSettings(overlap=False, verify=True, plans=1), metrics=StepMetrics(),
                        world_size=world, rank=me, nodes=(0,) * world)
    seen = comm.exchange_objects((dp, mp, found[2], problem), Tag(Kind.OBJECTS, "model-parallel layout"))
    failed = "; ".join(f"rank {r}: {p}" for r, (_, _, _, p) in enumerate(seen) if p is not None)
    problem = failed or _layout_problem([(set(d), set(m), k) for d, m, k, _ in seen], world)
    if problem:
        raise ZeroConfigError(f"the model-parallel layout (mpu= and the data-parallel group) is wrong: {problem} (every rank stops here)")
    return found


def _layout_problem(seen: list[tuple[set[int], set[int], int]], world: int) -> str | None:
    """What is wrong with every rank's (data-parallel ranks, model-parallel ranks, model-parallel rank)."""
    for kind, groups in (("data-parallel", [d for d, _, _ in seen]), ("model-parallel", [m for _, m, _ in seen])):
        for r, g in enumerate(groups):
            if r not in g or any(groups[q] != g for q in g):
                return f"rank {r}'s {kind} group {sorted(g)} is not the same group on each of its ranks"
        if sum(len(g) for g in {frozenset(g) for g in groups}) != world:
            return f"the {kind} groups do not cover the {world} ranks once each"
    for r, (d, m, _) in enumerate(seen):
        if len(d) * len(m) != world:
            return (f"rank {r}'s data-parallel group has {len(d)} ranks and its model-parallel group {len(m)}, which "
                    f"do not tile the {world} ranks (pipeline or context parallelism is not supported)")
        slices = sorted({seen[q][2] for q in d})
        if len(slices) > 1:
            return (f"the data-parallel group {sorted(d)} holds model-parallel ranks {slices}; every rank of a "
                    "data-parallel group must hold the same model-parallel slice")
    return None


def _given_group_problem(mpu: Any, dp_group: Any, dp: list[int]) -> str | None:
    """A data-parallel group given beside ``mpu`` that is not the mpu's own (probe 35B2: the refusal then
    named neither, and read as if the mpu's group were wrong)."""
    get = getattr(mpu, "get_data_parallel_group", None)
    try:
        own = get() if callable(get) else dp_group
        ranks = dp if own is dp_group else sorted(dist.get_process_group_ranks(own))
    except Exception as exc:  # noqa: BLE001 - every rank raises it after the exchange
        return f"mpu.get_data_parallel_group() raised {exc!r}"
    if ranks == dp:
        return None
    return (f"the data-parallel group given (ranks {dp}: Init's data_parallel_group= or group=, initialize's group=) "
            f"is not the mpu's get_data_parallel_group() (ranks {ranks}); give the mpu alone")


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


def is_tensor_parallel(p: torch.Tensor) -> bool:
    """Whether ``p`` is a slice that differs across model-parallel ranks (Megatron's attributes)."""
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))
