"""`RuntimeContext`: the runtime state of one partitioned model, made once and handed out explicitly.

Hooks, the optimizer side, checkpoints, accessors, pretrained loading and ``GatheredParameters``
receive the context (or find it on a parameter's record, ``ZeroParam.ctx``); nothing reaches into
the `Engine` (engine.py, the public class over the context; no layer may import it). ``zero3.Init`` makes a minimal context (group,
communicator, coordinator) for the parameters it partitions while a model is built;
``zero3.initialize`` makes the full one and adopts every parameter of the model.

    RuntimeContext
      config         ZeroConfig
      group, rank, world_size
      comm           Communicator      every collective
      node_comm      Communicator | None   hpZ: collectives inside this rank's secondary group (a node)
      metrics        StepMetrics       counters of the current step
      coordinator    ParamCoordinator  gathers and releases (after partitioning, with its PersistentParams,
                                       the one caller of the status primitives of partition/param.py)
      store          ShardStore        the one writer of shards and their residence (offload/residence.py)
      reducer        GradientReducer   full gradients -> averaged gradient shards (engine only)
      optimizer      PartitionedOptimizer | None   the user's optimizer over shards (engine only)
      model_parallel ModelParallel | None   the tensor-parallel group beside ZeRO-3 (engine with an mpu)
      io             AsyncIO | None    the threads of the swap files (NVMe offload only)
      late_read      callable | None   the hooks' gather of a parameter read late in a backward (hooks.py)
      external_added callable | None   the hooks' answer to register_external_parameter after install
      lr_scheduler, offloaded (engine.offload_states), module, params, global_steps, micro_steps,
      window_micro, window_backwards, boundary_override, grads_set
"""

from __future__ import annotations

import contextlib
import functools
import contextvars
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..comm.communicator import Communicator, Kind, Tag, group_alive, group_info, group_ranks, same_group
from ..comm.settings import CommSettings
from ..comm.hpz import secondary_communicator
from ..config import ZeroConfig
from .coordinator import ParamCoordinator, plan_config
from ..errors import ZeroConfigError, ZeroStateError
from .grad import GradientReducer
from ..metrics import StepMetrics
from ..comm.model_parallel import ModelParallel, is_tensor_parallel
from ..optim.optimizer import PartitionedOptimizer, resident_bytes, validate_optimizer
from ..partition import conversion
from ..partition.ids import next_id, skip_to
from ..partition.param import _TENSOR_GRAD, ZeroParameter, drop_grad_slot, guard_pending_grads, partition, raw_data
from ..optim.precision import lower_buffers, lower_precision, torch_dtype
from ..partition.state import ParamStatus
from ..optim.routed_step import own_scheduler
from ..optim.schedulers import build_optimizer, build_scheduler
from ..offload.states import OffloadPhase, StatesOffload
from ..offload.nvme import ShardTier
from ..offload.pool import BufferPool
from ..offload.swapfile import AsyncIO, SwapFile
from ..offload.policy import PlacementPolicy
from ..offload.residence import ShardStore
from ..comm.topology import hpz_group_size
from .adopt import take_from_rank0
from .buffers import ModuleBuffers
from .engine_calls import take_persistent_writes
from .publish import write_updated
from .refusals import (refuse_dtensors, refuse_memory_format, refuse_shared_storage, refuse_unshardable_embeddings,
                       unshardable, unshardable_refusal)
