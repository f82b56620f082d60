"""Activation checkpointing with DeepSpeed's API (``deepspeed.checkpointing``), beside ZeRO-3.

``checkpoint(function, *args)`` runs ``function`` without keeping its intermediate activations and
runs it again in the backward (the recompute), from saved inputs and saved RNG states, so gradients
are those of the plain model, dropout masks included. ``configure(mpu, ...)`` (or the config's
``activation_checkpointing`` section) chooses how the saved inputs are kept:

- ``partition_activations``: each floating-point input is flattened and split into mp equal slices
  (padded), mp being the model-parallel group's size; a rank keeps only its own slice, and the
  recompute gathers the slices over the model-parallel group (one all-gather per dtype);
- ``cpu_checkpointing``: the saved floating-point inputs (or slices) are copied into CPU memory and
  moved back to the device each came from for the recompute;
- ``contiguous_memory_optimization``: the slices are copied into buffers allocated once per forward
  pass, one slot per checkpoint for ``number_checkpoints`` checkpoints, instead of one allocation each;
- ``synchronize_checkpoint_boundary``: ``torch.cuda.synchronize()`` at the start and end of every
  checkpoint's forward and backward when CUDA is available; a no-op on a CPU-only machine;
- ``profile``: every forward and backward (recompute included) is timed, logged at INFO by this
  module's logger and summed in `timings()`.

Integer and boolean tensors (token ids, masks) and non-tensor arguments are kept as they are.

[Note: the recompute is part of zero3's step]
The forward runs ``function`` under ``no_grad`` and the backward runs it again with grad, then a
nested ``torch.autograd.backward`` (the reentrant scheme, as DeepSpeed's). zero3's module hooks see
both runs: parameters are gathered for them, and the recompute's visits are recorded in the step's
trace like any others, so the next step follows a schedule that prefetches for the recompute too.
`checkpoint_scopes.checkpoint_forward` tells the hooks that a ``no_grad`` root forward is a
checkpoint's, not an inference step; that a step ends with the outermost backward, not the nested
one, the hooks find at the nested one's end (`checkpoint_scopes.EnclosingEnd`).
The outputs require grad whenever grad mode is on (an empty leaf that requires grad rides along as
an input), so parameters inside ``function`` get gradients even when no input requires grad, as
with frozen embeddings: torch's reentrant checkpoint silently gives them none in that case.

[Note: inputs that differ across ranks]
``partition_activations`` assumes what Megatron's tensor parallelism gives: every model-parallel rank
passes the checkpoint the same input. Under Megatron's sequence parallelism each passes its own part
of the sequence, and the gathered slices would make an input no rank had: the recompute, and every
gradient after it, silently wrong (0.13 relative off the full model on 2 x 2 ranks; probe 28A).
So each partitioned input's `bit_sum` is kept beside its slice (one int64), and the recompute's
all-gather carries every rank's (as raw words appended to the slices): each rank then holds all the
fingerprints and the gathered input, and raises `ZeroStateError` unless they are all equal, so every
rank of the group reaches the same verdict (a local comparison let a rank whose own part matched
recompute on and hang in the next collective; review 28X). One read of each input per forward and per
recompute, no collective more. The sum is blind to inputs that differ by a permutation of whole 64-bit
words within one rank's slice (rows swapped there on one rank; review 28Z): a position-weighted sum would see it, at many times the
cost (runtime/gathered.py [Note: writes that GatheredParameters discards] measured 14x). Ranks that
pass their own parts of a sequence differ in their values, which the sum sees.

[Note: why this module has process-wide state]
DeepSpeed's API is process-wide: ``configure`` once, then ``checkpoint`` anywhere in the model code,
and one RNG tracker (``get_cuda_rng_tracker``, in rng.py) that model code forks. The settings, the
model-parallel communicator, the contiguous buffers and the timings therefore live in one `_State`
object, replaced as a whole by `configure`; this module keeps no other state (zero3's other
process-wide state: exit_release, process_group's warning flag, the parameter id counter, the
wrapper of ``nn.Module._apply``, the optimizer step pre-hook).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from ..comm.communicator import Communicator, Kind, Tag
from ..comm.settings import CommSettings
from ..config import ActivationCheckpointingConfig, resolve_config
from ..errors import ZeroStateError
from ..runtime.checkpoint_scopes import checkpoint_forward
from ..runtime.rank_values import bit_sum
from ..metrics import StepMetrics
from ..comm.model_parallel import model_parallel_group
from .rng import MODEL_PARALLEL_RNG, CudaRNGStatesTracker, RNGStatesTracker, get_cuda_rng_tracker

logger = logging.getLogger(__name__)

_SEED_OFFSET = 2718  # model-parallel seed = seed + 2718 + model-parallel rank, as Megatron and DeepSpeed


# -- settings -------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _ModelParallelGroup:
    world_size: int
    rank: int
    comm: Communicator | None  # None with one rank: slices are the whole tensor


@dataclass
class Timings:
    """What ``profile`` measured since `configure`: seconds and calls, forward and backward."""

    forward_seconds: float = 0.0
    forward_calls: int = 0
    backward_seconds: float = 0.0  # the recompute and its nested backward, gathers included
    backward_calls: int = 0


@dataclass(eq=False)
class _ContiguousBuffers:
    """One buffer per saved-input position, ``slots`` slices long, allocated at the first checkpoint of
    a forward pass; `new_pass` lets the next forward allocate fresh ones (the old buffers live on
    while saved slices still view them)."""

    slots: int
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    used: dict[int, int] = field(default_factory=dict)

    def store(self, position: int, t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        buf = self.buffers.get(position)
        if buf is None:
            buf = self.buffers[position] = torch.empty(self.slots * n, dtype=t.dtype, device=t.device)
            self.used[position] = 0
        slot = buf.numel() // self.slots
        if n != slot or buf.dtype != t.dtype or buf.device != t.device:
            raise ZeroStateError(
                f"contiguous_memory_optimization: saved input {position} of this checkpoint is {n} x {t.dtype} on "
                f"{t.device}, but the buffer slots for that input hold {slot} x {buf.dtype} on {buf.device}; every "
                "checkpoint of a forward pass must take inputs of the same sizes (homogeneous layers), or turn "
                "contiguous_memory_optimization off")
        k = self.used[position]
        if k >= self.slots:
            raise ZeroStateError(
                f"contiguous_memory_optimization: checkpoint {k + 1} of this forward pass, but number_checkpoints="
                f"{self.slots}; set number_checkpoints to the number of checkpoint() calls per forward pass (call "
                "zero3.checkpointing.reset() after forward passes that have no backward)")
        self.used[position] = k + 1
        # Through ``.data``: a slot gets a version counter of its own, so filling the next slot does not
        # look to autograd like an in-place change of the slices saved before it.
        return buf.data[k * n:(k + 1) * n].copy_(t)

    def new_pass(self) -> None:
        self.buffers = {}
        self.used = {}


@dataclass(eq=False)
class _State:
    config: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    configured: bool = False
    by_user: bool = False  # `configure` called by the user (an initialize's section does not replace it)
    mp: _ModelParallelGroup = field(default_factory=lambda: _ModelParallelGroup(1, 0, None))
    buffers: _ContiguousBuffers | None = None
    timings: Timings = field(default_factory=Timings)


_STATE = _State()


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None, *, metrics: StepMetrics | None = None) -> None:
    """Configure activation checkpointing (DeepSpeed's ``deepspeed.checkpointing.configure``).

    Every call starts from the defaults (everything off): the ``activation_checkpointing`` section of
    ``deepspeed_config`` if given, then each argument that is not None on top.

    Args:
        mpu_: a Megatron-style model-parallel unit (comm/model_parallel.py) whose model-parallel group
            partitioned activations are split over and `model_parallel_cuda_manual_seed` takes the
            rank from; None: no model parallelism (unlike DeepSpeed, None does not keep an earlier unit).
        deepspeed_config: a config (dict, JSON path or `ZeroConfig`) whose ``activation_checkpointing``
            section is read.
        partition_activations: ``partition_activations``.
        contiguous_checkpointing: ``contiguous_memory_optimization``.
        num_checkpoints: ``number_checkpoints``.
        checkpoint_in_cpu: ``cpu_checkpointing``.
        synchronize: ``synchronize_checkpoint_boundary``.
        profile: ``profile``.
        metrics: where the partitioned activations' gathers count their bytes (``zero3.initialize``
            passes its engine's step metrics); None: counters of their own, which no step reports.

    Raises:
        ZeroConfigError: an invalid value or combination (named), or an invalid ``mpu_``.
    """
    base = ActivationCheckpointingConfig()
    if deepspeed_config is not None:
        base = resolve_config(deepspeed_config).activation_checkpointing or base
    overrides = {"partition_activations": partition_activations, "contiguous_memory_optimization":
                 contiguous_checkpointing, "number_checkpoints": num_checkpoints, "cpu_checkpointing":
                 checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    config = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    mp = _ModelParallelGroup(1, 0, None)
    found = model_parallel_group(mpu_) if mpu_ is not None else None
    if found is not None and found[1] > 1:
        group, world, rank = found
        # No verification headers: these gathers run on the model's own model-parallel group, in
        # lockstep with the model's tensor-parallel collectives, which zero3 cannot verify either.
        mp = _ModelParallelGroup(world, rank, Communicator(group, CommSettings(overlap=False, verify=False),
                                                           metrics=metrics if metrics is not None else StepMetrics(),
                                                           world_size=world, rank=rank))
    global _STATE
    _STATE = _State(config=config, configured=True, by_user=True, mp=mp,
                    buffers=_ContiguousBuffers(config.number_checkpoints)
                    if config.contiguous_memory_optimization and config.number_checkpoints else None)
    logger.info("zero3: activation checkpointing %s, model-parallel rank %d of %d", config, mp.rank, mp.world_size)
    if config.partition_activations and mp.world_size == 1:
        logger.warning("zero3: partition_activations with no model parallelism (%s): there is one slice, so each "
                       "saved input is kept whole, as a copy; pass an mpu with a model-parallel group above 1, or "
                       "turn it off", "no mpu" if mpu_ is None else "model-parallel size 1")


def is_configured() -> bool:
    """Whether `configure` was called (``checkpoint`` also works without it: nothing is partitioned,
    offloaded or profiled then)."""
    return _STATE.configured


def configured_by_user() -> bool:
    """Whether the user called `configure` (not `configure_for_engine`): then its settings stand."""
    return _STATE.by_user


def configure_for_engine(mpu_: Any, config: Any, metrics: StepMetrics) -> None:
    """`configure` from an ``initialize``'s config section: a later ``initialize`` with a section
    replaces it, where a call of `configure` by the user stands."""
    configure(mpu_, deepspeed_config=config, metrics=metrics)
    _STATE.by_user = False


def current_config() -> ActivationCheckpointingConfig:
    """The settings `checkpoint` uses now."""
    return _STATE.config


def reset() -> None:
    """Drop the contiguous buffers, so the next forward pass starts at slot 0 (DeepSpeed's
    ``reset``: call it after forward passes that had no backward, e.g. in evaluation)."""
    if _STATE.buffers is not None:
        _STATE.buffers.new_pass()


def timings() -> Timings:
    """A copy of what ``profile`` measured since `configure` (zeros when it is off)."""
    return dataclasses.replace(_STATE.timings)


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with ``seed`` and the tracker's ``model-parallel-rng`` state with
    ``seed + 2718 + model-parallel rank`` (the configured unit's rank; 0 without one).

    The default generator (the CUDA one when CUDA is available, else the CPU one) is then the same
    on every model-parallel rank, for dropout outside tensor-parallel regions; the tracked state
    differs between model-parallel ranks and is the same across data-parallel ranks, for dropout
    inside them (``with get_cuda_rng_tracker().fork():``). Forgets every other tracked state.
    """
    mp_seed = seed + _SEED_OFFSET + _STATE.mp.rank
    tracker = get_cuda_rng_tracker()
    if tracker.device.type == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, mp_seed)
    logger.info("zero3: model-parallel rank %d: default seed %d, model-parallel seed %d", _STATE.mp.rank, seed,
                mp_seed)


