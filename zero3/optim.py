"""The optimizer over shards: re-pointing a user's ``torch.optim`` optimizer, fp32 master shards in
flat buffers, the fp16 overflow check, global-norm clipping.

[Note: flat master buffers]
With ``dtype="fp32"`` and no offload the optimizer steps on the parameter shards themselves
(`shard_optimizer`). Otherwise (bf16/fp16, or ``offload_optimizer="cpu"``) each param group of the
user's optimizer gets a `FlatGroup`: two buffers with one layout,

- ``master``: fp32, one allocation per group, on the shard's device (on the CPU when offloaded,
  pinned if asked and CUDA exists); each trainable parameter's master shard is a view into it, and
  the group's ``params`` list is replaced by those views (class, hyperparameters, ``param_groups``
  and therefore LR schedulers are untouched; the state is keyed by the master view);
- ``low``: the parameter shards in the parameter dtype, on the shard's device; ``p._zero.shard`` is
  a view into it, so the all-gathers read from it.

Every view starts at a multiple of ``ALIGN_ELEMENTS`` (64) elements: 128 bytes in a 2-byte buffer,
256 in the fp32 one. Every rank's buffer holds only its own shards, and ranks have identical layouts
(every shard is ``ceil(numel / world)`` elements), so each rank's slice of a parameter starts on the
same aligned offset on every rank. The gaps hold zeros and never receive a gradient. After the
optimizer step one ``low.copy_(master)`` per group casts all the new weights back. Frozen parameters
(``requires_grad=False``) get no master, no gradient and no state: they keep a standalone shard.

The gradient of a master shard (``master.grad``, fp32, on the master's device) is where the reducer
accumulates (grad.py); it is allocated lazily and dropped by ``zero_grad``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .comm import Communicator, Kind, Tag
from .errors import ZeroConfigError, ZeroStateError
from .model_parallel import ModelParallel, is_tensor_parallel
from .offload import OffloadPolicy
from .param import ZeroParameter
from .precision import LossScaler, unscale_

if TYPE_CHECKING:
    from .config import ZeroConfig

logger = logging.getLogger(__name__)

ALIGN_ELEMENTS = 64
"""Offsets of views in a flat buffer are multiples of this many elements (see [Note: flat master buffers])."""


def aligned(numel: int) -> int:
    """``numel`` rounded up to a multiple of `ALIGN_ELEMENTS`."""
    return -(-numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def shard_optimizer(optimizer: Any, params: Iterable[ZeroParameter]) -> torch.optim.Optimizer:
    """Point ``optimizer`` at the shards of ``params`` (or build one from a factory).

    A ``torch.optim.Optimizer`` built over the full parameters keeps its class, param groups and
    hyperparameters: each group's parameters are replaced by their shards in place, so schedulers
    and references the user holds keep working. A callable is called with the param groups
    (``[{"params": shards}]``) and must return an optimizer. State exists only for this rank's shard.
    """
    params = list(params)
    by_id = {id(p): p._zero.shard for p in params}
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_fresh(optimizer)
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
        return optimizer
    if callable(optimizer):
        shards = [p._zero.shard for p in params if p.requires_grad]
        return _call_factory(optimizer, [{"params": shards}])
    raise _bad_optimizer(optimizer)


def validate_optimizer(optimizer: Any) -> None:
    """Reject what ``initialize`` cannot use, before it changes anything."""
    if optimizer is None or (callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)):
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise _bad_optimizer(optimizer)
    _check_fresh(optimizer)


def _check_fresh(optimizer: torch.optim.Optimizer) -> None:
    if len(optimizer.state) > 0:
        raise ZeroStateError(
            "the optimizer already has state (it has stepped); build it over model.parameters() and "
            "pass it to zero3.initialize before any step")


def _foreign(p: torch.Tensor) -> ZeroConfigError:
    return ZeroConfigError(f"optimizer parameter of shape {tuple(p.shape)} is not a parameter of the model "
                           "given to zero3.initialize")


def _bad_optimizer(optimizer: Any) -> ZeroConfigError:
    return ZeroConfigError(
        f"optimizer must be a torch.optim.Optimizer, a callable(param_groups) -> Optimizer, or None; "
        f"got {type(optimizer).__name__}")


def _call_factory(factory: Any, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    opt = factory(groups)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ZeroConfigError(f"optimizer factory must return a torch.optim.Optimizer, got {type(opt).__name__}")
    return opt


@dataclass(eq=False)
class FlatGroup:
    """One param group's shards on this rank: fp32 masters and parameter shards, one layout."""

    params: list[ZeroParameter]
    offsets: list[int]
    master: torch.Tensor
    low: torch.Tensor

    def masters(self) -> list[torch.Tensor]:
        return [p._zero.train_tensor for p in self.params]


