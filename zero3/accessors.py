"""Full-tensor and local-shard accessors for partitioned parameters (debugging, RL, fine-tuning).

The ``safe_get_full_*`` functions are **collectives**: every rank of the parameter's group must call
them, for the same parameter, in the same order (they all-gather this rank's shard). They return a
new fp32 tensor of the parameter's true shape on every rank (fp64 for an fp64 parameter: no read
rounds). The ``safe_set_full_*`` functions need
the same full value on every rank and issue no collective (each rank keeps its slice), but a
persistent or gathered parameter is updated in place, so call them on every rank too. The
``safe_get_local_*`` / ``safe_set_local_*`` functions touch only this rank's unpadded slice
(the size of ``param._zero.shard_range()``, possibly empty) and issue no collective; call the
setters on every rank all the same: a persistent parameter's gathered copy is gathered again before
its next use (`safe_set_local_fp32_param`).

"fp32 param" means the tensor the optimizer steps on: the fp32 master under bf16/fp16 (exact, not
the rounded low-precision weight) or with the optimizer offloaded while the shards are not, else
the shard itself. Gradients are the accumulated
gradient shards, unscaled (divided by the fp16 loss scale if ``engine.backward`` scaled them).
Weights and optimizer state offloaded to NVMe are read in for the call (and written back by the
setters); the engine's states must not be offloaded by ``engine.offload_states``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

import torch

from .comm.communicator import Kind, Tag
from .runtime.context import RuntimeContext
from .runtime.publish import count_publish
from .errors import ZeroStateError
from .partition.param import ZeroParameter, raw_data
from .partition.state import ParamStatus


F = TypeVar("F", bound=Callable[..., Any])


def _in_memory(write: bool, kinds: tuple[str, ...], load: bool = True) -> Callable[[F], F]:
    """Run the accessor with its parameter's weights and optimizer state in memory (read from NVMe
    when they live there, unless ``load`` is false; written back after a setter), refusing while
    ``engine.offload_states`` has moved them."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(param: Any, *args: Any, **kwargs: Any) -> Any:
            ctx = param._zero.ctx if isinstance(param, ZeroParameter) else None
            if not isinstance(ctx, RuntimeContext):
                return fn(param, *args, **kwargs)
            # one call of the engine at a time: the full ones are collectives (review 38R1), and the local
            # ones read what a step rewrites (review 38R4: a logger thread's read crashed a rank)
            with ctx.claim.held(f"zero3.{fn.__name__}"):
                return _resident_call(ctx, fn, write, kinds, load, param, *args, **kwargs)
        return inner  # type: ignore[return-value]
    return wrap


def _resident_call(ctx: RuntimeContext, fn: Callable[..., Any], write: bool, kinds: tuple[str, ...], load: bool,
                   param: Any, *args: Any, **kwargs: Any) -> Any:
    """`_in_memory`'s call of the accessor ``fn`` on ``param`` of ``ctx``."""
    ctx.require_states(fn.__name__, kinds)
    if "hp_params" in kinds or "lp_params" in kinds:
        ctx.take_persistent_writes()  # in-place writes to kept-gathered parameters are read
    if write and "lp_params" in kinds:
        _refuse_racing_write(ctx, param, fn.__name__)
    if not load:
        return fn(param, *args, **kwargs)
    with ctx.resident([param], write):
        return fn(param, *args, **kwargs)


def _refuse_racing_write(ctx: RuntimeContext, param: ZeroParameter, what: str) -> None:
    """Refuse, before anything changes, a write to a shard the other ranks may be reading from shared
    memory now (inside a step, comm/shared.py [Note: shared shards]): no collective orders it."""
    shared = ctx.comm.shared
    if shared is not None and shared.may_be_read(param):
        raise ZeroStateError(
            f"{what}: called inside a step while the other ranks may be reading {param._zero.summary()}'s "
            "shard from shared memory (allgather_impl='shm'); call it between steps (after engine.step() "
            "or before the next forward), or set allgather_impl='p2p'")


def _check(param: Any, what: str) -> ZeroParameter:
    if not isinstance(param, ZeroParameter):
        shape = tuple(param.shape) if isinstance(param, torch.Tensor) else type(param).__name__
        raise ZeroStateError(
            f"{what}: the parameter ({shape}) is not partitioned by zero3; read or write it directly, or build "
            "the model under zero3.Init / pass it to zero3.initialize")
    return param


