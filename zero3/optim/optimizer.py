"""The optimizer over shards: re-pointing a user's ``torch.optim`` optimizer, fp32 master shards in
flat buffers, the fp16 overflow check, global-norm clipping.

[Note: flat master buffers]
With ``dtype="fp32"`` the optimizer steps on the parameter shards themselves (`shard_optimizer`),
unless the optimizer is offloaded while the shards are not (then the masters are separate, on the
CPU side). Where masters are separate (bf16/fp16, or that offload) each param group of the user's
optimizer gets a `FlatGroup` (with ``offload_optimizer="nvme"`` each master is a tensor of its own
instead, and shards on NVMe or in shared memory have no flat buffer): two buffers with one layout,

- ``master``: fp32, one allocation per group, on the shard's device (on the CPU when offloaded,
  pinned if asked and CUDA exists); each trainable parameter's master shard is a view into it, and
  the group's ``params`` list is replaced by those views (class, hyperparameters, ``param_groups``
  and therefore LR schedulers are untouched; the state is keyed by the master view);
- ``low``: the parameter shards in the parameter dtype, on the shard's device; ``p._zero.shard`` is
  a view into it, so the all-gathers read from it. Not made for a group with a shard in a
  shared-memory arena (comm/shared.py [Note: shared shards]): peers read the shards there, so
  they stay, and the masters are cast into them one parameter at a time.

Every view starts at a multiple of ``ALIGN_ELEMENTS`` (64) elements: 128 bytes in a 2-byte buffer,
256 in the fp32 one. Every rank's buffer holds only its own shards, and ranks have identical layouts
(every shard is ``ceil(numel / world)`` elements), so each rank's slice of a parameter starts on the
same aligned offset on every rank. The gaps hold zeros and never receive a gradient. After the
optimizer step one ``low.copy_(master)`` per group casts all the new weights back (groups without a
``low`` buffer, whose shards are on NVMe or in shared memory, cast one parameter at a time). Frozen parameters
(``requires_grad=False``) get no master, no gradient and no state: they keep a standalone shard.

The gradient of a master shard (``master.grad``, fp32, on the master's device) is where the reducer
accumulates (runtime/grad.py); it is allocated lazily and dropped by ``drop_grads``.

With ``offload_param="nvme"`` the shards stay standalone tensors (each goes to the drive on its own,
offload/nvme.py), so a `FlatGroup` has no ``low`` buffer and the masters are cast into each shard's region.
With ``offload_optimizer="nvme"`` there are no flat buffers: each master is a tensor of its own, so
that it and the optimizer's per-element state can go to the drive between steps and come back
``sub_group_size`` elements at a time ([Note: streamed optimizer step]).

[Note: streamed optimizer step]
When the tensors the optimizer steps on, or its state, live on NVMe, ``step`` walks the trainable
parameters in sub-groups (consecutive parameters of one param group, at most ``sub_group_size``
shard elements). For each, the param groups are narrowed to the sub-group's tensors (the others'
``params`` are empty for that call) and the user's optimizer steps; its state is keyed by tensor,
so it persists across the calls, and every built-in torch optimizer updates each parameter from
its own state only, so the result is the same, bit for bit, as one step over everything. The
next sub-group is read while one steps, and the one before is written: at most three sub-groups'
tensors are in memory. Optimizer step hooks run once per sub-group. The ranks agree that every rank
finished it before it counts; when it is staged (``offload_optimizer="nvme"``, ``staged_step``) a
failure anywhere is rolled back on every rank, otherwise every rank raises naming the failing rank
(agreed_step.py [Note: agreed optimizer step]). streamed.py `SubgroupStreamer` does the moves and the narrowed
steps; with ``offload_optimizer_step_in_backward`` the same sub-groups step inside the backward
instead (backward_step.py [Note: optimizer step in backward]).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..comm.communicator import Communicator, Kind, Tag
from ..errors import ZeroConfigError, ZeroStateError
from ..comm.model_parallel import ModelParallel, is_tensor_parallel
from ..offload.residence import ShardStore
from ..partition.param import ZeroParameter
from .agreed_step import AgreedStep, StepParts
from .backward_step import BackwardStep, BackwardStepPhase
from .deepspeed_optimizer import DeepSpeedOptimizerNames
from .foreign import guard_groups
from .rank_state import tag_rank_state
from .routed_step import torch_step
from .steppable import check_steppable
from .streamed import SubgroupStreamer
from .precision import RUNNING_BACKWARD, LossScaler, master_dtype, unscale_
from .grad_norm import clip_shards
from ..offload.nvme import ShardTier, StorageTier
from ..offload.swapfile import AsyncIO, SwapFile

if TYPE_CHECKING:
    from ..config import ZeroConfig

logger = logging.getLogger(__name__)

_WHOLE_STEP = 1_000_000_000
"""``sub_group_size``'s default (DeepSpeed's): not reported where the step takes every parameter at once."""

ALIGN_ELEMENTS = 64
"""Offsets of views in a flat buffer are multiples of this many elements (see [Note: flat master buffers])."""


def aligned_numel(numel: int) -> int:
    """``numel`` rounded up to a multiple of `ALIGN_ELEMENTS`."""
    return -(-numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def shard_optimizer(optimizer: Any, params: Iterable[ZeroParameter],
                    allow_untested: bool = False) -> torch.optim.Optimizer:
    """Point ``optimizer`` at the shards of ``params`` (or build one from a factory).

    A ``torch.optim.Optimizer`` built over the full parameters keeps its class, param groups and
    hyperparameters: each group's parameters are replaced by their shards in place, so schedulers
    and references the user holds keep working. A callable is called with the param groups
    (``[{"params": shards}]``) and must return an optimizer. State exists only for this rank's shard.
    """
    params = list(params)
    by_id = {id(p): p._zero.shard for p in params}
    if isinstance(optimizer, torch.optim.Optimizer):
        made = _check_state(optimizer)
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                if id(p) in by_id:
                    new.append(by_id[id(p)])
                elif any(p is s for s in by_id.values()):
                    new.append(p)
                else:
                    raise _foreign(p)
            group["params"] = new
        _reshard_state(optimizer, made, [(p, p._zero.shard) for p in params])
        return optimizer
    if callable(optimizer):
        shards = [p._zero.shard for p in params if p.requires_grad]
        return _call_factory(optimizer, [{"params": shards}], allow_untested)
    raise _bad_optimizer(optimizer)


def validate_optimizer(optimizer: Any, named_params: Iterable[tuple[str, torch.Tensor]] = (),
                       allow_untested: bool = False) -> None:
    """Reject, before ``initialize`` changes anything, an optimizer it cannot use: not an optimizer,
    one holding a tensor that is neither a parameter of ``named_params`` nor the shard of one, or one
    whose state cannot be sliced to the shards (a factory is called later, with the shards)."""
    if optimizer is None or (callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)):
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise _bad_optimizer(optimizer)
    check_steppable(optimizer, allow_untested)
    known: dict[int, str] = {}
    for name, p in named_params:
        known.setdefault(id(p), name)
        if isinstance(p, ZeroParameter):
            known.setdefault(id(p._zero.shard), name)
    for group in optimizer.param_groups:
        for t in group["params"]:
            if id(t) not in known:
                raise _foreign(t)
    _check_state(optimizer, known)


def _check_state(optimizer: torch.optim.Optimizer, names: dict[int, str] | None = None) -> dict[int, dict[str, Any]]:
    """The state ``optimizer`` holds (made in its constructor, by stepping, or loaded with torch's
    ``load_state_dict``: over the full parameters), by id of the tensor it is keyed by. Raises if a
    state tensor is neither of its parameter's full shape (sliced by `_reshard_state`) nor of one
    element (a step counter, kept): a factored state (Adafactor's row and column vectors) or one loaded
    for another model has no exact slice per rank."""
    for t, st in optimizer.state.items():
        full = tuple(t._zero.shape) if isinstance(t, ZeroParameter) else tuple(t.shape)
        for k, v in (st.items() if isinstance(st, dict) else ()):
            if isinstance(v, torch.Tensor) and tuple(v.shape) != full and v.numel() != 1:
                name = (names or {}).get(id(t)) or (t._zero.name if isinstance(t, ZeroParameter) else None)
                _refuse_state(optimizer, name or f"of shape {full}", k, tuple(v.shape), full)
    return {id(t): st for t, st in optimizer.state.items()}


def _reshard_state(optimizer: torch.optim.Optimizer, made: dict[int, dict[str, Any]],
                   moved: Iterable[tuple[ZeroParameter, torch.Tensor]]) -> None:
    """Re-key the state (`_check_state`) from each full parameter to the tensor the optimizer now steps
    (its shard or fp32 master), keeping this rank's slice of each tensor of the parameter's full shape,
    in the stepped tensor's dtype and device. Exact: the slice of a per-element state over the full
    parameter is what the same steps would have made over the shard. State left on a full parameter
    (one the optimizer no longer holds: frozen, under fp32 masters) is dropped."""
    if not made:
        return
    rounded: list[str] = []
    for p, new in moved:
        st = made.get(id(p))
        if st is None:  # no state, or state keyed by the shard already (an optimizer built over shards)
            continue
        del optimizer.state[p]
        start, end = p._zero.shard_range()
        out: dict[str, Any] = {}
        for k, v in st.items():
            if k != "step" and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p._zero.shape):
                if v.element_size() < new.element_size():
                    rounded.append(f"{k!r} of {p._zero.name} ({v.dtype})")
                mine = torch.zeros_like(new)
                mine[: end - start].copy_(v.detach().reshape(-1)[start:end])
                v = mine
            out[k] = v
        optimizer.state[new] = out
    if rounded:
        logger.warning("zero3: %d optimizer state tensors (first %s) were rounded before initialize (torch's "
                       "load_state_dict casts the state to the parameter's dtype); they are widened to the "
                       "masters' dtype as they are",
                       len(rounded), rounded[0])
    for t in [t for t in optimizer.state if isinstance(t, ZeroParameter)]:
        del optimizer.state[t]


def _refuse_state(optimizer: torch.optim.Optimizer, name: str, key: str, shape: tuple[int, ...],
                  full: tuple[int, ...]) -> None:
    raise ZeroStateError(
        f"{type(optimizer).__name__} given to zero3.initialize has optimizer state {key!r} of shape {shape} for "
        f"parameter {name} of shape {full}: zero3 keeps each rank's slice of a state of the parameter's shape (or a "
        "one-element step counter), and this one has no exact slice (a factored state, or one loaded for another "
        "model). Nothing was changed; pass the optimizer without that state (fresh), or resume with "
        "engine.load_checkpoint")


def _foreign(p: torch.Tensor) -> ZeroConfigError:
    hint = ""
    if p.dim() == 1 and not isinstance(p, torch.nn.Parameter):  # a shard or master, as an engine re-points its optimizer
        hint = (" (if an earlier engine over this model used this optimizer, it holds that engine's shards or fp32 "
                "masters now: after engine.remove_hooks(), give the new engine a new optimizer over model.parameters())")
    return ZeroConfigError(f"optimizer parameter of shape {tuple(p.shape)} is not a parameter of the model "
                           f"given to zero3.initialize{hint}")


def _bad_optimizer(optimizer: Any) -> ZeroConfigError:
    return ZeroConfigError(
        f"optimizer must be a torch.optim.Optimizer, a callable(param_groups) -> Optimizer, or None; "
        f"got {type(optimizer).__name__}")


def _call_factory(factory: Any, groups: list[dict[str, Any]], allow_untested: bool) -> torch.optim.Optimizer:
    opt = factory(groups)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ZeroConfigError(f"optimizer factory must return a torch.optim.Optimizer, got {type(opt).__name__}")
    check_steppable(opt, allow_untested, factory=True)
    return opt


@dataclass(eq=False)
class FlatGroup:
    """One param group's shards on this rank: fp32 masters and parameter shards, one layout.
    ``master`` is None when each master is a tensor of its own (optimizer state on NVMe), ``low``
    when each shard is (parameter shards on NVMe)."""

    params: list[ZeroParameter]
    offsets: list[int]
    master: torch.Tensor | None
    low: torch.Tensor | None

    def masters(self) -> list[torch.Tensor]:
        return [p._zero.train_tensor for p in self.params]


class PartitionedOptimizer(DeepSpeedOptimizerNames):
    """The user's optimizer plus what zero3 does around its step (see [Note: flat master buffers]).

    ``optimizer`` is the user's ``torch.optim.Optimizer`` object, re-pointed (or the one a factory
    built); ``scaler`` the fp16 `LossScaler` or None.
    """

    def __init__(self, optimizer: Any, params: Sequence[ZeroParameter], config: ZeroConfig,
                 comm: Communicator, fp32_shards: dict[int, torch.Tensor] | None = None,
                 model_parallel: ModelParallel | None = None, *, store: ShardStore,
                 shards: ShardTier | None = None, io: AsyncIO | None = None,
                 window_ends: Callable[[], bool] | None = None) -> None:
        """``window_ends()``: the running micro-batch ends an accumulation window (the step in
        backward steps only then; needed with ``offload_optimizer_step_in_backward``)."""
        self.config = config
        self.comm = comm
        self.model_parallel = model_parallel
        self.params = list(params)
        self.scaler = LossScaler.from_config(config)
        self.store = store  # rebinds shards into the flat buffers
        self.placement = store.placement
        self.shards = shards  # the NVMe tier of parameter shards (the coordinator's), or None
        self.states: StorageTier | None = None  # the NVMe tier of masters and optimizer state, or None
        if self.placement.optimizer_on_drive:
            assert io is not None, "offload_optimizer='nvme' needs the context's AsyncIO"
            self.states = StorageTier(io, SwapFile(self.placement.optimizer_nvme_path,
                                                   f"optimizer-rank{comm.rank}"))
        self.groups: list[FlatGroup] = []
        self.skipped_steps = 0
        self.comm_device = self.params[0].data.device if self.params else torch.device("cpu")
        self.unscaled = False  # fp16: this window's gradients were already unscaled (by clipping)
        self._overflow = False  # ... and whether some rank saw inf/nan then
        self._last_overflow = False
        self.global_grad_norm: torch.Tensor | None = None  # what the last clipping computed (no sync to read it here)
        self.user_step: Callable[[Any], Any] | None = None  # the routed ``optimizer.step`` (`step`); set by the engine
        self.user_zero_grad: Callable[[], None] | None = None  # ``engine.zero_grad`` (`zero_grad`); set by the engine
        # Separate fp32 masters: under mixed precision, and when the optimizer is offloaded but the
        # shards are not (offloaded shards already live on the CPU side, where the optimizer steps).
        self.separate_masters = self.placement.separate_masters
        if self.separate_masters:
            self.optimizer = self._build_masters(optimizer, fp32_shards or {})
        else:
            self.optimizer = shard_optimizer(optimizer, self.params,
                                             config.training.zero_allow_untested_optimizer)
        if isinstance(self.optimizer, torch.optim.Optimizer):  # its state_dict() is this rank's shard of it
            tag_rank_state(self.optimizer, comm.rank, comm.world_size, on_drive=self.states is not None)
            guard_groups(self.optimizer)  # its groups hold the shards: add_param_group is refused
        by_train = {id(p._zero.train_tensor): p for p in self.params}
        self.group_params = [[by_train[id(t)] for t in g["params"] if id(t) in by_train]
                             for g in self.optimizer.param_groups]
        self.streamed = self.states is not None or (self.shards is not None and not self.separate_masters)
        by_subgroup = self.streamed or self.placement.step_in_backward  # the step goes sub-group by sub-group
        if not by_subgroup and config.offload.sub_group_size != _WHOLE_STEP:
            logger.warning("zero3: sub_group_size=%d has no effect here: the optimizer steps every parameter at once "
                           "unless its state is on NVMe, fp32 parameter shards are on NVMe, or it steps in backward "
                           "(offload_optimizer_step_in_backward)", config.offload.sub_group_size)
        self.streamer = SubgroupStreamer(
            self.optimizer, self.states, self.shards, self.separate_masters,
            _subgroups(self.group_params, config.offload.sub_group_size) if by_subgroup else [], _per_element)
        # A step that reads or writes a drive happens on every rank or on none (agreed_step.py [Note: agreed optimizer step]);
        # it is staged (rolled back on failure) when the optimizer state is on the drive, unless asked not to.
        # Shards on the drive are written by every step: streamed (fp32), or by the masters' write-back.
        staged = self.placement.staged_step
        unstaged = ("it wrote the drive in place (offload_optimizer_staged_step=False)" if self.states is not None
                    else "the optimizer state is in memory and was not staged")
        self.agreed = AgreedStep(StepParts(
            self.optimizer, [p for ps in self.group_params for p in ps],
            self.states if staged else None, self.shards if staged else None, self.scaler, _per_element,
            unstaged, tuple(t for t in (self.states, self.shards) if t is not None)), comm, model_parallel) if by_subgroup or self.shards is not None else None
        self.backward_step: BackwardStep | None = None
        if self.placement.step_in_backward:
            assert self.agreed is not None and window_ends is not None
            self.backward_step = BackwardStep(self.streamer.subgroups, self.agreed, self.streamer.step_one,
                                              self.streamer.wait_writes, self.drop_grads, window_ends,
                                              lambda: self.optimizer.param_groups)
            logger.info("zero3: the optimizer steps in backward: %d sub-groups of at most %d elements, each as soon "
                        "as its gradients are reduced (%s)", len(self.streamer.subgroups),
                        config.offload.sub_group_size, "staged" if staged else "in place")
            if len(self.streamer.subgroups) == 1:
                logger.warning("zero3: offload_optimizer_step_in_backward with one sub-group (sub_group_size %d >= "
                               "this rank's trainable elements): it steps when the backward ends, holding every "
                               "gradient shard until then; set sub_group_size below the model's size (a layer's) "
                               "to drop them as the backward goes", config.offload.sub_group_size)

    # -- set-up ----------------------------------------------------------------------------------
    def _build_masters(self, optimizer: Any, fp32_shards: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
        by_id = {id(p): p for p in self.params}
        if isinstance(optimizer, torch.optim.Optimizer):
            made = _check_state(optimizer)
            per_group: list[list[ZeroParameter]] = []
            for group in optimizer.param_groups:  # validate everything before changing anything
                found = []
                for t in group["params"]:
                    p = by_id.get(id(t))
                    if p is None:
                        raise _foreign(t)
                    if p.requires_grad:
                        found.append(p)
                per_group.append(found)
            for group, ps in zip(optimizer.param_groups, per_group):
                fg = self._flatten(ps, fp32_shards)
                self.groups.append(fg)
                group["params"] = fg.masters()
            _reshard_state(optimizer, made, [(p, p._zero.train_tensor) for fg in self.groups for p in fg.params])
            return optimizer
        if callable(optimizer):
            fg = self._flatten([p for p in self.params if p.requires_grad], fp32_shards)
            self.groups.append(fg)
            return _call_factory(optimizer, [{"params": fg.masters()}],
                                 self.config.training.zero_allow_untested_optimizer)
        raise _bad_optimizer(optimizer)

    def _flatten(self, ps: list[ZeroParameter], fp32_shards: dict[int, torch.Tensor]) -> FlatGroup:
        offsets, total = [], 0
        for p in ps:
            offsets.append(total)
            total += aligned_numel(p._zero.shard_numel)
        device = ps[0]._zero.shard.device if ps else self.comm_device
        dtypes = {p._zero.shard.dtype for p in ps}
        if len(dtypes) > 1:
            raise ZeroConfigError(f"one optimizer param group holds shards of several dtypes "
                                  f"{sorted(map(str, dtypes))}; "
                                  "build the model in one dtype (zero3.Init(dtype=...)) or set ZeroConfig.dtype")
        dtype = dtypes.pop() if dtypes else torch.float32
        if self.placement.optimizer_on_drive:  # each master its own tensor, written to the drive as soon as it is made
            assert self.states is not None
            behind = 0
            for p in ps:
                m = p._zero.master = self._fp32_copy(p, fp32_shards)
                self.states.swap_out(("master", p._zero.id), m.untyped_storage())
                behind += m.numel() * m.element_size()
                if behind > (256 << 20):  # bounded write-behind: a large model's masters never all in memory
                    self.states.wait()
                    behind = 0
            self.states.wait()
            return FlatGroup(params=ps, offsets=offsets, master=None, low=None)
        master = self.placement.alloc_master(total, device, master_dtype(dtype))
        low = None
        shared = self.comm.shared
        if self.shards is None and not (shared is not None and any(shared.bound(p) for p in ps)):
            pin = self.placement.pin_param_shards and device.type == "cpu"
            low = torch.zeros(total, dtype=dtype, device=device, pin_memory=pin)
        for p, off in zip(ps, offsets):
            z = p._zero
            s = z.shard_numel
            master[off: off + s].copy_(fp32_shards[z.id] if z.id in fp32_shards else self._shard_values(p))
            if low is not None:
                low[off: off + s].copy_(z.shard)
                self.store.rebind(p, low[off: off + s])
            z.master = master[off: off + s]
        return FlatGroup(params=ps, offsets=offsets, master=master, low=low)

    def _shard_values(self, p: ZeroParameter) -> torch.Tensor:
        """``p``'s shard values (read back from the drive when its shard is there)."""
        return self.shards.read_copy(p) if self.shards is not None and p._zero.swap is not None else p._zero.shard

    def _fp32_copy(self, p: ZeroParameter, fp32_shards: dict[int, torch.Tensor]) -> torch.Tensor:
        src = fp32_shards[p._zero.id] if p._zero.id in fp32_shards else self._shard_values(p)
        out = torch.empty(src.shape, dtype=master_dtype(src.dtype), device="cpu", pin_memory=self.placement.pin_masters)
        return out.copy_(src)

    # -- one training window (micro-batches up to an optimizer step) ---------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to differentiate: times the fp16 loss scale (in fp32), else unchanged."""
        if self.scaler is None:
            return loss
        if self.unscaled:
            raise ZeroStateError(
                "backward after clip_grad_norm_ in the same accumulation window: the gradients were already "
                "unscaled. Clip once per optimizer step, after the last micro-batch's backward")
        return loss.float() * self.carried_scale

    @property
    def carried_scale(self) -> float:
        """fp16: the factor a backward's gradients (and then the shards, until `unscale_`) carry: the loss
        scale over ``gradient_accumulation_steps``, DeepSpeed's size (probe 36I: with the whole scale they
        were N times larger, and a static scale that trains there overflowed at every step)."""
        return self.scaler.scale / self.config.training.gradient_accumulation_steps

    @contextlib.contextmanager
    def scaling(self) -> Iterator[None]:
        """Around engine.backward's ``loss.backward()``: its gradients carry this engine's loss scale (1.0
        without fp16), in whichever engine they land (precision.py [Note: a backward that crosses engines])."""
        outer = RUNNING_BACKWARD.scale
        RUNNING_BACKWARD.scale = self.carried_scale if self.scaler is not None else 1.0
        try:
            yield
        finally:
            RUNNING_BACKWARD.scale = outer

    @property
    def grad_scale(self) -> float:
        """The factor the stored gradient shards carry: `carried_scale` until unscaled (fp16), else 1."""
        if self.scaler is None or self.unscaled:
            return 1.0
        return self.carried_scale

    def grads(self) -> list[torch.Tensor]:
        """Every gradient shard this rank holds (fp32 masters' under mixed precision), once each."""
        return [g for g, _ in self.grads_with_kind()]

    def grads_with_kind(self) -> list[tuple[torch.Tensor, bool]]:
        """`grads`, each with whether its parameter is tensor-parallel (comm/model_parallel.py)."""
        out, seen = [], set()
        for p in self.params:
            g = p._zero.train_tensor.grad
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                out.append((g, is_tensor_parallel(p)))
        return out

    def unscale_(self) -> bool:
        """fp16: divide this window's gradients by the loss scale, once; return the agreed overflow.

        A collective (an all-reduce of a 0/1 flag, MAX, over the data-parallel ranks and, with an
        ``mpu``, the model-parallel ones, whose slices of a tensor-parallel weight differ): every
        rank learns whether any rank saw an inf or nan, so all skip the step or none, and their loss
        scales stay equal. Without a scaler it does nothing and returns False.
        """
        if self.scaler is None or self.unscaled:
            return self._overflow
        grads = self.grads()
        found = unscale_(grads, 1.0 / self.carried_scale) if grads else torch.zeros(1)
        flag = found.to(self.comm_device)
        tag = Tag(Kind.ALL_REDUCE, "fp16 overflow check")
        self.comm.all_reduce(flag, tag, op="max")
        if self.model_parallel is not None:
            flag = self.model_parallel.comm.all_reduce(flag.to(self.model_parallel.comm.device), tag, op="max")
        self._overflow = bool(flag.item() > 0)
        self.unscaled = True
        return self._overflow

    def step(self, closure: Any = None) -> None:
        """``engine.step()``, through the user's optimizer's routed step (optim/routed_step.py). This
        object is the optimizer ``zero3.deepspeed.initialize`` returns, and DeepSpeed's loop may call
        ``optimizer.step()`` on it: stepping only the shards here skipped the rest of ``engine.step()``
        (the persistent parameters kept their old gathered values: losses off from the third step)."""
        if self.user_step is None:
            raise ZeroStateError("this optimizer is stepped by its engine: call engine.step()")
        self.user_step(closure)

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's state dict: this rank's shard of the state (optim/rank_state.py)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict` gave on this rank (refused for another rank's or a plain run's)."""
        self.optimizer.load_state_dict(state_dict)

    def step_shards(self) -> bool:
        """Unscale and agree on overflow (fp16), clip (``gradient_clipping``), step, copy back
        (streamed from NVMe when state lives there: [Note: streamed optimizer step]). The engine's
        part of ``engine.step()``.

        Returns False when an overflow skipped the step (on every rank), else True.
        """
        self._last_overflow = False
        if self.backward_step is not None:  # the sub-groups stepped in backward: agree on them
            self.backward_step.conclude()
            self.drop_grads()
            return True
        scaler_state = self.scaler.state_dict() if self.agreed is not None and self.scaler is not None else None
        if self.scaler is not None:
            overflow = self.unscale_()
            if overflow:
                self._last_overflow = True
                self.drop_grads()
                self.skipped_steps += 1  # counted before the scaler's update, which raises at the minimum scale
            self.scaler.update(overflow)  # (the step skipped and counted: engine.step still ends the window)
            if overflow:
                return False
        if self.config.training.gradient_clipping > 0:
            self.clip_grad_norm(self.config.training.gradient_clipping)
        step = self._streamed_step if self.streamed else self._in_memory_step
        stepped = [p for group in self.group_params for p in group if p._zero.train_tensor.grad is not None]
        if self.agreed is not None:
            self.agreed.run(step, self.drop_grads, scaler_state)
        else:
            step()
        self.drop_grads()
        with torch._C.DisableTorchFunctionSubclass():  # as torch's in-place step of the weights with a gradient:
            torch.autograd.graph.increment_version(stepped)  # a backward of a graph that saved one before the step
        return True                                          # raises (probe 26C); the others are untouched

    def _in_memory_step(self) -> None:
        """The optimizer's step on state in memory, then the masters cast into the shards (with
        ``offload_param="nvme"`` a write of the drive: agreed), also after a step post-hook's error."""
        try:
            torch_step(self.optimizer)
        finally:  # probe 36M: under bf16 the shards kept the old weights
            self.copy_masters_to_shards()

    # -- state on NVMe ---------------------------------------------------------------------------
    def _streamed_step(self) -> None:
        """See [Note: streamed optimizer step] (streamed.py moves and steps the sub-groups)."""
        self.streamer.step_all()

    def loaded(self, params: Sequence[ZeroParameter], write: bool) -> contextlib.AbstractContextManager[None]:
        """See `SubgroupStreamer.loaded`."""
        return self.streamer.loaded(params, write)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale (fp16, once per window), then clip the gradient shards by their global norm."""
        if self.backward_step is not None:
            raise ZeroStateError(
                "clip_grad_norm_ with offload_optimizer_step_in_backward: the optimizer steps during the backward "
                "and drops the gradient shards, so there is nothing to clip; set offload_optimizer_step_in_backward"
                "=False to clip")
        self.unscale_()
        norm = clip_shards(self.grads_with_kind(), max_norm, norm_type, self.comm, self.comm_device,
                           self.model_parallel)
        self.global_grad_norm = norm
        return norm

    def state_of(self, p: ZeroParameter) -> dict[str, torch.Tensor]:
        """This rank's optimizer state for ``p`` (e.g. ``exp_avg``), keyed as torch.optim keys it."""
        return self.optimizer.state.get(p._zero.train_tensor, {})

    # -- checkpoints: the state as plain tensors and dicts -----------------------------------------
    @property
    def class_name(self) -> str:
        """The class name of the user's optimizer (a checkpoint records it)."""
        return type(self.optimizer).__name__

    def shard_state(self, p: ZeroParameter) -> dict[str, Any]:
        """A new dict of this rank's optimizer state for ``p``: the live tensors and values, keyed as
        torch.optim keys them ({} before the first step)."""
        return dict(self.optimizer.state.get(p._zero.train_tensor, {}))

    def load_shard_state(self, p: ZeroParameter, state: dict[str, Any]) -> None:
        """Make ``state`` (tensors it keeps, and values) ``p``'s whole optimizer state; empty: none."""
        if state:
            self.optimizer.state[p._zero.train_tensor] = dict(state)
        else:
            self.optimizer.state.pop(p._zero.train_tensor, None)

    def steps_on_device(self) -> set[int]:
        """The ids of the tensors whose param group keeps its 0-d state (Adam's ``step``) on the
        parameter's device (``capturable`` or ``fused``) rather than on the CPU, where torch.optim
        creates it otherwise. One set for a whole load: a search per parameter made loads quadratic."""
        return {id(t) for g in self.optimizer.param_groups if g.get("capturable") or g.get("fused") for t in g["params"]}

    def group_hyperparameters(self) -> list[dict[str, Any]]:
        """Each param group's settings (lr, betas, ...), in the group's key order, without ``params``."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def group_param_names(self) -> list[list[str]]:
        """Each param group's parameters, by name (``<unnamed SHAPE>`` for a tensor not of the model)."""
        names = {id(p._zero.train_tensor): p._zero.name for p in self.params}
        return [[names.get(id(t), f"<unnamed {tuple(t.shape)}>") for t in g["params"]]
                for g in self.optimizer.param_groups]

    def plain_states(self) -> list[list[Any]]:
        """``[group, index, state]`` of each tensor in the param groups that is not the model's (a
        plain tensor added with ``add_param_group``, whole on every rank): its optimizer state, which
        the model's shards do not carry (a checkpoint saves rank 0's)."""
        ours = {id(p._zero.train_tensor) for p in self.params}
        return [[i, j, dict(self.optimizer.state.get(t, {}))] for i, g in enumerate(self.optimizer.param_groups)
                for j, t in enumerate(g["params"]) if id(t) not in ours]

    def load_plain_states(self, entries: Sequence[Sequence[Any]]) -> None:
        """The states `plain_states` gave, onto the tensors at the same places; tensors of a
        dimension go to their tensor's device (and floating dtype), 0-d ones (``step``) stay on the
        CPU, as torch's ``load_state_dict`` does for a parameter on another device."""
        for i, j, state in entries:
            t = self.optimizer.param_groups[i]["params"][j]
            if not state:
                self.optimizer.state.pop(t, None)
                continue
            self.optimizer.state[t] = {k: v.to(t.device, t.dtype if v.is_floating_point() else v.dtype)
                                       if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in state.items()}

    def load_group_hyperparameters(self, groups: Sequence[dict[str, Any]]) -> None:
        """Set each param group's settings from ``groups`` (as `group_hyperparameters` returns them)."""
        for group, saved in zip(self.optimizer.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    group[k] = v

    def copy_masters_to_shards(self) -> None:
        """One cast-and-copy per group: fp32 masters into the parameter shards (offload/policy.py);
        per parameter when shards or masters are tensors of their own."""
        for fg in self.groups:
            if fg.low is not None and fg.master is not None:
                self.placement.copy_back(fg.low, fg.master)
                continue
            for p in fg.params:
                z = p._zero
                if z.master is None and z.swap is None:
                    continue  # the optimizer stepped on the shard itself, in memory: nothing to copy
                with self.streamer.loaded([p], write=False):
                    self.streamer.write_shard(p, z.train_tensor)
        if self.shards is not None:
            self.shards.flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``engine.zero_grad()`` (runtime/engine_calls.py): within an accumulation window it keeps the
        window's gradients, as DeepSpeed's; this is the optimizer ``zero3.deepspeed.initialize`` returns.
        ``set_to_none`` is DeepSpeed's signature: the gradient shards are always dropped (None)."""
        if self.user_zero_grad is None:
            raise ZeroStateError("this optimizer's gradients are the engine's: call engine.zero_grad()")
        self.user_zero_grad()

    def stepping_in_backward(self) -> bool:
        """The running (or last) backward steps the optimizer inside it; its abort drops the gradients."""
        return self.backward_step is not None and self.backward_step.phase in (BackwardStepPhase.STEPPING,
                                                                                BackwardStepPhase.STEPPED)

    def stepped_in_backward(self) -> bool:
        """The last backward stepped sub-groups (the step in backward), so ``engine.step()`` ends its window."""
        return self.backward_step is not None and self.backward_step.phase is BackwardStepPhase.STEPPED

    def left_half_stepped(self) -> bool:
        """A backward that stepped sub-groups in place was aborted: the parameters are part-way through a
        step until a checkpoint is loaded."""
        return self.backward_step is not None and self.backward_step.phase is BackwardStepPhase.BROKEN

    def drop_grads(self) -> None:
        """Drop every gradient shard (after a step, an overflow, or a window's first micro-batch)."""
        type(self.optimizer).zero_grad(self.optimizer, set_to_none=True)  # its own, not the routed one
        for p in self.params:  # also those the wrapped optimizer does not hold
            t = p._zero.train_tensor
            if t.grad is not None:
                t.grad = None
        self.unscaled = self._overflow = False

    # -- accounting ------------------------------------------------------------------------------
    def shard_bytes(self) -> int:
        """Bytes of parameter shards in memory: the flat ``low`` buffers (gaps included) plus
        standalone shards (those on the drive count 0)."""
        flat = {p._zero.id for fg in self.groups if fg.low is not None for p in fg.params}
        n = sum(resident_bytes(fg.low) for fg in self.groups if fg.low is not None)
        return n + sum(resident_bytes(p._zero.shard) for p in self.params if p._zero.id not in flat)

    def master_bytes(self) -> int:
        """Bytes of the fp32 masters in memory (0 when the optimizer steps on the shards themselves)."""
        flat = sum(resident_bytes(fg.master) for fg in self.groups if fg.master is not None)
        return flat + sum(resident_bytes(p._zero.master) for fg in self.groups if fg.master is None
                          for p in fg.params if p._zero.master is not None)

    def state_bytes(self) -> int:
        """Bytes of the optimizer's per-element state in memory."""
        return sum(resident_bytes(v) for state in self.optimizer.state.values() for v in state.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    @property
    def nvme_bytes(self) -> int:
        """Bytes of masters and optimizer state whose home is the drive."""
        return self.states.nvme_bytes if self.states is not None else 0


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` in memory: 0 while its storage is released (offloaded or swapped out)."""
    return t.numel() * t.element_size() if t.untyped_storage().nbytes() > 0 else 0


def _per_element(v: Any, shard_numel: int) -> bool:
    """Optimizer state with one value per shard element (Adam's moments; not a step counter)."""
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == shard_numel


def _subgroups(group_params: list[list[ZeroParameter]], limit: int) -> list[tuple[int, list[ZeroParameter]]]:
    """Consecutive parameters of each param group, at most ``limit`` shard elements per sub-group
    (a larger parameter is a sub-group of its own)."""
    out: list[tuple[int, list[ZeroParameter]]] = []
    for gi, ps in enumerate(group_params):
        cur: list[ZeroParameter] = []
        n = 0
        for p in ps:
            if cur and n + p._zero.shard_numel > limit:
                out.append((gi, cur))
                cur, n = [], 0
            cur.append(p)
            n += p._zero.shard_numel
        if cur:
            out.append((gi, cur))
    return out

