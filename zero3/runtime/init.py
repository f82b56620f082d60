"""`zero3.Init`: partition parameters as the model is built (`GatheredParameters` and external parameters
are in gathered.py).

[Note: partitioning during construction]
Entering the outermost `Init` wraps the ``__init__`` of every ``nn.Module`` subclass (and of
classes defined while it is active, through ``__init_subclass__``), wraps ``nn.Module.apply`` and
installs a global parameter-registration hook; leaving the last one open in the process (also on an
exception) restores exactly those, so nothing leaks into modules built afterwards, and a thread with
no block of its own open builds plain modules meanwhile (init_patches.py [Note: Init's patches are
process-wide, the open Init is per context]). A module's parameters are partitioned the
moment its outermost ``__init__`` returns (after its own ``reset_parameters``), so construction
holds at most one module's full parameters plus this rank's shards, even for
``nn.Sequential(*[nn.Linear(...) for _ in range(n)])``. Parameters registered after ``__init__``
(Hugging Face's ``from_pretrained`` registers every loaded weight so) are partitioned when the
context exits, in registration order: partitioning numbers them (``ds_id``), and collectives name
parameters by those numbers, so every rank must number them alike.

Initialisation stays consistent across ranks because entering `Init` broadcasts rank 0's RNG state
(``sync="rng"``, the default): every rank then draws the same full tensors and keeps its own slice.
A rank whose RNG state differed from rank 0's on entry (per-rank seeds) gets its own back on exit,
so what it draws after the build (batches, dropout) stays its own.
``sync="broadcast"`` instead broadcasts every parameter from rank 0 (exact even when ranks would
compute different values, at the price of one broadcast per parameter).

[Note: touching partitioned parameters while building]
Constructors and ``post_init`` methods often touch a child's parameters after the child was
partitioned: ``module.apply(fn)`` (gathered around ``fn``, module by module), in-place inits
(``nn.init.normal_(p)``: gathered, applied, re-partitioned at once), indexing and slicing
(``init.zeros_(emb.weight[padding_idx])``), reading values (``p.abs().max()``) and assigning
``p.data = ...``. Inside `Init` any op on a partitioned parameter or its ``.data`` gathers it
around the op. If the result is a view of the parameter (indexing, slicing, ``.t()``), code may
write through that view later, so the parameter stays gathered until the outermost module's
``__init__`` returns, and is then written back into the shards and released; otherwise it is
released at once. So a model built under `Init` gets exactly the values of a plain build from the
same seed, holding at most one module's full parameters, the shards, and the parameters whose views
the building code still holds. All of these are collectives: every rank builds the model the same
way, which data-parallel code does.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Literal
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..partition import sharding
from ..planning.persistence import MemoryBudget, PersistenceRule
from ..comm.agreement import agree_on_config
from ..comm.communicator import Kind, Tag
from ..comm.process_group import ensure_default_group, group_of_mesh
from ..config import ZeroConfig, resolve_config
from ..config.sections import DRIVE_POOL_KNOBS, OffloadConfig
from .context import RuntimeContext, align_ids, lazy_refusal, meta_refusal
from .init_patches import Replacements, close_patches, open_patches
from .refusals import unshardable, unshardable_refusal
from ..errors import ZeroConfigError, ZeroStateError
from ..comm.model_parallel import check_mpu, data_parallel_group as mpu_data_parallel_group
from .gathered import LOCAL_MODIFIER, GatheredParameters
from .handed_copies import modifier_holding
from .rank_values import take_rank0_where_ranks_differ
from .publish import repartition
from ..partition.param import (
    PartitionedParameter,
    ReleasedData,
    ZeroParameter,
    construction_handler,
    copy_full_into_shard,
    raw_data,
    set_placeholder_dtype,
)
from ..optim.precision import torch_dtype

logger = logging.getLogger(__name__)

SyncMode = Literal["rng", "broadcast", "none"]


@dataclass(eq=False)
class _InitState:
    ctx: RuntimeContext  # the minimal context that partitions (and gathers) while building
    remote_device: torch.device | None
    dtype: torch.dtype | None
    sync: SyncMode
    pin_memory: bool = False
    # remote_device="nvme": the engine's rules (planning/persistence.py) in construction order: which
    # parameters will be persistent, and which other shards stay in memory (max_in_cpu)
    persistence: PersistenceRule = field(default_factory=lambda: PersistenceRule(0, 0))
    in_memory: MemoryBudget = field(default_factory=lambda: MemoryBudget(0))
    # Modules that registered a parameter, in registration order (a dict, not a set: partitioning
    # hands out ds_ids, which must follow the same order on every rank; a set's follows addresses).
    modules: "WeakKeyDictionary[nn.Module, None]" = field(default_factory=WeakKeyDictionary)
    touched: dict[int, ZeroParameter] = field(default_factory=dict)  # kept gathered: views handed out
    closed: bool = False  # its block exited (from another context, it stays on this context's stack: skipped)
    patches_token: Any = None  # the context's outermost open block holds the process-wide patches' token


_STACK: contextvars.ContextVar[tuple[_InitState, ...]] = contextvars.ContextVar("zero3_init", default=())


_UNSUPPORTED = {
    "zero_param_parallel_group": "hpZ's secondary groups come from zero_hpz_partition_size in the config given to "
                                 "zero3.initialize (it builds them per node); a group passed to Init",
    "zero_quantized_weights": "quantized weight gathers apply to training: set zero_quantized_weights in the config "
                              "given to zero3.initialize; construction's gathers stay exact, and",
    "zero_quantized_nontrainable_weights": "quantized weight gathers",
    "sequence_data_parallel_group": "sequence parallelism",
    "param_swapper": "a custom parameter swapper",
}


class Init:
    """Context manager: every parameter created inside is partitioned across the group's ranks.

    The arguments are DeepSpeed's ``deepspeed.zero.Init`` ones, with the same meaning, so code written
    for it (Megatron's ``model_provider``) runs unchanged apart from the import.

    Args:
        module: an already-built module to partition now, as if it had been built inside (its
            parameters are broadcast from rank 0 first, so ranks agree).
        data_parallel_group: process group to partition over (default: ``mpu``'s data-parallel group,
            else the world group, or none when ``torch.distributed`` is not initialised).
        mem_efficient_linear: accepted for compatibility: zero3 frees the full weights that
            ``F.linear`` saves for backward whenever it releases a parameter (its storage is resized to
            0 bytes; persistent and user-held parameters stay gathered).
        remote_device: where shards live: ``"none"`` (where the parameter was created), ``"cpu"``,
            ``"nvme"`` (written to ``offload_param.nvme_path`` of the config as they are made, past
            ``max_in_cpu`` elements and except parameters small enough to become persistent), or
            any torch device. None: the config's ``offload_param.device``.
        pin_memory: pin CPU shards (with CUDA available); also on when the config's
            ``offload_param.pin_memory`` is.
        config_dict_or_path: a zero3 or DeepSpeed config (dict or JSON path); its ``bf16`` / ``fp16``
            setting makes shards low precision as they are created, and its ``collective`` settings
            apply to the construction's collectives. ``config`` and ``deepspeed_config`` are aliases.
        enabled: ``False`` makes the context a no-op (a plain model is built).
        dtype: cast floating-point parameters to this dtype before partitioning (overrides the config).
        mpu: a Megatron-style model-parallel unit; its ``get_data_parallel_group()`` is the group
            (parameters are partitioned over data-parallel ranks only; a tensor-parallel layer builds
            its own slice, which zero3 partitions further). Its model-parallel names are checked.
        group: alias of ``data_parallel_group``.
        sync: ``"rng"`` (broadcast rank 0's RNG state on entry), ``"broadcast"`` (broadcast every
            parameter from rank 0), or ``"none"``: the values built are overwritten before use (a
            checkpoint load into a model built under transformers' ``no_init_weights``), so they are
            neither made alike nor checked.

    Raises:
        ZeroConfigError: an argument zero3 does not support (named, with what it is for), two
            configs, or a bad value; a config that is invalid on some rank or differs between ranks
            (every rank raises, naming the rank or the key); ``WORLD_SIZE`` > 1 without a process
            group and without ``MASTER_ADDR``/``MASTER_PORT`` to make one.

    With no process group and a launcher's ``WORLD_SIZE`` > 1, the default group is made from the
    environment first (`zero3.init_distributed`).
    """

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | torch.device | None = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None, *,
                 group: Any = None, sync: SyncMode = "rng", **unsupported: Any) -> None:
        deepspeed_config = unsupported.pop("deepspeed_config", None)
        for name, value in unsupported.items():
            what = _UNSUPPORTED.get(name)
            if what is not None and not value:
                continue  # DeepSpeed's "off" value of a feature zero3 does not have: nothing to do
            hint = f" ({what} is not available in zero3)" if what else ""
            raise ZeroConfigError(
                f"zero3.Init does not support the argument {name}={value!r}{hint}. Supported: module, "
                "data_parallel_group, mem_efficient_linear, remote_device, pin_memory, config_dict_or_path "
                "(or config / deepspeed_config), enabled, dtype, mpu, group, sync")
        configs = [c for c in (config_dict_or_path, config, deepspeed_config) if c is not None]
        if len(configs) > 1:
            raise ZeroConfigError("zero3.Init got more than one of config_dict_or_path, config and deepspeed_config; "
                                  "pass one")
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"zero3.Init(module=...) must be a torch.nn.Module built outside the block, got "
                            f"{type(module).__name__}: {module!r:.80}")
        if sync not in ("rng", "broadcast", "none"):
            raise ZeroConfigError(f"Init(sync=...) must be 'rng', 'broadcast' or 'none', got {sync!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ZeroConfigError(f"Init(dtype=...) must be a floating-point torch.dtype, got {dtype!r}")
        if not isinstance(mem_efficient_linear, bool) or not isinstance(pin_memory, bool) \
                or not isinstance(enabled, bool):
            raise ZeroConfigError(f"Init(mem_efficient_linear=..., pin_memory=..., enabled=...) must be bools, got "
                                  f"{mem_efficient_linear!r}, {pin_memory!r}, {enabled!r}")
        if data_parallel_group is not None and group is not None and data_parallel_group is not group:
            raise ZeroConfigError("zero3.Init got both data_parallel_group and group; pass one")
        self.enabled = enabled
        if enabled:
            _refuse_meta_default_device("zero3.Init(module=...) was called" if module is not None else None)
            ensure_default_group("zero3.Init")
        self._group = group_of_mesh(data_parallel_group if data_parallel_group is not None else group, "zero3.Init")
        if mpu is not None:
            if self._group is None:
                self._group = mpu_data_parallel_group(mpu)
            check_mpu(mpu, self._group)  # a unit zero3.initialize would refuse is refused here already
        # A config that is bad on one rank only still takes part in the agreement, so every rank raises.
        resolved, error = None, None
        try:
            resolved, remote_device = _effective_config(configs[0] if configs else None, remote_device)
        except ZeroConfigError as exc:
            error = exc
        if enabled:
            agree_on_config(self._group, resolved, error, "zero3.Init")
        elif error is not None:
            raise error
        assert resolved is not None
        self._config = resolved
        self._remote_device = _remote_device(remote_device)
        self._pin_memory = pin_memory  # or the config's offload_param.pin_memory (the context's placement)
        self._dtype = dtype if dtype is not None else (torch_dtype(self._config.precision.dtype)
                                                       if self._config.precision.dtype != "fp32" else None)
        self._sync: SyncMode = sync
        self._own_rng: _OwnRng | None = None  # this rank's RNG states, given back on exit (`_sync_rng`)
        self._token: Any = None
        self._handler_token: Any = None
        self._entered: Any = None  # the build state this block pushed
        if module is not None and enabled:
            self._partition_built(module)

    def _state(self) -> _InitState:
        ctx = RuntimeContext.minimal(self._config, self._group)
        return _InitState(ctx=ctx, remote_device=self._remote_device, dtype=self._dtype, sync=self._sync,
                          pin_memory=self._pin_memory or ctx.store.placement.param_pin_memory,
                          persistence=PersistenceRule(self._config.budget.param_persistence_threshold,
                                                      self._config.budget.model_persistence_threshold),
                          in_memory=ctx.store.placement.in_memory_budget())

    def _partition_built(self, module: nn.Module) -> None:
        """``Init(module=m)``: partition a built module; rank 0's values win (a broadcast each)."""
        meta = next((n for n, p in module.named_parameters() if p.is_meta), None)
        if meta is not None:  # before any is partitioned (RuntimeContext.partition refuses one by one)
            raise meta_refusal(meta)
        lazy = next((n for n, p in module.named_parameters() if nn.parameter.is_lazy(p)), None)
        if lazy is not None:
            raise lazy_refusal(lazy)
        state = self._state()
        align_ids(state.ctx.comm)
        state.sync = "broadcast"
        _partition_module(module, state, recurse=True)
        if state.ctx.coordinator.shards is not None:
            state.ctx.coordinator.shards.flush()

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        if self._token is not None:  # review 38R4: the second entry overwrote the first's tokens, and every later
            raise ZeroStateError(  # Init of the thread partitioned nothing
                "this zero3.Init is open already: an Init object is one block; nest a new zero3.Init() instead")
        _refuse_meta_default_device()  # also for an Init made outside the meta device and entered inside it
        state = self._state()
        align_ids(state.ctx.comm)
        stack = tuple(s for s in _STACK.get() if not s.closed)  # a block left from another context: gone
        if self._sync == "rng" and state.ctx.world_size > 1:
            self._own_rng = _sync_rng(state.ctx)
        if not stack:  # this context's outermost Init (a collective that failed above has installed nothing)
            state.patches_token = open_patches(_REPLACEMENTS)
        self._entered = state
        self._token = _STACK.set(stack + (state,))
        self._handler_token = construction_handler.set(_touch)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled or self._token is None:
            return
        state, stack = self._entered, _STACK.get()
        inside = any(s is state for s in stack)  # else left from another context (review 38R3: a generator
        last = inside and stack[-1] is state     # suspended in the block, closed on another thread)
        try:
            if inside:
                _write_back(state)
                if exc_type is None:
                    for m in list(state.modules):
                        _partition_module(m, state, recurse=False)
                if state.ctx.coordinator.shards is not None:
                    state.ctx.coordinator.shards.flush()  # every shard written before the model is used
        finally:
            state.closed = True
            if inside and not last:  # closed out of order (review 38R4: an abandoned generator's block, closed
                rest = tuple(s for s in stack if s is not state)  # inside another): the others stay open
                _STACK.set(rest)
                heir = next((s for s in rest if not s.closed), None)  # now the context's outermost open block
                if heir is not None and state.patches_token is not None:
                    heir.patches_token, state.patches_token = state.patches_token, None
            else:
                for var, token in ((construction_handler, self._handler_token), (_STACK, self._token)):
                    with contextlib.suppress(ValueError):  # a token of another context: its value stays there
                        var.reset(token)
            self._token = None
            if self._own_rng is not None:  # this rank's own stream again (`_sync_rng`)
                self._own_rng.restore()
                self._own_rng = None
            if state.patches_token is not None:
                with contextlib.suppress(ValueError):
                    close_patches(state.patches_token)  # the process-wide count goes down whatever the context
                state.patches_token = None
        if not inside:
            raise ZeroStateError(
                "zero3.Init was left in another context than it was entered in (a generator or coroutine suspended "
                "inside the block, then closed or resumed on another thread): what it built was not partitioned "
                "by it. Keep an Init block within one function call on one thread")


def _refuse_meta_default_device(call: str | None = None) -> None:
    """Init under a meta default device (``torch.set_default_device("meta")`` or ``with
    torch.device("meta"):`` around it, FSDP2's habit) would build every module on meta, with no values
    to partition; refused on every rank before anything changes (its first collective is the config
    agreement). A ``torch.device("meta")`` opened inside the block stays allowed (api.md). ``call``:
    what was called, where it is not a block entered (``Init(module=...)``)."""
    if torch.get_default_device().type == "meta":
        if call is not None:  # Init(module=m): m is built already
            raise ZeroStateError(
                f"{call} under the meta default device (torch.set_default_device('meta') or `with "
                "torch.device('meta'):` around it): zero3's own buffers would be made on meta, with no values to "
                "exchange. Call it with the meta device left out (the module is built already); nothing was changed")
        raise ZeroStateError(
            "zero3.Init was entered under the meta default device (torch.set_default_device('meta') or `with "
            "torch.device('meta'):` around it): the modules built inside would have meta parameters, which hold "
            "no values to partition. zero3.Init already builds a model without any rank holding all of it: enter "
            "it on a real device (the meta device left out), or build on meta without zero3.Init, materialise "
            "(model.to_empty(device=...) and initialise the weights) and then call zero3.initialize; nothing was "
            "changed")


def _effective_config(config: Any, remote_device: Any) -> tuple[ZeroConfig, Any]:
    """The config `Init` builds with (its own gathers and swap files follow ``remote_device``, which
    defaults to the config's ``offload_param`` device, as DeepSpeed's does), and that device."""
    cfg = resolve_config(config)
    if remote_device is None and cfg.offload.offload_param != "none":
        remote_device = cfg.offload.offload_param
    _remote_device(remote_device)  # a bad device is a config error of this rank's too
    try:
        if remote_device == "nvme":
            return cfg.replace(offload_param="nvme"), remote_device
        # not on the drive: its pool settings do not apply (beside another device they would be reported)
        defaults = OffloadConfig()
        return cfg.replace(offload_param="none", **{k: getattr(defaults, k) for k in DRIVE_POOL_KNOBS}), remote_device
    except ZeroConfigError as exc:
        raise ZeroConfigError(f"zero3.Init(remote_device='nvme') needs offload_param.nvme_path in the config "
                              f"passed as config_dict_or_path: {exc}") from None


def _remote_device(value: Any) -> torch.device | None:
    """Where shards are made: None (where the parameter is), or a device; 'nvme' shards are made on the
    CPU and then written to the drive."""
    if value is None or value == "none":
        return None
    if value == "nvme":
        return torch.device("cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ZeroConfigError(f"zero3.Init(remote_device={value!r}) must be None, 'none', 'cpu', 'nvme' or a torch "
                              "device") from None
    if device.type == "meta":  # shards with no data: the weights would be lost at initialize
        raise ZeroConfigError("zero3.Init(remote_device='meta'): shards need real storage; use None, 'cpu', 'nvme' or "
                              "a device (build on the meta device with `with torch.device('meta'):` instead)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ZeroConfigError(f"zero3.Init(remote_device={value!r}): CUDA is not available here")
    return device


def _current() -> _InitState | None:
    return next((s for s in reversed(_STACK.get()) if not s.closed), None)


def _sync_rng(ctx: RuntimeContext) -> _OwnRng | None:
    """Every rank takes rank 0's RNG state (CPU, and CUDA on NCCL), so they draw the same weights.

    Returns this rank's own states where they differed from rank 0's (per-rank seeds, as nanoGPT's
    ``torch.manual_seed(1337 + rank)``), for `Init` to give back on exit: keeping rank 0's would
    make every rank draw the same batches and dropout masks afterwards. Where they were equal (one
    seed everywhere) nothing is returned and the state after the build is the plain build's."""
    tag = Tag(Kind.BROADCAST, "zero3.Init RNG state")
    own_cpu = torch.get_rng_state()
    cpu = ctx.comm.broadcast(own_cpu.to(ctx.comm.device, copy=True), 0, tag).cpu()  # in place: keep own_cpu
    torch.set_rng_state(cpu)
    own = _OwnRng(cpu=None if torch.equal(own_cpu, cpu) else own_cpu, cuda=None)
    if torch.cuda.is_available() and torch.cuda.is_initialized() and ctx.comm.backend == "nccl":
        own_cuda = torch.cuda.get_rng_state()
        cuda = ctx.comm.broadcast(own_cuda.to('cuda', copy=True), 0, tag).cpu()
        torch.cuda.set_rng_state(cuda)
        own = _OwnRng(cpu=own.cpu, cuda=None if torch.equal(own_cuda, cuda) else own_cuda)
    return own if own.cpu is not None or own.cuda is not None else None


@dataclass(frozen=True)
class _OwnRng:
    """A rank's RNG states from before `Init` took rank 0's, each only where it differed (a stream
    that was rank 0's stays where the build leaves it, as on rank 0)."""

    cpu: torch.Tensor | None
    cuda: torch.Tensor | None

    def restore(self) -> None:
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


# -- what the global patches (init_patches.py) do for the Init open in the calling context -------
def _on_param_registered(module: nn.Module, name: str, param: Any) -> None:
    state = _current()
    if state is not None and param is not None:
        state.modules[module] = None


def _apply_with_gather(self: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    """``Module.apply`` under Init: gather each module's own parameters around ``fn``."""
    for child in self.children():
        child.apply(fn)
    params = [p for p in self._parameters.values() if isinstance(p, ZeroParameter)]
    state = _current()
    if not params or state is None:
        fn(self)
        return self
    with _gathered_while_building(params, state):
        fn(self)
    return self


def _built(module: nn.Module, last: bool) -> None:
    """A module's outermost ``__init__`` returned (``last``: no other module is being built in this context)."""
    state = _current()
    if state is not None:
        _partition_module(module, state, recurse=True)
        if last:  # the outermost module is built: views of its params are done
            _write_back(state)


def _gathered_while_building(params: list[ZeroParameter], state: _InitState) -> GatheredParameters:
    """``params`` gathered around code that changes them while a model is built: each rank keeps its
    own write (every rank computes the same one, from rank 0's RNG), or rank 0's under ``sync="broadcast"``."""
    return GatheredParameters(params, modifier_rank=0 if state.sync == "broadcast" else LOCAL_MODIFIER)


def _parametrize_with_gather(register: Callable, module: nn.Module, tensor_name: str, *args: Any, **kwargs: Any) -> Any:
    """``parametrize.register_parametrization`` under Init (``weight_norm(nn.Linear(...))`` in a model's
    ``__init__``): the module was partitioned when it was built, and the parametrization computes its
    new parameters from the full tensor; gathered around the call, as `Module.apply` (Hugging Face
    does this by hand for DeepSpeed: ``GatheredParameters(conv.weight, modifier_rank=0)``). The new
    parameters are partitioned when their ``ParametrizationList`` is built."""
    p = module._parameters.get(tensor_name)
    state = _current()
    if not isinstance(p, ZeroParameter) or state is None:
        return register(module, tensor_name, *args, **kwargs)
    with _gathered_while_building([p], state):
        result = register(module, tensor_name, *args, **kwargs)
    _forget_if_dropped(module, tensor_name, p, state)
    return result


def _old_weight_norm_with_gather(apply: Callable, module: nn.Module, name: str, dim: int) -> Any:
    """The deprecated ``torch.nn.utils.weight_norm`` under Init: gathered as `_parametrize_with_gather`,
    and its new parameters (``weight_g``; ``weight_v``, which shares the gathered storage) partitioned
    before the release empties that storage (parameters registered on a built module otherwise wait
    for the end of Init)."""
    p = module._parameters.get(name)
    state = _current()
    if not isinstance(p, ZeroParameter) or state is None:
        return apply(module, name, dim)
    with _gathered_while_building([p], state):
        fn = apply(module, name, dim)
        _partition_module(module, state, recurse=False)
    _forget_if_dropped(module, name, p, state)
    return fn


_REPLACEMENTS = Replacements(on_param_registered=_on_param_registered, apply=_apply_with_gather,
                             register_parametrization=_parametrize_with_gather,
                             weight_norm_apply=_old_weight_norm_with_gather, built=_built)


def _forget_if_dropped(module: nn.Module, name: str, p: ZeroParameter, state: _InitState) -> None:
    """A parametrization replaced ``p`` (weight_norm keeps ``weight_g``/``weight_v``, or ``original0``
    and ``original1``, and drops the weight): the context stops driving it, so its shard goes with it.
    One that keeps it (as ``parametrizations.<name>.original``) leaves it driven."""
    if all(q is not p for q in module.parameters()):
        state.ctx.coordinator.register([p], drop=True)


def _partition_module(module: nn.Module, state: _InitState, *, recurse: bool) -> None:
    """Partition the parameters of ``module`` (and, with ``recurse``, of its submodules) not partitioned yet.

    [Note: parameter names while building] A parameter is named by its path under the module whose
    ``__init__`` just returned (``dec.weight``, as ``named_parameters`` and `zero3.initialize` name it),
    or ``Linear.weight`` when it is that module's own: a child is partitioned before it is attached
    to its parent, so the parameters this Init partitioned earlier under ``module`` are renamed here,
    on the walk that looks for new ones (one name per parameter and enclosing module; no extra walk)."""
    modules = list(module.named_modules() if recurse else [("", module)])
    for path, m in modules:  # refused before any of them is partitioned
        lazy = next((_name(module, path, n) for n, p in m._parameters.items() if nn.parameter.is_lazy(p)), None)
        if lazy is not None:
            raise lazy_refusal(lazy, "the modules built before it in this Init block are partitioned")
        bad = next(((_name(module, path, n), p) for n, p in m._parameters.items() if p is not None
                    and not isinstance(p, ZeroParameter) and unshardable(p)), None)
        if bad is not None:
            raise unshardable_refusal(*bad, "the modules built before it in this Init block are partitioned")
    todo: dict[int, tuple[nn.Parameter, str]] = {}  # a tied parameter once, under its first name
    named: set[int] = set()
    for path, m in modules:
        for pname, p in m._parameters.items():
            if p is None:
                continue
            if not isinstance(p, ZeroParameter):
                todo.setdefault(id(p), (p, _name(module, path, pname)))
            elif recurse and not p._zero.ctx.attached and id(p) not in named:  # no engine holds it
                named.add(id(p))
                p._zero.name = _name(module, path, pname)
    if state.sync == "rng":  # [Note: values that differ between ranks under sync="rng"]
        take_rank0_where_ranks_differ(state.ctx, [(name, p.data) for p, name in todo.values()])
    for p, name in todo.values():
        _partition_param(p, name, state)


def _name(module: nn.Module, path: str, pname: str) -> str:
    """A parameter's name while building: see [Note: parameter names while building]."""
    return f"{path}.{pname}" if path else f"{type(module).__name__}.{pname}"


def _partition_param(p: nn.Parameter, name: str, state: _InitState) -> ZeroParameter:
    ctx = state.ctx
    if state.sync == "broadcast" and ctx.world_size > 1:
        ctx.comm.broadcast(p.data, 0, Tag(Kind.BROADCAST, f"zero3.Init value of {name}"))
    zp = ctx.partition(p, name, shard_device=state.remote_device, dtype=state.dtype)
    z = zp._zero
    tier = ctx.coordinator.shards
    if tier is not None and not state.in_memory.stays(state.persistence.admit(z.numel), z.shard_numel):
        tier.offload(zp)  # as the engine will place it (placement.py), if it sees the same order
    elif state.pin_memory:
        ctx.store.pin(zp)
    return zp


def _deepcopy(p: ZeroParameter, state: _InitState) -> ZeroParameter:
    """``copy.deepcopy`` of a partitioned parameter while `Init` builds (torch's
    ``nn.TransformerEncoder`` deep-copies the layer it is given, already partitioned): a new
    parameter, partitioned, with the values of ``p`` (and, as torch's copy, none of its attributes).
    A collective (one gather, over the group of the `Init` that built ``p``), as building is. Where
    the ranks' values may differ, the copy takes the ones ``p`` will have: those of the modifier rank
    of a ``GatheredParameters`` holding it, else rank 0's where they differ, as an assignment does (probe
    36H: each rank partitioned its own values, a copy stitched from two ranks' edits)."""
    p._zero.ctx.coordinator.gather_for_user([p])
    try:
        full = raw_data(p).detach().clone()
    finally:
        p._zero.ctx.coordinator.release_for_user([p])
    modifier = modifier_holding(p)
    if modifier is not None and p._zero.world_size > 1:
        tag = Tag(Kind.BROADCAST, f"zero3.Init deep copy of {p._zero.name}")
        full = p._zero.ctx.comm.broadcast(full, modifier, tag)
    elif state.sync == "rng" and state.ctx.world_size > 1:
        take_rank0_where_ranks_differ(state.ctx, [(p._zero.name, full)])
    return _partition_param(nn.Parameter(full, requires_grad=p.requires_grad), p._zero.name, state)


def _param_of(target: Any, state: _InitState) -> ZeroParameter | None:
    """The parameter behind a guarded tensor (the parameter itself, or its ``.data`` alias)."""
    if isinstance(target, PartitionedParameter):
        return target
    return state.ctx.coordinator.param_of(target._zero.id) if isinstance(target, ReleasedData) else None


def _touch(target: Any, func: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """An op on a partitioned parameter while `Init` builds: see [Note: touching partitioned
    parameters while building]. Installed as ``param.construction_handler``."""
    state = _current()
    name = getattr(func, "__name__", "")
    # a deep copy is of the parameter itself, gathered or not (a view of it may be out)
    p = target if name == "__deepcopy__" else _param_of(target, state) if state is not None else None
    if name == "__deepcopy__" and state is not None:  # of this Init's parameters or an earlier one's
        return True, _deepcopy(p, state)
    if state is None or p is None or p._zero.ctx is not state.ctx:
        return False, None
    if name == "__set__" or name == "set_":  # p.data = value, p.set_(value): the full value, into the shards
        value = args[1]
        if name == "__set__" and isinstance(value, torch.Tensor) and \
                value.untyped_storage()._cdata == raw_data(p).untyped_storage()._cdata:
            return True, None  # ``p.data += v``'s reassignment of the result of an in-place op just written back
        _assign(p, value, state)
        return True, (p if name == "set_" else None)
    if is_inplace_op(name):  # p[i] = v too: a write
        modifier = 0 if state.sync == "broadcast" else LOCAL_MODIFIER
        with GatheredParameters([p], modifier_rank=modifier):
            return True, func(*unguarded(args, state.ctx.coordinator), **unguarded(kwargs, state.ctx.coordinator))
    state.ctx.coordinator.gather_for_user([p])
    keep = False
    try:
        result = func(*unguarded(args, state.ctx.coordinator), **unguarded(kwargs, state.ctx.coordinator))
        storage = raw_data(p).untyped_storage().data_ptr()
        keep = any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage
                   for t in pytree.tree_leaves(result))
    finally:
        if keep and p._zero.id not in state.touched:
            state.touched[p._zero.id] = p  # a view is out: written back when the outermost __init__ returns
        else:
            state.ctx.coordinator.release_for_user([p])
    return True, result


_touch.live = lambda: _current() is not None  # type: ignore[attr-defined]  # partition/param.py `building`


def is_inplace_op(name: str) -> bool:
    """Whether the torch op named ``name`` writes into its first argument (``add_``, ``p[i] = v``)."""
    return (name.endswith("_") and not name.startswith("_")) or name in _INPLACE_DUNDERS


_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                              "__imatmul__"})


def unguarded(tree: Any, coordinator: Any) -> Any:
    """``.data`` aliases of ``coordinator``'s now-gathered parameters, as plain tensors (so the op does
    not re-enter the guard); ds_ids are per engine, so an alias must be of that very parameter."""
    def plain(t: Any) -> Any:
        if isinstance(t, ReleasedData):
            p = coordinator.param_of(t._zero.id)
            if p is not None and p._zero is t._zero and not isinstance(p, PartitionedParameter):
                return raw_data(p)
        return t

    return pytree.tree_map(plain, tree)


def _assign(p: ZeroParameter, value: Any, state: _InitState) -> None:
    """``p.data = value`` while building: ``value`` is the new full tensor (its dtype and device win)."""
    z = p._zero
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(z.shape):
        raise ZeroStateError(f"{z.summary()}: .data may only be assigned a tensor of its shape {tuple(z.shape)}, got "
                             f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
    value = value.detach()
    if state.sync == "broadcast" and z.world_size > 1:
        value = state.ctx.comm.broadcast(value.clone(), 0, Tag(Kind.BROADCAST, f"zero3.Init value of {z.name}"))
    elif z.world_size > 1:
        value = value.clone()  # rank 0's where the ranks' differ, without writing into the caller's tensor
        take_rank0_where_ranks_differ(state.ctx, [(z.name, value)])
    shard = sharding.shard_tensor(value, z.world_size, z.rank).to(z.shard.device)
    if shard.dtype == z.shard.dtype:
        with state.ctx.resident([p], write=True, overwrite=True):
            z.shard.copy_(shard)
    elif z.swap is not None:
        raise ZeroStateError(f"{z.summary()}: its shard is on NVMe in {z.shard.dtype}; .data may only be assigned a "
                             f"{z.shard.dtype} tensor under zero3.Init(remote_device='nvme'), got {shard.dtype}")
    else:
        state.ctx.store.rebind(p, shard)
        set_placeholder_dtype(p, shard.dtype)


def _write_back(state: _InitState) -> None:
    """The parameters whose views building code held: their (possibly changed) full values go back
    into the shards, and they are released."""
    if not state.touched:
        return
    touched = sorted(state.touched.values(), key=lambda q: q._zero.id)
    state.touched.clear()
    reshaped = {p._zero.id for p in touched if raw_data(p).shape != p._zero.shape}
    for p in touched:
        data = raw_data(p)
        if p._zero.id in reshaped and data.untyped_storage().nbytes() < data.numel() * data.element_size():
            raise ZeroStateError(
                f"{p._zero.name}: while zero3.Init built the model, its .data was replaced by another partitioned "
                f"parameter's (shape {tuple(data.shape)}, its own {tuple(p._zero.shape)}; Hugging Face's "
                "resize_token_embeddings does this), whose values live in that one's shards. Resize after the "
                "Init block, inside `with zero3.GatheredParameters([model.get_input_embeddings().weight, "
                "model.get_output_embeddings().weight], modifier_rank=0):` (before zero3.initialize)")
    if state.sync == "broadcast" and state.ctx.world_size > 1:
        for p in touched:
            state.ctx.comm.broadcast(raw_data(p), 0, Tag(Kind.BROADCAST, f"zero3.Init value of {p._zero.name}"))
    else:
        take_rank0_where_ranks_differ(state.ctx, [(p._zero.name, raw_data(p)) for p in touched
                                                  if p._zero.id not in reshaped])
    with state.ctx.resident(touched, write=True, overwrite=True):
        for p in touched:
            if p._zero.id in reshaped:  # gathered.py [Note: a new shape before initialize]
                repartition(state.ctx, p)
            else:
                copy_full_into_shard(p)
    state.ctx.coordinator.release_for_user(touched)