def _context(param: ZeroParameter, what: str) -> RuntimeContext:
    """The context of the engine ``param`` belongs to."""
    ctx = param._zero.ctx
    if not isinstance(ctx, RuntimeContext) or not ctx.attached:
        raise ZeroStateError(f"{what}: {param._zero.summary()} belongs to no engine (zero3.initialize was not "
                             "called on its model, or remove_hooks() was); gradients and optimizer state exist "
                             "only under an engine")
    return ctx


def _gather(param: ZeroParameter, shard: torch.Tensor) -> torch.Tensor:
    """All-gather ``shard`` (this rank's padded 1-D piece of ``param``) into a full fp32 tensor."""
    z = param._zero
    if shard.numel() != z.shard_numel:
        raise ZeroStateError(f"{z.summary()}: expected a shard of {z.shard_numel} elements, got {shard.numel()}")
    src = shard.detach().to(_read_dtype(shard))
    if z.world_size == 1:
        return src[: z.numel].clone().view(z.shape)
    device = raw_data(param).device  # where the collectives run (the shard may be offloaded)
    rows = z.ctx.comm.all_gather_tensor(src.to(device), Tag(Kind.TENSOR_GATHER, f"accessor of {z.name}", (z.id,)))
    return rows.reshape(-1)[: z.numel].view(z.shape)


def _read_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for a 16-bit tensor, its own dtype for an fp64 one: a read never rounds."""
    return torch.promote_types(t.dtype, torch.float32)


def _local_slice(param: ZeroParameter, t: torch.Tensor) -> torch.Tensor:
    start, end = param._zero.shard_range()
    return t[: max(end - start, 0)]


def _my_slice(param: ZeroParameter, value: torch.Tensor, what: str) -> torch.Tensor:
    z = param._zero
    if tuple(value.shape) != tuple(z.shape):
        raise ValueError(f"{what}: value of shape {tuple(value.shape)} does not match {z.summary()}")
    start, end = z.shard_range()
    return value.detach().reshape(-1)[start:end]


def _inv_scale(ctx: RuntimeContext) -> float:
    return 1.0 / ctx.grad_scale


def _state(ctx: RuntimeContext, param: ZeroParameter, key: str, what: str) -> torch.Tensor:
    state = ctx.optimizer_state(param)
    if key not in state:
        have = sorted(state) if state else "none: its engine has no optimizer" if ctx.optimizer is None else \
            "none yet (the optimizer has not stepped, or the parameter is frozen)"
        how = ("" if state or not what.startswith("safe_set") else
               "; the setters overwrite existing state: to bring in a plain torch run's state, load it into the "
               "optimizer before zero3.initialize (opt.load_state_dict(sd)), which keeps each rank's slice of it")
        raise KeyError(f"{what}: {param._zero.summary()} has no optimizer state {key!r}; it has {have}{how}")
    v = state[key]
    if not isinstance(v, torch.Tensor) or v.numel() != param._zero.shard_numel:
        raise ZeroStateError(f"{what}: optimizer state {key!r} of {param._zero.summary()} is not per-element "
                             "(a step counter?); read it from engine.optimizer_state(param)")
    return v


# -- full tensors (collectives) --------------------------------------------------------------------
@_in_memory(write=False, kinds=("lp_params", "hp_params"))
def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The full fp32 weight the optimizer steps on (master under mixed precision). A collective."""
    p = _check(param, "safe_get_full_fp32_param")
    return _gather(p, p._zero.train_tensor)


