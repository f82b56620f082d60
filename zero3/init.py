"""`zero3.Init`: partition parameters as the model is built; `GatheredParameters`; external params.

[Note: partitioning during construction]
Entering the outermost `Init` wraps the ``__init__`` of every ``nn.Module`` subclass (and of
classes defined while it is active, through ``__init_subclass__``), wraps ``nn.Module.apply`` and
installs a global parameter-registration hook; leaving it (also on an exception) restores exactly
those, so nothing leaks into modules built afterwards. A module's parameters are partitioned the
moment its outermost ``__init__`` returns (after its own ``reset_parameters``), so construction
holds at most one module's full parameters plus this rank's shards, even for
``nn.Sequential(*[nn.Linear(...) for _ in range(n)])``. Parameters registered after ``__init__``
are partitioned when the context exits.

Initialisation stays consistent across ranks because entering `Init` broadcasts rank 0's RNG state
(``sync="rng"``, the default): every rank then draws the same full tensors and keeps its own slice.
``sync="broadcast"`` instead broadcasts every parameter from rank 0 (exact even when ranks would
compute different values, at the price of one broadcast per parameter). Re-initialisation after a
child is partitioned works too: ``module.apply(fn)`` gathers each module's parameters around ``fn``,
and an in-place op on a partitioned parameter (``nn.init.normal_(p)``) is applied to the gathered
tensor and re-partitioned ("write-through"). Both are collectives: every rank must build the model
the same way, which data-parallel code does.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal
from weakref import WeakSet

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from .comm import Kind, Tag
from .config import resolve_config
from .context import RuntimeContext
from .errors import ZeroConfigError
from .param import PartitionedParameter, ZeroParameter, copy_full_into_shard, inplace_handler, raw_data

logger = logging.getLogger(__name__)

SyncMode = Literal["rng", "broadcast"]


@dataclass(eq=False)
class _InitState:
    ctx: RuntimeContext  # the minimal context that partitions (and gathers) while building
    remote_device: torch.device | None
    dtype: torch.dtype | None
    sync: SyncMode
    modules: "WeakSet[nn.Module]" = field(default_factory=WeakSet)


_STACK: contextvars.ContextVar[tuple[_InitState, ...]] = contextvars.ContextVar("zero3_init", default=())


@dataclass(eq=False)
class _Patches:
    handles: list[Any]
    apply: Callable
    init_subclass: Any
    inits: dict[type, Callable]  # original __init__ of every class we wrapped
    building: dict[int, int] = field(default_factory=dict)  # id(module) -> nesting of its __init__ wrappers


_PATCHES: contextvars.ContextVar[_Patches | None] = contextvars.ContextVar("zero3_init_patches", default=None)


class Init:
    """Context manager: every parameter created inside is partitioned across the group's ranks.

    Args:
        config: a `ZeroConfig` (or dict / JSON path); used for dtype-independent defaults only.
        group: process group to partition over (default: the world group, or none if
            ``torch.distributed`` is not initialised, i.e. world size 1).
        enabled: ``False`` makes the context a no-op (a plain model is built).
        remote_device: where shards live (``"cpu"`` to keep them off the GPU); default: where the
            parameter was created.
        dtype: cast floating-point parameters to this dtype before partitioning.
        sync: ``"rng"`` (broadcast rank 0's RNG state on entry) or ``"broadcast"`` (broadcast every
            parameter from rank 0).
    """

    def __init__(self, config: Any = None, group: Any = None, enabled: bool = True,
                 remote_device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 sync: SyncMode = "rng") -> None:
        if sync not in ("rng", "broadcast"):
            raise ZeroConfigError(f"Init(sync=...) must be 'rng' or 'broadcast', got {sync!r}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ZeroConfigError(f"Init(dtype=...) must be a torch.dtype, got {dtype!r}")
        self.enabled = enabled
        self._config = config
        self._group = group
        self._remote_device = torch.device(remote_device) if remote_device is not None else None
        self._dtype = dtype
        self._sync: SyncMode = sync
        self._token: Any = None
        self._handler_token: Any = None

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        ctx = RuntimeContext.minimal(resolve_config(self._config), self._group)
        state = _InitState(ctx=ctx, remote_device=self._remote_device, dtype=self._dtype, sync=self._sync)
        stack = _STACK.get()
        if not stack:
            _install_patches()
        if self._sync == "rng" and ctx.world_size > 1:
            _sync_rng(ctx)
        self._token = _STACK.set(stack + (state,))
        self._handler_token = inplace_handler.set(write_through)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled or self._token is None:
            return
        state = _STACK.get()[-1]
        try:
            if exc_type is None:
                for m in list(state.modules):
                    _partition_module(m, state, recurse=False)
        finally:
            inplace_handler.reset(self._handler_token)
            _STACK.reset(self._token)
            self._token = None
            if not _STACK.get():
                _remove_patches()


def _current() -> _InitState | None:
    stack = _STACK.get()
    return stack[-1] if stack else None


def _sync_rng(ctx: RuntimeContext) -> None:
    """Every rank takes rank 0's RNG state (CPU, and CUDA on NCCL), so they draw the same weights."""
    tag = Tag(Kind.BROADCAST, "zero3.Init RNG state")
    torch.set_rng_state(ctx.comm.broadcast(torch.get_rng_state().to(ctx.comm.device), 0, tag).cpu())
    if torch.cuda.is_available() and torch.cuda.is_initialized() and ctx.comm.backend == "nccl":
        torch.cuda.set_rng_state(ctx.comm.broadcast(torch.cuda.get_rng_state().cuda(), 0, tag).cpu())


