"""The partitioned parameter: one `ZeroParam` record per ``nn.Parameter``.

[Note: parameter storage]
A partitioned parameter keeps its full *shape* but owns no memory: ``param.data`` is a tensor of the
true shape whose storage is resized to 0 bytes. Gathering resizes that same storage back and fills
it; releasing resizes it to 0 again. Autograd may have saved views of the weight (``weight.t()`` in
``F.linear``); because the storage object is kept, those views see the re-gathered data in backward
and the memory is really freed in between. Code that reads ``param.shape`` (PEFT, HF) sees the truth,
and the familiar DeepSpeed names (``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_tensor``,
``ds_status``) read the record: through read-only properties while partitioned, and from entries of
the parameter's ``__dict__`` that every gather rewrites from the record while gathered.

The parameter's Python class tells its state: exactly ``nn.Parameter`` while gathered (torch's
own class: no ``__torch_function__`` lookup on any call, see `ZeroParameter`; from the end of a
backward to the next step a gathered trainable one is a `PendingGradParameter`),
`PartitionedParameter` otherwise, whose ``__torch_function__`` turns any computation into a
`ZeroStateError` naming the parameter. ``isinstance(p, ZeroParameter)`` holds in both states.

This module holds the record and the storage primitives; it decides nothing. `partition` (used by
``zero3.Init`` and ``initialize``) creates the record and releases the parameter at once; after that
only the coordinator (runtime/coordinator.py) and its persistent parameters (runtime/persistent.py)
call `begin_gather`, `finish_gather`, `release`, `alias_shard` and `unalias_shard`, so every status
change of a built model has one driver.
"""

from __future__ import annotations

import contextvars
import itertools
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from . import sharding
from .ids import new_id
from .refused_use import partitioned_use_message
from ..errors import ZeroStateError
from .state import LEGAL_NEXT_STATUS, MEMORY, ParamStatus, Residence, check_transition

# Read three times per gather and release: a module global costs a tenth of a member read through its class.
_NOT_AVAILABLE, _INFLIGHT, _AVAILABLE = ParamStatus.NOT_AVAILABLE, ParamStatus.INFLIGHT, ParamStatus.AVAILABLE

ConstructionHandler = Callable[[Any, Callable, tuple, dict], tuple[bool, Any]]
construction_handler: contextvars.ContextVar[ConstructionHandler | None] = contextvars.ContextVar(
    "zero3_construction_handler", default=None)
"""Set by ``zero3.Init`` while it builds a model: an op on a partitioned parameter (or on its
``.data``) is handed to it (``nn.init.normal_(p)``, ``p[idx]``, ``p.data = x``, reading values),
which gathers the parameter around the op instead of raising (runtime/init.py [Note: touching partitioned
parameters while building])."""

converting: contextvars.ContextVar[bool] = contextvars.ContextVar("zero3_module_conversion", default=False)
"""Set by partition/conversion.py while torch's ``Module._apply`` (``model.to(...)``) runs with every
zero3 parameter handed back unchanged: reading ``param.grad`` is then torch's plain read (nothing is
converted, so no gradient is misread)."""


