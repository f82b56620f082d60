"""The optimizer and the learning-rate schedule a DeepSpeed config describes, built over shards.

``optimizer: {type, params}`` and ``scheduler: {type, params}`` sections of a DeepSpeed JSON mean the
same here: `build_optimizer` makes the torch optimizer (DeepSpeed's ``Adam`` is AdamW unless
``adam_w_mode`` is false; ``torch_adam`` selects torch's implementation, the only one zero3 has), and
`build_scheduler` one of DeepSpeed's warm-up schedules, which ``engine.step()`` steps once per
optimizer step (not on an fp16-skipped step).

The schedules follow DeepSpeed's definitions: iteration ``i`` counts ``step()`` calls from
``last_batch_iteration`` + 1; warm-up rises from the minimum to the maximum over
``warmup_num_steps`` (at least 2) as ``log(i + 1) / log(warmup_num_steps)``
(``warmup_type="log"``) or ``i / warmup_num_steps`` (``"linear"``). A schedule built fresh
(``last_batch_iteration=-1``) writes its starting lr into the optimizer at once, as DeepSpeed's do,
so the first optimizer step already runs at it (``warmup_min_lr``; 0 for `WarmupCosineLR`), not
at the optimizer's own ``lr``: a warm-up exists to avoid exactly that first full-lr step.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable

import torch

from ..config import OptimizerSpec, SchedulerSpec
from ..errors import ZeroConfigError

logger = logging.getLogger(__name__)


def build_optimizer(spec: OptimizerSpec, params: Iterable[Any]) -> torch.optim.Optimizer:
    """The torch optimizer ``spec`` names, over ``params`` (tensors or param-group dicts)."""
    p = dict(spec.params)
    torch_adam = p.pop("torch_adam", False)  # torch's implementation is the only one here
    kind = spec.type.lower()
    if kind in ("adam", "adamw"):
        if not torch_adam:  # DeepSpeed's own Adam (FusedAdam, CPUAdam) defaults to no weight decay
            p.setdefault("weight_decay", 0.0)
        p.pop("set_grad_none", None)  # FusedAdam's zero_grad(set_to_none): zero3's zero_grad drops gradients anyway
        decoupled = p.pop("adam_w_mode", True)
        if kind == "adamw" and decoupled is not True:
            raise ZeroConfigError("optimizer type AdamW with adam_w_mode=false is contradictory: AdamW decays the weights "
                                  "decoupled; use type Adam with adam_w_mode false for L2 regularisation")
        if not p.pop("bias_correction", True):
            raise ZeroConfigError("optimizer.params.bias_correction=false is not supported (torch's Adam always "
                                  "corrects the bias)")
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        if "betas" in p:
            p["betas"] = tuple(p["betas"])
        return _construct(cls, params, p, spec)
    if kind == "sgd":
        return _construct(torch.optim.SGD, params, p, spec)
    raise ZeroConfigError(f"optimizer.type {spec.type!r} is not supported: use Adam, AdamW or SGD")


class WarmupLR:
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.
    Without ``warmup_max_lr``, up to the first param group's lr, as DeepSpeed's today (it was 0.001,
    which trained a config's lr of 3e-4 at 3.3x after the warm-up: probe 30A)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | list[float] = 0.0,
                 warmup_max_lr: float | list[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        if warmup_type not in ("log", "linear"):
            raise ZeroConfigError(f"scheduler warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.optimizer = optimizer
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None
        if last_batch_iteration == -1:
            self._apply()

    def _warmup(self) -> float:
        i = self.last_batch_iteration
        if self.warmup_type == "log":
            return math.log(i + 1) / math.log(self.warmup_num_steps)
        return i / self.warmup_num_steps

    def _gamma(self) -> float:
        return self._warmup() if self.last_batch_iteration < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        """The lr of each param group at ``last_batch_iteration`` (the minimum before the first step)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError("call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._apply()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])


class WarmupDecayLR(WarmupLR):
    """`WarmupLR`, then a linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: Any = 0.0,
                 warmup_max_lr: Any = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = int(total_num_steps)
        _warn_short(self)

    def _gamma(self) -> float:
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            return self._warmup()
        return max(0.0, (self.total_num_steps - i) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(WarmupLR):
    """Warm up from ``warmup_min_ratio`` of the optimizer's lr to all of it, then a cosine decay to
    ``cos_min_ratio`` of it at ``total_num_steps``. Before the first step the lr is 0, DeepSpeed's
    value (which DeepSpeed writes into the first param group only; here into every group)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]  # before the base class writes the start
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        super().__init__(optimizer, 0.0, 0.0, warmup_num_steps, warmup_type, last_batch_iteration)
        _warn_short(self)

    def _ratio(self) -> float:
        i = self.last_batch_iteration
        if i < self.warmup_num_steps:
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * self._warmup()
        done = i - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        # Held at the floor from total_num_steps on, as DeepSpeed's today: unclamped, the cosine rose
        # again past it, and with total_num_steps <= warmup_num_steps it jumped between full and the
        # floor every step (probe 26B).
        cosine = (1.0 + math.cos(math.pi * min(1.0, done / span))) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0] * len(self.base_lrs)
        ratio = self._ratio()
        return [lr * ratio for lr in self.base_lrs]


def _warn_short(schedule: WarmupDecayLR | WarmupCosineLR) -> None:
    """DeepSpeed's warning for a decay that ends before its warm-up does (a short run of a Trainer
    with a fixed warm-up): the lr then stays in the warm-up for the whole run, as DeepSpeed's."""
    if schedule.total_num_steps < schedule.warmup_num_steps:
        logger.warning("zero3: %s total_num_steps %d is less than warmup_num_steps %d: the run ends inside the "
                       "warm-up (and any step past total_num_steps stays at the decay's end)",
                       type(schedule).__name__, schedule.total_num_steps, schedule.warmup_num_steps)


def _construct(cls: type, params: Iterable[Any], p: dict[str, Any], spec: OptimizerSpec) -> torch.optim.Optimizer:
    """``cls(params, **p)``; torch's refusal of a combination of values (SGD's nesterov without momentum)
    is the config's error, naming the section (probe 30A: torch's ValueError came out of initialize)."""
    try:
        return cls(params, **p)
    except ValueError as exc:
        raise ZeroConfigError(f"optimizer section {{'type': {spec.type!r}, 'params': {dict(spec.params)!r}}}: "
                              f"torch.optim.{cls.__name__} refused it: {exc}") from None


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_scheduler(spec: SchedulerSpec, optimizer: torch.optim.Optimizer) -> WarmupLR:
    cls = SCHEDULERS.get(spec.type)
    if cls is None:
        raise ZeroConfigError(f"scheduler.type {spec.type!r} is not supported: use one of {sorted(SCHEDULERS)}")
    try:
        return cls(optimizer, **spec.params)
    except TypeError as exc:
        raise ZeroConfigError(f"scheduler {spec.type}: {exc}") from None


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ZeroConfigError(f"scheduler {name}: {len(value)} values for {len(optimizer.param_groups)} param "
                                  "groups")
        return [float(v) for v in value]
    return [float(value)] * len(optimizer.param_groups)
