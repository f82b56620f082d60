"""The optimizer step taken during the backward, one sub-group as soon as its gradients are complete.

[Note: optimizer step in backward]
Gradient shards (4 bytes a parameter in fp32) live from the backward that makes them to the
optimizer step. Without offload they are a quarter of fp32 AdamW's 16 bytes a parameter; with
``offload_optimizer="nvme"``, where the state, masters and (usually) the shards are on the drive,
they are most of what memory holds that grows with the model. With
``offload_optimizer_step_in_backward`` the optimizer steps in sub-groups (the streamed step's,
optimizer.py [Note: streamed optimizer step], with any offload device) inside the backward of the
micro-batch that ends an accumulation window: when the reducer has added the last reduced gradient
of every parameter of a sub-group (`landed`), the sub-group is read in, stepped with the user's
optimizer narrowed to it, written out, and its gradient shards are dropped. So only sub-groups not
yet complete hold gradients. A sub-group some of whose parameters got no gradient steps on the
ones it has when the backward ends (`backward_ended`); one without any gradient does not step, as
the optimizer skips parameters without a gradient in the streamed step.

Why it is exact: autograd runs a leaf's AccumulateGrad once per backward, after every use of it, and
the reducer lands a parameter's slice once per backward, so a landed gradient is final, and every
built-in torch optimizer updates each parameter from its own gradient and state only. The sub-group
sees the same gradients, state and hyperparameters (the LR scheduler steps after ``engine.step()``
as before) as in the streamed step, so the result is the same bit for bit. A parameter that gets a
second gradient after its sub-group stepped (two backwards in one window, or a weight used both
inside and outside a reentrant activation checkpoint) is not silently left out: the step fails,
agreed, at ``engine.step()``. So does a parameter gathered again after its sub-group stepped and
then used in the same backward (`gathered`, `used`, told by the coordinator): a recompute that reads
a weight without a gradient through it would compute with the new value. One still gathered from
before its step holds the old value and is fine. (The coordinator tells it as its `GatherWatch`.)

With shared shards (``allgather_impl="shm"``, comm/shared.py [Note: shared shards]) a peer reads
this rank's shards straight from its arena, at the peer's own time, and the step in backward writes
them while that backward runs. It stays safe because of when a rank may step a parameter: only once
its reduction landed, which needs every peer's part of its gradient, which a peer issues (`sent`)
after its last use of it in this backward, and a shared read is done when its gather is issued. So
every read a peer made for a use before that point precedes the write. A gather issued after this
rank sent the parameter's gradient may read a peer's half-written shard (the peer lands and steps
when it likes), so it counts as gathered again (`gathered`), and a use of it fails the step as
above, even when this rank has not stepped it yet: both ranks run the same modules, so every rank
that reads it so finds out.

The agreement (agreed_step.py [Note: agreed optimizer step]) is split in time: the copies are taken
and the tiers staged at the first landed gradient (with shared shards, at the first issued
reduction; at ``engine.step()`` when nothing landed), the sub-groups step during the backward, and the
ranks agree at ``engine.step()``, which commits, or rolls back on every rank (staged) or reports that
the ranks may differ (``offload_optimizer_staged_step=False``, or the optimizer state in memory,
which is never staged). A param group setting (``lr``, say) changed between that backward and
``engine.step()`` would apply to a step already taken: it fails the step the same way, rather than be
ignored until the next one. A backward aborted by an exception rolls back the staged step on the spot;
in place, the parameters already stepped cannot be undone, so every later step is refused until a
checkpoint is loaded. Between such a backward and ``engine.step()`` a checkpoint is refused
(`check_between_steps`): the parameters and state hold a step not agreed on.

Refused with what needs every gradient before any parameter changes: ``gradient_clipping`` (the
global norm) and fp16 (the overflow check, a skipped step). ``engine.clip_grad_norm_`` and the
gradient accessors raise for a gradient the step used, rather than return None (no gradient).
"""

from __future__ import annotations

import copy
import enum
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ZeroStateError
from ..partition.param import ZeroParameter
from ..partition.state import ParamStatus
from .agreed_step import AgreedStep, Kept

logger = logging.getLogger(__name__)


class BackwardStepPhase(enum.Enum):
    """Where the step in backward is.

    - IDLE: no boundary backward has landed a gradient (with shared shards: issued a reduction)
      since the last ``engine.step()``.
    - STEPPING: the window's last backward runs; sub-groups step as their gradients complete.
    - STEPPED: that backward ended with every sub-group that has a gradient stepped; the ranks
      agree at ``engine.step()``.
    - BROKEN: a backward aborted after stepping in place; nothing steps until a checkpoint loads.
    """

    IDLE = enum.auto()
    STEPPING = enum.auto()
    STEPPED = enum.auto()
    BROKEN = enum.auto()