@dataclass(eq=False)
class ZeroParam:
    """Everything zero3 knows about one partitioned parameter."""

    id: int
    name: str
    shape: torch.Size
    dtype: torch.dtype
    shard: torch.Tensor  # 1D, this rank's padded shard; the optimizer steps on it unless `master` is set.
    # `shard`, `dtype` (after creation) and `residence` have one writer: offload/residence.py `ShardStore`.
    world_size: int
    rank: int
    group: Any  # the process group it is partitioned over (None: a single process)
    status: ParamStatus = ParamStatus.NOT_AVAILABLE
    persistent: bool = False
    active_forward: int = 0  # modules currently running forward that use it
    active_backward: int = 0  # backward calls (gathered in pre-backward) not finished yet
    user_pins: int = 0  # open GatheredParameters contexts
    handle: Any = None  # the coordinator's in-flight gather while INFLIGHT
    master: torch.Tensor | None = None  # fp32 master shard (a view into a flat buffer), if separate
    prefetched: bool = False  # gathered ahead of use and not used yet (prefetch accounting)
    aliased: bool = False  # world size 1, persistent: the full data is a view of the shard (alias_shard)
    swap: Any = None  # the `nvme.ShardSwap` of a shard whose tier is the drive (None: it belongs in memory)
    secondary: Any = None  # hpZ: a `Secondary` (comm/secondary.py), this rank's slice kept from a forward gather (runtime/hpz.py)
    ctx: Any = None  # the RuntimeContext that owns the parameter (runtime/context.py imports this module)
    flat: torch.Tensor | None = None  # a flat view of the full data, kept across resizes (`alloc_full`)
    flat_storage: Any = None  # the storage ``flat`` views (an UntypedStorage), resized by gathers and releases
    numel: int = field(init=False)  # full, unpadded; read on every fetch and release, so stored
    shard_numel: int = field(init=False)  # padded; the same on every rank and for every shard dtype
    residence: Residence = field(init=False)  # where the shard's bytes are
    nbytes: int = field(init=False)  # of the full data in `dtype`; read on every gather and release, so stored

    def __post_init__(self) -> None:
        self.numel = self.shape.numel()
        self.shard_numel = self.shard.numel()
        self.residence = residence_of(self.shard)
        self.nbytes = self.numel * self.dtype.itemsize

    def reshape(self, shape: torch.Size, shard: torch.Tensor) -> None:
        """A new full shape with its new shard (its one caller is `ShardStore.repartition`)."""
        self.shape = shape
        self.numel = shape.numel()
        self.shard = shard
        self.shard_numel = shard.numel()
        self.residence = residence_of(shard)
        self.retype(shard.dtype)
        self.flat = None  # the full data is another storage now

    def retype(self, dtype: torch.dtype) -> None:
        """``dtype`` follows the shard (its one writer is `ShardStore.rebind`); ``nbytes`` follows it."""
        self.dtype = dtype
        self.nbytes = self.numel * dtype.itemsize

    @property
    def pinned(self) -> bool:
        return self.persistent or self.active_forward > 0 or self.active_backward > 0 or self.user_pins > 0

    @property
    def train_tensor(self) -> torch.Tensor:
        """The tensor the optimizer steps on and whose ``.grad`` is the gradient shard: the fp32
        master under mixed precision or optimizer offload, else the shard itself."""
        return self.master if self.master is not None else self.shard

    def set_status(self, new: ParamStatus) -> None:
        if new not in LEGAL_NEXT_STATUS[self.status]:  # the table, checked inline: 3 changes per gather
            check_transition(self.name, self.status, new)  # raises, naming the parameter
        self.status = new

    def shard_range(self) -> tuple[int, int]:
        return sharding.shard_range(self.numel, self.world_size, self.rank)

    def summary(self) -> str:
        return (f"{self.name or '<unnamed>'} (ds_id={self.id}, ds_shape={tuple(self.shape)}, "
                f"ds_status={self.status.name}, rank={self.rank}/{self.world_size})")


def residence_of(t: torch.Tensor | torch.UntypedStorage) -> Residence:
    """The memory place of a tensor's (or a storage's) bytes. Whether memory is pinned is a CUDA
    driver call that may create a context, so it is asked only once torch's CUDA state is
    initialised; before, host memory counts as HOST (a label: no move depends on pinned or not)."""
    if t.device.type != "cpu":
        return Residence.DEVICE
    return Residence.PINNED_HOST if torch.cuda.is_initialized() and t.is_pinned() else Residence.HOST


