"""`ZeroConfig`: every knob of the runtime in one typed, validated, immutable object.

Budgets are counted in parameter *elements* (as DeepSpeed counts them) unless the field name says
``bytes``. ``from_dict`` accepts our field names or a DeepSpeed config (``zero_optimization`` with
``stage3_*`` keys), so an existing DeepSpeed JSON carries over.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from .errors import ZeroConfigError

logger = logging.getLogger(__name__)

_OPTIMIZER_PARAMS = {
    "adam": {"lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "adam_w_mode", "bias_correction"},
    "adamw": {"lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "bias_correction"},
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
}
_SCHEDULER_PARAMS = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"},
    "WarmupDecayLR": {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"},
    "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """A DeepSpeed ``optimizer`` section: ``type`` (Adam, AdamW, SGD) and its ``params``."""

    type: str
    params: dict[str, Any]

    def __post_init__(self) -> None:
        allowed = _OPTIMIZER_PARAMS.get(self.type.lower()) if isinstance(self.type, str) else None
        if allowed is None:
            raise ZeroConfigError(f"optimizer.type {self.type!r} is not supported; use Adam, AdamW or SGD "
                                  "(or pass a torch.optim optimizer to zero3.initialize)")
        _check_params("optimizer", self.type, self.params, allowed)


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerSpec:
    """A DeepSpeed ``scheduler`` section: ``type`` (WarmupLR, WarmupDecayLR, WarmupCosineLR) and ``params``."""

    type: str
    params: dict[str, Any]

    def __post_init__(self) -> None:
        allowed = _SCHEDULER_PARAMS.get(self.type) if isinstance(self.type, str) else None
        if allowed is None:
            raise ZeroConfigError(f"scheduler.type {self.type!r} is not supported; use one of "
                                  f"{sorted(_SCHEDULER_PARAMS)} (or pass lr_scheduler= to zero3.initialize)")
        _check_params("scheduler", self.type, self.params, allowed)
        if self.type in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in self.params:
            raise ZeroConfigError(f"scheduler {self.type} needs params.total_num_steps")


def _check_params(section: str, kind: str, params: Any, allowed: set[str]) -> None:
    if not isinstance(params, dict):
        raise ZeroConfigError(f"{section}.params must be a dict, got {params!r}")
    for key in params:
        if key not in allowed:
            raise ZeroConfigError(f"{section} {kind}: " + _unknown_key_message(key, allowed))


def _spec(section: str, value: Any, cls: type) -> Any:
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict) or "type" not in value:
        raise ZeroConfigError(f"{section} must be a dict such as {{'type': ..., 'params': {{...}}}}, got {value!r}")
    extra = set(value) - {"type", "params"}
    if extra:
        raise ZeroConfigError(f"{section}: unknown key(s) {sorted(extra)}; a section holds 'type' and 'params'")
    return cls(type=value["type"], params=dict(value.get("params") or {}))


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's ``activation_checkpointing`` section: how ``zero3.checkpointing.checkpoint`` keeps
    the inputs it saves for the recompute (docs/activation_checkpointing.md). The keys are DeepSpeed's."""

    partition_activations: bool = False
    """Keep only this rank's 1/mp slice of each saved floating-point input (mp: the model-parallel
    group's size); the recompute all-gathers the slices over the model-parallel group."""

    cpu_checkpointing: bool = False
    """Copy the saved inputs (or their slices) into CPU memory; the recompute moves them back to the
    device each input came from."""

    contiguous_memory_optimization: bool = False
    """Copy the saved slices into buffers allocated once per forward pass, one slot per checkpoint,
    instead of one allocation per checkpoint (less fragmentation). Needs ``partition_activations`` and
    ``number_checkpoints``."""

    number_checkpoints: int | None = None
    """How many checkpoints one forward pass makes (the slots of the contiguous buffers)."""

    synchronize_checkpoint_boundary: bool = False
    """``torch.cuda.synchronize()`` at the start and end of every checkpoint's forward and backward
    when CUDA is available; nothing to wait for (a no-op) on a CPU-only machine."""

    profile: bool = False
    """Time every checkpoint's forward and backward (recompute included); logged at INFO by the
    ``zero3.checkpointing`` logger and summed in ``zero3.checkpointing.timings()``."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "number_checkpoints":
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ZeroConfigError(f"activation_checkpointing.number_checkpoints must be None or an int "
                                          f">= 1, got {value!r}")
            elif not isinstance(value, bool):
                raise ZeroConfigError(f"activation_checkpointing.{f.name} must be a bool, got {value!r} "
                                      f"({type(value).__name__})")
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ZeroConfigError("activation_checkpointing.contiguous_memory_optimization needs "
                                  "partition_activations (it lays out the partitioned slices); set both")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ZeroConfigError("activation_checkpointing.contiguous_memory_optimization needs number_checkpoints "
                                  "(how many checkpoints a forward pass makes: the buffer slots)")

    @classmethod
    def from_dict(cls, d: Any) -> "ActivationCheckpointingConfig":
        if isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise ZeroConfigError(f"activation_checkpointing must be a dict such as {{'partition_activations': "
                                  f"true}}, got {d!r}")
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ZeroConfigError("activation_checkpointing: " + _unknown_key_message(key, known))
        return cls(**{k: _coerce(k, v) for k, v in d.items()})


ReduceImpl = Literal["auto", "reduce_scatter", "all_reduce", "p2p"]
GatherImpl = Literal["auto", "all_gather", "p2p"]
DtypeName = Literal["fp32", "bf16", "fp16"]
OffloadDevice = Literal["none", "cpu", "nvme"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """Configuration of the ZeRO-3 runtime. Defaults equal DeepSpeed's where the knob exists there."""

    prefetch_bucket_size: int = 50_000_000
    """Elements prefetched ahead of use (in flight or gathered but not yet used). 0 disables prefetch."""

    max_live_parameters: int = 1_000_000_000
    """Hard cap on gathered, non-persistent parameter elements alive on a rank, demand fetches included.
    Exceeded only when the modules running at that moment need more by themselves."""

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

    overlap_comm: bool = True
    """Issue all-gathers asynchronously (side CUDA stream on GPU, ``async_op`` on CPU)."""

    reduce_bucket_size: int = 500_000_000
    """Gradient elements collected before one reduce-scatter is issued."""

    allgather_bucket_size: int = 500_000_000
    """Largest number of elements gathered by one collective; larger fetches are split."""

    reduce_scatter_impl: ReduceImpl = "auto"
    """How gradients are reduced: ``reduce_scatter``, ``all_reduce`` then slice, ``p2p`` (every rank
    sends each other rank its chunk and sums what it receives), or ``auto``: p2p on gloo (measured
    0.59x the wall time of gloo's reduce-scatter and 0.72x its all-reduce's; see
    docs/performance.md), reduce-scatter elsewhere."""

    allgather_impl: GatherImpl = "auto"
    """How parameters are all-gathered: ``all_gather``, ``p2p`` (every rank sends its shards to every
    other rank), or ``auto``: p2p on gloo (measured 0.60x the wall time of gloo's all-gather),
    all-gather elsewhere."""

    max_traces: int = 4
    """How many recorded step traces are cached (keyed by how the step began)."""

    verify_collectives: bool | None = None
    """Verify that every rank issues the same collectives (kind, size, parameters carried), so ranks
    that run different modules all raise ``ZeroDivergenceError`` instead of hanging or mixing
    gradients. Steps that repeat an agreed plan carry the check inside their payloads (one header
    exchange per step); others exchange a header before each collective (comm_verify.py).
    ``None``: on for gloo, off for NCCL (checking a payload costs a device-to-host sync)."""

    collective_timeout: float = 300.0
    """Seconds any zero3 collective may wait for the other ranks. zero3's collectives run on a
    process group of their own with this timeout: when a rank stops taking part (returned early,
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
    default); -1: the ranks per node, found from where the ranks run (torchrun's LOCAL_WORLD_SIZE);
    else it must divide the data-parallel world size. Costs about 1/L of the gathered weights per
    rank while a step runs (a quarter of that with ``zero_quantized_weights``); see
    docs/multinode.md."""

    wall_clock_breakdown: bool = False
    """Log the step's time breakdown (forward, backward, gather and reduction waits, header
    exchanges, optimizer) every ``steps_per_print`` optimizer steps; the figures are in
    ``engine.last_step_metrics`` either way (on CUDA this also synchronizes before reading them)."""

    steps_per_print: int = 10
    """How often (in optimizer steps) ``wall_clock_breakdown`` logs."""

    optimizer: OptimizerSpec | None = None
    """DeepSpeed's ``optimizer`` section: ``zero3.initialize`` without an optimizer builds this one."""

    scheduler: SchedulerSpec | None = None
    """DeepSpeed's ``scheduler`` section: the learning-rate schedule ``engine.step()`` steps."""

    leaf_modules: tuple[str, ...] = ()
    """Class names of modules gathered and reduced as one unit, hooks on the module only (mixture of
    experts: every expert is gathered when the layer runs and reduced, zeros where no token went, so
    ranks that route differently issue the same collectives). See ``zero3.set_leaf_modules``."""

    activation_checkpointing: ActivationCheckpointingConfig | None = None
    """DeepSpeed's ``activation_checkpointing`` section, read by ``zero3.checkpointing.configure(mpu,
    deepspeed_config=...)``; ``zero3.initialize`` configures activation checkpointing from it when it is
    given (docs/activation_checkpointing.md). None: the section is absent."""

    # -- precision, optimizer step and gradient accumulation (docs/mixed_precision.md) ---------------
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

    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step: ``engine.step()`` is called after every micro-batch and steps
    the optimizer on every N-th call; each micro-batch's reduced gradient is divided by N."""

    gradient_clipping: float = 0.0
    """When > 0, ``engine.step()`` clips the gradients to this global L2 norm (fp32, after unscaling)
    before the optimizer step."""

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
    ``zero_optimization.sub_group_size``. Only used when optimizer state or parameter shards are on
    NVMe."""

    aio_thread_count: int = 1
    """Threads that read and write the swap files (DeepSpeed's ``aio.thread_count``); file IO runs
    outside the GIL, so reads overlap compute even with one."""

    def __post_init__(self) -> None:
        if isinstance(self.leaf_modules, list):
            object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))
        object.__setattr__(self, "optimizer", _spec("optimizer", self.optimizer, OptimizerSpec))
        object.__setattr__(self, "scheduler", _spec("scheduler", self.scheduler, SchedulerSpec))
        if self.activation_checkpointing is not None:
            object.__setattr__(self, "activation_checkpointing",
                               ActivationCheckpointingConfig.from_dict(self.activation_checkpointing))
        for f in fields(self):
            if f.name != "zero_hpz_partition_size":
                _check_field(f, getattr(self, f.name))
        hpz = self.zero_hpz_partition_size
        if isinstance(hpz, bool) or not isinstance(hpz, int) or not (hpz == -1 or hpz >= 1):
            raise ZeroConfigError(f"zero_hpz_partition_size must be an int >= 1 (1: off) or -1 (the ranks per node), "
                                  f"got {hpz!r}")
        if self.max_traces < 1:
            raise ZeroConfigError(f"max_traces must be >= 1, got {self.max_traces!r}")
        for name in ("gradient_accumulation_steps", "loss_scale_window", "hysteresis", "steps_per_print"):
            if getattr(self, name) < 1:
                raise ZeroConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.quantized_gradient_bits not in (8, 4):
            raise ZeroConfigError(f"quantized_gradient_bits must be 8 or 4, got {self.quantized_gradient_bits!r}")
        if self.quantization_block_size < 1:
            raise ZeroConfigError(f"quantization_block_size must be >= 1, got {self.quantization_block_size!r}")
        if self.min_loss_scale <= 0:
            raise ZeroConfigError(f"min_loss_scale must be > 0, got {self.min_loss_scale!r}")
        for name in ("offload_param_buffer_count", "offload_param_buffer_size", "sub_group_size", "aio_thread_count"):
            if getattr(self, name) < 1:
                raise ZeroConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for tier in ("offload_param", "offload_optimizer"):
            if getattr(self, tier) == "nvme" and not getattr(self, f"{tier}_nvme_path"):
                raise ZeroConfigError(
                    f"{tier}='nvme' needs {tier}_nvme_path (DeepSpeed's zero_optimization.{tier}.nvme_path): "
                    "a directory on the drive to hold the swap files")

    # -- construction from dicts and files -------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ZeroConfig":
        """Build from our field names, or from a DeepSpeed config dict (``zero_optimization`` ...)."""
        if not isinstance(d, dict):
            raise ZeroConfigError(f"config must be a dict, got {type(d).__name__}")
        if "zero_optimization" in d or any(k in _DEEPSPEED_TOP_LEVEL for k in d):
            return cls(**_from_deepspeed(d))
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ZeroConfigError(_unknown_key_message(key, known))
        out = {k: _coerce(k, v) for k, v in d.items()}
        if isinstance(out.get("offload_optimizer"), dict):  # DeepSpeed's {device, pin_memory, ...} form
            out.update(_offload_section(out.pop("offload_optimizer"), "offload_optimizer"))
        if isinstance(out.get("offload_param"), dict):
            out.update(_offload_section(out.pop("offload_param"), "offload_param"))
        return cls(**out)

    @classmethod
    def from_json(cls, path: str | Path) -> "ZeroConfig":
        with open(path) as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ZeroConfigError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "ZeroConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_field(f: dataclasses.Field, value: Any) -> None:
    ann = f.type
    name = f.name
    if ann in ("int", int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ZeroConfigError(f"{name} must be an int >= 0, got {value!r} ({type(value).__name__})")
        if value < 0:
            raise ZeroConfigError(f"{name} must be >= 0, got {value!r}")
    elif ann in ("int | None",):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ZeroConfigError(f"{name} must be None or an int >= 0, got {value!r}")
    elif ann == "bool | None":
        if value is not None and not isinstance(value, bool):
            raise ZeroConfigError(f"{name} must be None or a bool, got {value!r}")
    elif ann == "str | None":
        if value is not None and (not isinstance(value, str) or not value):
            raise ZeroConfigError(f"{name} must be None or a non-empty path string, got {value!r}")
    elif ann in ("bool", bool):
        if not isinstance(value, bool):
            raise ZeroConfigError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    elif ann in ("ReduceImpl", "GatherImpl", "DtypeName", "OffloadDevice"):
        allowed = get_args(_LITERALS[ann])
        if value not in allowed:
            raise ZeroConfigError(f"{name} must be one of {allowed}, got {value!r}")
    elif ann == "tuple[str, ...]":
        if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
            raise ZeroConfigError(f"{name} must be a list of class names (strings), got {value!r}")
    elif ann in ("float", float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ZeroConfigError(f"{name} must be a finite number >= 0, got {value!r} ({type(value).__name__})")
        if value < 0:
            raise ZeroConfigError(f"{name} must be >= 0, got {value!r}")


_LITERALS: dict[str, Any] = {"ReduceImpl": ReduceImpl, "GatherImpl": GatherImpl, "DtypeName": DtypeName,
                             "OffloadDevice": OffloadDevice}
_FLOAT_FIELDS = {"loss_scale", "min_loss_scale", "gradient_clipping", "collective_timeout"}


def _coerce(key: str, value: Any) -> Any:
    """JSON configs write big counts as floats (``5e8``); accept those when they are integral.

    Float fields take ints too (``"gradient_clipping": 1``) and store them as floats.
    """
    if key in _FLOAT_FIELDS:
        if isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value
    if key == "leaf_modules" and isinstance(value, list):
        return tuple(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _unknown_key_message(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown config key {key!r}{hint} Known keys: {', '.join(sorted(known))}"


# DeepSpeed ``zero_optimization`` keys mapped onto ours.
_DEEPSPEED_ZERO_KEYS = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "overlap_comm": "overlap_comm",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "sub_group_size": "sub_group_size",
}
# DeepSpeed keys we understand but that change nothing here (logged, not an error).
_DEEPSPEED_ZERO_IGNORED = {
    "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
    "sub_group_size", "stage3_gather_16bit_weights_on_model_save", "log_trace_cache_warnings",
    "elastic_checkpoint", "ignore_unused_parameters", "load_from_fp32_weights",
}
_DEEPSPEED_TOP_LEVEL = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown",
    "bf16", "fp16", "zero_allow_untested_optimizer", "prescale_gradients", "communication_data_type",
    "bfloat16", "activation_checkpointing", "aio",
}


_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16",
                  "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
# DeepSpeed ``fp16`` section keys mapped onto ours; ``enabled`` selects dtype="fp16".
_DEEPSPEED_FP16_KEYS = {
    "loss_scale": "loss_scale", "initial_scale_power": "initial_scale_power",
    "loss_scale_window": "loss_scale_window", "hysteresis": "hysteresis",
    "consecutive_hysteresis": "consecutive_hysteresis", "min_loss_scale": "min_loss_scale",
}
_DEEPSPEED_FP16_IGNORED = {"auto_cast", "fp16_master_weights_and_grads"}
_DEEPSPEED_BF16_IGNORED = {"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                           "bf16_optimizer_states"}
# DeepSpeed's offload sections: key -> our field suffix (None: accepted, no effect here, logged).
_DEEPSPEED_OFFLOAD_KEYS: dict[str, dict[str, str | None]] = {
    "offload_optimizer": {"device": "", "nvme_path": "_nvme_path", "pin_memory": "_pin_memory", "ratio": None,
                          "buffer_count": None, "fast_init": None, "pipeline_read": None, "pipeline_write": None,
                          "pipeline": None},
    "offload_param": {"device": "", "nvme_path": "_nvme_path", "pin_memory": "_pin_memory",
                      "buffer_count": "_buffer_count", "buffer_size": "_buffer_size", "max_in_cpu": "_max_in_cpu"},
}
# DeepSpeed's ``aio`` section: only the thread count means something here.
_DEEPSPEED_AIO_IGNORED = {"block_size", "queue_depth", "single_submit", "overlap_events", "intra_op_parallelism"}


def _enabled(section: str, value: Any) -> bool:
    if not isinstance(value, dict):
        raise ZeroConfigError(f"{section} must be a dict such as {{'enabled': true}}, got {value!r}")
    enabled = value.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ZeroConfigError(f"{section}.enabled must be a bool, got {enabled!r} ({type(enabled).__name__}); "
                              "replace 'auto' by true or false")
    return enabled


def _section(section: str, value: dict[str, Any], mapped: dict[str, str], ignored: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key == "enabled":
            continue
        if key in mapped:
            out[mapped[key]] = _coerce(mapped[key], v)
        elif key in ignored:
            logger.info("zero3: DeepSpeed key %s.%s has no effect in zero3; ignored", section, key)
        else:
            raise ZeroConfigError(f"{section}: " + _unknown_key_message(key, set(mapped) | ignored | {"enabled"}))
    return out


def _precision(d: dict[str, Any]) -> dict[str, Any]:
    """dtype, loss-scaling and reduce-dtype fields from DeepSpeed's ``bf16``/``fp16`` sections and
    ``communication_data_type``. Settings inside a section that is not enabled are ignored."""
    out: dict[str, Any] = {}
    bf16 = [k for k in ("bf16", "bfloat16") if k in d and _enabled(k, d[k])]
    for k in ("bf16", "bfloat16"):
        if k in d:
            _section(k, d[k], {}, _DEEPSPEED_BF16_IGNORED)
    fp16 = "fp16" in d and _enabled("fp16", d["fp16"])
    if bf16 and fp16:
        raise ZeroConfigError(f"{bf16[0]}.enabled and fp16.enabled are both true; enable one of them")
    if bf16:
        out["dtype"] = "bf16"
    if "fp16" in d:
        scaling = _section("fp16", d["fp16"], _DEEPSPEED_FP16_KEYS, _DEEPSPEED_FP16_IGNORED)
        if fp16:
            out["dtype"] = "fp16"
            out.update(scaling)
    if "communication_data_type" in d and d["communication_data_type"] is not None:
        name = d["communication_data_type"]
        if name not in _DTYPE_ALIASES:
            raise ZeroConfigError(f"communication_data_type must be one of {sorted(_DTYPE_ALIASES)}, got {name!r}")
        out["reduce_dtype"] = _DTYPE_ALIASES[name]
    return out


def _offload_section(value: Any, section: str) -> dict[str, Any]:
    """DeepSpeed's ``offload_optimizer`` / ``offload_param`` dict onto our flat fields.

    ``section`` is how the user spelled it (``zero_optimization.offload_param``); its last part names
    the fields. A key that changes behaviour we do not have is refused (``ratio`` other than 1)."""
    if value is None:
        return {}
    kind = section.rsplit(".", 1)[-1]
    keys = _DEEPSPEED_OFFLOAD_KEYS[kind]
    if not isinstance(value, dict):
        raise ZeroConfigError(f"{section} must be a dict such as {{'device': 'cpu', 'pin_memory': true}}, "
                              f"got {value!r}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key not in keys:
            raise ZeroConfigError(f"{section}: " + _unknown_key_message(key, set(keys)))
        suffix = keys[key]
        if key == "ratio" and v != 1:
            raise ZeroConfigError(f"{section}.ratio {v!r} is not supported by zero3 (it offloads all of the "
                                  "optimizer state or none of it); remove it or set it to 1")
        if suffix is None:
            logger.info("zero3: DeepSpeed key %s.%s has no effect in zero3; ignored", section, key)
            continue
        field_name = kind + suffix
        out[field_name] = _coerce(field_name, v)
    return out


def _aio(value: Any) -> dict[str, Any]:
    """DeepSpeed's ``aio`` section: ``thread_count`` sets ``aio_thread_count``; GPUDirect is refused."""
    if not isinstance(value, dict):
        raise ZeroConfigError(f"aio must be a dict such as {{'thread_count': 1}}, got {value!r}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key == "thread_count":
            out["aio_thread_count"] = _coerce("aio_thread_count", v)
        elif key == "use_gds":
            if v:
                raise ZeroConfigError("aio.use_gds (GPUDirect Storage) is not supported by zero3; swap files "
                                      "are read into host buffers. Remove it or set it to false")
        elif key in _DEEPSPEED_AIO_IGNORED:
            logger.info("zero3: DeepSpeed key aio.%s has no effect in zero3; ignored", key)
        else:
            raise ZeroConfigError("aio: " + _unknown_key_message(key, _DEEPSPEED_AIO_IGNORED | {"thread_count",
                                                                                              "use_gds"}))
    return out


def _from_deepspeed(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = _precision(d)
    ours = {f.name for f in fields(ZeroConfig)}
    for key, value in d.items():
        if key == "zero_optimization" or key in ("bf16", "bfloat16", "fp16", "communication_data_type"):
            continue
        if key in ("gradient_accumulation_steps", "gradient_clipping"):
            out[key] = _coerce(key, value)
            continue
        if key in ("optimizer", "scheduler", "activation_checkpointing", "wall_clock_breakdown", "steps_per_print"):
            out[key] = _coerce(key, value)
            continue
        if key == "aio":
            out.update(_aio(value))
            continue
        if key in _DEEPSPEED_TOP_LEVEL:
            logger.info("zero3: DeepSpeed key %r is not used by ZeroConfig; ignored", key)
            continue
        if key in _DEEPSPEED_OFFLOAD_KEYS and isinstance(value, dict):
            out.update(_offload_section(value, key))
            continue
        if key in ours:
            out[key] = _coerce(key, value)
            continue
        raise ZeroConfigError(_unknown_key_message(key, ours | _DEEPSPEED_TOP_LEVEL | {"zero_optimization"}))
    zero = d.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ZeroConfigError(f"zero_optimization must be a dict, got {zero!r}")
    stage = zero.get("stage", 3)
    if stage != 3:
        raise ZeroConfigError(f"zero_optimization.stage must be 3 (zero3 implements stage 3 only), got {stage!r}")
    for key, value in zero.items():
        if key == "stage":
            continue
        if key in _DEEPSPEED_ZERO_KEYS:
            out[_DEEPSPEED_ZERO_KEYS[key]] = _coerce(key, value)
        elif key in _DEEPSPEED_OFFLOAD_KEYS:
            out.update(_offload_section(value, f"zero_optimization.{key}"))
        elif key in _DEEPSPEED_ZERO_IGNORED:
            logger.info("zero3: zero_optimization.%s has no effect in zero3; ignored", key)
        elif key in ours:
            out[key] = _coerce(key, value)
        else:
            known = set(_DEEPSPEED_ZERO_KEYS) | _DEEPSPEED_ZERO_IGNORED | ours | {"stage"} | set(_DEEPSPEED_OFFLOAD_KEYS)
            raise ZeroConfigError("zero_optimization: " + _unknown_key_message(key, known))
    return out


def resolve_config(config: ZeroConfig | dict | str | Path | None) -> ZeroConfig:
    """Accept a ZeroConfig, a dict, a JSON path, or None (defaults)."""
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        return config
    if isinstance(config, dict):
        return ZeroConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return ZeroConfig.from_json(config)
    raise ZeroConfigError(f"config must be a ZeroConfig, dict, JSON path or None, got {type(config).__name__}")


__all__ = ["ActivationCheckpointingConfig", "ZeroConfig", "resolve_config"]
