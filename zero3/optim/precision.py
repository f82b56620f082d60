"""Mixed precision: parameter dtypes, the fp16 loss scaler, unscaling with an overflow check.

[Note: mixed precision dtype flow]
With ``dtype="bf16"`` (or ``"fp16"``) a parameter's shard, its gathers and all compute are in that
dtype; the optimizer never sees them. `lower_precision` casts the shards when the engine is built
and keeps an fp32 copy of every trainable shard, which becomes its *master* (optimizer.py
[Note: flat master buffers]). Each step then runs:

1. forward/backward in ``dtype``; for fp16 ``engine.backward`` multiplies the loss by the loss scale;
2. the full low-precision gradient is cast to ``reduce_dtype``, reduced (comm/reduce.py), and this rank's
   slice is added into the fp32 gradient of the master shard (runtime/grad.py); the full gradient is freed;
3. at the accumulation boundary (fp16) the fp32 gradients are unscaled and checked for inf/nan, the
   ranks agree on overflow with an all-reduce (MAX of a 0/1 flag, over the data-parallel ranks and
   an ``mpu``'s model-parallel ones), and an overflowing step is
   skipped on every rank while `LossScaler` backs off;
4. optional clipping by the global fp32 norm, then the user's optimizer steps on the fp32 masters;
5. each group's masters are copied into its low-precision shard buffer in one copy (cast; one per
   parameter where the shards have no flat buffer: NVMe, shared memory), and the
   persistent parameters are re-gathered from the new shards.

Nothing is cast when ``dtype="fp32"`` (the default): the optimizer steps on the shards themselves,
exactly as without this module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.utils.parametrize import ParametrizationList
from torch.nn.utils.spectral_norm import SpectralNorm

from ..errors import ZeroStateError
from ..partition.param import ZeroParam, ZeroParameter, set_placeholder_dtype
from ..partition.state import ParamStatus

if TYPE_CHECKING:
    from ..config import ZeroConfig
    from ..offload.residence import ShardStore

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class RunningBackward:
    """The factor every gradient of the running ``engine.backward`` carries: its engine's loss scale
    (1.0 without fp16), or None while no ``engine.backward`` runs (a plain ``loss.backward()``).

    [Note: a backward that crosses engines]
    One backward reaches every model its graph crosses: a GAN's generator loss runs through the
    discriminator, an RLHF critic may call the actor's trunk. Each engine's gradients must carry its
    own factor (its loss scale until unscaled, else 1), which the one that called ``engine.backward``
    does not know. So the factor is process-wide, set around ``engine.backward`` (`scaling`), and an
    engine a gradient reaches multiplies it by ``its own / the running one`` before it is reduced
    (runtime/hooks.py ``_on_grad``): an fp32 discriminator gets torch's gradient of the generator's
    loss, not 65,536 times it, and an fp16 one the generator's scale traded for its own. Limits: the
    receiving engine's fp16 part computed its gradients at the other's factor, so below its own scale
    small ones may have flushed to zero (an fp32 generator into an fp16 discriminator at 2**16: 104
    of 128 entries of a weight's gradient zero, 92% off, measured); a gradient that overflowed stays
    inf: an fp16 engine skips its step on it (its overflow check), an fp32 or bf16 one has none. An
    fp16 engine whose window clipping has unscaled refuses it (hooks.py `_refuse_unscaled`), as it
    refuses its own ``engine.backward`` there; one whose optimizer steps in the backward
    (``offload_optimizer_step_in_backward``) steps inside the other's backward. Not a thread-local:
    autograd runs a CUDA backward on threads of its own.
    """

    __slots__ = ("scale",)

    def __init__(self) -> None:
        self.scale: float | None = None


RUNNING_BACKWARD = RunningBackward()


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (``fp32``, ``bf16``, ``fp16``)."""
    return DTYPES[name]


def master_dtype(shard_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the masters of shards of ``shard_dtype``: fp32, or fp64 for fp64 shards (an fp64
    model under ``dtype: fp32`` with the optimizer offloaded trained through fp32 masters, 3e-8 off torch's
    fp64 run, and saved fp32 weights; probe 31J)."""
    return torch.float64 if shard_dtype == torch.float64 else torch.float32


def lower_precision(params: Iterable[ZeroParameter], dtype: torch.dtype, store: ShardStore) -> dict[int, torch.Tensor]:
    """Cast every floating-point shard (and the empty full-size placeholder) to ``dtype``.

    Returns the full-precision (fp32) shard of every trainable parameter, keyed by ``ZeroParam.id``:
    the masters are initialised from it, so they start from the weights as built, not from their
    rounded low-precision copy. Must run before anything is gathered.
    """
    fp32: dict[int, torch.Tensor] = {}
    for p in params:
        z = p._zero
        if not z.shard.is_floating_point():
            continue
        if z.status is not ParamStatus.NOT_AVAILABLE:
            raise ZeroStateError(f"{z.summary()} is gathered while the engine casts it to {dtype}; close "
                                 "GatheredParameters contexts before zero3.initialize")
        if z.swap is not None:
            continue  # on NVMe, in ``dtype`` already (runtime/context.py checks): masters read it back when built
        if p.requires_grad:
            fp32[z.id] = z.shard if z.shard.dtype == torch.float32 else _finest(z)
        if z.shard.dtype == dtype:
            continue
        store.cast(p, dtype)
        set_placeholder_dtype(p, dtype)
    return fp32


def _finest(z: ZeroParam) -> torch.Tensor:
    """The fp32 values of a low-precision shard: an earlier engine's master when it still rounds to
    the shard (a model initialized again after ``remove_hooks``: seeding from the shard rounded the
    trained masters to bf16, 8e-4 off, probe 31H), else the shard cast up."""
    master = z.master  # on the drive (offload_optimizer nvme) its storage holds no bytes: not read
    if master is not None and master.dtype == torch.float32 and master.numel() == z.shard.numel() and \
            master.untyped_storage().nbytes() >= (master.storage_offset() + master.numel()) * 4 and \
            torch.equal(master.to(device=z.shard.device, dtype=z.shard.dtype), z.shard):
        return master.to(z.shard.device, copy=True)
    return z.shard.float()


def lower_buffers(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Cast to ``dtype`` the buffers torch's kernels use beside a weight that zero3 lowers to it: the
    running statistics of normalisation layers (BatchNorm, InstanceNorm) and spectral normalisation's
    power-iteration vectors (both APIs). Torch refuses them in fp32 beside a bf16 weight, and
    ``model.bfloat16()`` (DeepSpeed's ``module.bfloat16()``) casts them. Every other buffer keeps its
    dtype (a rotary ``inv_freq``; a router's fp32 bias, which Hugging Face keeps in fp32 on purpose).
    Returns the names cast. Run after `lower_precision`."""
    cast: list[str] = []
    for prefix, module in model.named_modules():
        for owner, key, name, weights in _buffers_beside_weights(module):
            if not any(isinstance(p, ZeroParameter) and p._zero.shard.dtype == dtype for p in weights):
                continue
            b = owner._buffers.get(name)
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                owner._buffers[name] = b.to(dtype)
                cast.append(".".join(part for part in (prefix, key, name) if part))
    if cast:
        logger.info("zero3: buffers cast to %s with the weights they are used beside: %s", dtype, ", ".join(cast))
    return cast


def _buffers_beside_weights(module: nn.Module) -> Iterator[tuple[nn.Module, str, str, list[nn.Parameter]]]:
    """(owner, owner's name under ``module``, buffer name, the weights it is used with) for each such
    buffer of ``module``: BatchNorm's running statistics; ``weight_u``/``weight_v`` of the old
    ``spectral_norm`` hook (its weight is ``weight_orig``); every buffer of a parametrization in a
    ``ParametrizationList`` (its weight is the list's ``original``: spectral norm's ``_u``/``_v``,
    orthogonal's ``base``, a user's own), as ``model.to(dtype)`` casts them."""
    if isinstance(module, _NormBase):
        own = list(module.parameters(recurse=False))
        yield from ((module, "", name, own) for name in ("running_mean", "running_var"))
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, SpectralNorm):
            weight = [p for p in (module._parameters.get(hook.name + "_orig"),) if p is not None]
            yield from ((module, "", hook.name + suffix, weight) for suffix in ("_u", "_v"))
    if isinstance(module, ParametrizationList):
        own = list(module.parameters(recurse=False))
        for i, child in enumerate(module):
            for path, owner in child.named_modules(prefix=str(i)):
                yield from ((owner, path, name, own) for name in list(owner._buffers))


class LossScaler:
    """The fp16 loss scale, with DeepSpeed's ``DynamicLossScaler`` semantics.

    - dynamic: starts at ``2**initial_scale_power``. An overflow consumes one unit of hysteresis;
      when none is left the scale halves (never below ``min_loss_scale``). After
      ``loss_scale_window`` consecutive clean steps the scale doubles and the hysteresis is refilled
      (with ``consecutive_hysteresis`` it is refilled after every clean step). An overflow that would
      halve a scale already at ``min_loss_scale`` raises `ZeroStateError` on every rank, as
      DeepSpeed's ``raise_error_at_min_scale`` (its default) does: each step from there on would be
      skipped, and training would go on without learning.
    - static (``loss_scale > 0``): the scale never changes; overflowing steps are still skipped.

    The scale is a host float; every rank holds the same one because `update` is called with the
    overflow flag the ranks agreed on.
    """

    def __init__(self, *, scale: float, dynamic: bool, window: int = 1000, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, min_scale: float = 1.0, factor: float = 2.0) -> None:
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.min_scale = float(min_scale)
        self.factor = factor
        self.hysteresis_left = hysteresis
        self.clean_steps = 0  # clean steps since the last overflow
        self.overflows = 0

    @classmethod
    def from_config(cls, config: ZeroConfig) -> LossScaler | None:
        """The scaler ``config`` asks for: None unless ``dtype`` is fp16."""
        precision = config.precision
        if precision.dtype != "fp16":
            return None
        if precision.loss_scale > 0:
            return cls(scale=precision.loss_scale, dynamic=False)
        return cls(scale=2.0 ** precision.initial_scale_power, dynamic=True, window=precision.loss_scale_window,
                   hysteresis=precision.hysteresis, consecutive_hysteresis=precision.consecutive_hysteresis,
                   min_scale=precision.min_loss_scale)

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step that overflowed (and was skipped) or did not."""
        if overflow:
            self.overflows += 1
            self.clean_steps = 0
            if not self.dynamic:
                return
            if self.hysteresis_left <= 1:
                if self.scale == self.min_scale:  # DeepSpeed's test (a scale below it rises to it)
                    raise ZeroStateError(
                        f"fp16: a gradient overflowed at the minimum loss scale (min_loss_scale={self.min_scale:g}) "
                        f"after {self.overflows} overflowing steps; the step was skipped, and every later one would "
                        "be: the loss or the gradients are inf/nan whatever the scale (check the data and the lr), or "
                        "lower min_loss_scale")
                new = max(self.scale / self.factor, self.min_scale)
                logger.info("zero3::loss_scale overflow: skipping the step, scale %g -> %g", self.scale, new)
                self.scale = new
            else:
                self.hysteresis_left -= 1
                logger.info("zero3::loss_scale overflow: skipping the step, scale stays %g (hysteresis %d left)",
                            self.scale, self.hysteresis_left)
            return
        self.clean_steps += 1
        if not self.dynamic:
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.clean_steps % self.window == 0:
            if not self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            self.scale *= self.factor

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "dynamic": self.dynamic, "hysteresis_left": self.hysteresis_left,
                "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's scaler state. The config's mode wins (probe 36I: a static ``loss_scale`` given
        at resume was replaced by the checkpoint's dynamic scale, and a static checkpoint gave a dynamic
        run its unused hysteresis): a static scaler keeps its scale; a dynamic one takes the saved
        scale (at least ``min_loss_scale``), and the saved progress only from a dynamic checkpoint, its
        hysteresis at most the configured one (from a static one it starts afresh, whatever ran before).
        DeepSpeed's engine takes the checkpoint's whole scaler, its mode included."""
        saved_dynamic = bool(state.get("dynamic", True))
        if saved_dynamic != self.dynamic or not self.dynamic and float(state["scale"]) != self.scale:
            logger.warning("zero3: the checkpoint's fp16 loss scale is %s %g; this config's %s, which is kept%s",
                           "dynamic at" if saved_dynamic else "static", float(state["scale"]),
                           "is dynamic" if self.dynamic else f"is static {self.scale:g}",
                           " (starting from the saved scale)" if self.dynamic else "")
        self.overflows = int(state.get("overflows", 0))
        if not self.dynamic:
            return
        self.scale = max(float(state["scale"]), self.min_scale)  # the config's minimum holds too
        self.hysteresis_left, self.clean_steps = self.hysteresis, 0  # a static one saved no progress (review 36R1)
        if saved_dynamic:
            self.hysteresis_left = min(int(state["hysteresis_left"]), self.hysteresis)
            self.clean_steps = int(state["clean_steps"])

    def restore(self, state: dict[str, Any]) -> None:
        """Every field of `state_dict` back as it was, whatever the config says (a rolled-back step;
        review 36R1: `load_state_dict`'s policy for a checkpoint left a static scaler's clean steps
        advanced)."""
        self.scale, self.dynamic = float(state["scale"]), bool(state["dynamic"])
        self.hysteresis_left, self.clean_steps = int(state["hysteresis_left"]), int(state["clean_steps"])
        self.overflows = int(state.get("overflows", 0))


def unscale_(grads: Sequence[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place; return a 0/1 float tensor: any inf/nan seen.

    One fused pass per device and dtype (``torch._amp_foreach_non_finite_check_and_unscale_``, as
    ``torch.amp.GradScaler`` uses).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    found = torch.zeros(1, dtype=torch.float32)
    for (device, _), gs in groups.items():
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, flag, inv)
        found = torch.maximum(found, flag.cpu())
    return found