class _ZeroParameterType(type(nn.Parameter)):  # type: ignore[misc]
    """Makes ``isinstance(p, ZeroParameter)`` true of every zero3 parameter, gathered ones included,
    whose class is exactly ``nn.Parameter`` (see `ZeroParameter`)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if type(obj) is nn.Parameter:
            return cls is ZeroParameter and "_zero" in obj.__dict__
        return super().__instancecheck__(obj)


class ZeroParameter(nn.Parameter, metaclass=_ZeroParameterType):
    """A parameter zero3 partitioned: the type ``isinstance`` and annotations name, and its API.

    No parameter keeps this class itself. Partitioned, its class is `PartitionedParameter`, whose
    guard makes computing with it raise. Gathered, its class is exactly ``nn.Parameter``: torch
    skips the ``__torch_function__`` lookup for that class (and for ``Tensor``) and does it on every
    call that takes a tensor of any other class, at about 1,500 instructions a lookup; a threshold-0
    step makes four per parameter (its module's op, reading and clearing ``.grad`` after
    accumulation, ``untyped_storage()`` at release). A gathered parameter keeps this class's API
    (the ``ds_*`` attributes, ``all_gather``, ``partition``, the refusals to copy or pickle) through
    entries in its ``__dict__`` (`_expose_api`, `refresh_api`), which the properties here shadow
    while it is partitioned."""

    _zero: ZeroParam

    @property
    def ds_id(self) -> int:
        return self._zero.id

    @property
    def ds_shape(self) -> torch.Size:
        return self._zero.shape

    @property
    def ds_numel(self) -> int:
        return self._zero.numel

    @property
    def ds_tensor(self) -> torch.Tensor:
        return self._zero.shard

    @property
    def ds_status(self) -> ParamStatus:
        return self._zero.status

    @property
    def ds_persist(self) -> bool:
        return self._zero.persistent

    def ds_summary(self) -> str:
        return self._zero.summary()

    def all_gather(self, param_list: Any = None, async_op: bool = False, hierarchy: int = 0) -> None:
        """DeepSpeed's ``param.all_gather()``: gather this parameter (and those of ``param_list``)
        and keep them gathered until `partition`. A collective: call it on every rank."""
        params = _sorted_params(self, param_list)
        self._zero.ctx.require_states("param.all_gather()", ("lp_params",))
        self._zero.ctx.refresh_stale_persistent()  # a local setter's stale persistent copies (runtime/persistent.py)
        self._zero.ctx.gather_for_user(params)

    def partition(self, param_list: Any = None, has_been_updated: bool = False) -> None:
        """DeepSpeed's ``param.partition()``: end an `all_gather`. With ``has_been_updated`` the
        gathered values (changed the same way on every rank) are written back into the shards; data
        of a new shape is partitioned anew before ``zero3.initialize`` and refused after it (the
        parameter then keeps its shape and values). The parameters are released either way."""
        params = [p for p in _sorted_params(self, param_list) if p._zero.user_pins > 0]
        try:
            if has_been_updated:  # a new shape too, before initialize (runtime/publish.py)
                self._zero.ctx.write_updated(params, "param.partition(has_been_updated=True)")
        finally:
            self._zero.ctx.coordinator.release_for_user(params)

    def __deepcopy__(self, memo: dict) -> Any:
        handler = construction_handler.get()  # inside zero3.Init: a partitioned copy (runtime/init.py)
        if handler is not None:
            done, result = handler(self, ZeroParameter.__deepcopy__, (self, memo), {})
            if done:
                return result
        if self._zero.status is ParamStatus.AVAILABLE:  # gathered (for the user, or persistent): torch's copy
            return memo.setdefault(id(self), nn.Parameter(raw_data(self).detach().clone(), self.requires_grad))
        raise ZeroStateError(f"cannot deepcopy partitioned parameter {self._zero.summary()}: deep-copy inside `with "
                             "zero3.Init():` (a partitioned copy) or zero3.GatheredParameters (a plain one)")

    def __reduce_ex__(self, proto: Any) -> Any:
        raise ZeroStateError(
            f"cannot pickle partitioned parameter {self._zero.summary()}; save with "
            "engine.save_checkpoint() or a consolidated state dict")


def _sorted_params(first: ZeroParameter, more: Any) -> list[ZeroParameter]:
    found = {first._zero.id: first}
    for q in more or ():
        if not isinstance(q, ZeroParameter):
            raise ZeroStateError(f"param_list holds a parameter of shape {tuple(q.shape)} that zero3 did not partition")
        found.setdefault(q._zero.id, q)
    return [found[i] for i in sorted(found)]  # the same order on every rank


# Tensor methods and properties that only read metadata or register hooks: allowed while partitioned.
_METADATA_OK = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
    "get_device", "is_contiguous", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "__hash__", "__len__", "data_ptr", "untyped_storage", "_is_view", "is_shared", "is_pinned",
    "__reduce_ex__", "__deepcopy__", "__setstate__", "_has_compatible_shallow_copy_type",
})
_COMPUTE_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})
_REPR = frozenset({"__repr__", "__str__", "__format__"})


def _guard(cls: type, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    """``__torch_function__`` of a partitioned parameter and of its ``.data``: metadata only."""
    kwargs = kwargs or {}
    name = getattr(func, "__name__", "")
    if name == "__delete__" and getattr(getattr(func, "__self__", None), "__name__", "") == "grad" \
            and isinstance(args[0], PartitionedParameter):
        _check_grad_write(args[0])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if name in ("__get__", "__set__"):
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        if name == "__set__" and prop == "data" and isinstance(args[0], PartitionedParameter):
            if args[1] is args[0]:
                return None  # ``p.data = p`` (torch's Module._apply, handed p back): nothing changes
            handler = construction_handler.get()
            if handler is not None:
                done, result = handler(args[0], func, args, kwargs)
                if done:
                    return result
            raise ZeroStateError(
                f"assigning .data of partitioned parameter {args[0]._zero.summary()} would drop its shards; "
                "write the full value inside `with zero3.GatheredParameters([param], modifier_rank=0):` "
                "(param.data.copy_(value)), or load it with zero3.pretrained.load_state_dict")
        if prop == "grad" and name == "__set__" and isinstance(args[0], PartitionedParameter):
            _check_grad_write(args[0], args[1] if len(args) > 1 else None)
        if prop not in _COMPUTE_PROPERTIES:
            with torch._C.DisableTorchFunctionSubclass():
                result = func(*args, **kwargs)
            if prop == "data" and name == "__get__" and isinstance(args[0], PartitionedParameter):
                # Its storage holds 0 bytes: hand out a guarded alias, never a bare tensor.
                result = result.as_subclass(ReleasedData)
                result._zero = args[0]._zero
            elif prop == "grad" and name == "__get__" and result is None and isinstance(args[0], PartitionedParameter) \
                    and not converting.get():
                _check_grad_read(args[0])
            return result
    elif name in _METADATA_OK:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    target = _first_guarded(args, kwargs)
    if name in _REPR and target is not None:
        return f"{type(target).__name__}({target._zero.summary()})"
    handler = construction_handler.get()
    if handler is not None and target is not None:
        done, result = handler(target, func, args, kwargs)
        if done:
            return result
    late_read = target._zero.ctx.late_read if target is not None and target._zero.ctx is not None else None
    if late_read is not None:  # inside a backward, after the parameter's module's (runtime/late_read.py)
        done, result = late_read(target, func, args, kwargs)
        if done:
            return result
    which = target._zero.summary() if target is not None else "<unknown>"
    building = _optimizer_being_built()
    if building is not None:
        raise ZeroStateError(
            f"parameter {which} is used by {name or func!r} while it is partitioned: {building} initialises its "
            "state from the parameters when it is built, which zero3 holds only as shards. Pass it to "
            f"zero3.initialize as a callable over the shards instead: zero3.initialize(model, lambda groups: "
            f"{building}(groups, ...), config) (the same for deepspeed.initialize's optimizer argument)")
    if func is torch.autograd.grad:
        raise ZeroStateError(
            f"torch.autograd.grad with respect to partitioned parameters ({which}): zero3 reduces each parameter's "
            "gradient into its shards as the backward produces it, and hands back no full gradient. Use "
            "loss.backward() (or engine.backward) and read the reduced gradients from the shards "
            "(zero3.safe_get_full_grad), or gather the parameters around the forward and the grad call: `with "
            "zero3.GatheredParameters(list(model.parameters())):` (the gradients are then this rank's own, "
            "not averaged, as DDP's autograd.grad returns them). Gradients with respect to inputs work as in torch")
    if func is torch.autograd.backward:
        raise ZeroStateError(
            f"backward(inputs=[...]) names partitioned parameter {which}, which is not gathered now: torch hands "
            "it to zero3 before the backward starts. zero3 reduces the gradient of every trainable parameter the "
            "backward reaches; to leave some unchanged, set requires_grad_(False) on them before zero3.initialize "
            "(or give the optimizer only the others), and drop inputs=. Parameters kept gathered (persistent) may "
            "be named")
    raise ZeroStateError(partitioned_use_message(which, repr(name or func), target))


class PartitionedParameter(ZeroParameter):
    """A partitioned parameter whose full data is not gathered: computing with it raises."""

    __torch_function__ = classmethod(_guard)  # type: ignore[assignment]

    def set_(self, source: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``Tensor.set_`` never reaches ``__torch_function__``, so it would swap the storage behind the
        shards in silence (torch's ``remove_parametrizations`` calls it). Inside `zero3.Init` a full
        tensor of the parameter's shape is written into the shards, as ``p.data = t`` is; anything else
        is refused."""
        handler = construction_handler.get()
        if handler is not None and isinstance(source, torch.Tensor) and not args and not kwargs:
            done, _ = handler(self, PartitionedParameter.set_, (self, source), {})
            if done:
                return self
        raise ZeroStateError(
            f"{self._zero.summary()}: set_ would replace the storage of a partitioned parameter behind its shards; "
            "write full values inside `with zero3.GatheredParameters([p], modifier_rank=0):` (or, while zero3.Init "
            "builds, p.set_(t) / p.data = t with t of the parameter's shape)")