# -- checkpoint ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _RngStates:
    cpu: torch.Tensor
    cuda: dict[int, torch.Tensor]
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls, devices: set[int]) -> _RngStates:
        cuda = {d: torch.cuda.get_rng_state(d) for d in devices}
        return cls(torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, state in self.cuda.items():
            torch.cuda.set_rng_state(state, d)
        get_cuda_rng_tracker().set_states(self.tracker)


def _cuda_devices(tensors: list[torch.Tensor]) -> set[int]:
    """The CUDA devices whose RNG a checkpoint saves: the current one and its inputs' (none without CUDA)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return set()
    return {torch.cuda.current_device()} | {t.device.index for t in tensors if t.is_cuda}


def _boundary(config: ActivationCheckpointingConfig) -> None:
    if config.synchronize_checkpoint_boundary and torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass(frozen=True)
class _Kept:
    """How one tensor input is saved: its place among the saved tensors and how to rebuild it."""

    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool  # saved as this rank's slice of the flat, padded tensor
    fingerprint: torch.Tensor | None = None  # a partitioned input's `bit_sum`, checked after the gather


@dataclass(eq=False)
class _Call:
    """One `checkpoint` call: the function's arguments that are not tensors, and its outputs'
    structure (filled in by the forward)."""

    function: Callable[..., Any]
    flat: list[Any]  # the flattened arguments; the tensors' places are None once the forward ran
    spec: Any
    tensor_at: list[int]  # positions of the tensors in ``flat``
    state: _State
    kept: list[_Kept] = field(default_factory=list)
    rng: _RngStates | None = None
    out_flat: list[Any] = field(default_factory=list)
    out_spec: Any = None
    out_tensor_at: list[int] = field(default_factory=list)

    def arguments(self, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        flat = list(self.flat)
        for i, t in zip(self.tensor_at, tensors):
            flat[i] = t
        return tuple(pytree.tree_unflatten(flat, self.spec))


def _is_activation(t: torch.Tensor) -> bool:
    return t.is_floating_point()


def _keep(call: _Call, tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """What the forward saves for each input (see the module docstring)."""
    config, mp, buffers = call.state.config, call.state.mp, call.state.buffers
    out = []
    position = 0
    for t in tensors:
        partitioned = config.partition_activations and _is_activation(t)
        fingerprint = _fingerprint(t) if partitioned and mp.comm is not None else None  # [Note: inputs that differ
        call.kept.append(_Kept(t.shape, t.device, t.requires_grad, partitioned, fingerprint))  # across ranks]
        if not _is_activation(t):
            out.append(t)
            continue
        if partitioned:
            flat = t.detach().reshape(-1)
            s = -(-flat.numel() // mp.world_size)
            part = torch.zeros(s, dtype=t.dtype, device=t.device)
            mine = flat[mp.rank * s:(mp.rank + 1) * s]
            part[: mine.numel()].copy_(mine)
            if config.cpu_checkpointing:
                part = part.to("cpu")
            if buffers is not None:
                part = buffers.store(position, part)
            position += 1
            out.append(part)
        elif config.cpu_checkpointing:
            out.append(t.detach().to("cpu", copy=True))
        else:
            out.append(t)
    return out


def _restore(call: _Call, saved: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The inputs again, detached, on their devices, with their ``requires_grad``; partitioned ones
    gathered over the model-parallel group (one all-gather per dtype)."""
    mp = call.state.mp
    full: dict[int, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, k in enumerate(call.kept):
        if k.partitioned:
            by_dtype.setdefault(saved[i].dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        if mp.comm is None:
            rows = [saved[i].reshape(1, -1) for i in idx]
        else:  # each rank's fingerprints ride along, as raw words of this dtype ([Note: inputs that differ
            prints = [call.kept[i].fingerprint.to(mp.comm.device).reshape(1).view(torch.uint8).view(dtype)  # across
                      for i in idx]  # ranks])
            flat = torch.cat([saved[i].to(mp.comm.device) for i in idx] + prints)  # type: ignore[union-attr]
            gathered = mp.comm.all_gather_tensor(flat, Tag(Kind.TENSOR_GATHER, "activation checkpoint recompute"))
            rows, off = [], 0
            for i in idx:
                rows.append(gathered[:, off: off + saved[i].numel()])
                off += saved[i].numel()
            ranks_prints = gathered[:, off:].contiguous().view(torch.uint8).view(torch.int64)  # (ranks, inputs)
        for j, (i, r) in enumerate(zip(idx, rows)):
            k = call.kept[i]
            numel = k.shape.numel()
            full[i] = r.reshape(-1)[:numel].view(k.shape)
            if k.fingerprint is not None:  # every rank sees every rank's fingerprint: one verdict for all
                theirs = ranks_prints[:, j]
                if not bool((theirs == theirs[0]).all()) or not torch.equal(_fingerprint(full[i]).to(theirs.device),
                                                                            theirs[0]):
                    raise _differs_refusal(i, k, mp.world_size)
    out = []
    for i, k in enumerate(call.kept):
        t = full.get(i, saved[i])
        t = t.to(k.device).detach()
        if k.requires_grad:
            t.requires_grad_(True)
        out.append(t)
    return out


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """`bit_sum` of ``t``'s values in order, whatever its storage offset (`bit_sum` sums 64-bit words
    only from an 8-byte boundary: a view elsewhere is copied first)."""
    flat = t.detach().reshape(-1)
    return bit_sum(flat if flat.storage_offset() * flat.element_size() % 8 == 0 else flat.clone())


def _differs_refusal(i: int, k: _Kept, mp: int) -> ZeroStateError:
    return ZeroStateError(
        f"activation checkpoint recompute: the {mp} model-parallel ranks passed different values as input {i} (shape "
        f"{tuple(k.shape)}): the fingerprints they kept at the forward differ, or differ from the input gathered "
        "from their slices. partition_activations keeps 1/mp of each input and needs every model-parallel rank "
        "to pass the same one (Megatron's "
        "sequence parallelism gives each its own part of the sequence). Set partition_activations false for such "
        "blocks (Megatron turns it off under sequence parallelism); the gradients would be wrong")


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        config = call.state.config
        _boundary(config)
        t0 = time.perf_counter()
        call.rng = _RngStates.capture(_cuda_devices(list(tensors)))
        with checkpoint_forward():
            outputs = call.function(*call.arguments(tensors))
        for i in call.tensor_at:
            call.flat[i] = None  # the call lives as long as the graph: it must not hold the inputs
        ctx.save_for_backward(*_keep(call, tensors))
        ctx.call = call
        call.out_flat, call.out_spec = pytree.tree_flatten(outputs)
        call.out_tensor_at = [i for i, o in enumerate(call.out_flat) if isinstance(o, torch.Tensor)]
        outs = [call.out_flat[i] for i in call.out_tensor_at]
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        _boundary(config)
        if config.profile:
            _record(call.state, "forward", time.perf_counter() - t0)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        if not torch.autograd._is_checkpoint_valid():
            raise ZeroStateError("zero3.checkpointing.checkpoint recomputes inside backward, which torch.autograd.grad "
                                 "does not allow; use loss.backward() (or engine.backward(loss))")
        call: _Call = ctx.call
        config = call.state.config
        _boundary(config)
        t0 = time.perf_counter()
        if call.state.buffers is not None:
            call.state.buffers.new_pass()  # the next forward pass allocates its own buffers
        inputs = _restore(call, ctx.saved_tensors)
        assert call.rng is not None
        now = _RngStates.capture(set(call.rng.cuda))
        call.rng.restore()
        try:
            with torch.enable_grad():
                outputs = call.function(*call.arguments(tuple(inputs)))
        finally:
            now.restore()
        outs, out_grads = [], []
        for o, g in zip((o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor)), grads):
            if o.requires_grad and g is not None:
                outs.append(o)
                out_grads.append(g)
        if outs:
            torch.autograd.backward(outs, out_grads)
        _boundary(config)
        if config.profile:
            _record(call.state, "backward", time.perf_counter() - t0)
        return (None, None) + tuple(t.grad if t.requires_grad else None for t in inputs)


def _record(state: _State, what: str, seconds: float) -> None:
    t = state.timings
    if what == "forward":
        t.forward_seconds += seconds
        t.forward_calls += 1
    else:
        t.backward_seconds += seconds
        t.backward_calls += 1
    logger.info("zero3::checkpoint %s %.3f ms", what, 1e3 * seconds)


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` without keeping its activations; recompute them in the backward.

    ``args`` may hold tensors anywhere (nested in lists, tuples, dicts) and any other objects; the
    result may be a tensor or any structure of tensors and other objects, and integer or boolean
    result tensors are not differentiable. Gradients equal those of ``function(*args)`` run plainly:
    the recompute starts from the CPU, CUDA and tracker RNG states the forward started from. How the
    inputs are kept follows `configure` (module docstring). With grad mode off, ``function`` just runs.

    Raises:
        ZeroStateError: ``torch.autograd.grad`` through a checkpoint (use ``.backward()``), or a
            contiguous-buffer limit (``number_checkpoints``, sizes) was exceeded.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    flat, spec = pytree.tree_flatten(args)
    tensor_at = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    call = _Call(function=function, flat=flat, spec=spec, tensor_at=tensor_at, state=_STATE)
    anchor = torch.empty(0, requires_grad=True)
    outs = _CheckpointFunction.apply(call, anchor, *[flat[i] for i in tensor_at])
    out_flat, call.out_flat = call.out_flat, []  # nor the outputs (the next layer's full input)
    for i, o in zip(call.out_tensor_at, outs):
        out_flat[i] = o
    return pytree.tree_unflatten(out_flat, call.out_spec)


__all__ = [
    "CudaRNGStatesTracker",
    "MODEL_PARALLEL_RNG",
    "RNGStatesTracker",
    "Timings",
    "checkpoint",
    "configure",
    "current_config",
    "get_cuda_rng_tracker",
    "is_configured",
    "configured_by_user",
    "configure_for_engine",
    "model_parallel_cuda_manual_seed",
    "reset",
    "timings",
]
