"""DeepSpeed's ZeRO-optimizer names on the optimizer ``zero3.deepspeed.initialize`` returns.

Frameworks hold that object where DeepSpeed's engine would hand them its ZeRO optimizer, and read
DeepSpeed's names off it: Accelerate's ``DeepSpeedOptimizerWrapper.step_was_skipped`` reads
``overflow`` and its ``AcceleratedOptimizer`` forwards ``state``, ``defaults`` and ``param_groups``;
Lightning moves ``state`` at teardown; Megatron-style loops log ``cur_scale``. Each is a view of the
user's optimizer or of the loss scaler. `PartitionedOptimizer` inherits them (``self`` is it).
"""

from __future__ import annotations

from typing import Any

from ..errors import ZeroConfigError


class DeepSpeedOptimizerNames:
    """DeepSpeed's ZeRO-optimizer attributes that are views of zero3's state."""

    optimizer: Any
    scaler: Any
    _last_overflow: bool

    @property
    def overflow(self) -> bool:
        """Whether the last optimizer step found an fp16 overflow (and was skipped), as DeepSpeed's
        ``optimizer.overflow``."""
        return self._last_overflow

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The user's optimizer's param groups (their ``params`` are the shards or fp32 masters)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        """Given to the user's optimizer, as DeepSpeed's setter does; the step refuses a tensor in
        them that is not a shard (optim/foreign.py)."""
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        """The user's optimizer's state: this rank's shard of it, keyed by the shards."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The user's optimizer's default hyperparameters."""
        return self.optimizer.defaults

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale (1.0 without fp16), DeepSpeed's ``optimizer.loss_scale``."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @loss_scale.setter
    def loss_scale(self, value: Any) -> None:
        _refuse_scale_write("loss_scale", value)

    @property
    def cur_scale(self) -> float:
        """The same as ``loss_scale`` (DeepSpeed's other name for it)."""
        return self.loss_scale

    @cur_scale.setter
    def cur_scale(self, value: Any) -> None:
        _refuse_scale_write("cur_scale", value)

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the fp16 loss scale moves with overflows (False without fp16, or with a static scale)."""
        return self.scaler is not None and self.scaler.dynamic


def _refuse_scale_write(name: str, value: Any) -> None:
    raise ZeroConfigError(
        f"optimizer.{name} = {value!r}: zero3's loss scale is set by the config's fp16 section (initial_scale_power, "
        "or loss_scale for a static one) and moves only at the optimizer step, where the gradients it scaled are "
        "unscaled; a write in between would unscale them by another factor. Set it in the config")