_TENSOR_GRAD = torch._C.TensorBase.__dict__["grad"]  # torch's own ``.grad`` descriptor


class PendingGradParameter(ZeroParameter):
    """A gathered parameter (persistent, or held by ``GatheredParameters``) after a backward that
    reduced its gradient into its shard: reading ``.grad`` as None is refused as on a partitioned
    parameter (`_check_grad_read`), so ``torch.nn.utils.clip_grad_norm_(model.parameters())`` on a
    model whose parameters are all kept gathered no longer clips nothing in silence. Nothing else is
    guarded (no ``__torch_function__`` of its own); runtime/step.py gives the class at the end of a
    backward and takes it back as the next step begins, so forwards see torch's class."""

    @property  # type: ignore[override]
    def grad(self) -> torch.Tensor | None:
        g = _TENSOR_GRAD.__get__(self)
        if g is None and not converting.get():
            _check_grad_read(self)
        return g

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _check_grad_write(self, value)
        _TENSOR_GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        _check_grad_write(self)
        _TENSOR_GRAD.__delete__(self)


def drop_grad_slots(params: Iterable[torch.Tensor]) -> None:
    """`drop_grad_slot` for each of ``params`` that holds a gradient (read past the guard too)."""
    with torch._C.DisableTorchFunctionSubclass():
        for p in params:
            if _TENSOR_GRAD.__get__(p) is not None:  # not through a guarded class's property, which may refuse
                drop_grad_slot(p)