@_in_memory(write=False, kinds=("lp_grads",), load=False)
def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full, reduced (averaged over ranks), accumulated gradient in fp32, or None if there is
    none (frozen parameter, or no backward since the last step). A collective; call it between
    backward and ``engine.step()``."""
    p = _check(param, "safe_get_full_grad")
    ctx = _context(p, "safe_get_full_grad")
    ctx.finish_gradients()
    g = p._zero.train_tensor.grad
    if g is None:
        ctx.check_gradient_read(p, "safe_get_full_grad")
        return None
    return _gather(p, g).mul_(_inv_scale(ctx))


@_in_memory(write=False, kinds=("optim_states",))
def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """The full optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``. A collective."""
    p = _check(param, "safe_get_full_optimizer_state")
    ctx = _context(p, "safe_get_full_optimizer_state")
    return _gather(p, _state(ctx, p, optim_state_key, "safe_get_full_optimizer_state"))


def _say_rounded(master: torch.Tensor, name: str, what: str) -> None:
    """A parameter with no fp32 master (bf16/fp16, in no optimizer: an EMA or a frozen copy) keeps the
    set value rounded; an EMA updated so lost its small steps without a word (probe 26C)."""
    if master.dtype in (torch.bfloat16, torch.float16) and what not in _ROUNDED:
        _ROUNDED.add(what)
        logging.getLogger(__name__).warning(
            "zero3: %s on a parameter kept in %s only (first %s: no fp32 master, which only an optimizer over it under "
            "bf16/fp16 keeps): the value is stored rounded to %s, and updates much smaller than the weight (an EMA's) "
            "are lost. For an EMA or another copy, build it in fp32 and give its engine a config without bf16/fp16 "
            "(said once)", what, master.dtype, name, master.dtype)


_ROUNDED: set[str] = set()


@_in_memory(write=True, kinds=("lp_params", "hp_params"))
@torch.no_grad()
def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the full fp32 weight (master and low-precision shard) from ``value``, the same on every rank.

    No collective: each rank keeps its slice. A persistent or currently gathered parameter is
    updated in place too, so call it on every rank.
    """
    p = _check(param, "safe_set_full_fp32_param")
    z = p._zero
    mine = _my_slice(p, value, "safe_set_full_fp32_param")
    master = p._zero.train_tensor
    _say_rounded(master, z.name, "safe_set_full_fp32_param")
    master[: mine.numel()].copy_(mine)
    if master is not z.shard:
        z.shard.copy_(master)
    if z.status is ParamStatus.AVAILABLE:
        p.data.copy_(value.reshape(z.shape))
        count_publish(p)  # written through: no discarded write (gathered.py)


