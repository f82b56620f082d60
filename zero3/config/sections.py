"""The runtime's sections of `ZeroConfig`: what the coordinator may keep gathered (`BudgetConfig`),
how ranks talk (`CommConfig`), in which precision (`PrecisionConfig`) and where state lives
(`OffloadConfig`). Each is frozen and validated by its field types on construction.

Budgets are counted in parameter *elements* (as DeepSpeed counts them) unless the field name says
``bytes``. Defaults equal DeepSpeed's where the knob exists there.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ZeroConfigError
from .fields import KnobValues, check_fields, check_ignored, coerce, field_types, unknown_key_message

logger = logging.getLogger(__name__)

ReduceImpl = Literal["auto", "reduce_scatter", "all_reduce", "p2p", "shm"]
GatherImpl = Literal["auto", "all_gather", "p2p", "shm"]
DtypeName = Literal["fp32", "bf16", "fp16"]
OffloadDevice = Literal["none", "cpu", "nvme"]


def _default(section: type, name: str) -> Any:
    """The default of field ``name`` of the dataclass ``section``."""
    return next(f.default for f in dataclasses.fields(section) if f.name == name)


def _changed(section: Any, names: tuple[str, ...]) -> list[str]:
    """``name=value`` of each of ``names`` that ``section`` holds at other than its default."""
    return [f"{n}={getattr(section, n)!r}" for n in names if getattr(section, n) != _default(type(section), n)]


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time only (a config is rebuilt by ``replace`` and by
    ``zero3.Init`` and ``initialize`` each: one warning per setting, not per copy)."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


@dataclass(frozen=True, kw_only=True, slots=True)
class BudgetConfig:
    """How much the coordinator may keep gathered, prefetch and remember (docs/config.md)."""

    prefetch_bucket_size: int = 50_000_000
    """Elements prefetched ahead of use (in flight or gathered but not yet used). 0 disables prefetch."""

    max_live_parameters: int = 1_000_000_000
    """Hard cap on gathered, non-persistent parameter elements alive on a rank, demand fetches included.
    Exceeded when the modules running at that moment need more by themselves, by a module called
    again in a step whose inputs need no gradient (held until its last call's backward is done), and
    under torch's non-reentrant activation checkpoint (``use_reentrant=False``: the recompute gathers
    earlier modules while a module's backward holds its own); docs/config.md has the details."""

    max_reuse_distance: int = 1_000_000_000
    """Keep a parameter after use if its next use comes within this many gathered elements."""

    param_persistence_threshold: int = 100_000
    """Parameters with at most this many elements stay gathered for the whole run."""

    model_persistence_threshold: int = sys.maxsize
    """Cap on the total elements kept persistent (greedy, in ``named_parameters`` order)."""

    max_live_bytes: int | None = None
    """Byte form of ``max_live_parameters``; when set, budgets are counted in bytes instead."""

    max_reuse_distance_bytes: int | None = None
    """Byte form of ``max_reuse_distance`` (used when ``max_live_bytes`` is set)."""

    prefetch_bucket_bytes: int | None = None
    """Byte form of ``prefetch_bucket_size`` (used when ``max_live_bytes`` is set)."""

    max_traces: int = 4
    """How many recorded step traces are cached (keyed by how the step began)."""

    memory_budget: int | Literal["auto"] | None = None
    """Bytes per rank for persistent and gathered parameters and the reduce bucket, or ``"auto"``
    (a share of the memory free at initialize): zero3 then chooses the six knobs (persistence and
    reduce bucket at initialize, the live, reuse and prefetch budgets from the first step's trace;
    planning/budget.py [Note: memory budget]) and ``engine.explain("budget")`` says what and why.
    None (the default): the knobs as set. Refused together with any of them set (docs/config.md)."""

    def __post_init__(self) -> None:
        check_fields(self, skip=frozenset({"memory_budget"}), counts=("max_traces",))
        if self.max_live_bytes is None:  # the byte knobs count only when the plan is in bytes
            for name, numel in (("prefetch_bucket_bytes", "prefetch_bucket_size"),
                                ("max_reuse_distance_bytes", "max_reuse_distance")):
                if getattr(self, name) is not None:
                    raise ZeroConfigError(f"{name}={getattr(self, name)!r} counts in bytes, which max_live_bytes "
                                          f"turns on: set max_live_bytes too, or use {numel} (elements)")
        # An element knob beside its byte form is never read (coordinator.py `plan_config`); one set
        # to other than its default (which cannot be told from unset) is refused, not dropped.
        for numel, nbytes in (("max_live_parameters", "max_live_bytes"), ("max_reuse_distance", "max_reuse_distance_bytes"),
                              ("prefetch_bucket_size", "prefetch_bucket_bytes")):
            if getattr(self, nbytes) is not None and getattr(self, numel) != _default(BudgetConfig, numel):
                raise ZeroConfigError(f"{numel}={getattr(self, numel)!r} is not used beside {nbytes}="
                                      f"{getattr(self, nbytes)!r}, which replaces it (in bytes): remove one of them")
        budget = self.memory_budget
        if budget is not None and budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int)
                                                         or budget <= 0):
            raise ZeroConfigError(f"memory_budget must be None, \"auto\" or an int > 0 (bytes per rank), "
                                  f"got {budget!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CommConfig:
    """How parameters are gathered and gradients reduced: buckets, transports, checks, ZeRO++."""

    overlap_comm: bool = True
    """Issue all-gathers asynchronously (side CUDA stream on GPU, ``async_op`` on CPU)."""

    reduce_bucket_size: int = 500_000_000
    """Gradient elements collected before one reduce-scatter is issued."""

    allgather_bucket_size: int = 500_000_000
    """Largest number of elements gathered by one collective; larger fetches are split."""

    reduce_scatter_impl: ReduceImpl = "auto"
    """How gradients are reduced: ``reduce_scatter``, ``all_reduce`` then slice, ``p2p`` (every rank
    sends each other rank its chunk and sums what it receives), ``shm`` (the same chunks passed
    through shared memory while the gathers' shared-memory window is open, comm/shared_reduce.py;
    needs shm gathers), or ``auto``: on gloo, shm where the gathers are shm and qgZ is off, else
    p2p (measured 0.59x the wall time of gloo's reduce-scatter and 0.72x its all-reduce's; see
    docs/performance.md); reduce-scatter elsewhere."""

    allgather_impl: GatherImpl = "auto"
    """How parameters are all-gathered: ``all_gather``, ``p2p`` (every rank sends its shards to every
    other rank), ``shm`` (ranks on one node keep their parameter shards in shared memory and read each
    other's during a step, comm/shared.py; p2p for the rest), or ``auto``: on gloo, shm when every
    rank is on one node and neither qwZ nor hpZ is on, else p2p (measured 0.60x the wall time of gloo's
    all-gather); all-gather elsewhere."""

    verify_collectives: bool | None = None
    """Verify that every rank issues the same collectives (kind, size, parameters carried), so ranks
    that run different modules all raise ``ZeroDivergenceError`` instead of hanging or mixing
    gradients. Steps that repeat an agreed plan carry the check inside their payloads (one header
    exchange per step); others exchange a header before each collective (comm/verify.py [Note: verified
    collectives]).
    ``None`` (the default): on, on every backend, NCCL included; ``False`` turns it off."""

    collective_timeout: float = 300.0
    """Seconds the engine's collectives (data- and model-parallel) may wait for the other ranks. They
    run on a process group of their own with this timeout (``zero3.Init``, the config agreement and
    activation checkpointing use the caller's group and its timeout): when a rank stops taking part (returned early,
    raised in its own code, died), every other rank raises ``ZeroCommunicationError`` naming it
    instead of hanging. 0: use the caller's process group and its timeout."""

    zero_quantized_weights: bool = False
    """ZeRO++ qwZ: parameter all-gathers carry blockwise-quantized int8 weights plus one fp32 scale per
    ``quantization_block_size`` elements (about a quarter of fp32's bytes); the gathered weights are
    dequantized, while shards, masters and the optimizer stay exact."""

    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ: gradient reduction messages carry blockwise-quantized values
    (``quantized_gradient_bits``); each is dequantized before it is summed, in fp32, so the error is
    one rounding per message and does not grow with the number of ranks; the reduced shard is fp32."""

    quantized_gradient_bits: int = 8
    """8 or 4: the integer width of ``zero_quantized_gradients`` messages."""

    quantization_block_size: int = 512
    """Elements per quantization block (one fp32 scale each) for qwZ and qgZ."""

    zero_hpz_partition_size: int = 1
    """ZeRO++ hpZ: ranks per secondary group. After a parameter is gathered in a training step's
    forward, each rank keeps 1/L of it (L ranks per group) until the step ends, so its backward
    gathers stay inside the group: a node, when L is the ranks per node. 1: off (DeepSpeed's
    default); -1: the ranks per node, found from where the ranks run (the ranks sharing this rank's host name and torchrun's GROUP_RANK);
    else it must divide the data-parallel world size. Costs about 1/L of the gathered weights per
    rank while a step runs (a quarter of that with ``zero_quantized_weights``); see
    docs/multinode.md."""

    def __post_init__(self) -> None:
        # zero_hpz_partition_size: -1 is allowed, checked here
        check_fields(self, skip=frozenset({"zero_hpz_partition_size"}), counts=("quantization_block_size",))
        hpz = self.zero_hpz_partition_size
        if isinstance(hpz, bool) or not isinstance(hpz, int) or not (hpz == -1 or hpz >= 1):
            raise ZeroConfigError(f"zero_hpz_partition_size must be an int >= 1 (1: off) or -1 (the ranks per node), "
                                  f"got {hpz!r}")
        if self.quantized_gradient_bits not in (8, 4):
            raise ZeroConfigError(f"quantized_gradient_bits must be 8 or 4, got {self.quantized_gradient_bits!r}")
        # ZeRO++'s wire settings without the coding they set: refused, not dropped
        if not self.zero_quantized_gradients and self.quantized_gradient_bits != 8:
            raise ZeroConfigError(f"quantized_gradient_bits={self.quantized_gradient_bits!r} applies only with "
                                  "zero_quantized_gradients=True; remove it or turn qgZ on")
        if not (self.zero_quantized_weights or self.zero_quantized_gradients) and self.quantization_block_size != 512:
            raise ZeroConfigError(f"quantization_block_size={self.quantization_block_size!r} applies only with "
                                  "zero_quantized_weights or zero_quantized_gradients; remove it or turn one on")
        if self.collective_timeout > _MAX_TIMEOUT_S:  # a process group's timeout is a C int of milliseconds
            raise ZeroConfigError(f"collective_timeout must be at most {_MAX_TIMEOUT_S:.0f} seconds (0: the caller's "
                                  f"group and its timeout), got {self.collective_timeout!r}")


_MAX_SCALE_POWER = 127  # 2**128 overflows fp32
_MAX_TIMEOUT_S = 2**31 / 1000  # about 24.8 days


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionConfig:
    """Precision of shards, gathers and reductions, and fp16 loss scaling (docs/mixed_precision.md)."""

    dtype: DtypeName = "fp32"
    """Precision of parameter shards, all-gathers and compute. With ``bf16``/``fp16`` the optimizer
    steps on fp32 master shards and copies them back; ``fp32`` casts nothing. DeepSpeed's
    ``bf16.enabled`` / ``fp16.enabled`` set it."""

    reduce_dtype: DtypeName = "fp32"
    """Precision in which full gradients are reduce-scattered (DeepSpeed's ``communication_data_type``).
    The reduced slices always accumulate into fp32 gradient shards when ``dtype`` is not fp32."""

    loss_scale: float = 0.0
    """fp16 only: a static loss scale; 0 selects dynamic loss scaling (DeepSpeed's ``fp16.loss_scale``)."""

    initial_scale_power: int = 16
    """fp16 dynamic loss scaling starts at ``2**initial_scale_power``."""

    loss_scale_window: int = 1000
    """fp16: the dynamic scale doubles after this many consecutive optimizer steps without overflow."""

    hysteresis: int = 2
    """fp16: overflowing steps tolerated (skipped without backing off) before the scale halves."""

    consecutive_hysteresis: bool = False
    """fp16: refill the hysteresis after every clean step (default: only when the scale grows)."""

    min_loss_scale: float = 1.0
    """fp16: the dynamic loss scale never drops below this."""

    def __post_init__(self) -> None:
        m = self.min_loss_scale  # its own bound first: the generic one (>= 0) named another for -1 (probe 30D)
        if isinstance(m, (int, float)) and not isinstance(m, bool) and m <= 0:
            raise ZeroConfigError(f"min_loss_scale must be > 0, got {m!r}")
        check_fields(self, counts=("loss_scale_window", "hysteresis"))
        # the loss is multiplied by the scale in fp32: a scale past fp32's range makes every gradient inf,
        # so every step would be skipped (for ever, with a static scale)
        if not 0 <= self.initial_scale_power <= _MAX_SCALE_POWER:
            raise ZeroConfigError(f"initial_scale_power must be in [0, {_MAX_SCALE_POWER}] (2**power is the first "
                                  f"loss scale, finite in fp32), got {self.initial_scale_power!r}")
        for name in ("loss_scale", "min_loss_scale"):
            if getattr(self, name) > 2.0 ** _MAX_SCALE_POWER:
                raise ZeroConfigError(f"{name} must be at most 2**{_MAX_SCALE_POWER} (a loss scale finite in fp32), "
                                      f"got {getattr(self, name)!r}")
        # Loss scaling exists only under fp16, and a static scale (loss_scale > 0) has no dynamics: a
        # setting that would not be read is refused rather than dropped (DeepSpeed drops it).
        if self.dtype != "fp16" and (given := _changed(self, _LOSS_SCALING)):
            raise ZeroConfigError(f"{', '.join(given)}: fp16 loss scaling, but dtype={self.dtype!r} scales no loss; "
                                  "remove it, or use dtype='fp16' (DeepSpeed's fp16.enabled)")
        if self.dtype == "fp16" and self.loss_scale > 0 and (given := _changed(self, _LOSS_SCALING[1:])):
            # said, not refused: Megatron-DeepSpeed's fp16 templates keep them beside a static scale
            warn_once(f"zero3: {', '.join(given)}: dynamic loss scaling, but loss_scale={self.loss_scale!r} selects a "
                      "static scale, so they are not read; remove them, or set loss_scale=0 (dynamic)")


_LOSS_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                 "min_loss_scale")
"""`PrecisionConfig`'s fp16 loss-scaling fields; after the first, those of dynamic scaling only."""

DRIVE_POOL_KNOBS = ("offload_param_buffer_count", "offload_param_buffer_size", "offload_param_max_in_cpu")
"""`OffloadConfig`'s fields read only with ``offload_param="nvme"``."""


# DeepSpeed's offload sections (also accepted in our dicts): key -> our field suffix (None: accepted,
# no effect here, logged).
OFFLOAD_SECTION_KEYS: dict[str, dict[str, str | None]] = {
    "offload_optimizer": {"device": "", "nvme_path": "_nvme_path", "pin_memory": "_pin_memory", "ratio": None,
                          "buffer_count": None, "fast_init": None, "pipeline_read": None, "pipeline_write": None,
                          "pipeline": None, "staged_step": "_staged_step",
                          "step_in_backward": "_step_in_backward"},
    "offload_param": {"device": "", "nvme_path": "_nvme_path", "pin_memory": "_pin_memory",
                      "buffer_count": "_buffer_count", "buffer_size": "_buffer_size", "max_in_cpu": "_max_in_cpu"},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """Where parameter shards and optimizer state live: device, CPU memory or NVMe swap files
    (docs/offload.md)."""

    offload_optimizer: OffloadDevice = "none"
    """``cpu``: fp32 master shards, their gradients and the optimizer state live in CPU memory and the
    optimizer steps there (DeepSpeed's ``offload_optimizer.device``). ``nvme``: the same, but between
    steps the fp32 masters and the optimizer's per-element state live in files under
    ``offload_optimizer_nvme_path``; the step streams them through memory ``sub_group_size``
    elements at a time. Gradient shards stay in memory (docs/offload.md)."""

    offload_optimizer_nvme_path: str | None = None
    """Directory for the optimizer's swap files with ``offload_optimizer="nvme"`` (DeepSpeed's
    ``offload_optimizer.nvme_path``). Files are unlinked as soon as they are opened, so they vanish
    with the process."""

    offload_optimizer_pin_memory: bool = False
    """Pin the CPU master buffer (DeepSpeed's ``offload_optimizer.pin_memory``); ignored without CUDA."""

    offload_optimizer_staged_step: bool = True
    """With ``offload_optimizer="nvme"``: write every step to a second region of each swap-file key,
    so a step that fails on any rank is rolled back on every rank (optim/agreed_step.py [Note: agreed
    optimizer step]). The price is drive space: two regions of every key, reserved at the first step
    (fp32 AdamW with parameters on NVMe too: 24 bytes a parameter instead of 12). ``False`` writes in
    place: half the drive, and a failed step is still reported on every rank, naming the failing
    rank, but not undone (load the last checkpoint). zero3's own key (``offload_optimizer.staged_step``
    in a DeepSpeed dict); DeepSpeed has no such rollback."""

    offload_optimizer_step_in_backward: bool = False
    """With any ``offload_optimizer`` device: step each sub-group of the optimizer during the backward of
    the micro-batch that ends an accumulation window, as soon as the gradients of all its parameters
    are reduced, and drop those gradient shards right away, so a rank holds only the gradient
    shards of sub-groups not yet complete (4 bytes a parameter in fp32; with ``sub_group_size``
    below the model's size, say a layer's, that is a small part of them). With the optimizer in
    memory (no offload, or ``cpu``) the step is agreed but never staged. The training is the same bit for bit; the step's
    agreement (and, staged, its rollback) happens at ``engine.step()`` (optim/backward_step.py
    [Note: optimizer step in backward]). Refused with ``gradient_clipping`` and fp16, which need
    every gradient before any parameter changes. zero3's own key (``offload_optimizer.step_in_backward``
    in a DeepSpeed dict)."""

    offload_param: OffloadDevice = "none"
    """Where parameter shards live (DeepSpeed's ``offload_param.device``). ``cpu``: in CPU memory
    (pinned with ``offload_param_pin_memory`` and CUDA), copied to the compute device by each
    all-gather. ``nvme``: in files under ``offload_param_nvme_path`` (after the first
    ``offload_param_max_in_cpu`` elements, which stay in CPU memory); each shard is read into the
    buffer pool ahead of its all-gather along the recorded trace, and its memory is released again
    when the gather is done. Persistent parameters keep their shards in memory."""

    offload_param_nvme_path: str | None = None
    """Directory for the parameter swap files with ``offload_param="nvme"`` (unlinked once opened)."""

    offload_param_pin_memory: bool = False
    """Pin the CPU shards and the buffer pool (DeepSpeed's ``offload_param.pin_memory``); only with CUDA."""

    offload_param_buffer_count: int = 5
    """Buffers in the pool that NVMe shards are read into (DeepSpeed's ``offload_param.buffer_count``)."""

    offload_param_buffer_size: int = 100_000_000
    """Elements (of the shard dtype) per pool buffer; shards are packed into the buffers, and each
    offloaded shard must fit in one (DeepSpeed's ``offload_param.buffer_size``)."""

    offload_param_max_in_cpu: int = 1_000_000_000
    """With ``offload_param="nvme"``: this many shard elements (per rank, first parameters first)
    stay in CPU memory instead (DeepSpeed's ``offload_param.max_in_cpu``; its default keeps a model
    of up to 1e9 elements per rank entirely in memory, so set it, e.g. to 0, to use the drive)."""

    sub_group_size: int = 1_000_000_000
    """Elements per group that the optimizer step streams from NVMe at a time (state of at most
    three groups is in memory: one being read, one stepping, one being written); DeepSpeed's
    ``zero_optimization.sub_group_size``. Used when the optimizer state is on NVMe, when parameter
    shards are on NVMe and the optimizer steps on them (fp32: no separate masters), and by the
    optimizer step in backward (``offload_optimizer.step_in_backward``); elsewhere the step takes
    every parameter at once, and a value other than the default is reported at ``initialize``."""

    aio_thread_count: int = 1
    """Threads that read and write the swap files (DeepSpeed's ``aio.thread_count``); file IO runs
    outside the GIL, so reads overlap compute even with one."""

    def __post_init__(self) -> None:
        check_fields(self, counts=("offload_param_buffer_count", "offload_param_buffer_size", "sub_group_size",
                                   "aio_thread_count"))
        if not self.offload_optimizer_staged_step and self.offload_optimizer != "nvme":
            raise ZeroConfigError(
                f"offload_optimizer_staged_step=False only applies with offload_optimizer='nvme' (got "
                f"offload_optimizer={self.offload_optimizer!r}): only a step on the drive is staged; remove it")
        if self.offload_param != "nvme" and (given := _changed(self, DRIVE_POOL_KNOBS)):
            # said, not refused: a template switched from nvme to cpu keeps its tuned pool keys
            warn_once(f"zero3: {', '.join(given)}: read only with offload_param='nvme' (got "
                      f"offload_param={self.offload_param!r}): the drive's read pool and what stays off the "
                      "drive are not used; remove them")
        for tier in ("offload_param", "offload_optimizer"):
            if getattr(self, tier) == "nvme" and not getattr(self, f"{tier}_nvme_path"):
                raise ZeroConfigError(
                    f"{tier}='nvme' needs {tier}_nvme_path (DeepSpeed's zero_optimization.{tier}.nvme_path): "
                    "a directory on the drive to hold the swap files")

    @staticmethod
    def read_section(value: Any, section: str, out: KnobValues, lax_bool: bool) -> None:
        """DeepSpeed's ``offload_optimizer`` / ``offload_param`` dict onto our flat knobs in ``out``.

        ``section`` is how the user spelled it (``zero_optimization.offload_param``); its last part
        names the knobs. ``lax_bool``: the section is part of a DeepSpeed-format config, whose
        booleans take 0/1 too; in a flat zero3 config they take true/false only. The keys with no
        effect here (``buffer_count``, ``fast_init``, ...) are DeepSpeed's alone and checked as
        DeepSpeed reads them wherever they appear. A key that changes behaviour we do not have is
        refused (``ratio`` other than 1)."""
        if value is None:
            return
        kind = section.rsplit(".", 1)[-1]
        keys = OFFLOAD_SECTION_KEYS[kind]
        if not isinstance(value, dict):
            raise ZeroConfigError(f"{section} must be a dict such as {{'device': 'cpu', 'pin_memory': true}}, "
                                  f"got {value!r}")
        for key, v in value.items():
            if key not in keys:
                raise ZeroConfigError(f"{section}: " + unknown_key_message(key, set(keys)))
            suffix = keys[key]
            if key == "ratio" and v != 1:
                raise ZeroConfigError(f"{section}.ratio {v!r} is not supported by zero3 (it offloads all of the "
                                      "optimizer state or none of it); remove it or set it to 1")
            if suffix is None:
                check_ignored(f"{section}.{key}", key, v)
                logger.info("zero3: DeepSpeed key %s.%s has no effect in zero3; ignored", section, key)
                continue
            knob = kind + suffix
            out.set(knob, coerce(field_types(OffloadConfig)[knob], v, lax_bool=lax_bool), f"{section}.{key}")
        if value.get("pin_memory") and value.get("device", "none") == "none":
            logger.info("zero3: %s.pin_memory has no effect with device 'none' (nothing is offloaded); ignored", section)