def take_grad_slot(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad``, emptied, for zero3's own use, past the guard on the user's reads: a released
    parameter's slot is read when an AccumulateGrad fires with nothing after a nested backward reduced
    its gradient (a reversible layer's Function given the parameters, probe 37E; the guard blamed user code)."""
    if type(p) is nn.Parameter:  # gathered, the usual case: torch's class, nothing guarded
        grad = p.grad
        p.grad = None
        return grad
    with torch._C.DisableTorchFunctionSubclass():
        grad = _TENSOR_GRAD.__get__(p)
        _TENSOR_GRAD.__set__(p, None)
    return grad


def drop_grad_slot(p: torch.Tensor) -> None:
    """``p.grad = None`` for zero3's own use (a gradient autograd accumulated there, handed on),
    past the guard on the user's writes (`_check_grad_write`)."""
    if type(p) is nn.Parameter:  # gathered in a backward, the usual case: torch's class, nothing guarded
        p.grad = None
        return
    with torch._C.DisableTorchFunctionSubclass():
        _TENSOR_GRAD.__set__(p, None)


def guard_pending_grads(params: list[ZeroParameter]) -> dict[int, ZeroParameter]:
    """Between steps: every gathered trainable one of ``params`` becomes a `PendingGradParameter`;
    returns them by id (for `unguard_pending_grads`)."""
    guarded = {id(p): p for p in params if type(p) is nn.Parameter and p.requires_grad}
    for p in guarded.values():
        p.__class__ = PendingGradParameter
    return guarded


def unguard_pending_grads(params: Iterable[ZeroParameter]) -> None:
    """A step begins: those of ``params`` still guarded are torch's class again (one released or
    re-gathered since already has its class)."""
    for p in params:
        if type(p) is PendingGradParameter:
            p.__class__ = nn.Parameter


class ReleasedData(torch.Tensor):
    """``param.data`` of a partitioned parameter: the 0-byte placeholder, guarded the same way."""

    _zero: ZeroParam
    __torch_function__ = classmethod(_guard)  # type: ignore[assignment]


def _check_grad_read(p: ZeroParameter) -> None:
    """``p.grad`` read None on a partitioned parameter: refuse it where None would be a wrong answer.

    The reducer adds a parameter's gradient into its shard's ``.grad`` (`ZeroParam.train_tensor`),
    never into ``p.grad``. Between a backward and the step, code written for plain torch that reads
    ``p.grad`` (``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, which then clips nothing
    and returns 0; ``model.zero_grad()``, which then drops nothing) would silently see no gradient."""
    z = p._zero
    if z.train_tensor.grad is None:
        if z.ctx is not None:
            z.ctx.check_gradient_read(p, "param.grad")  # used by the step in backward: not "none"
        return
    if _detached(z):
        return
    raise ZeroStateError(
        f"param.grad of {z.summary()}: zero3 reduced this parameter's gradient into shards (each rank "
        "holds its 1/world_size slice), so param.grad is None although a gradient exists; code written "
        "for plain torch would read it as none (torch.nn.utils.clip_grad_norm_(model.parameters(), ...) "
        "clips nothing and returns 0, model.zero_grad() drops nothing). Clip with "
        "zero3.clip_grad_norm_(engine_or_model, max_norm) or the config's gradient_clipping; read the "
        "gradient with zero3.safe_get_full_grad(param) (a collective) or zero3.safe_get_local_grad(param) "
        "(this rank's slice); drop the gradients with the optimizer's zero_grad() (engine.zero_grad())")


def _check_grad_write(p: ZeroParameter, value: torch.Tensor | None = None) -> None:
    """``p.grad`` assigned or deleted (``value`` None) where the optimizer would not see it: refused,
    pointing at the setters that reach the shard. The optimizer steps on the shard's gradient, so a
    write while the shard holds one would be ignored (a parameter meant to be skipped would step), as
    was one where the shard holds none (not reached by the backward, or before any: probe 35B, torch
    steps on it). Clearing one that is not there (``optimizer.zero_grad()``) is taken."""
    z = p._zero
    if converting.get():
        return
    if z.train_tensor.grad is None:
        if z.ctx is not None:
            try:
                z.ctx.check_gradient_read(p, "param.grad")
            except ZeroStateError:
                raise ZeroStateError(
                    f"param.grad of {z.summary()} assigned or deleted after the optimizer step taken in this backward "
                    "(offload_optimizer_step_in_backward) used its gradient, so the write would change nothing. Set "
                    "gradients (zero3.safe_set_full_grad) in a run with offload_optimizer_step_in_backward=False") from None
        if value is None or z.ctx is None or _detached(z):
            return
        raise ZeroStateError(
            f"param.grad of {z.summary()} assigned: zero3's optimizer steps on gradient shards (each rank holds "
            "its 1/world_size slice of the reduced gradient), never on param.grad, so the value would be "
            "ignored (torch would step on it). Use zero3.safe_set_full_grad(param, value) (the full gradient, "
            "the same on every rank) or zero3.safe_set_local_grad(param, value) (this rank's slice)")
    if _detached(z):
        return
    raise ZeroStateError(
        f"param.grad of {z.summary()} assigned or deleted between backward and step: zero3 keeps the reduced "
        "gradient in shards (each rank holds its 1/world_size slice) and the optimizer steps on those, so the "
        "write would be ignored. Use zero3.safe_set_full_grad(param, value) (the full gradient, the same on "
        "every rank; None drops it, so the optimizer skips the parameter) or zero3.safe_set_local_grad(param, "
        "value) (this rank's slice)")


def _detached(z: ZeroParam) -> bool:
    """No engine steps ``z``'s gradient shards any more (``engine.remove_hooks()``): ``p.grad`` is
    torch's again, for the user to read and clear."""
    return z.ctx is not None and not z.ctx.attached


def _optimizer_being_built() -> str | None:
    """The name of a ``torch.optim.Optimizer`` whose ``__init__`` is running up the stack (Adagrad's
    fills its state from each parameter), for the guard's error; None if none."""
    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return None
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), torch.optim.Optimizer):
            cls = type(frame.f_locals["self"])
            return f"torch.optim.{cls.__name__}" if cls.__module__.startswith("torch.optim") else cls.__name__
        frame = frame.f_back
    return None