_PHASES = {
    (BackwardStepPhase.IDLE, BackwardStepPhase.STEPPING),
    (BackwardStepPhase.STEPPING, BackwardStepPhase.STEPPED),
    (BackwardStepPhase.STEPPING, BackwardStepPhase.IDLE),  # aborted: rolled back, or nothing stepped
    (BackwardStepPhase.STEPPING, BackwardStepPhase.BROKEN),  # aborted after writing in place
    (BackwardStepPhase.STEPPED, BackwardStepPhase.IDLE),  # engine.step() agreed, or a later abort rolled back
    (BackwardStepPhase.STEPPED, BackwardStepPhase.BROKEN),
    (BackwardStepPhase.BROKEN, BackwardStepPhase.IDLE),  # a checkpoint was loaded
}


class BackwardStep:
    """Steps sub-groups during the backward ([Note: optimizer step in backward]).

    ``subgroups``: the streamed step's (param group index, parameters); ``step_subgroup(gi, ps)``
    reads one in, steps it and starts its writes; ``wait_writes()`` waits for every write; ``drop_grads``
    drops every gradient shard; ``is_boundary()``: the running micro-batch ends a window;
    ``param_groups()``: the optimizer's param groups, whose settings (all but ``"params"``) the step
    in backward uses and must still be in force at ``engine.step()``.
    """

    def __init__(self, subgroups: Sequence[tuple[int, list[ZeroParameter]]], agreed: AgreedStep,
                 step_subgroup: Callable[[int, list[ZeroParameter]], None], wait_writes: Callable[[], None],
                 drop_grads: Callable[[], None], is_boundary: Callable[[], bool],
                 param_groups: Callable[[], list[dict[str, Any]]]) -> None:
        self.subgroups = list(subgroups)
        self.agreed = agreed
        self._step_subgroup = step_subgroup
        self._wait_writes = wait_writes
        self._drop_grads = drop_grads
        self._is_boundary = is_boundary
        self._param_groups = param_groups
        self._settings: list[dict[str, Any]] | None = None  # the param groups' settings the first sub-group used
        self._index = {p._zero.id: k for k, (_, ps) in enumerate(self.subgroups) for p in ps}
        self.phase = BackwardStepPhase.IDLE
        self._landed: list[set[int]] = []
        self._stepped_ids: set[int] = set()  # ZeroParam.id of every parameter stepped in this backward
        self._sent_ids: set[int] = set()  # ... whose gradient went to a reduction (told only with shared shards)
        self._regathered: set[int] = set()  # ... of those gathered again after their step (or send)
        self._kept: Kept | None = None
        self._error: BaseException | None = None
        self._wrote = False  # some sub-group was written (in place: what an abort cannot undo)
        self.steps_in_backward = 0  # sub-groups stepped during backwards (metrics, tests)
        self.before_steps: Callable[[], None] | None = None  # before a backward's first sub-group steps

    def _enter(self, phase: BackwardStepPhase) -> None:
        if (self.phase, phase) not in _PHASES:
            raise ZeroStateError(f"illegal step-in-backward phase change {self.phase.name} -> {phase.name}")
        self.phase = phase

    # -- the backward --------------------------------------------------------------------------------
    def landed(self, p: ZeroParameter) -> None:
        """The reducer added ``p``'s reduced gradient into its shard's gradient."""
        if self.phase is BackwardStepPhase.BROKEN:
            raise ZeroStateError(self._broken_message())
        if self.phase is BackwardStepPhase.IDLE:
            if not self._is_boundary():
                return  # accumulating: the window's last backward steps
            self._open()
        k = self._index.get(p._zero.id)
        if k is None:
            return  # frozen, or not in the optimizer
        if self.phase is BackwardStepPhase.STEPPED or self._is_stepped(k):
            if self._error is None:
                self._error = ZeroStateError(
                    f"{p._zero.name} got a gradient after the optimizer stepped it in this backward "
                    "(offload_optimizer_step_in_backward): a second backward in one accumulation window, or a "
                    "weight used both inside and outside a reentrant activation checkpoint. The step is not "
                    "taken with that gradient left out; call engine.step() after each window's last backward, "
                    "or set offload_optimizer_step_in_backward=False")
            return
        got = self._landed[k]
        got.add(p._zero.id)
        if len(got) == len(self.subgroups[k][1]):
            self._step(k)

    def sent(self, params: Sequence[ZeroParameter]) -> None:
        """(Shared shards only.) This rank's gradients of ``params`` went to a reduction: from now on a
        peer may step them and write its shards, which this rank's gathers read in place."""
        if self.phase is BackwardStepPhase.IDLE:
            if not self._is_boundary():
                return
            self._open()
        if self.phase is BackwardStepPhase.STEPPING:
            self._sent_ids.update(p._zero.id for p in params if p._zero.id in self._index)

    def gathered(self, params: Sequence[ZeroParameter]) -> None:
        """A gather of ``params`` was issued: one stepped in this backward now holds its new value; with
        shared shards, one whose gradient was sent may hold a peer's half-written shard."""
        if self.phase is BackwardStepPhase.STEPPING and (self._stepped_ids or self._sent_ids):
            self._regathered.update(p._zero.id for p in params
                                    if p._zero.id in self._stepped_ids or p._zero.id in self._sent_ids)

    def used(self, params: Sequence[ZeroParameter]) -> None:
        """``params`` are about to be used (a module's fetch). One that stepped in this backward and is
        gathered now or was gathered since (or, at world size 1, a persistent one whose full data is
        its shard) would be computed with its new value: a recompute that reads a weight without a gradient through it,
        say. The step then fails at ``engine.step()`` rather than train on mixed values. A parameter
        still gathered from before its step holds the old value, which is the right one."""
        if self.phase is not BackwardStepPhase.STEPPING or self._error is not None or \
                not (self._stepped_ids or self._sent_ids):
            return
        for p in params:
            z = p._zero
            late = z.status is ParamStatus.NOT_AVAILABLE or z.id in self._regathered
            if z.id in self._sent_ids and z.id not in self._stepped_ids and late:
                self._error = ZeroStateError(
                    f"{z.name} was gathered from the peers' shared memory and used after this rank sent its "
                    "gradient to the reduction in this backward (offload_optimizer_step_in_backward with "
                    "shared-memory gathers): a peer may have stepped it and be writing its shard, so the value "
                    "read is not defined. A module that ran again in the backward (an activation checkpoint's "
                    "recompute, say) reads it. The step is not taken; set allgather_impl='p2p' or "
                    "offload_optimizer_step_in_backward=False for this model")
                return
            if z.id in self._stepped_ids and (late or z.aliased):
                self._error = ZeroStateError(
                    f"{z.name} was used after the optimizer stepped it in this backward "
                    "(offload_optimizer_step_in_backward): a module that ran again in the backward (an activation "
                    "checkpoint's recompute, say) reads it without a gradient through it, so it would compute with "
                    "the new value. The step is not taken; set offload_optimizer_step_in_backward=False for this "
                    "model")
                return

    def backward_ended(self) -> None:
        """The step's backward is over: step what has gradients and is not stepped, wait for the writes."""
        if self.phase is not BackwardStepPhase.STEPPING:
            return
        for k, (_, ps) in enumerate(self.subgroups):
            if not self._is_stepped(k) and any(p._zero.train_tensor.grad is not None for p in ps):
                self._step(k)
        try:
            self._wait_writes()
        except Exception as exc:  # noqa: BLE001 - agreed at engine.step()
            self._error = self._error or exc
        self._enter(BackwardStepPhase.STEPPED)

    def aborted(self) -> None:
        """The step was aborted (an exception in forward or backward, on this rank or a peer): undo
        what stepped (staged), or refuse later steps (in place, after a write)."""
        if self.phase not in (BackwardStepPhase.STEPPING, BackwardStepPhase.STEPPED):
            return
        try:
            self._wait_writes()
        except Exception:  # noqa: BLE001 - the step is being undone; the abort's own error is what the caller sees
            pass
        if self._kept is not None:
            self.agreed.roll_back(self._kept)
            self._enter(BackwardStepPhase.IDLE)
        elif self._wrote:
            logger.error("zero3: %s", self._broken_message())
            self._enter(BackwardStepPhase.BROKEN)
        else:
            self._enter(BackwardStepPhase.IDLE)
        self._drop_grads()
        self._reset()

    # -- engine.step() ---------------------------------------------------------------------------------
    def conclude(self) -> None:
        """The window's optimizer step (a collective): agree on what the backward stepped, then commit
        or roll back and raise. A window whose backward landed nothing (no gradient at all) agrees too,
        so every rank runs the same collectives."""
        if self.phase is BackwardStepPhase.BROKEN:
            raise ZeroStateError(self._broken_message())
        if self.phase is BackwardStepPhase.IDLE:
            self._open()
        if self.phase is BackwardStepPhase.STEPPING:
            self.backward_ended()
        if self._error is None and self._settings is not None:
            self._error = _changed_settings(self._settings, self._param_groups())
        kept, error = self._kept, self._error
        self._enter(BackwardStepPhase.IDLE)
        self._reset()
        self.agreed.conclude(kept, error, self._drop_grads)

    def check_between_steps(self, what: str) -> None:
        """Refuse ``what`` (a checkpoint) while a step taken in backward awaits ``engine.step()``: the
        drive holds values the ranks have not agreed on yet."""
        if self.phase in (BackwardStepPhase.STEPPING, BackwardStepPhase.STEPPED):
            raise ZeroStateError(
                f"{what} between a backward that stepped the optimizer (offload_optimizer_step_in_backward) and "
                "engine.step(): the step is not agreed on yet; call engine.step() first")

    def check_gradient_read(self, p: ZeroParameter, what: str) -> None:
        """Refuse ``what`` (a gradient accessor) for a parameter whose gradient the step in this backward
        used and dropped: None would read as "no gradient", which is not what happened."""
        if self.phase in (BackwardStepPhase.STEPPING, BackwardStepPhase.STEPPED) and p._zero.id in self._stepped_ids:
            raise ZeroStateError(
                f"{what}({p._zero.name}): its gradient was used by the optimizer step taken in this backward "
                "(offload_optimizer_step_in_backward) and dropped, so there is none to read. Read gradients in a run "
                "with offload_optimizer_step_in_backward=False")

    def recovered(self) -> None:
        """A checkpoint was loaded: the parameters and state are whole again."""
        if self.phase is BackwardStepPhase.BROKEN:
            self._enter(BackwardStepPhase.IDLE)

    # -- internals -------------------------------------------------------------------------------------
    def _open(self) -> None:
        if self.before_steps is not None:  # in-place writes to kept-gathered weights, taken as engine.step takes them
            self.before_steps()
        self._enter(BackwardStepPhase.STEPPING)
        self._landed = [set() for _ in self.subgroups]
        self._stepped_ids, self._sent_ids, self._regathered = set(), set(), set()
        self._kept = self.agreed.keep(None)
        self._error = self.agreed.stage()
        self._wrote = False

    def _step(self, k: int) -> None:
        gi, ps = self.subgroups[k]
        if self._settings is None:
            self._settings = _settings(self._param_groups())
        self._stepped_ids.update(p._zero.id for p in ps)
        if self._error is None:  # after a failure nothing more is written: the step fails anyway
            try:
                self._wrote = True
                self._step_subgroup(gi, ps)
                self.steps_in_backward += 1
            except Exception as exc:  # noqa: BLE001 - agreed at engine.step()
                self._error = exc
        for p in ps:
            p._zero.train_tensor.grad = None

    def _is_stepped(self, k: int) -> bool:
        return self.subgroups[k][1][0]._zero.id in self._stepped_ids  # a sub-group steps whole

    def _reset(self) -> None:
        self._landed, self._stepped_ids, self._sent_ids, self._regathered = [], set(), set(), set()
        self._kept, self._error, self._wrote = None, None, False
        self._settings = None

    @staticmethod
    def _broken_message() -> str:
        return ("a backward was aborted after the optimizer stepped part of the model in place "
                "(offload_optimizer_step_in_backward, not staged: the optimizer state is in memory, or "
                "offload_optimizer_staged_step=False), so the parameters are part-way through a step: load the "
                "last checkpoint before training on")


