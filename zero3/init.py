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
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as module_mod

from .comm import Communicator
from .config import ZeroConfig, resolve_config
from .errors import ZeroConfigError
from .metrics import StepMetrics
from .param import PartitionedParameter, ZeroParameter, convert, copy_full_into_shard, free_full
from .state import ParamStatus

logger = logging.getLogger(__name__)

SyncMode = Literal["rng", "broadcast"]


@dataclass(eq=False)
class _InitState:
    config: ZeroConfig
    group: Any
    world_size: int
    rank: int
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


def group_info(group: Any) -> tuple[Any, int, int]:
    """(group, world_size, rank) for a process group, the default group, or no distributed at all."""
    if dist.is_available() and dist.is_initialized():
        g = group if group is not None else dist.group.WORLD
        return g, dist.get_world_size(g), dist.get_rank(g)
    if group is not None:
        raise ZeroConfigError("a process group was given but torch.distributed is not initialized")
    return None, 1, 0


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

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        group, world, rank = group_info(self._group)
        state = _InitState(config=resolve_config(self._config), group=group, world_size=world, rank=rank,
                           remote_device=self._remote_device, dtype=self._dtype, sync=self._sync)
        stack = _STACK.get()
        if not stack:
            _install_patches()
        if self._sync == "rng" and world > 1:
            _sync_rng(group)
        self._token = _STACK.set(stack + (state,))
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
            _STACK.reset(self._token)
            self._token = None
            if not _STACK.get():
                _remove_patches()


def _current() -> _InitState | None:
    stack = _STACK.get()
    return stack[-1] if stack else None


def _sync_rng(group: Any) -> None:
    cpu = torch.get_rng_state()
    dist.broadcast(cpu, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    torch.set_rng_state(cpu)
    if torch.cuda.is_available() and torch.cuda.is_initialized() and dist.get_backend(group) == "nccl":
        gpu = torch.cuda.get_rng_state().cuda()
        dist.broadcast(gpu, src=dist.get_global_rank(group, 0), group=group)
        torch.cuda.set_rng_state(gpu.cpu())


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
    for m in modules:
        for pname, p in list(m._parameters.items()):
            if p is None or isinstance(p, ZeroParameter):
                continue
            if state.sync == "broadcast" and state.world_size > 1:
                dist.broadcast(p.data, src=dist.get_global_rank(state.group, 0), group=state.group)
            convert(p, name=f"{type(m).__name__}.{pname}", world_size=state.world_size, rank=state.rank,
                    group=state.group, shard_device=state.remote_device, dtype=state.dtype)


def write_through(p: PartitionedParameter, func: Callable, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """An in-place op on a partitioned param inside Init: apply it to the full tensor, re-partition."""
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
        self.modifier_rank = modifier_rank
        self.enabled = enabled and bool(self.params)

    def __enter__(self) -> list[ZeroParameter]:
        if not self.enabled:
            return self.params
        for p in self.params:
            p._zero.user_pins += 1
        _fetch(self.params)
        return self.params

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._publish()
        finally:
            for p in self.params:
                p._zero.user_pins -= 1
            _release(self.params)

    def _publish(self) -> None:
        z0 = self.params[0]._zero
        if self.modifier_rank != LOCAL_MODIFIER and z0.world_size > 1:
            src = dist.get_global_rank(z0.group, self.modifier_rank) if z0.group is not None else self.modifier_rank
            flat = torch.cat([p.data.reshape(-1) for p in self.params])
            dist.broadcast(flat, src=src, group=z0.group)
            off = 0
            for p in self.params:
                n = p._zero.numel
                p.data.view(-1).copy_(flat[off: off + n])
                off += n
        for p in self.params:
            copy_full_into_shard(p)
            hook = p._zero.extra.get("on_shard_changed")
            if hook is not None:
                hook(p)


def _fetch(params: list[ZeroParameter]) -> None:
    owner = params[0]._zero.extra.get("coordinator")
    if owner is not None:
        owner.fetch(params)
        return
    missing = [p for p in params if p._zero.status is ParamStatus.NOT_AVAILABLE]
    if missing:
        z = missing[0]._zero
        comm = Communicator(z.group, world_size=z.world_size, rank=z.rank, overlap=False,
                            bucket_numel=1 << 62, reduce_impl="auto", metrics=StepMetrics())
        comm.all_gather(missing).wait()


def _release(params: list[ZeroParameter]) -> None:
    owner = params[0]._zero.extra.get("coordinator")
    if owner is not None:
        owner.release(params)
        return
    for p in params:
        if not p._zero.pinned and p._zero.status is ParamStatus.AVAILABLE:
            free_full(p)


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