def _first_guarded(args: tuple, kwargs: dict) -> Any:
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, (PartitionedParameter, ReleasedData)):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, (PartitionedParameter, ReleasedData)):
                    return b
    return None


def raw_data(p: nn.Parameter) -> torch.Tensor:
    """``p.data`` without the guard (zero3 internals filling or freeing the storage)."""
    with torch._C.DisableTorchFunctionSubclass():
        return p.data


def is_partitioned(p: Any) -> bool:
    """Whether ``p`` is a parameter partitioned by zero3 (DeepSpeed's ``is_zero_param``)."""
    return isinstance(p, ZeroParameter)


# -- storage and status of the full tensor ---------------------------------------------------
def begin_gather(p: ZeroParameter, handle: Any) -> None:
    """NOT_AVAILABLE -> INFLIGHT: a gather of ``p`` was issued; ``handle`` is what to wait on. Its
    shard must be in memory (one on the drive is read first, one taken by offload_states reloaded)."""
    if p._zero.residence not in MEMORY:
        raise ZeroStateError(f"{p._zero.summary()}: gathered while its shard is {p._zero.residence.name}, "
                             "not in memory")
    p._zero.set_status(_INFLIGHT)
    p._zero.handle = handle


def alloc_full(p: ZeroParameter) -> torch.Tensor:
    """Give the placeholder real storage again; returns the flat full tensor (uninitialised) to fill.

    The flat view is kept in ``ZeroParam.flat``: a view holds the storage itself, so it stays valid
    through the resizes of every gather and release. It is dropped wherever the parameter's data is
    replaced here, and `release` drops it if anything else replaced it."""
    z = p._zero
    flat = z.flat
    if flat is None:
        flat = z.flat = raw_data(p).view(-1)
        z.flat_storage = flat.untyped_storage()
    z.flat_storage.resize_(z.numel * flat.element_size())
    return flat