from .leaf import check_leaf_classes, leaf_modules
from .thread_claim import ThreadClaim
from .budget import MemoryBudget
from .placement import place_shards, share_shards

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class RuntimeContext:
    """Everything one partitioned model's runtime shares; see the module docstring."""

    config: ZeroConfig
    group: Any
    world_size: int
    rank: int
    comm: Communicator
    metrics: StepMetrics
    coordinator: ParamCoordinator
    store: ShardStore  # the one writer of parameter shards; its `placement` says where all state lives
    module: nn.Module | None = None
    params: list[ZeroParameter] = field(default_factory=list)
    reducer: GradientReducer | None = None
    optimizer: PartitionedOptimizer | None = None
    model_parallel: ModelParallel | None = None  # an mpu's model-parallel group of > 1 ranks (comm/model_parallel.py)
    node_comm: Communicator | None = None  # hpZ: this rank's secondary group (runtime/hpz.py [Note: hpZ secondary shards])
    lr_scheduler: Any = None  # stepped by engine.step() after every optimizer step that was not skipped
    lr_scheduler_step: Any = None  # its step, which engine.step() calls (its own refuses: routed_step.own_scheduler)
    global_steps: int = 0  # optimizer steps attempted (accumulation boundaries), skipped ones included
    micro_steps: int = 0  # engine.step() calls
    global_samples: int = 0  # samples over the data-parallel ranks at the boundaries so far (DeepSpeed's count)
    step_applied: bool = False  # the last engine.step() stepped the optimizer (engine.was_step_applied())
    window_micro: int = 0  # engine.step() calls since the last boundary: the open window's micro-batches
    window_backwards: int = 0  # backwards ended since the last boundary (or since their gradients were dropped)
    boundary_override: bool | None = None  # engine.set_gradient_accumulation_boundary; None: every n-th
    grads_set: bool = False  # safe_set_full_grad / safe_set_local_grad set a gradient since the last engine.step()
    step_open: bool = False  # a forward or backward of this engine's step runs (step.py `StepLifecycle.open`, mirrored)
    guarded_grads: dict[int, ZeroParameter] = field(default_factory=dict)  # PendingGradParameters, back as a step begins
    io: AsyncIO | None = None  # the threads of every swap file of this context (made with the first)
    offloaded: StatesOffload | None = None  # engine.offload_states (made on its first call)
    # The hooks' gather of a parameter read in a backward after its module's backward closed
    # (late_read.py [Note: a parameter read after its module's backward]); None without hooks.
    late_read: Callable[[Any, Any, tuple, dict], tuple[bool, Any]] | None = None
    # The hooks' `external_added` (a registration after install), weakly; None without hooks.
    external_added: Callable[[Any], None] | None = None
    _io_mark: tuple[int, int] = (0, 0)  # io's (read, written) bytes when the last step's were counted
    claim: ThreadClaim = field(default_factory=ThreadClaim)  # the thread running a call of the engine (thread_claim.py)
    ranks: tuple[int, ...] = ()  # the group's default-group ranks, taken when made (a destroyed group has none)

    @classmethod
    def minimal(cls, config: ZeroConfig, group: Any, comm: Communicator | None = None,
                own_group: bool = False) -> RuntimeContext:
        """A context without model, reducer or optimizer: what ``zero3.Init`` needs while building.
        ``own_group``: collectives run on a process group of their own with ``collective_timeout``
        (the engine's context; Init uses the caller's group)."""
        group, world, rank = group_info(group)
        metrics = StepMetrics()
        if comm is None:
            comm = Communicator(group, CommSettings.from_config(config, own_group), metrics=metrics, world_size=world,
                                rank=rank)
        io = shards = None
        placement = PlacementPolicy.from_config(config)
        store = ShardStore(placement)
        if placement.params_on_drive:
            io = AsyncIO(placement.aio_threads)
            pool = BufferPool(placement.param_buffer_count,
                              placement.param_buffer_size * torch_dtype(config.precision.dtype).itemsize,
                              pin=placement.param_pin_memory)
            shards = ShardTier(io, SwapFile(placement.param_nvme_path, f"params-rank{rank}"), pool,
                               comm.metrics, store)
        return cls(config=config, group=group, world_size=world, rank=rank, comm=comm, metrics=comm.metrics,
                   coordinator=ParamCoordinator(config, comm, comm.metrics, shards=shards), store=store, io=io,
                   ranks=tuple(group_ranks(group)))

    def count_swap_io(self) -> None:
        """Put the swap-file bytes read and written since the last call into the step's metrics."""
        if self.io is not None:
            read, written = self.io.read_bytes, self.io.write_bytes
            self.metrics.nvme_read_bytes = read - self._io_mark[0]
            self.metrics.nvme_write_bytes = written - self._io_mark[1]
            self._io_mark = (read, written)

    def swap_io(self) -> AsyncIO:
        """The threads that read and write this context's swap files (made on first use)."""
        if self.io is None:
            self.io = AsyncIO(self.store.placement.aio_threads)
        return self.io

    def partition(self, p: nn.Parameter, name: str, *, shard_device: torch.device | None = None,
                  dtype: torch.dtype | None = None) -> ZeroParameter:
        """Partition a plain parameter over this context's group; this context drives it."""
        conversion.install()  # model.to(...) and the like never convert a zero3 parameter
        zp = partition(p, name=name, world_size=self.world_size, rank=self.rank, group=self.group, ctx=self,
                       shard_device=shard_device, dtype=dtype)
        self.coordinator.register([zp])
        return zp

    @property
    def data_comms(self) -> list[Communicator]:
        """The communicators of the data-parallel ranks (the group's, and hpZ's node group's): an epoch
        ends, or is abandoned, on all of them together."""
        return [self.comm] if self.node_comm is None else [self.comm, self.node_comm]

    # -- what the optimizer side and checkpoints ask for -----------------------------------------
    def require_states(self, what: str, kinds: Sequence[str] | None = None) -> None:
        """Raise a clear error when ``engine.offload_states`` moved states of ``kinds`` (default: all)
        that ``what`` needs (a non-blocking reload is waited for instead). Called when a step begins
        and at the entry points that read the states, never per module. Also refuses ``what`` once the
        engine's process group was destroyed (torch's collectives then raise a bare error)."""
        if self.offloaded is not None and self.offloaded.phase is not OffloadPhase.RESIDENT:
            self.offloaded.check(what, kinds)
        if self.world_size > 1 and not group_alive(self.group):
            raise ZeroStateError(
                f"{what}: this engine's process group (world size {self.world_size}) was destroyed "
                "(torch.distributed.destroy_process_group()), so nothing can gather its parameters or reduce its "
                "gradients. Checkpoints saved before still load: after init_process_group again, call "
                "engine.remove_hooks() and zero3.initialize(model, ...) for a new engine over the same model")

    def samples_per_step(self) -> int:
        """What an optimizer step adds to ``global_samples``: DeepSpeed's ``train_batch_size``, or 0 when
        the config gives no micro-batch size."""
        tr = self.config.training
        return (tr.train_micro_batch_size_per_gpu or 0) * tr.gradient_accumulation_steps * self.world_size

    def forward_needs(self, grad: bool) -> tuple[str, ...] | None:
        """The state kinds a forward needs (None: all): its parameters; with grad, the gradient
        shards its backward adds into; and when that backward steps the optimizer (the step in
        backward, at a window's end), everything the step reads and writes."""
        if not grad:
            return ("lp_params",)
        opt = self.optimizer
        if opt is not None and opt.backward_step is not None and self.window_ends():
            return None
        return ("lp_params", "lp_grads")

    def require_between_steps(self, what: str) -> None:
        """Refuse ``what`` while an optimizer step taken in backward awaits ``engine.step()``."""
        if self.optimizer is not None and self.optimizer.backward_step is not None:
            self.optimizer.backward_step.check_between_steps(what)

    @contextlib.contextmanager
    def resident(self, params: Sequence[ZeroParameter], write: bool = False,
                 overwrite: bool = False) -> Iterator[None]:
        """Inside the block, ``params``' shards, masters and optimizer state are in memory even when
        their home is NVMe (read in, one parameter's worth at a time when called per parameter);
        with ``write`` what the block changed goes back after it; with ``overwrite`` the block
        replaces the whole shards, which are therefore not read. Outside a module's forward or
        backward computation (checkpoints, accessors, ``GatheredParameters(modifier_rank=...)`` also
        inside a step, and ``Init``'s writes while a model is built)."""
        ps = list(params)
        tier = self.coordinator.shards
        if tier is not None:
            tier.load(ps, read=not overwrite)
        try:
            with self.optimizer.loaded(ps, write) if self.optimizer is not None else contextlib.nullcontext():
                yield
        finally:
            if tier is not None:
                tier.unload(ps, write)

    def write_updated(self, params: Sequence[ZeroParameter], what: str) -> None:
        """Every rank changed the gathered full data of ``params`` alike (``what`` names the call, e.g.
        DeepSpeed's ``param.partition(has_been_updated=True)``): the shards and masters take it, a new
        shape is partitioned anew before ``initialize`` and refused after it (publish.py)."""
        write_updated(self, list(params), what)

    @property
    def attached(self) -> bool:
        """Whether this context still manages its model (``initialize`` put it there and no
        ``remove_hooks`` took it off)."""
        return self.module is not None and self.module.__dict__.get("_zero3_context") is self

    def window_ends(self) -> bool:
        """The running micro-batch ends an accumulation window: the next ``engine.step()`` steps. The
        user's `set_gradient_accumulation_boundary` decides while set (DeepSpeed's override)."""
        if self.boundary_override is not None:
            return self.boundary_override
        return (self.micro_steps + 1) % self.config.training.gradient_accumulation_steps == 0

    def step_ends_window(self, warn: bool = True) -> bool:
        """Whether ``engine.step()`` now ends the window: where it ends, or after a backward that
        stepped the optimizer inside it (the step in backward), whatever the override says since:
        that step stands, with a warning (the boundary was moved after the backward that used it)."""
        if self.window_ends():
            return True
        if self.optimizer is None or not self.optimizer.stepped_in_backward():
            return False
        if warn:
            logger.warning("zero3: engine.step(): the optimizer stepped inside the last backward (its window ended "
                           "when it ran) and the boundary says otherwise now: that step stands. With "
                           "offload_optimizer_step_in_backward, call set_gradient_accumulation_boundary before each "
                           "micro-batch's forward")
        return True

    def window_position(self) -> str:
        """The running micro-batch's place in its window, for messages."""
        k, n = self.window_micro + 1, self.config.training.gradient_accumulation_steps
        if self.boundary_override is None:
            return f"micro-batch {k} of {n} (gradient_accumulation_steps)"
        return (f"micro-batch {k} of a window whose end engine.set_gradient_accumulation_boundary sets "
                f"(now {self.boundary_override})")

    def take_persistent_writes(self) -> None:
        """In-place writes to kept-gathered (persistent) parameters since their last gather go into
        their shards and masters (persistent.py `take_writes`): before the optimizer step, and before a
        save or a read of the shards or masters, which would miss them. Not after a backward that
        stepped the optimizer (the step in backward): the kept copies are older than the shards then,
        until the step's refresh."""
        opt = self.optimizer
        if opt is None or opt.backward_step is None or self.metrics.backward_seconds == 0.0:
            take_persistent_writes(self.coordinator.persistent_params, functools.partial(self.resident, write=True))

    def gather_for_user(self, params: list[ZeroParameter]) -> None:
        """Gather ``params`` for the user (``GatheredParameters``, DeepSpeed's ``param.all_gather()``), held
        until released; between steps the ``.grad`` of those it gathers is guarded as there (review 35R1,
        35R2: a gradient assigned to one was taken and ignored)."""
        fresh = [p for p in params if p._zero.status is ParamStatus.NOT_AVAILABLE]
        self.coordinator.gather_for_user(params)
        if self.attached and not self.coordinator.in_step:  # by id: each gather of a loop guards them again (35R3)
            self.guarded_grads.update(guard_pending_grads(fresh))

    def refresh_stale_persistent(self) -> None:
        """Before a forward or a user gather between steps: the persistent parameters a local setter
        left with other ranks' old slices in their gathered copies are gathered again (one collective,
        only when there are such; every rank has the same ones), after taking in-place writes to the
        copies, which the gather would drop (persistent.py `mark_stale`). Not inside a step, where
        running modules use the copies."""
        if self.coordinator.persistent_params.stale and not self.coordinator.in_step:
            self.take_persistent_writes()
            self.coordinator.persistent_params.refresh_stale()

    def finish_gradients(self) -> None:
        """Every gradient reduction issued so far has landed in the gradient shards."""
        if self.reducer is not None:
            self.reducer.finish()

    def check_gradient_read(self, p: ZeroParameter, what: str) -> None:
        """Raise if ``p`` has no gradient because the optimizer step in this backward used it."""
        if self.optimizer is not None and self.optimizer.backward_step is not None:
            self.optimizer.backward_step.check_gradient_read(p, what)

    def optimizer_state(self, p: ZeroParameter) -> dict[str, torch.Tensor]:
        """This rank's optimizer state for ``p`` (e.g. ``exp_avg``); {} without an optimizer."""
        return self.optimizer.state_of(p) if self.optimizer is not None else {}

    def refresh_from_masters(self) -> None:
        """The master shards were written (checkpoint load, accessors): cast them into the parameter
        shards and re-gather the persistent parameters. A collective when persistent params exist."""
        if self.optimizer is not None:
            self.optimizer.copy_masters_to_shards()
        self.coordinator.refresh_persistent()

    def grads_with_kind(self) -> list[tuple[torch.Tensor, bool]]:
        """Every gradient shard this rank holds, once each, with whether its parameter is
        tensor-parallel (`model_parallel.is_tensor_parallel`)."""
        if self.optimizer is not None:
            return self.optimizer.grads_with_kind()
        return [(g, is_tensor_parallel(p)) for p in self.params if (g := p._zero.train_tensor.grad) is not None]

    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds, against the full (unpartitioned) model's.

        The first five count bytes in memory (those on NVMe count 0). ``param_shard_bytes``:
        parameter shards in their dtype (flat buffers with their alignment gaps under mixed
        precision); ``grad_shard_bytes``: gradient shards (fp32 under mixed precision);
        ``optimizer_state_bytes``: the optimizer's per-element state plus the fp32 master shards when
        they are separate from the parameter shards (the ZeRO paper's K bytes per parameter), of
        which ``master_bytes`` are the masters; ``gathered_param_bytes``: full tensors gathered now
        (persistent ones included); ``persistent_param_bytes``: full tensors kept gathered for the
        whole run (not budgeted); ``offloaded_bytes``: model state whose home is an offload tier:
        host memory (``offload_optimizer``/``offload_param`` ``"cpu"``, also counted above, and
        ``offload_states(device="cpu")``) plus NVMe; ``nvme_bytes``: the NVMe part (shards,
        masters and optimizer state in swap files, and ``offload_states(device="nvme")``);
        ``nvme_file_bytes``: what this rank's swap files hold on the drive (allocated blocks: with the
        default staged step twice the optimizer's and shards' ``nvme_bytes``, docs/offload.md);
        ``swap_buffer_bytes``: the parameter buffer pool allocated now.
        ``secondary_param_bytes``: hpZ secondary slices held now (only inside a training step; the
        step's peak is ``last_step_metrics.peak_secondary_bytes``).
        """
        part = self.optimizer
        tier = self.coordinator.shards
        if part is not None:
            shard = part.shard_bytes()
        else:
            shard = sum(resident_bytes(p._zero.shard) for p in self.params)
        grad = sum(resident_bytes(g) for p in self.params if (g := p._zero.train_tensor.grad) is not None)
        masters = part.master_bytes() if part is not None else 0
        states = part.state_bytes() if part is not None else 0
        full = sum(p._zero.numel * p._zero.shard.element_size() for p in self.params)
        gathered = sum(resident_bytes(raw_data(p)) for p in self.params if p._zero.status is not ParamStatus.NOT_AVAILABLE)
        persistent = sum(p._zero.numel * p._zero.shard.element_size() for p in self.coordinator.persistent)
        secondary = sum(p._zero.secondary.nbytes for p in self.params if p._zero.secondary is not None)
        nvme = (tier.nvme_bytes if tier is not None else 0) + (part.nvme_bytes if part is not None else 0)
        cpu = masters + states if part is not None and self.store.placement.optimizer_device == "cpu" else 0
        if self.store.placement.params_on_host:
            cpu += shard
        files = [p._zero.swap.file for p in self.params if p._zero.swap is not None]  # Init's file, or the tier's
        files += [t.file for t in (tier, part.states if part is not None else None) if t is not None]
        if self.offloaded is not None:  # engine.offload_states
            nvme += self.offloaded.nvme_bytes
            cpu += self.offloaded.moved_bytes - self.offloaded.nvme_bytes
            files.append(self.offloaded.swap_file)
        drive = sum(f.allocated_bytes for f in {id(f): f for f in files if f is not None}.values())
        return {"param_shard_bytes": shard, "grad_shard_bytes": grad, "optimizer_state_bytes": masters + states,
                "master_bytes": masters, "full_param_bytes": full, "gathered_param_bytes": gathered,
                "persistent_param_bytes": persistent, "offloaded_bytes": cpu + nvme, "nvme_bytes": nvme,
                "nvme_file_bytes": drive,
                "swap_buffer_bytes": tier.pool.allocated_bytes if tier is not None else 0,
                "secondary_param_bytes": secondary}

    @property
    def grad_scale(self) -> float:
        """The factor the stored gradient shards carry (the fp16 loss scale until unscaled, else 1)."""
        return self.optimizer.grad_scale if self.optimizer is not None else 1.0


def build_context(model: nn.Module, optimizer: Any, config: ZeroConfig, group: Any,
                  comm: Communicator | None = None, model_parameters: Any = None,
                  lr_scheduler: Any = None, mpu: Any = None) -> RuntimeContext:
    """Partition ``model`` (adopting parameters built under Init; the others take rank 0's values
    first, adopt.py), and build the full runtime.

    Without an ``optimizer``, the config's ``optimizer`` section builds one over ``model_parameters``
    (default: all of the model's); ``lr_scheduler`` (a scheduler, or a callable taking the optimizer)
    or the config's ``scheduler`` section gives the learning-rate schedule. ``mpu``: a Megatron-style
    model-parallel unit whose model-parallel group clipping and checkpoints take into account
    (comm/model_parallel.py). Validates the arguments, the optimizer (its type, freshness and
    parameters), meta parameters and embeddings before it changes anything; what only the built
    shards tell (a param group of several dtypes, a parameter of another engine's group) is refused
    after the model was partitioned, its values kept in the shards. A scheduler factory is called over
    a torch optimizer given before anything changes (the shards replace only its groups' ``params``).
    """
    if model.__dict__.get("_zero3_context") is not None:
        raise ZeroStateError("zero3.initialize was already called on this model; call engine.remove_hooks() "
                             "first, or keep using the engine it returned")
    _refuse_managed_parts(model)
    if optimizer is not None and config.training.optimizer is not None:
        raise ZeroConfigError("zero3.initialize got an optimizer and a config with an 'optimizer' section; pass one")
    if lr_scheduler is not None and config.training.scheduler is not None:
        raise ZeroConfigError("zero3.initialize got lr_scheduler and a config with a 'scheduler' section; pass one")
    if lr_scheduler is not None and optimizer is None and config.training.optimizer is None:
        raise ZeroConfigError("zero3.initialize got an lr_scheduler but no optimizer (nor an 'optimizer' section)")
    _refuse_plateau(lr_scheduler)  # before anything is partitioned
    _check_scheduler(lr_scheduler, optimizer)
    if model_parameters is not None and callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(model_parameters)  # DeepSpeed's client optimizer callable: over full parameters
    if optimizer is None and config.training.optimizer is not None:
        optimizer = build_optimizer(config.training.optimizer, model_parameters if model_parameters is not None
                                    else model.parameters())
    validate_optimizer(optimizer, model.named_parameters(remove_duplicate=False),  # before anything changes:
                       config.training.zero_allow_untested_optimizer)  # the model is left as it was
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None and not meta_dry_run.get():
        raise meta_refusal(meta)
    lazy = next((n for n, p in model.named_parameters() if nn.parameter.is_lazy(p)), None)
    if lazy is not None:
        raise lazy_refusal(lazy)
    refuse_unshardable_embeddings(model)
    refuse_dtensors(model)
    refuse_shared_storage(model)
    refuse_memory_format(model)
    bad = next(((n, p) for n, p in model.named_parameters() if unshardable(p)), None)
    if bad is not None:
        raise unshardable_refusal(*bad, "zero3.initialize changed nothing")
    check_leaf_classes(model, config.training.leaf_modules)
    config = config.for_world_size(group_info(group)[1])  # DeepSpeed's batch-size rule needs the world size
    _check_nvme_shards(model, config, PlacementPolicy.from_config(config))
    _check_init_precision(model, config)
    _drop_stale_grads(model)
    ctx = RuntimeContext.minimal(config, group, comm, own_group=True)
    units = [[p for p in m.parameters() if p.requires_grad] for m in leaf_modules(model, config.training.leaf_modules)]
    config, budget = MemoryBudget.resolve(config, ctx.comm, list(model.named_parameters()), _device_of(model), units)
    if budget is not None:
        ctx.config = config
        ctx.coordinator.use_budget(config, budget)
    hpz = ctx.comm.hpz  # zero_hpz_partition_size resolved against the ranks' nodes: the same on every rank
    if comm is not None and hpz != hpz_group_size(config.comm.zero_hpz_partition_size, comm.nodes):
        raise ZeroConfigError(f"the communicator passed to zero3.initialize has hpZ groups of {hpz} ranks, but the "
                              f"config asks for zero_hpz_partition_size={config.comm.zero_hpz_partition_size}; build it "
                              "with CommSettings.from_config(config)")
    if hpz > 1:
        ctx.node_comm = secondary_communicator(ctx.comm)
        ctx.coordinator.enable_hpz(ctx.node_comm)
        logger.info("zero3: hpZ: secondary groups of %d ranks (%d nodes); this rank keeps 1/%d of each weight "
                    "gathered in forward until the step ends", hpz, len(set(ctx.comm.nodes)), hpz)
    if mpu is not None:
        ctx.model_parallel = ModelParallel.from_mpu(mpu, config, ctx.group, ctx.metrics)
    ctx.module = model
    for name, p in model.named_parameters():  # before anything is partitioned (probe 35F: refused half-way, the
        if isinstance(p, ZeroParameter):      # model's other parameters were partitioned, and no retry could work)
            _check_group(ctx, name, p)
    if isinstance(optimizer, torch.optim.Optimizer) and lr_scheduler is not None:
        # a factory, called once over the optimizer as given, after every check before partitioning, so that what it
        # makes is refused with the optimizer as given (probe 35B2: refused after, the optimizer was pointed at the
        # shards; review 35R2: called twice, a caching factory handed back the first; review 35R3: called before a
        # refusal, a warmup scheduler's initial step stayed in the groups' lr, and the retry's lr was off for good)
        lr_scheduler = _scheduler_from(lr_scheduler, optimizer)
    align_ids(ctx.comm)  # before partitioning: the same ids on every rank (partition/ids.py)
    take_from_rank0(ctx.comm, [(name, p) for name, p in model.named_parameters() if not isinstance(p, ZeroParameter)])
    ModuleBuffers(ctx.comm, model).take_from_rank0("initialize")  # as DDP: every rank starts from rank 0's
    for name, p in model.named_parameters():
        if not isinstance(p, ZeroParameter):
            p = ctx.partition(p, name)
        p._zero.name = name
        p._zero.ctx = ctx
        ctx.params.append(p)
    ctx.coordinator.register(ctx.params)
    # bf16/fp16: cast the shards now (before anything is gathered); their fp32 values seed the masters
    fp32_shards: dict[int, torch.Tensor] = {}
    if config.precision.dtype != "fp32":
        fp32_shards = lower_precision(ctx.params, torch_dtype(config.precision.dtype), ctx.store)
        lower_buffers(model, torch_dtype(config.precision.dtype))
    for p in ctx.params:  # an earlier engine's masters (read above) are not this one's: a new engine without
        p._zero.master = None  # them stepped the old CPU masters and never the shards (review 31RD)
    ctx.reducer = GradientReducer(ctx.comm, config.comm.reduce_bucket_size, reduce_dtype=torch_dtype(config.precision.reduce_dtype),
                                  accumulation_steps=config.training.gradient_accumulation_steps,
                                  boundary_numel=_prefetch_numel(config))
    if budget is not None:  # memory_budget counts one bucket's hold: the reducer stays within it (grad.py)
        ctx.reducer.held_cap = budget.static.reduce_bucket_bytes
        ctx.reducer.arrivals = []  # the first training step's order of gradient pieces, for the choice
    if ctx.model_parallel is not None:  # Megatron's sequence parallelism (grad.py `sum_over_model_parallel`)
        ctx.reducer.sum_over_model_parallel([p for p in ctx.params if getattr(p, "sequence_parallel", False)],
                                            ctx.model_parallel.comm)
    ctx.coordinator.persistent_params.choose(ctx.params, config.budget.param_persistence_threshold,
                                             config.budget.model_persistence_threshold)
    place_shards(ctx.store, ctx.coordinator.shards, ctx.params)  # CPU memory or the drive, before the optimizer
    shared = share_shards(ctx.comm, ctx.store, ctx.coordinator.shards, ctx.params)  # allgather_impl="shm"
    if optimizer is not None:
        ctx.optimizer = PartitionedOptimizer(optimizer, ctx.params, config, ctx.comm, fp32_shards,
                                             model_parallel=ctx.model_parallel,
                                             shards=ctx.coordinator.shards, store=ctx.store,
                                             io=ctx.swap_io() if ctx.store.placement.optimizer_on_drive else None,
                                             window_ends=ctx.window_ends)
        if ctx.optimizer.backward_step is not None:
            # in-place writes to kept-gathered weights since the last step, taken before the first sub-group steps
            ctx.optimizer.backward_step.before_steps = functools.partial(
                take_persistent_writes, ctx.coordinator.persistent_params, functools.partial(ctx.resident, write=True))
            ctx.reducer.on_landed = ctx.optimizer.backward_step.landed
            ctx.coordinator.watch = ctx.optimizer.backward_step
            if shared:  # peers read shards in place: a read after this rank's send is checked
                ctx.reducer.on_sent = ctx.optimizer.backward_step.sent
        torch_opt = ctx.optimizer.optimizer
        if config.training.scheduler is not None:
            ctx.lr_scheduler = build_scheduler(config.training.scheduler, torch_opt)
        elif lr_scheduler is not None:
            ctx.lr_scheduler = _scheduler_from(lr_scheduler, torch_opt)
        if ctx.lr_scheduler is not None:
            ctx.lr_scheduler_step = own_scheduler(ctx.lr_scheduler)
    ctx.coordinator.persistent_params.gather()  # gathers: after every shard has its final buffer
    model.__dict__["_zero3_context"] = ctx
    LIVE_CONTEXTS.add(ctx)
    return ctx


def _scheduler_from(given: Any, optimizer: torch.optim.Optimizer) -> Any:
    """``lr_scheduler`` as given, or what a factory (a callable without ``step``, or a scheduler class,
    as DeepSpeed calls both) makes over the optimizer, refused if it is no scheduler or a plateau one."""
    if not isinstance(given, type) and (hasattr(given, "step") or not callable(given)):
        return given
    try:
        made = given(optimizer)
    except TypeError as exc:
        if not isinstance(given, type):
            raise
        raise ZeroConfigError(f"zero3.initialize: lr_scheduler={given.__name__} (a class) was called over the "
                              f"optimizer, as DeepSpeed calls it, and raised {exc}; pass functools.partial("
                              f"{given.__name__}, ...) with its other arguments, or a scheduler built over the "
                              "optimizer") from exc
    _refuse_plateau(made)
    if not hasattr(made, "step"):
        raise ZeroConfigError(f"zero3.initialize: the lr_scheduler factory returned a {type(made).__name__}, not a "
                              "scheduler (an object with step())")
    return made


def _check_scheduler(scheduler: Any, optimizer: Any) -> None:
    """A scheduler (with ``step()``) or a factory of one, over the optimizer given: one over another
    optimizer would schedule that one while the engine's kept its lr, silently."""
    if scheduler is None:
        return
    if isinstance(scheduler, type):
        return  # a scheduler class: a factory, called over the optimizer (as DeepSpeed calls it)
    if not (hasattr(scheduler, "step") or callable(scheduler)):
        raise ZeroConfigError(f"zero3.initialize: lr_scheduler must be a scheduler (an object with step()) or a "
                              f"callable(optimizer) -> scheduler, got {type(scheduler).__name__}: {scheduler!r}")
    bound = getattr(scheduler, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer) and isinstance(bound, torch.optim.Optimizer) \
            and bound is not optimizer:
        raise ZeroConfigError("zero3.initialize: lr_scheduler schedules another optimizer than the one given; build "
                              "it over the optimizer you pass (or pass a callable(optimizer) -> scheduler)")


def _refuse_plateau(scheduler: Any) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ZeroConfigError("zero3.initialize got a ReduceLROnPlateau as lr_scheduler: it needs a metric at each "
                              "step (scheduler.step(val_loss)), which engine.step() does not have. Keep it out of "
                              "zero3.initialize and step it yourself after each evaluation")


meta_dry_run: contextvars.ContextVar[bool] = contextvars.ContextVar("zero3_meta_dry_run", default=False)
"""Set by ``zero3.plan.record_trace``: a dry run that partitions a meta model to record its trace
(nothing is computed from values); ``initialize`` refuses a meta parameter otherwise (`meta_refusal`)."""


def meta_refusal(name: str) -> ZeroStateError:
    """A meta parameter given to ``initialize`` or ``Init(module=)``: refused before anything is
    partitioned. Inside an ``Init`` block one is partitioned as it comes (transformers'
    ``from_pretrained`` builds on meta, then registers the loaded weights in place of those)."""
    return ZeroStateError(
        f"parameter {name} is on the meta device (built under torch.device('meta')): zero3 partitions a "
        "parameter's values, and a meta tensor has none. zero3.Init already builds a model without any rank "
        "holding all of it: build it under `zero3.Init()` on a real device (each module is initialised, then "
        "partitioned), or materialise it first (model.to_empty(device=...) and initialise the weights) and then "
        "call zero3.initialize; nothing was partitioned")


def lazy_refusal(name: str, tail: str = "nothing was partitioned") -> ZeroStateError:
    """A parameter of a lazy module (``nn.LazyLinear``) not materialised yet: it has no shape to split
    until the module's first forward. Refused by ``initialize`` and by ``Init`` when the module is built
    (it was partitioned as an empty tensor, and the first forward failed inside torch)."""
    return ZeroStateError(
        f"parameter {name} is uninitialized (a lazy module's: nn.LazyLinear, nn.LazyConv2d, ...) and has no shape "
        "until the module's first forward, so zero3 cannot partition it. Give the module its sizes (nn.Linear(in, out)), "
        f"or build the model outside zero3.Init, run one forward to materialise it, then call zero3.initialize; {tail}")


def _device_of(model: nn.Module) -> torch.device:
    """Where the model's parameters are (CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


LIVE_CONTEXTS: "weakref.WeakSet[RuntimeContext]" = weakref.WeakSet()
"""Every engine's context while it lives: what ``zero3.see_memory_usage`` reports model state from
(the one process-wide registry; it holds no context alive)."""


def _refuse_managed_parts(model: nn.Module) -> None:
    """A model that holds another engine's model (a wrapper), or is part of one (a submodule): two
    engines' hooks would gather and release the same parameters."""
    for name, m in model.named_modules():
        if m.__dict__.get("_zero3_context") is not None:
            raise ZeroStateError(f"zero3.initialize: submodule {name!r} is already managed by an engine (zero3.initialize "
                                 "was called on it); call that engine's remove_hooks() first, or initialize only one of them")
    for name, p in model.named_parameters():
        owner = p._zero.ctx if isinstance(p, ZeroParameter) else None
        if isinstance(owner, RuntimeContext) and owner.attached:
            raise ZeroStateError(f"zero3.initialize: parameter {name!r} belongs to an engine over another model (this "
                                 "model is part of that one, or shares a submodule or a tied parameter with it); "
                                 "give each model its own copy, or call that engine's remove_hooks() first")


def _drop_stale_grads(model: nn.Module) -> None:
    """Gradients a backward left on the parameters before `initialize` (a backward after an earlier
    engine's remove_hooks(), a plain backward) would be added into the first step's (autograd
    accumulates into ``.grad``), where the engine's optimizer.zero_grad() cannot reach them: dropped, said."""
    # read and dropped past a partitioned parameter's guard (an earlier engine's checks are not this one's:
    # review 30Z2, its step in backward refused the read)
    with torch._C.DisableTorchFunctionSubclass():
        stale = [n for n, p in model.named_parameters() if _TENSOR_GRAD.__get__(p) is not None]
    if stale:
        logger.warning("zero3.initialize: parameters %s%s hold gradients from an earlier backward; dropped (the engine "
                       "keeps gradients in its shards)", stale[:3], " ..." if len(stale) > 3 else "")
        for p in model.parameters():
            drop_grad_slot(p)
    # Gradient shards an earlier engine left (a backward its step never took: an unfinished accumulation
    # window before its remove_hooks()): the new engine adopts the shards, and would step on them (review 30Z).
    left = [(n, p) for n, p in model.named_parameters() if isinstance(p, ZeroParameter) and p._zero.shard is not None
            and (p._zero.train_tensor.grad is not None or p._zero.shard.grad is not None)]
    if left:
        logger.warning("zero3.initialize: the gradient shards of %s%s were left by an earlier engine (a backward its "
                       "step did not take, such as an unfinished accumulation window); dropped", [n for n, _ in left[:3]],
                       " ..." if len(left) > 3 else "")
        for _, p in left:
            p._zero.train_tensor.grad = p._zero.shard.grad = None


def _check_nvme_shards(model: nn.Module, config: ZeroConfig, placement: PlacementPolicy) -> None:
    """Shards that ``zero3.Init(remote_device="nvme")`` wrote to the drive stay there: the engine
    must keep them on NVMe, in the dtype they were written in."""
    for name, p in model.named_parameters():
        z = getattr(p, "_zero", None)
        if z is None or z.swap is None:
            continue
        if not placement.params_on_drive:
            raise ZeroConfigError(
                f"parameter {name!r} was partitioned onto NVMe by zero3.Init(remote_device='nvme'), but initialize's "
                f"config has offload_param={config.offload.offload_param!r}; pass initialize the config given to Init "
                "(zero_optimization.offload_param.device 'nvme'), or build without remote_device='nvme'")
        want = torch_dtype(config.precision.dtype)
        if z.shard.is_floating_point() and z.shard.dtype != want:
            raise ZeroConfigError(
                f"parameter {name!r} was written to NVMe by zero3.Init in {z.shard.dtype}, but the config's dtype is "
                f"{config.precision.dtype!r}; pass the same config to zero3.Init (config_dict_or_path=...) and initialize")


def _check_init_precision(model: nn.Module, config: ZeroConfig) -> None:
    """A model partitioned by ``zero3.Init`` in bf16/fp16 (its config's dtype, ``dtype=``, or a
    low-precision checkpoint) and an fp32 config here: the optimizer steps on the low-precision
    shards, with no fp32 masters (DeepSpeed keeps fp32 partitions for them). Pure low-precision
    training is a choice some make, so it is said, once, not refused."""
    if config.precision.dtype != "fp32":
        return
    for name, p in model.named_parameters():
        z = getattr(p, "_zero", None)
        if z is not None and z.shard.dtype in (torch.bfloat16, torch.float16):
            logger.warning(
                "zero3.initialize: parameter %r was partitioned by zero3.Init in %s and the config's dtype is 'fp32', "
                "so the optimizer steps on the %s shards themselves, with no fp32 masters (DeepSpeed would keep fp32 "
                "ones); pass initialize the config given to Init (bf16/fp16 enabled) for fp32 masters", name,
                z.shard.dtype, z.shard.dtype)
            return


def _check_group(ctx: RuntimeContext, name: str, p: ZeroParameter) -> None:
    z = p._zero
    made = z.ctx.ranks if isinstance(z.ctx, RuntimeContext) and z.ctx.ranks else None  # the ranks it was cut for
    alive = z.group is None or group_alive(z.group)
    if made is None and alive:
        made = tuple(group_ranks(z.group))
    if not alive and made in (None, ctx.ranks) and (z.world_size, z.rank) == (ctx.world_size, ctx.rank):
        z.group = ctx.group  # destroyed, and torch.distributed made anew (a notebook, a sweep): this rank's part still
        return  # (on the same ranks: review of probe 37T, a group of other ranks took two models' halves)
    if not alive or z.world_size != ctx.world_size or z.rank != ctx.rank or not same_group(z.group, ctx.group):
        raise ZeroConfigError(  # the ranks too: two groups of one size read alike (probe 37T)
            f"parameter {name!r} was partitioned over a group of world size {z.world_size} (rank {z.rank}; ranks "
            f"{list(made) if made else 'unknown'}) under zero3.Init, but initialize got a group of world size "
            f"{ctx.world_size} (rank {ctx.rank}; ranks {list(ctx.ranks)}); pass the same group to zero3.Init and "
            "zero3.initialize (with Megatron's model parallelism, the same mpu= to both: its data-parallel group "
            "is the one the parameters are split over)")


def context_of(obj: Any, what: str = "this call") -> RuntimeContext:
    """The context of an engine (``engine.context``), of a model given to ``initialize``, or of a
    partitioned parameter; a clear error otherwise."""
    ctx = getattr(obj, "context", None)
    if isinstance(ctx, RuntimeContext):
        return ctx
    if isinstance(obj, nn.Module):
        ctx = obj.__dict__.get("_zero3_context")
        if ctx is not None:
            return ctx
    if isinstance(obj, ZeroParameter) and isinstance(obj._zero.ctx, RuntimeContext) \
            and obj._zero.ctx.module is not None:
        return obj._zero.ctx
    raise ZeroStateError(f"{what} needs a zero3 Engine or a model passed to zero3.initialize, got "
                         f"{type(obj).__name__}")


def _prefetch_numel(config: ZeroConfig) -> int:
    """The prefetch bucket in elements (0: no prefetch), where the gradient reducer issues the queued
    gradients at a module's end (grad.py)."""
    plan = plan_config(config)  # the planner's resolution of the element and byte knobs
    if plan.unit == "numel":
        return plan.prefetch_bucket_size
    return plan.prefetch_bucket_size // torch_dtype(config.precision.dtype).itemsize


def align_ids(comm: Any) -> None:
    """Every rank of ``comm``'s group on the highest next parameter id among them, before they
    partition the same parameters in the same order (partition/ids.py). A collective."""
    if comm.world_size > 1:
        top = comm.all_reduce(torch.tensor([next_id()], dtype=torch.int64, device=comm.device),
                              Tag(Kind.ALL_REDUCE, "parameter ids"), op="max")
        skip_to(int(top.item()))