class PartitionedOptimizer:
    """The user's optimizer plus what zero3 does around its step (see [Note: flat master buffers]).

    ``optimizer`` is the user's ``torch.optim.Optimizer`` object, re-pointed (or the one a factory
    built); ``scaler`` the fp16 `LossScaler` or None.
    """

    def __init__(self, optimizer: Any, params: Sequence[ZeroParameter], config: ZeroConfig,
                 comm: Communicator, fp32_shards: dict[int, torch.Tensor] | None = None,
                 model_parallel: ModelParallel | None = None) -> None:
        self.config = config
        self.comm = comm
        self.model_parallel = model_parallel
        self.params = list(params)
        self.scaler = LossScaler.from_config(config)
        self.offload = OffloadPolicy.from_config(config)
        self.groups: list[FlatGroup] = []
        self.skipped_steps = 0
        self.comm_device = self.params[0].data.device if self.params else torch.device("cpu")
        self._unscaled = False  # fp16: this window's gradients were already unscaled (by clipping)
        self._overflow = False  # ... and whether some rank saw inf/nan then
        self._scaled_backward = False  # fp16: engine.backward scaled a loss in this window
        self._last_overflow = False
        self.flat = config.dtype != "fp32" or self.offload.enabled
        if self.flat:
            self.optimizer = self._build_flat(optimizer, fp32_shards or {})
        else:
            self.optimizer = shard_optimizer(optimizer, self.params)

    # -- set-up ----------------------------------------------------------------------------------
    def _build_flat(self, optimizer: Any, fp32_shards: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
        by_id = {id(p): p for p in self.params}
        if isinstance(optimizer, torch.optim.Optimizer):
            _check_fresh(optimizer)
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
            return optimizer
        if callable(optimizer):
            fg = self._flatten([p for p in self.params if p.requires_grad], fp32_shards)
            self.groups.append(fg)
            return _call_factory(optimizer, [{"params": fg.masters()}])
        raise _bad_optimizer(optimizer)

    def _flatten(self, ps: list[ZeroParameter], fp32_shards: dict[int, torch.Tensor]) -> FlatGroup:
        offsets, total = [], 0
        for p in ps:
            offsets.append(total)
            total += aligned(p._zero.shard_numel)
        device = ps[0]._zero.shard.device if ps else self.comm_device
        dtypes = {p._zero.shard.dtype for p in ps}
        if len(dtypes) > 1:
            raise ZeroConfigError(f"one optimizer param group holds shards of several dtypes "
                                  f"{sorted(map(str, dtypes))}; "
                                  "build the model in one dtype (zero3.Init(dtype=...)) or set ZeroConfig.dtype")
        master = self.offload.alloc_master(total, device)
        low = torch.zeros(total, dtype=dtypes.pop() if dtypes else torch.float32, device=device)
        for p, off in zip(ps, offsets):
            z = p._zero
            s = z.shard_numel
            master[off: off + s].copy_(fp32_shards.get(z.id, z.shard))
            low[off: off + s].copy_(z.shard)
            z.replace_shard(low[off: off + s])
            z.master = master[off: off + s]
        return FlatGroup(params=ps, offsets=offsets, master=master, low=low)

    # -- one training window (micro-batches up to an optimizer step) ---------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to differentiate: times the fp16 loss scale (in fp32), else unchanged."""
        if self.scaler is None:
            return loss
        if self._unscaled:
            raise ZeroStateError(
                "backward after clip_grad_norm_ in the same accumulation window: the gradients were already "
                "unscaled. Clip once per optimizer step, after the last micro-batch's backward")
        self._scaled_backward = True
        return loss.float() * self.scaler.scale

    @property
    def grad_scale(self) -> float:
        """The factor the stored gradient shards carry: the loss scale until unscaled (fp16), else 1."""
        if self.scaler is None or self._unscaled:
            return 1.0
        return self.scaler.scale

    def grads(self) -> list[torch.Tensor]:
        """Every gradient shard this rank holds (fp32 masters' under mixed precision), once each."""
        return [g for g, _ in self.grads_with_kind()]

    def grads_with_kind(self) -> list[tuple[torch.Tensor, bool]]:
        """`grads`, each with whether its parameter is tensor-parallel (model_parallel.py)."""
        out, seen = [], set()
        for p in self.params:
            g = p._zero.train_tensor.grad
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                out.append((g, is_tensor_parallel(p)))
        return out

    def unscale_(self) -> bool:
        """fp16: divide this window's gradients by the loss scale, once; return the agreed overflow.

        A collective (an all-reduce of a 0/1 flag, MAX): every rank learns whether any rank saw an
        inf or nan. Without a scaler it does nothing and returns False.
        """
        if self.scaler is None or self._unscaled:
            return self._overflow
        grads = self.grads()
        if grads and not self._scaled_backward:
            raise ZeroStateError(
                "fp16 training needs engine.backward(loss): it multiplies the loss by the loss scale before "
                "backward. Replace loss.backward() by engine.backward(loss)")
        found = unscale_(grads, 1.0 / self.scaler.scale) if grads else torch.zeros(1)
        flag = found.to(self.comm_device)
        self.comm.all_reduce(flag, Tag(Kind.ALL_REDUCE, "fp16 overflow check"), op="max")
        self._overflow = bool(flag.item() > 0)
        self._unscaled = True
        return self._overflow

    def step(self) -> bool:
        """Unscale and agree on overflow (fp16), clip (``gradient_clipping``), step, copy back.

        Returns False when an overflow skipped the step (on every rank), else True.
        """
        self._last_overflow = False
        if self.scaler is not None:
            overflow = self.unscale_()
            self.scaler.update(overflow)
            if overflow:
                self._last_overflow = True
                self.skipped_steps += 1
                self.zero_grad()
                return False
        if self.config.gradient_clipping > 0:
            self.clip_grad_norm(self.config.gradient_clipping)
        self.optimizer.step()
        self.copy_masters_to_shards()
        self.zero_grad()
        return True

    @property
    def overflow(self) -> bool:
        """Whether the last optimizer step found an fp16 overflow (and was skipped), as DeepSpeed's
        ``optimizer.overflow``."""
        return self._last_overflow

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The user's optimizer's param groups (their ``params`` are the shards or fp32 masters)."""
        return self.optimizer.param_groups

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale (fp16, once per window), then clip the gradient shards by their global norm."""
        self.unscale_()
        return clip_shards(self.grads_with_kind(), max_norm, norm_type, self.comm, self.comm_device,
                           self.model_parallel)

    def state_of(self, p: ZeroParameter) -> dict[str, torch.Tensor]:
        """This rank's optimizer state for ``p`` (e.g. ``exp_avg``), keyed as torch.optim keys it."""
        return self.optimizer.state.get(p._zero.train_tensor, {})

    def copy_masters_to_shards(self) -> None:
        """One cast-and-copy per group: fp32 masters into the parameter shards (zero3/offload.py)."""
        for fg in self.groups:
            self.offload.copy_back(fg.low, fg.master)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p._zero.train_tensor.grad = None
        self._unscaled = self._overflow = self._scaled_backward = False

    # -- accounting ------------------------------------------------------------------------------
    def shard_bytes(self) -> int:
        """Bytes of parameter shards: the flat ``low`` buffers (gaps included) plus standalone shards."""
        flat = {p._zero.id for fg in self.groups for p in fg.params}
        n = sum(fg.low.numel() * fg.low.element_size() for fg in self.groups)
        return n + sum(p._zero.shard.numel() * p._zero.shard.element_size() for p in self.params
                       if p._zero.id not in flat)

    def master_bytes(self) -> int:
        """Bytes of the fp32 master buffers (0 when the optimizer steps on the shards themselves)."""
        return sum(fg.master.numel() * fg.master.element_size() for fg in self.groups)


def clip_shards(grads: Sequence[tuple[torch.Tensor, bool]], max_norm: float, norm_type: float,
                comm: Communicator, device: torch.device, model_parallel: ModelParallel | None = None) -> torch.Tensor:
    """Scale the gradient shards so their global ``norm_type``-norm is at most ``max_norm``; return it.

    ``grads`` pairs each shard with whether its parameter is tensor-parallel. The norm is over the
    full model: the shards' powers are summed over the data-parallel ranks (``comm``) and, with
    ``model_parallel``, over the model-parallel ranks too, where a replicated parameter (the same on
    every model-parallel rank) is counted only on model-parallel rank 0. Accumulated in fp32, reduced
    on ``device`` (where the collectives run).
    """
    norm_type = float(norm_type)
    tensors = [g for g, _ in grads]
    gdev = tensors[0].device if tensors else device
    tag = Tag(Kind.ALL_REDUCE, "gradient norm (clipping)")
    mp_tag = Tag(Kind.ALL_REDUCE, "gradient norm (clipping, model-parallel)")
    if norm_type == math.inf:
        local = max((g.abs().max() for g in tensors), default=torch.zeros((), device=gdev)).float()
        total = comm.all_reduce(local.to(device, copy=True), tag, op="max")
        if model_parallel is not None:
            total = model_parallel.comm.all_reduce(total.to(model_parallel.comm.device), mp_tag, op="max").to(device)
    else:
        counted = [g for g, parallel in grads if model_parallel is None or parallel or model_parallel.rank == 0]
        local = torch.zeros((), dtype=torch.float32, device=gdev)
        for g in counted:
            local += g.float().abs().pow(norm_type).sum()
        total = comm.all_reduce(local.to(device), tag)
        if model_parallel is not None:
            total = model_parallel.comm.all_reduce(total.to(model_parallel.comm.device), mp_tag).to(device)
        total = total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in tensors:
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total
