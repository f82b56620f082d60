"""The training loop's sections of `ZeroConfig`: what ``engine.step()`` does (`TrainingConfig`, with
DeepSpeed's typed ``optimizer`` and ``scheduler`` sections) and how activation checkpointing keeps
its saved inputs (`ActivationCheckpointingConfig`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ZeroConfigError
from .fields import check_fields, coerce, field_types, is_finite_number, shown, unknown_key_message

_OPTIMIZER_PARAMS = {
    "adam": {"lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "adam_w_mode", "bias_correction",
             "set_grad_none"},
    "adamw": {"lr", "betas", "eps", "weight_decay", "amsgrad", "torch_adam", "adam_w_mode", "bias_correction",
              "set_grad_none"},
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
    """Adam, AdamW or SGD (any case)."""

    params: dict[str, Any]
    """The optimizer's keyword arguments, DeepSpeed's names."""

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
    """WarmupLR, WarmupDecayLR or WarmupCosineLR (``zero3.schedulers``)."""

    params: dict[str, Any]
    """The schedule's keyword arguments, DeepSpeed's names."""

    def __post_init__(self) -> None:
        allowed = _SCHEDULER_PARAMS.get(self.type) if isinstance(self.type, str) else None
        if allowed is None:
            raise ZeroConfigError(f"scheduler.type {self.type!r} is not supported; use one of "
                                  f"{sorted(_SCHEDULER_PARAMS)} (or pass lr_scheduler= to zero3.initialize)")
        _check_params("scheduler", self.type, self.params, allowed)
        if self.type in ("WarmupDecayLR", "WarmupCosineLR") and "total_num_steps" not in self.params:
            raise ZeroConfigError(f"scheduler {self.type} needs params.total_num_steps")
        if self.type == "WarmupCosineLR" and self.params.get("warmup_num_steps", 1) == 0:  # as DeepSpeed's
            raise ZeroConfigError("scheduler WarmupCosineLR: params.warmup_num_steps must be a positive integer, got 0 "
                                  "(DeepSpeed's WarmupCosineLR refuses it too; 1 warms up over 2 steps)")


def _number(v: Any) -> bool:
    return is_finite_number(v)  # 10**400 too is refused, not an OverflowError


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rate(v: Any) -> bool:
    return _number(v) and v >= 0


def _rates(v: Any) -> bool:
    return _rate(v) or (isinstance(v, (list, tuple)) and len(v) > 0 and all(_rate(x) for x in v))


_PARAM_KINDS: dict[str, tuple[str, Any]] = {
    **{k: ("a finite number >= 0", _rate) for k in ("lr", "eps", "weight_decay", "momentum", "dampening")},
    "betas": ("two numbers in [0, 1)", lambda v: isinstance(v, (list, tuple)) and len(v) == 2
              and all(_number(b) and 0 <= b < 1 for b in v)),
    **{k: ("true or false", lambda v: isinstance(v, bool))
       for k in ("amsgrad", "torch_adam", "adam_w_mode", "bias_correction", "nesterov", "set_grad_none")},
    "warmup_min_lr": ("a finite number >= 0, or a list of them (one per param group)", lambda v: _rates(v)),
    "warmup_max_lr": ("a finite number >= 0, a list of them (one per param group), or null (the optimizer's lr)",
                      lambda v: v is None or _rates(v)),
    "warmup_num_steps": ("an integer >= 0 (below 2 it counts as 2, as in DeepSpeed)", lambda v: _integer(v) and v >= 0),
    "total_num_steps": ("an integer >= 1", lambda v: _integer(v) and v >= 1),
    "last_batch_iteration": ("an integer >= -1", lambda v: _integer(v) and v >= -1),
    "warmup_type": ("'log' or 'linear'", lambda v: v in ("log", "linear")),
    **{k: ("a number in [0, 1]", lambda v: _number(v) and 0 <= v <= 1) for k in ("warmup_min_ratio", "cos_min_ratio")},
}


def _check_params(section: str, kind: str, params: Any, allowed: set[str]) -> None:
    """Every key known, every value of its kind: a wrong one raises here, when the config is read,
    not from inside torch at the first step (and a string such as "false" is not read as true)."""
    if not isinstance(params, dict):
        raise ZeroConfigError(f"{section}.params must be a dict, got {params!r}")
    for key, value in params.items():
        if key not in allowed:
            raise ZeroConfigError(f"{section} {kind}: " + unknown_key_message(key, allowed))
        what, ok = _PARAM_KINDS[key]
        if not ok(value):
            hint = (" ('auto' is what Hugging Face's Trainer fills in before DeepSpeed reads the config: give the "
                    "value)" if value == "auto" else "")
            raise ZeroConfigError(f"{section} {kind}: params.{key} must be {what}, got {shown(value)}{hint}")


def _spec(section: str, value: Any, cls: type) -> Any:
    """``value`` as ``cls``: a spec stays, a ``{'type': ..., 'params': ...}`` dict is built into one."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict) or "type" not in value:
        raise ZeroConfigError(f"{section} must be a dict such as {{'type': ..., 'params': {{...}}}}, got {value!r}")
    extra = set(value) - {"type", "params"}
    if extra:
        raise ZeroConfigError(f"{section}: unknown key(s) {sorted(extra)}; a section holds 'type' and 'params'")
    params = value.get("params")
    params = {} if params is None else params
    if isinstance(params, dict):  # a copy, with lists as tuples: the caller's dict stays the caller's
        params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
    return cls(type=value["type"], params=params)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig:
    """What ``engine.step()`` does around the optimizer: accumulation, clipping, the optimizer and
    schedule built from the config, timing logs, and which modules are gathered as one unit."""

    optimizer: OptimizerSpec | None = None
    """DeepSpeed's ``optimizer`` section: ``zero3.initialize`` without an optimizer builds this one."""

    scheduler: SchedulerSpec | None = None
    """DeepSpeed's ``scheduler`` section: the learning-rate schedule ``engine.step()`` steps."""

    gradient_accumulation_steps: int | None = None
    """Micro-batches per optimizer step: ``engine.step()`` is called after every micro-batch and steps
    the optimizer on every N-th call; each micro-batch's reduced gradient is divided by N. Not given:
    fixed by the two batch sizes when both are given (at ``zero3.initialize``, see `for_world_size`),
    else 1."""

    train_batch_size: int | None = None
    """DeepSpeed's global batch: ``train_micro_batch_size_per_gpu`` x ``gradient_accumulation_steps``
    x the data-parallel world size. Any two of the three fix the third; all three must agree."""

    train_micro_batch_size_per_gpu: int | None = None
    """Samples per rank in one forward and backward (one ``engine.step()`` call)."""

    gradient_clipping: float = 0.0
    """When > 0, ``engine.step()`` clips the gradients to this global L2 norm (fp32, after unscaling)
    before the optimizer step."""

    wall_clock_breakdown: bool = False
    """Log the step's time breakdown (forward, backward, gather and reduction waits, header
    exchanges, optimizer) every ``steps_per_print`` optimizer steps; the figures are in
    ``engine.last_step_metrics`` either way (on CUDA this also synchronizes before reading them)."""

    gather_16bit_weights_on_model_save: bool = False
    """DeepSpeed's ``stage3_gather_16bit_weights_on_model_save``, read by frameworks through
    ``engine.zero_gather_16bit_weights_on_model_save()``: Accelerate and the Hugging Face Trainer
    gather the whole 16-bit model onto rank 0 when they save only where it is True (zero3 itself
    reads it nowhere: ``save_16bit_model`` and ``save_pretrained`` always work)."""

    zero_allow_untested_optimizer: bool = False
    """DeepSpeed's key, with its default: allow an optimizer outside torch.optim's, which zero3 cannot
    tell updates each element from its own state (it steps flat 1-D shards; optim/steppable.py
    [Note: optimizers zero3 can step]). Ones known to read the whole parameter (Adafactor, LAMB, ...)
    are refused either way."""

    steps_per_print: int = 10
    """How often (in optimizer steps) the engine logs its progress at INFO, as DeepSpeed's does: on
    rank 0 the step, the skipped steps, the learning rates and fp16's loss scale; and, with
    ``wall_clock_breakdown``, every rank's timers."""

    leaf_modules: tuple[str, ...] = ()
    """Class names of modules gathered and reduced as one unit, hooks on the module only (mixture of
    experts: every expert is gathered when the layer runs and reduced, zeros where no token went, so
    ranks that route differently issue the same collectives). See ``zero3.set_leaf_modules``."""

    broadcast_buffers: bool = False
    """DDP's option: every forward with gradients first takes rank 0's module buffers (BatchNorm's
    running statistics), so they, and eval outputs, are the same on every rank. Off, as in DeepSpeed
    and FSDP2: each rank's buffers follow its own batches (``initialize`` gives every rank rank 0's
    buffers either way). runtime/buffers.py."""

    def __post_init__(self) -> None:
        if isinstance(self.leaf_modules, list):
            object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))
        object.__setattr__(self, "optimizer", _spec("optimizer", self.optimizer, OptimizerSpec))
        object.__setattr__(self, "scheduler", _spec("scheduler", self.scheduler, SchedulerSpec))
        counts = ("gradient_accumulation_steps", "steps_per_print", "train_batch_size", "train_micro_batch_size_per_gpu")
        check_fields(self, counts=counts)  # one bound per knob in every message (review 29X: -1 said >= 0, 0 >= 1)
        for name in counts:
            value = getattr(self, name)
            if value is not None and value > _MAX_COUNT and name != "steps_per_print":  # a huge one is a typo,
                # which overflowed later; steps_per_print huge is DeepSpeed's way to print never (1e12)
                raise ZeroConfigError(f"{name} must be at most {_MAX_COUNT}, got {value!r}")
        if self.gradient_accumulation_steps is None and None in (self.train_batch_size,
                                                                 self.train_micro_batch_size_per_gpu):
            object.__setattr__(self, "gradient_accumulation_steps", 1)  # nothing else could fix it

    def for_world_size(self, world_size: int) -> "TrainingConfig":
        """This section with the batch sizes and accumulation steps fixed by DeepSpeed's rule
        ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
        world_size`` (``world_size``: data-parallel ranks, known at ``zero3.initialize``); itself when
        neither batch size is given. Raises `ZeroConfigError` when the given ones cannot agree."""
        batch, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        steps = self.gradient_accumulation_steps
        if batch is None and micro is None:
            return self
        if steps is None:  # both batch sizes given
            steps = _whole(batch, micro * world_size, "gradient_accumulation_steps",
                           f"train_micro_batch_size_per_gpu ({micro}) x {world_size} data-parallel rank(s)", batch)
        elif micro is None:
            micro = _whole(batch, steps * world_size, "train_micro_batch_size_per_gpu",
                           f"gradient_accumulation_steps ({steps}) x {world_size} data-parallel rank(s)", batch)
        elif batch is None:
            batch = micro * steps * world_size
        elif batch != micro * steps * world_size:
            raise ZeroConfigError(f"train_batch_size ({batch}) must equal train_micro_batch_size_per_gpu ({micro}) x "
                                  f"gradient_accumulation_steps ({steps}) x {world_size} data-parallel rank(s) = "
                                  f"{micro * steps * world_size}; fix one of them or leave one out")
        if (batch, micro, steps) == (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                     self.gradient_accumulation_steps):
            return self
        return dataclasses.replace(self, train_batch_size=batch, train_micro_batch_size_per_gpu=micro,
                                   gradient_accumulation_steps=steps)


_MAX_COUNT = 2**31 - 1


def _whole(batch: int, per_unit: int, name: str, unit: str, given: int) -> int:
    """``batch / per_unit`` when it is a whole number >= 1 (the knob ``name``), else an error."""
    n, rest = divmod(batch, per_unit)
    if rest or n < 1:
        raise ZeroConfigError(f"train_batch_size ({given}) is not a whole multiple of {unit}: no {name} gives it; "
                              "fix the batch sizes or give all three")
    return n


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
    ``zero3.activation.checkpointing`` logger and summed in ``zero3.checkpointing.timings()``."""

    def __post_init__(self) -> None:
        value = self.number_checkpoints  # checked here: None or a count >= 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ZeroConfigError(f"activation_checkpointing.number_checkpoints must be None or an int "
                                  f">= 1, got {value!r}")
        check_fields(self, prefix="activation_checkpointing.", skip=frozenset({"number_checkpoints"}))
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
                raise ZeroConfigError("activation_checkpointing: " + unknown_key_message(key, known))
        types_ = field_types(cls)
        return cls(**{k: coerce(types_[k], v) for k, v in d.items()})