def finish_gather(p: ZeroParameter) -> None:
    """INFLIGHT -> AVAILABLE: the full data is in ``p.data``; computing with ``p`` is allowed. Its
    class becomes exactly ``nn.Parameter`` (why: `ZeroParameter`)."""
    z = p._zero
    z.set_status(_AVAILABLE)
    z.handle = None
    refresh_api(p)
    p.__class__ = nn.Parameter


def release(p: ZeroParameter) -> None:
    """AVAILABLE -> NOT_AVAILABLE: resize the storage to 0 bytes; computing with ``p`` raises again."""
    z = p._zero
    z.set_status(_NOT_AVAILABLE)
    # AVAILABLE, so a plain ``nn.Parameter``: its own storage is its data's, no guard to pass
    storage = p.untyped_storage()
    if z.flat is not None and z.flat_storage._cdata != storage._cdata:
        # Its data was replaced while gathered (``p.data = t``, torch's vector_to_parameters): back to
        # its own storage, leaving t's alone (the user's tensor, or a view into a bigger one, which
        # emptying would break; the value was taken already, persistent.py `take_writes`).
        p.data = z.flat.view(z.shape)
        storage = z.flat_storage
    storage.resize_(0)
    p.__class__ = PartitionedParameter


# What a gathered parameter (class ``nn.Parameter``) answers of `ZeroParameter`'s API, from its __dict__.
_API_METHODS = ("ds_summary", "all_gather", "partition", "__deepcopy__", "__reduce_ex__")


class _ParamMethod:
    """A `ZeroParameter` method kept in a parameter's ``__dict__``. It holds the parameter weakly: a
    bound method there would be a reference cycle, and a model dropped would wait for the cyclic GC."""

    __slots__ = ("func", "param")

    def __init__(self, func: Callable[..., Any], p: ZeroParameter) -> None:
        self.func = func
        self.param = weakref.ref(p)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(self.param(), *args, **kwargs)


def _expose_api(p: ZeroParameter) -> None:
    """At partitioning: the parts of the API that never change."""
    z, d = p._zero, p.__dict__
    d.update(ds_id=z.id, ds_shape=z.shape, ds_numel=z.numel)
    for name in _API_METHODS:
        d[name] = _ParamMethod(getattr(ZeroParameter, name), p)
    refresh_api(p)


def refresh_api(p: ZeroParameter) -> None:
    """At every gather, and where the record changes (`ShardStore.rebind` replaces the shard, so the
    entry never holds one the record dropped; `set_persistent`): the parts that can change, and the
    status, AVAILABLE. These entries are read only while the parameter is gathered (partitioned, the
    properties shadow them). Writing one of them on a gathered parameter is not refused (its class
    is torch's); the next gather rewrites it."""
    z, d = p._zero, p.__dict__
    d["ds_tensor"] = z.shard
    d["ds_persist"] = z.persistent
    d["ds_status"] = _AVAILABLE


def set_persistent(p: ZeroParameter, persistent: bool) -> None:
    """Mark or unmark ``p`` persistent (the coordinator's choice), gathered or not."""
    p._zero.persistent = persistent
    refresh_api(p)


def alias_shard(p: ZeroParameter) -> None:
    """NOT_AVAILABLE -> AVAILABLE without a copy, at world size 1: the full data becomes a view of the
    shard (same elements, no padding), so an optimizer step on the shard is already in the parameter."""
    z = p._zero
    if z.world_size != 1 or z.status is not ParamStatus.NOT_AVAILABLE or z.shard.device != raw_data(p).device \
            or z.shard.dtype != raw_data(p).dtype:
        return
    with torch._C.DisableTorchFunctionSubclass():
        p.data = z.shard[: z.numel].view(z.shape)
    z.flat = None
    z.set_status(ParamStatus.INFLIGHT)
    finish_gather(p)
    z.aliased = True


def alias_replaced(p: ZeroParameter) -> bool:
    """Whether an aliased parameter's data no longer views its shard (``p.data = t`` since)."""
    return raw_data(p).untyped_storage().data_ptr() != p._zero.shard.untyped_storage().data_ptr()