def _settings(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy of every param group's settings (``lr``, ``betas``, ...: all but ``"params"``)."""
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in param_groups]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value that does not compare: count it as changed
        return False


def _changed_settings(used: list[dict[str, Any]], now: list[dict[str, Any]]) -> ZeroStateError | None:
    """The error for a param group setting that changed after the step in backward used it, or None."""
    hint = ("the step was taken during the backward with the earlier value. Change optimizer settings before the "
            "window's last backward (an lr_scheduler given to zero3.initialize steps after engine.step(), which is "
            "right), or set offload_optimizer_step_in_backward=False")
    if len(now) != len(used):
        return ZeroStateError(f"the optimizer's param groups went from {len(used)} to {len(now)} between the backward "
                              f"that stepped them (offload_optimizer_step_in_backward) and engine.step(): {hint}")
    for i, (before, group) in enumerate(zip(used, now)):
        for key in sorted(set(before) | {k for k in group if k != "params"}):
            old, new = before.get(key, "<unset>"), group.get(key, "<unset>")
            if not _same(old, new):
                return ZeroStateError(
                    f"param group {i}'s {key!r} changed from {old!r} to {new!r} between the backward that stepped the "
                    f"optimizer (offload_optimizer_step_in_backward) and engine.step(): {hint}")
    return None


__all__ = ["BackwardStep", "BackwardStepPhase"]