@_in_memory(write=True, kinds=("optim_states",))
@torch.no_grad()
def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set optimizer state ``optim_state_key`` of ``param`` from the full ``value`` (same on every rank).

    The state must exist: the optimizer has stepped, or its state was loaded into it before
    ``zero3.initialize`` (``opt.load_state_dict(sd)``, sliced to each rank there). No collective.
    """
    p = _check(param, "safe_set_full_optimizer_state")
    ctx = _context(p, "safe_set_full_optimizer_state")
    state = _state(ctx, p, optim_state_key, "safe_set_full_optimizer_state")
    mine = _my_slice(p, value, "safe_set_full_optimizer_state")
    state[: mine.numel()].copy_(mine)


@_in_memory(write=True, kinds=("lp_grads",), load=False)
@torch.no_grad()
def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor | None) -> None:
    """Set the reduced gradient the next optimizer step uses from the full ``value`` (fp32 or any float
    dtype, the same on every rank), or drop it with None (the optimizer then skips the parameter, as
    torch's does for ``p.grad = None``). No collective: each rank keeps its slice. Between backward and
    ``engine.step()``; within an accumulation window it replaces the sum so far, as assigning
    ``p.grad`` does in torch."""
    p = _check(param, "safe_set_full_grad")
    _set_grad(p, None if value is None else _my_slice(p, value, "safe_set_full_grad"), "safe_set_full_grad")


def _set_grad(p: ZeroParameter, mine: torch.Tensor | None, what: str) -> None:
    ctx = _context(p, what)
    ctx.finish_gradients()  # a reduction still landing would add into what is set here
    ctx.check_gradient_read(p, what)  # the step in backward has not used it already
    t = p._zero.train_tensor
    if mine is None:
        t.grad = None
        return
    if t.grad is None:
        t.grad = torch.zeros_like(t)
    t.grad[: mine.numel()].copy_(mine.reshape(-1)).mul_(ctx.grad_scale)  # stored as the reducer stores it
    ctx.grads_set = True  # engine.step() steps on it without a backward (DP-SGD: gradients computed elsewhere)


# -- this rank's slice only (no collective) ---------------------------------------------------------
@_in_memory(write=False, kinds=("lp_params", "hp_params"))
def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """A copy of this rank's unpadded slice of the fp32 weight (master under mixed precision)."""
    p = _check(param, "safe_get_local_fp32_param")
    t = _local_slice(p, p._zero.train_tensor).detach()
    return t.to(_read_dtype(t), copy=True)


@_in_memory(write=False, kinds=("lp_grads",), load=False)
def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """A copy of this rank's unpadded slice of the accumulated gradient (fp32, or fp64 for an fp64
    parameter; unscaled), or None."""
    p = _check(param, "safe_get_local_grad")
    ctx = _context(p, "safe_get_local_grad")
    g = p._zero.train_tensor.grad
    if g is None:
        ctx.check_gradient_read(p, "safe_get_local_grad")
        return None
    t = _local_slice(p, g)
    return t.to(_read_dtype(t)).mul(_inv_scale(ctx))


@_in_memory(write=False, kinds=("optim_states",))
def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor:
    """A copy of this rank's unpadded slice of optimizer state ``optim_state_key``."""
    p = _check(param, "safe_get_local_optimizer_state")
    ctx = _context(p, "safe_get_local_optimizer_state")
    t = _local_slice(p, _state(ctx, p, optim_state_key, "safe_get_local_optimizer_state"))
    return t.to(_read_dtype(t), copy=True)


@_in_memory(write=True, kinds=("lp_params", "hp_params"))
@torch.no_grad()
def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's unpadded slice of the fp32 weight (and its low-precision shard). No collective,
    but call it on every rank (for the same parameters): a persistent parameter's gathered copy gets
    this rank's slice at once and the other ranks' when the next forward, ``GatheredParameters`` or
    ``param.all_gather()`` gathers it again first (one collective for all such; none after an
    optimizer step, checkpoint load or ``engine.refresh_from_masters()``, which gather it anyway)."""
    p = _check(param, "safe_set_local_fp32_param")
    z = p._zero
    if z.status is not ParamStatus.NOT_AVAILABLE and (z.ctx.step_open or z.ctx.coordinator.in_step):
        raise ZeroStateError(  # probe 37H: a MoCo momentum update in forward trained 1e-2 off torch, silently
            f"safe_set_local_fp32_param: called inside a step on {z.summary()}, which is gathered now (persistent, "
            "or gathered ahead for a module of this step): the modules after it in this step would compute with "
            "this rank's slice new and the other ranks' old. Call it between steps (after engine.step(), before "
            "the next forward), or inside the step use safe_set_full_fp32_param (every rank passes the full "
            "value) or `with zero3.GatheredParameters(params, modifier_rank=0):`. Nothing was changed")
    master = p._zero.train_tensor
    local = _local_slice(p, master)
    if value.numel() != local.numel():
        raise ValueError(f"safe_set_local_fp32_param: {z.summary()} owns {local.numel()} elements on this rank, "
                         f"got {value.numel()}")
    _say_rounded(master, z.name, "safe_set_local_fp32_param")
    local.copy_(value.reshape(-1))
    if master is not z.shard:
        z.shard.copy_(master)
    if z.persistent and z.status is ParamStatus.AVAILABLE and not z.aliased:  # else the step takes the stale
        start = z.shard_range()[0]                                               # copy for a write (persistent.py)
        raw_data(p).view(-1)[start:start + local.numel()].copy_(z.shard[: local.numel()])
        z.ctx.coordinator.persistent_params.mark_stale(p, "safe_set_local_fp32_param")  # the others: next use


@_in_memory(write=True, kinds=("lp_grads",), load=False)
@torch.no_grad()
def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor | None) -> None:
    """Set this rank's unpadded slice of the gradient the next optimizer step uses, or drop the
    gradient with None (every rank should then drop it: a rank that keeps its slice steps on it while
    the others skip the parameter). No collective."""
    p = _check(param, "safe_set_local_grad")
    if value is not None:
        expect = _local_slice(p, p._zero.train_tensor).numel()
        if value.numel() != expect:
            raise ValueError(f"safe_set_local_grad: {p._zero.summary()} owns {expect} elements on this rank, "
                             f"got {value.numel()}")
    _set_grad(p, value, "safe_set_local_grad")


@_in_memory(write=True, kinds=("optim_states",))
@torch.no_grad()
def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's unpadded slice of optimizer state ``optim_state_key``. No collective."""
    p = _check(param, "safe_set_local_optimizer_state")
    ctx = _context(p, "safe_set_local_optimizer_state")
    local = _local_slice(p, _state(ctx, p, optim_state_key, "safe_set_local_optimizer_state"))
    if value.numel() != local.numel():
        raise ValueError(f"safe_set_local_optimizer_state: {p._zero.summary()} owns {local.numel()} elements on "
                         f"this rank, got {value.numel()}")
    local.copy_(value.reshape(-1))


__all__ = [
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state", "safe_set_local_fp32_param",
    "safe_set_local_grad", "safe_set_local_optimizer_state",
]