# -- global patches, installed only while an Init context is active ------------------------------
def _on_param_registered(module: nn.Module, name: str, param: Any) -> None:
    state = _current()
    if state is not None and param is not None:
        state.modules.add(module)


def _wrap_init(cls: type, patches: _Patches) -> None:
    """Wrap ``cls.__init__`` so a module is partitioned the moment its outermost ``__init__`` returns."""
    orig = cls.__dict__.get("__init__")
    if orig is None or cls in patches.inits or getattr(orig, "_zero3_wrapped", False):
        return

    @functools.wraps(orig)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        key = id(self)
        patches.building[key] = patches.building.get(key, 0) + 1
        try:
            orig(self, *args, **kwargs)
        finally:
            depth = patches.building.pop(key) - 1
            if depth:
                patches.building[key] = depth
        state = _current()
        if not depth and state is not None:
            _partition_module(self, state, recurse=True)

    __init__._zero3_wrapped = True  # type: ignore[attr-defined]
    try:
        cls.__init__ = __init__  # type: ignore[misc]
    except (TypeError, AttributeError):
        return
    patches.inits[cls] = orig


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], list(cls.__subclasses__())
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def _apply_with_gather(self: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    """``Module.apply`` under Init: gather each module's own parameters around ``fn``."""
    for child in self.children():
        child.apply(fn)
    params = [p for p in self._parameters.values() if isinstance(p, ZeroParameter)]
    state = _current()
    if not params or state is None:
        fn(self)
        return self
    modifier = 0 if state.sync == "broadcast" else LOCAL_MODIFIER
    with GatheredParameters(params, modifier_rank=modifier):
        fn(self)
    return self


def _install_patches() -> None:
    handles = [module_mod.register_module_parameter_registration_hook(_on_param_registered)]
    patches = _Patches(handles=handles, apply=nn.Module.apply,
                       init_subclass=nn.Module.__dict__.get("__init_subclass__"), inits={})
    _PATCHES.set(patches)
    for cls in _all_subclasses(nn.Module):
        _wrap_init(cls, patches)

    def __init_subclass__(cls: type, **kwargs: Any) -> None:  # classes defined while Init is active
        super(nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
        _wrap_init(cls, patches)

    nn.Module.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
    nn.Module.apply = _apply_with_gather  # type: ignore[method-assign]


def _remove_patches() -> None:
    patches = _PATCHES.get()
    if patches is None:
        return
    for h in patches.handles:
        h.remove()
    nn.Module.apply = patches.apply  # type: ignore[method-assign]
    if patches.init_subclass is None:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = patches.init_subclass  # type: ignore[assignment]
    for cls, orig in patches.inits.items():
        cls.__init__ = orig  # type: ignore[misc]
    _PATCHES.set(None)


def _partition_module(module: nn.Module, state: _InitState, *, recurse: bool) -> None:
    modules = module.modules() if recurse else (module,)
    ctx = state.ctx
    for m in modules:
        for pname, p in list(m._parameters.items()):
            if p is None or isinstance(p, ZeroParameter):
                continue
            name = f"{type(m).__name__}.{pname}"
            if state.sync == "broadcast" and ctx.world_size > 1:
                ctx.comm.broadcast(p.data, 0, Tag(Kind.BROADCAST, f"zero3.Init value of {name}"))
            ctx.partition(p, name, shard_device=state.remote_device, dtype=state.dtype)


def write_through(p: PartitionedParameter, func: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """An in-place op on a partitioned param inside Init: apply it to the full tensor, re-partition.
    (Installed as ``param.inplace_handler`` while an Init context is active.)"""
    state = _current()
    if state is None:
        return False, None
    modifier = 0 if state.sync == "broadcast" else LOCAL_MODIFIER
    with GatheredParameters([p], modifier_rank=modifier):
        result = func(*args, **kwargs)
    return True, result


# -- GatheredParameters ------------------------------------------------------------------------
LOCAL_MODIFIER = -1
"""``modifier_rank`` meaning: every rank made the same change; re-partition without a broadcast."""


class GatheredParameters:
    """Gather partitioned parameters for reading, or for modifying them on one rank.

    A collective: every rank of the parameters' group must enter it with the same parameters.
    With ``modifier_rank=r``, rank r may change the full tensors; on exit they are broadcast from r
    and re-partitioned on every rank (this is how pretrained weights are loaded into a partitioned
    model). With ``modifier_rank=None`` changes are discarded. Parameters already gathered (by a
    running module, or persistent ones) stay gathered on exit.
    """

    def __init__(self, params: Iterable[nn.Parameter] | nn.Parameter, modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        seen: dict[int, ZeroParameter] = {}
        for p in params:
            if isinstance(p, ZeroParameter):
                seen.setdefault(p._zero.id, p)
        self.params = sorted(seen.values(), key=lambda p: p._zero.id)  # same order on every rank
        self._ids = tuple(p._zero.id for p in self.params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)

    def __enter__(self) -> list[ZeroParameter]:
        if not self.enabled:
            return self.params
        _owner(self.params).coordinator.gather_for_user(self.params)
        return self.params

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._publish()
        finally:
            _owner(self.params).coordinator.release_for_user(self.params)

    def _publish(self) -> None:
        ctx = _owner(self.params)
        if self.modifier_rank != LOCAL_MODIFIER and ctx.world_size > 1:
            flat = torch.cat([raw_data(p).reshape(-1) for p in self.params])
            ctx.comm.broadcast(flat, self.modifier_rank, Tag(Kind.BROADCAST, "GatheredParameters(modifier_rank="
                                                           f"{self.modifier_rank})", self._ids))
            off = 0
            for p in self.params:
                n = p._zero.numel
                raw_data(p).view(-1).copy_(flat[off: off + n])
                off += n
        for p in self.params:
            copy_full_into_shard(p)


def _owner(params: list[ZeroParameter]) -> RuntimeContext:
    """The one context that drives ``params``; mixing models in one call is refused."""
    ctx = params[0]._zero.ctx
    for p in params[1:]:
        if p._zero.ctx is not ctx:
            raise ZeroConfigError(f"GatheredParameters got parameters of two different models or zero3.Init "
                                  f"contexts ({params[0]._zero.name} and {p._zero.name}); gather each model's "
                                  "parameters in their own context")
    return ctx


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter``, which another module owns.

    zero3 then gathers it with ``module`` (forward and backward). Accesses through another module's
    attribute (``self.wte.weight``) inside a forward are detected automatically once the engine is
    initialised; this call makes it explicit and works for any access path.
    """
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter expects an nn.Parameter, got {type(parameter).__name__}")
    ext = module.__dict__.setdefault("_external_params", {})
    ext[id(parameter)] = parameter


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    return list(module.__dict__.get("_external_params", {}).values())