def view_shard_again(p: ZeroParameter) -> None:
    """An aliased parameter whose data was replaced views its shard again (t is dropped)."""
    z = p._zero
    with torch._C.DisableTorchFunctionSubclass():
        p.data = z.shard[: z.numel].view(z.shape)


def unalias_shard(p: ZeroParameter) -> None:
    """Give an aliased parameter its own (empty) storage again, so releasing it leaves the shard alone."""
    z = p._zero
    placeholder = torch.empty(z.shape, dtype=z.shard.dtype, device=z.shard.device)
    with torch._C.DisableTorchFunctionSubclass():
        p.data = placeholder
    z.aliased = False
    z.flat = None
    if z.status is ParamStatus.AVAILABLE:
        placeholder.copy_(z.shard[: z.numel].view(z.shape))


def set_placeholder_dtype(p: ZeroParameter, dtype: torch.dtype) -> None:
    """Give a partitioned (not gathered) parameter a 0-byte placeholder of ``dtype`` (mixed precision)."""
    if p._zero.status is not ParamStatus.NOT_AVAILABLE:
        raise ZeroStateError(f"{p._zero.summary()}: cannot change the dtype of a gathered parameter")
    placeholder = torch.empty(p._zero.shape, dtype=dtype, device=raw_data(p).device)
    placeholder.untyped_storage().resize_(0)
    with torch._C.DisableTorchFunctionSubclass():
        p.data = placeholder
    p._zero.flat = None


def partition(p: nn.Parameter, *, name: str, world_size: int, rank: int, group: Any, ctx: Any = None,
              shard_device: torch.device | None = None, dtype: torch.dtype | None = None) -> ZeroParameter:
    """Partition ``p`` in place: keep this rank's shard, free the full data, keep the shape.

    ``ctx`` is the runtime context that will drive the parameter (`ZeroParam.ctx`).
    """
    if isinstance(p, ZeroParameter):
        return p
    full = p.data
    if dtype is not None and full.is_floating_point():
        full = full.to(dtype)
    device = shard_device if shard_device is not None else full.device
    shard = sharding.shard_tensor(full, world_size, rank).to(device)
    z = ZeroParam(id=new_id(), name=name, shape=full.shape, dtype=full.dtype, shard=shard,
                  world_size=world_size, rank=rank, group=group, status=ParamStatus.AVAILABLE, ctx=ctx)
    placeholder = torch.empty(full.shape, dtype=full.dtype, device=full.device)
    p.data = placeholder
    p._zero = z
    _expose_api(p)  # type: ignore[arg-type]
    p.__class__ = nn.Parameter  # AVAILABLE: the data is the full tensor until `release`
    release(p)  # type: ignore[arg-type]
    return p  # type: ignore[return-value]


def update_shard_from_full(p: ZeroParameter) -> bool:
    """After the full data may have been modified (``GatheredParameters(modifier_rank=...)``), make
    this rank's shard (and master) match it; returns whether the shard changed. A shard that already
    holds those values keeps its master as it is, so a context that changes nothing leaves an fp32
    master (finer than a bf16 shard) bit-identical. An aliased parameter's full data is its shard, so
    a write there is already in the shard: its master follows when it no longer rounds to the shard.
    Both must be in memory (``RuntimeContext.resident``)."""
    z = p._zero
    if z.aliased:
        if alias_replaced(p):  # ``p.data = t`` inside the context: t is the new value
            z.shard[: z.numel].copy_(raw_data(p).reshape(-1))
            view_shard_again(p)
            if z.master is not None:
                z.master.copy_(z.shard)
            return True
        if z.master is None or torch.equal(z.master.to(z.shard.dtype), z.shard):
            return False
        z.master.copy_(z.shard)
        return True
    new = sharding.shard_tensor(raw_data(p), z.world_size, z.rank).to(z.shard.device)
    if new.is_meta or z.shard.is_meta or (new.dtype == z.shard.dtype and torch.equal(new, z.shard)):
        return False  # unchanged, or built on meta (transformers' build): no values to write or compare
    z.shard.copy_(new)
    if z.master is not None:
        z.master.copy_(z.shard)
    return True


def copy_full_into_shard(p: ZeroParameter) -> None:
    """After the full data was modified, make this rank's shard (and master) match it. Both must be
    in memory (``RuntimeContext.resident``)."""
    z = p._zero
    z.shard.copy_(sharding.shard_tensor(raw_data(p), z.world_size, z.rank))
    if z.master is not None:
        z.master.copy_(z.shard)
