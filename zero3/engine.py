"""`zero3.initialize` and the `Engine`: the object that owns one partitioned model's runtime state."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm import Communicator
from .config import ZeroConfig, resolve_config
from .coordinator import ParamCoordinator
from .errors import ZeroConfigError, ZeroStateError
from .grad import GradientReducer, grad_target
from .hooks import ModuleHooks
from .init import group_info
from .metrics import StepMetrics
from .optim import PartitionedOptimizer, validate_optimizer
from .param import ZeroParameter, convert, free_full
from .precision import LossScaler, lower_precision, torch_dtype
from .state import ParamStatus

logger = logging.getLogger(__name__)


class Engine:
    """A partitioned model with its hooks, gradient reducer and sharded optimizer.

    Use ``loss = engine(x); engine.backward(loss); engine.step()``, or the plain loop
    ``loss = model(x); loss.backward(); engine.step()`` (the hooks live on the module; fp16 needs
    ``engine.backward``, which applies the loss scale). With ``gradient_accumulation_steps = N`` call
    ``engine.step()`` after every micro-batch; it steps the optimizer on every N-th call.
    """

    def __init__(self, model: nn.Module, optimizer: Any, config: ZeroConfig, group: Any) -> None:
        if model.__dict__.get("_zero3_engine") is not None:
            raise ZeroStateError("zero3.initialize was already called on this model; call engine.remove_hooks() "
                                 "first, or keep using the engine it returned")
        validate_optimizer(optimizer)  # before anything is changed: a rejected call leaves the model as it was
        self.config = config
        self.group, self.world_size, self.rank = group_info(group)
        self.module = model
        self.params = self._partition(model)
        # bf16/fp16: cast the shards now (before anything is gathered); their fp32 values seed the masters
        fp32_shards = lower_precision(self.params, torch_dtype(config.dtype)) if config.dtype != "fp32" else {}
        self.metrics = StepMetrics()
        self.last_step_metrics = StepMetrics()
        self.global_steps = 0  # optimizer steps attempted (accumulation boundaries), skipped ones included
        self.micro_steps = 0  # engine.step() calls
        self.comm = Communicator(self.group, world_size=self.world_size, rank=self.rank,
                                 overlap=config.overlap_comm, bucket_numel=config.allgather_bucket_size,
                                 reduce_impl=config.reduce_scatter_impl, metrics=self.metrics,
                                 verify=config.verify_collectives)
        self.coordinator = ParamCoordinator(config, self.comm, self.metrics, self.params)
        self.reducer = GradientReducer(self.comm, config.reduce_bucket_size,
                                       reduce_dtype=torch_dtype(config.reduce_dtype),
                                       accumulation_steps=config.gradient_accumulation_steps)
        for p in self.params:
            p._zero.extra["coordinator"] = self.coordinator
            p._zero.extra["engine"] = self
        self._mark_persistent()
        self.hooks = ModuleHooks(self)
        self.hooks.install(model)
        self.partitioned = (PartitionedOptimizer(optimizer, self.params, config, self.comm, fp32_shards)
                            if optimizer is not None else None)
        self.optimizer = self.partitioned.optimizer if self.partitioned is not None else None
        self.loss_scaler: LossScaler | None = self.partitioned.scaler if self.partitioned is not None else None
        model.__dict__["_zero3_engine"] = self

    # -- set-up ---------------------------------------------------------------------------------
    def _partition(self, model: nn.Module) -> list[ZeroParameter]:
        params: list[ZeroParameter] = []
        for name, p in model.named_parameters():
            if isinstance(p, ZeroParameter):
                self._check_group(name, p)
            else:
                convert(p, name=name, world_size=self.world_size, rank=self.rank, group=self.group)
            p._zero.name = name
            params.append(p)  # type: ignore[arg-type]
        return params

    def _check_group(self, name: str, p: ZeroParameter) -> None:
        z = p._zero
        same = z.world_size == self.world_size and z.rank == self.rank
        if same and z.group is not None and self.group is not None and z.group is not self.group:
            same = dist.get_process_group_ranks(z.group) == dist.get_process_group_ranks(self.group)
        if not same:
            raise ZeroConfigError(
                f"parameter {name!r} was partitioned over a group of world size {z.world_size} (rank {z.rank}) "
                f"under zero3.Init, but initialize got a group of world size {self.world_size} (rank "
                f"{self.rank}); pass the same group to zero3.Init and zero3.initialize")

    def _mark_persistent(self) -> None:
        """Small params stay gathered; greedy in ``named_parameters`` order under the model cap."""
        budget = self.config.model_persistence_threshold
        chosen = []
        for p in self.params:
            n = p._zero.numel
            if n <= self.config.param_persistence_threshold and n <= budget:
                budget -= n
                chosen.append(p)
        for p in chosen:
            p._zero.persistent = True
        self._persistent = chosen
        self._gather_persistent()

    def _gather_persistent(self) -> None:
        """Persistent params are gathered outside any step; their traffic is counted separately."""
        todo = [p for p in self._persistent if p._zero.status is ParamStatus.NOT_AVAILABLE]
        if todo:
            self.metrics.persistent_refresh_numel += sum(p._zero.numel for p in todo)
            self.comm.all_gather(todo, tag="persistent parameters", count=False).wait()

    # -- training API ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.module(*args, **kwargs)
        except BaseException:
            self.hooks.reset_stack()
            raise

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``; with fp16, of the loss times the current loss scale (in fp32)."""
        if self.partitioned is not None:
            loss = self.partitioned.scale_loss(loss)
        loss.backward(**kwargs)

    def step(self) -> bool:
        """End a micro-batch; at an accumulation boundary, step the optimizer on the shards.

        At the boundary (every call when ``gradient_accumulation_steps`` is 1): fp16 gradients are
        unscaled and checked for overflow on every rank, ``gradient_clipping`` is applied, the
        optimizer steps (on fp32 masters under mixed precision, copied back to the parameter
        shards), gradients are zeroed and persistent parameters re-gathered.

        Returns:
            True if the optimizer stepped; False between boundaries, without an optimizer, or when
            an fp16 overflow on some rank made every rank skip the step (``engine.skipped_steps``).
        """
        self.reducer.finish()
        self.hooks.forget_graph_tasks()
        if self.coordinator.in_step:
            self.coordinator.end_step()
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        stepped = False
        if boundary and self.partitioned is not None:
            stepped = self.partitioned.step()
        self.coordinator.release_all()
        if boundary:
            self._refresh_persistent()
            self.global_steps += 1
        self._finish_step()
        return stepped

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``engine.step()`` steps the optimizer (its micro-batch ends a window)."""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale ``engine.backward`` applies now (1.0 without fp16)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because of an fp16 overflow."""
        return self.partitioned.skipped_steps if self.partitioned is not None else 0

    def zero_grad(self) -> None:
        for p in self.params:
            p._zero.shard.grad = None
            grad_target(p).grad = None
        if self.partitioned is not None:
            self.partitioned.zero_grad()

    def _refresh_persistent(self) -> None:
        """Shards changed: persistent params must be re-gathered from them."""
        for p in self._persistent:
            if p._zero.status is ParamStatus.AVAILABLE:
                free_full(p)
        self._gather_persistent()

    def _finish_step(self) -> None:
        self.last_step_metrics = copy.copy(self.metrics)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("zero3::step %s", self.last_step_metrics.as_dict())
        self.metrics.reset(self.global_steps)

    def remove_hooks(self) -> None:
        """Take every hook off; parameters stay partitioned until gathered."""
        self.hooks.remove()
        self.coordinator.release_all()
        for p in self._persistent:
            p._zero.persistent = False
            if p._zero.status is ParamStatus.AVAILABLE and not p._zero.pinned:
                free_full(p)
        for p in self.params:
            p._zero.extra.pop("coordinator", None)
            p._zero.extra.pop("engine", None)
        self.module.__dict__.pop("_zero3_engine", None)

    # -- state of one parameter, for accessors and checkpoints ----------------------------------
    def master_shard(self, p: ZeroParameter) -> torch.Tensor:
        """The tensor the optimizer steps on for ``p`` (this rank's padded 1-D shard, full precision).

        Under bf16/fp16 or optimizer offload it is the fp32 master, a view into its group's flat
        buffer (zero3/optim.py [Note: flat master buffers]); a frozen parameter has none and gets its
        shard. After writing into it, call `refresh_from_masters`.
        """
        return p._zero.extra.get("master", p._zero.shard)

    def refresh_from_masters(self) -> None:
        """The master shards were written (checkpoint load, accessors): cast them into the parameter
        shards and re-gather the persistent parameters. A collective when persistent params exist."""
        if self.partitioned is not None:
            self.partitioned.copy_masters_to_shards()
        self._refresh_persistent()

    def optimizer_state(self, p: ZeroParameter) -> dict[str, torch.Tensor]:
        """This rank's optimizer state for ``p`` (e.g. ``exp_avg``), keyed as torch.optim keys it."""
        if self.optimizer is None:
            return {}
        return self.optimizer.state.get(self.master_shard(p), {})

    # -- checkpoints (zero3/checkpoint.py, zero3/consolidate.py) ------------------------------------
    def save_checkpoint(self, save_dir: Any, tag: str | None = None, client_state: Any = None,
                        **kwargs: Any) -> str:
        """Write a sharded checkpoint (a collective); see `zero3.checkpoint.save_checkpoint`."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, save_dir, tag, client_state, **kwargs)

    def load_checkpoint(self, load_dir: Any, tag: str | None = None, **kwargs: Any) -> tuple[str, Any]:
        """Load a checkpoint saved at any world size (a collective); returns ``(path, client_state)``.

        See `zero3.checkpoint.load_checkpoint`.
        """
        from .checkpoint import load_checkpoint

        return load_checkpoint(self, load_dir, tag, **kwargs)

    def consolidated_state_dict(self, rank0_only: bool = True, **kwargs: Any) -> dict[str, torch.Tensor]:
        """The full fp32 state dict, module by module (a collective); see `zero3.consolidate`."""
        from .consolidate import consolidated_state_dict

        return consolidated_state_dict(self, rank0_only, **kwargs)

    # -- introspection --------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds, against the full (unpartitioned) model's.

        ``param_shard_bytes``: parameter shards in their dtype (flat buffers with their alignment gaps
        under mixed precision); ``grad_shard_bytes``: gradient shards (fp32 under mixed precision);
        ``optimizer_state_bytes``: the optimizer's per-element state plus the fp32 master shards when
        they are separate from the parameter shards (the ZeRO paper's K bytes per parameter);
        ``gathered_param_bytes``: full tensors gathered now (persistent ones included);
        ``persistent_param_bytes``: full tensors kept gathered for the whole run (not budgeted).
        """
        if self.partitioned is not None:
            shard = self.partitioned.shard_bytes()
        else:
            shard = sum(p._zero.shard.numel() * p._zero.shard.element_size() for p in self.params)
        grad = sum(g.numel() * g.element_size() for p in self.params if (g := grad_target(p).grad) is not None)
        optim = self.partitioned.master_bytes() if self.partitioned is not None else 0
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        optim += v.numel() * v.element_size()
        full = sum(p._zero.numel * p.data.element_size() for p in self.params)
        gathered = sum(p._zero.numel * p.data.element_size() for p in self.params
                       if p._zero.status is not ParamStatus.NOT_AVAILABLE)
        persistent = sum(p._zero.numel * p.data.element_size() for p in self._persistent)
        return {"param_shard_bytes": shard, "grad_shard_bytes": grad, "optimizer_state_bytes": optim,
                "full_param_bytes": full, "gathered_param_bytes": gathered,
                "persistent_param_bytes": persistent}

    # -- explain and export (the coordinator's trace and schedule) -------------------------------
    def explain(self, target: Any = None) -> list[str]:
        """Why each parameter was gathered, prefetched, kept or released in the last planned step.

        ``target`` is a parameter, a module, a parameter or module name, or None (everything).
        Steps that fell back to on-demand fetching (no trace yet, or a divergence) say so.
        """
        return self.coordinator.explain(self._resolve_target(target))

    def export_trace(self, path: str) -> None:
        """Write the last step's trace: ``.json`` (replayable by ``python -m zero3.plan``), ``.graphml``
        or ``.dot`` (the module graph)."""
        self.coordinator.export_trace(path)

    def _resolve_target(self, target: Any) -> tuple[str, Any]:
        if target is None:
            return ("all", None)
        if isinstance(target, ZeroParameter):
            return ("param", target._zero.id)
        if isinstance(target, nn.Module):
            for name, m in self.module.named_modules():
                if m is target:
                    return ("module", name)
            raise ZeroConfigError("explain(): that module is not part of this engine's model")
        if isinstance(target, str):
            for p in self.params:
                if p._zero.name == target:
                    return ("param", p._zero.id)
            if target in dict(self.module.named_modules()):
                return ("module", target)
            raise ZeroConfigError(f"explain(): no parameter or module named {target!r}")
        raise ZeroConfigError(f"explain() takes a parameter, module, name or None, got {type(target).__name__}")


def initialize(model: nn.Module, optimizer: Any = None, config: Any = None, group: Any = None) -> Engine:
    """Partition ``model`` (if it was not built under `zero3.Init`), hook it, shard ``optimizer``.

    Args:
        model: the model; its parameters are partitioned in place.
        optimizer: a ``torch.optim.Optimizer`` over ``model.parameters()``, a callable taking param
            groups and returning one, or None (inference).
        config: `ZeroConfig`, dict (ours or DeepSpeed's), JSON path or None.
        group: process group (default: world).

    Raises:
        ZeroStateError: the model was already initialised.
        ZeroConfigError: invalid config, or the model was built under Init with another group.
    """
    return Engine(model, optimizer, resolve_config(config), group)
