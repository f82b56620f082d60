"""DeepSpeed's ZeRO-optimizer names on the optimizer ``zero3.deepspeed.initialize`` returns.

Frameworks hold that object where DeepSpeed's engine would hand them its ZeRO optimizer, and read
DeepSpeed's names off it: Accelerate's ``DeepSpeedOptimizerWrapper.step_was_skipped`` reads
``overflow`` and its ``AcceleratedOptimizer`` forwards ``state``, ``defaults`` and ``param_groups``;
Lightning moves ``state`` at teardown; Megatron-style loops log ``cur_scale``. Each is a view of the
user's optimizer or of the loss scaler. `PartitionedOptimizer` inherits them (``self`` is it).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ZeroConfigError, ZeroStateError


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
        """Given to the user's optimizer, as DeepSpeed's setter does (Accelerate sets the groups it
        read), if they hold exactly the tensors the optimizer steps now: other ones (a deep copy, the
        full parameters) would leave the shards untrained, silently (review 28X)."""
        mine = sorted(id(t) for g in self.optimizer.param_groups for t in g["params"])
        if not isinstance(groups, list) or not all(isinstance(g, dict) and "params" in g for g in groups) or \
                sorted(id(t) for g in groups for t in g["params"]) != mine:
            raise ZeroConfigError(
                "optimizer.param_groups = ...: the new groups must hold exactly the tensors the optimizer steps now "
                "(this rank's shards or fp32 masters, each once), as optimizer.param_groups gives them; change a "
                "group's hyperparameters in place (param_groups[i]['lr'] = ...)")
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        """The user's optimizer's state: this rank's shard of it, keyed by the shards. Refused while
        its tensors have no bytes here (NVMe between steps, ``offload_states``): a read of one crashed
        the process (review 28X; Lightning's teardown moves each)."""
        state = self.optimizer.state
        if any(isinstance(t, torch.Tensor) and t.numel() and not t.untyped_storage().nbytes()
               for per in state.values() for t in per.values()):
            if getattr(self, "states", None) is not None:
                raise ZeroStateError("optimizer.state: the optimizer state lives on NVMe between steps (offload_optimizer "
                                     "device nvme), so its tensors hold no bytes here; read one with "
                                     "zero3.safe_get_local_optimizer_state(p, key)")
            raise ZeroStateError("optimizer.state: the optimizer state is offloaded (engine.offload_states), so its "
                                 "tensors hold no bytes here; call engine.reload_states() first")
        return state

    @state.setter
    def state(self, value: Any) -> None:
        """Only the state itself (Accelerate's setter hands back what it read): zero3 keys this rank's
        shard of the state by its shards, which a new mapping would not be."""
        if value is not self.optimizer.state:
            raise ZeroConfigError("optimizer.state = ...: zero3 keys this rank's optimizer state by its shards; "
                                  "load a saved state with optimizer.load_state_dict(...) or engine.load_checkpoint")

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
