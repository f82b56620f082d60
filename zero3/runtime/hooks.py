"""Module hooks: turn forward/backward module events into coordinator calls, and drive the step phase.

[Note: hook protocol]
- forward pre-hook (``prepend=True``): push a `_Call` for this module on the forward stack, gather its
  parameters (own + external) and, when grad is on and its gradients do not close it (below), wrap
  the tensor inputs in `_PostBackward`.
- forward post-hook: pop the call, report its end to the coordinator (which releases the parameters
  or keeps them: still used elsewhere, a schedule's reuse keeps, generation mode) and hook the
  output tensors (a pre-hook on each one's autograd node, a tensor hook on a leaf: outputs.py `prepare_output`):
  the first gradient that reaches any of them is the module's *pre-backward*, which gathers the
  parameters again (once per call).
- a module's *post-backward* releases the call's parameters. Where its parameters tell when its
  backward is done (see [Note: post-backward from the gradients]) that is when the last of them has
  its gradient; otherwise the inputs are wrapped in `_PostBackward`, whose backward runs when the
  gradients of the module's inputs are ready. A wrapped module whose inputs need no grad never gets
  it; the end of the step releases those.
- ``register_post_accumulate_grad_hook`` on every trainable parameter, kept after the user's
  (last_grad_hook.py), hands its full gradient to the reducer as soon as autograd has accumulated it
  (a leaf module's go to its unit, reduced when the leaf's backward ends), then drops it.
- one callback per autograd graph task (queued from the first hook that fires in it); when the last
  running graph task ends, the backward is over: gradients are complete and the step ends.
Accessing a partitioned parameter of *another* module inside a forward (``self.wte.weight`` in the
root's forward) is caught by the `ParamDict` (param_reads.py) that replaces each module's ``_parameters`` and turns
into an automatic `register_external_parameter`.

Every hook checks and moves the step phase through the step's lifecycle (`StepLifecycle`, step.py),
the one way a step ends, whether it finished, was aborted by an exception or lost its hooks. The
one exception is a resident decode forward (below), which is no step at all: it gathers, releases
and communicates nothing.

[Note: post-backward from the gradients]
Autograd runs a leaf parameter's AccumulateGrad once per backward, after every node that uses the
parameter in that graph has run (their gradients are summed into its input first). So once each of
a module's parameters has had its gradient accumulated, no node of the backward needs them again:
that is the module's post-backward, and it costs a set insertion per parameter in the gradient hook
that runs anyway, where `_PostBackward` costs an autograd function per call (apply in the forward,
a Python node in the backward: about 15 µs a module call on the 2-core machine, bench_hooks.py).
It is used for a module ("closed by its gradients") when every parameter it gathers is its own,
belongs to no other module (no tied weights, no external parameters), requires grad, and it is
not a leaf module; any other module keeps `_PostBackward`. Only a module's first call of a step is
closed this way: its gradients land after the backward of its last call, so a module called twice
(a, b, c, b, a; or two forwards before one backward) held every such module gathered from its first
backward to its last, over `max_live_parameters` (3 modules live where the cap allowed 1, probe 23C).
Its later calls get `_PostBackward`: each releases after its own backward, and the first call gathers
again for its own. A later call none of whose inputs needs grad has no such node: it is closed by the
gradients too. The step is counted by `_backwards_ended`: a step can end while its forward's graph waits for
its backward (a second no_grad forward inside it, ``engine.step()`` or a checkpoint load ends it). The order of events is the same as with
`_PostBackward` on its inputs: the engine's ready queue takes AccumulateGrad nodes first, so the
last gradient of a module lands before the backward of the module that ran before it. Two
differences: a module whose inputs need no grad (the first layer) gets its post-backward too, and
one of whose parameters gets no gradient in a backward (an output unused by the loss) does not;
the end of the step releases those.

A backward node reading a parameter after that: late_read.py [Note: a parameter read after its
module's backward].

[Note: resident decode forwards]
In generation mode with the whole model inside the live cap, the first decode forward gathers every
parameter and nothing releases one until the mode ends (coordinator.py `generation_resident`). A
no-grad forward of the root after that needs nothing from zero3: no gather, no release, no
collective, no step. So its root pre-hook lands any gather still in flight, counts the root call
(`_resident_calls`) and takes zero3's forward hooks off every other module (`SubmoduleHooks`, submodule_hooks.py):
torch then calls them as if zero3 were not there (bench_generation.py's "torch without zero3" row
is the ceiling). The next forward that is not such a one, and the end of generation mode, put them
back before anything else. It is
decided at the root, for the whole forward, from state every rank reaches at the end of the same
forward (the same gathers ran), so all ranks skip the same forwards and their collectives stay in
step. A forward of the root with grad on, or after any release (which clears the state), takes
the full path. While the hooks are off, a submodule called on its own (not through the root) runs
without them: it finds its parameters gathered, unless a checkpoint load or a
``GatheredParameters`` write released them, and then raises the `ZeroStateError` of a parameter
used while not gathered (checked with a scratch script, not in the tests).

[Note: a no_grad forward inside a step]
A forward of the root under ``torch.no_grad()`` (or in grad mode with nothing trainable in reach,
`_frozen`) ends its step as its root returns, but for one: the first that runs while a step is open
in which a module with partitioned parameters ran forward in grad mode with a backward to reach it
(`_grad_forward`: between a training forward and its backward; a metric on held-out rows) joins
that step, as a forward with grad on does: it gathers under the step's keeps, and its events are in
the step's trace. Ending the step there made the backward gather every module again (a 7-module MLP
at the default reuse: 4 gathers a step instead of 2), and memory_budget chose from a trace of the
backward alone (review 40R2). A second one ends the step: an evaluation loop after a loss that never
gets its backward is one step per forward, not one growing step, and a trace holds one forward more
at most (41R1). A step opened by a submodule's call under no_grad (T5's encoder in ``generate``) or
by a frozen one's in grad mode is no training step (42R1, 42R2), nor is one whose partitioned
modules all ran under no_grad (inside reentrant checkpoints): there the eval ends the step as
before. While a joined step waits for its backward, ``engine.generation()`` and ``offload_states``
are refused, as right after the training forward.

The decision reads only the calls the rank made (`_opened_step`, set at the root's pre-hook,
`_grad_forward`, `_joined_inference`), so ranks that run the same forwards decide alike; asking
whether the step's autograd graph was alive made them part when one rank's cyclic GC freed it
(41R1). A rank that runs such a forward alone joins it alone: a gather only it runs is raised by the
verified wire (comm/verify.py); one that needs none (shared-memory reads, all kept) changes nothing
the ranks share but their traces, and memory_budget's choice from such a first step is rank 0's on
every rank (runtime/budget.py `MemoryBudget._agreed`).

[Note: activation checkpointing and the end of a step]: checkpoint_scopes.py.

[Note: one thread]: thread_claim.py.

[Note: a second backward]
Several losses over one forward, each with its own ``backward`` (the first with
``retain_graph=True``), run the backward of the same calls more than once. The first backward ends
the step and releases everything; the second runs through the same autograd nodes, whose hooks
fire again. A call whose backward opened or ended in an earlier step (`_Call.ended_in`; one that
opened and never closed: its output's node ran, its post-backward did not) opens again: its
parameters are gathered again, its gradients reduced again and added into the same shards, as
torch adds them into ``.grad``. Within one backward a call never opens twice (a hook on a second
output node that fires after the call closed finds it ended in this step). A leaf module whose call
opens again, or after a backward's end reset its call count (two forwards, a backward each), is
`LeafUnit.reopened`: its unit is reduced once at this backward's end, on every rank (which of its calls
open is not known before they run); so is a leaf recomputed by activation checkpointing (its forward
ran under ``no_grad`` and counted no call). A no_grad forward neither counts calls nor resets the counts.

Leaf modules: leaf.py ([Note: a leaf called inside and outside a checkpoint], [Note: a leaf's gradient
from outside it]).
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import weakref
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .checkpoint_scopes import CHECKPOINT_FORWARD, EnclosingEnd, dispatch_modes, outside_dispatch_modes
from .context import RuntimeContext
from ..errors import ZeroStateError
from .gathered import external_parameters, register_external_parameter, load_hooks, refuse_partitioned_load
from .handed_copies import copy_gathered_state
from .leaf import LeafUnit, is_leaf, reached_outside_leaves
from ..partition.param import PartitionedParameter, ZeroParameter, drop_grad_slots, take_grad_slot
from ..planning.trace import EventKind
from ..optim.precision import RUNNING_BACKWARD
from .step import StepLifecycle, StepPhase
from .trainable import FrozenAtInstall
from .refusals import (EAGER, STOP_RECOMPUTATION, create_graph_refusal,
                       eval_frame_callback, refuse_compiled_call, refuse_copy, removed_refusal, refuse_transform,
                       swapped_or_traced_refusal, transform_level, unpartitioned_refusal, unscaled_backward_refusal)
from .buffers import ModuleBuffers
from .submodule_hooks import SubmoduleHooks
from .outputs import prepare_output
from .param_reads import unwatch_reads, watch_reads
from .last_grad_hook import LastGradHook
from .late_read import LateReads, weak_late_read
from .thread_claim import root_post, root_pre

logger = logging.getLogger(__name__)


class CallState(Enum):
    """One forward call of a module with gathered parameters (`_Call`).

    - OPEN: its PRE_FORWARD event was recorded; its parameters are pinned until POST_FORWARD.
    - JOINED: it had no parameters to gather at entry but its forward used another module's
      partitioned parameter, which was pinned for it (an automatic external parameter); no event
      was recorded, so closing it only unpins.
    - FORWARD_DONE: its forward returned; a gradient reaching its outputs will open its backward.
    - BACKWARD_OPEN: PRE_BACKWARD recorded; its parameters are pinned until POST_BACKWARD.
    - BACKWARD_DONE: POST_BACKWARD recorded; nothing more happens to this call.
    """

    OPEN = auto()
    JOINED = auto()
    FORWARD_DONE = auto()
    BACKWARD_OPEN = auto()
    BACKWARD_DONE = auto()


@dataclass(eq=False)
class _ModuleRecord:
    module: nn.Module
    name: str
    key: tuple[int, int, int] = (-1, -1, -1)  # (#own params, #external params, #backward hooks) the cache is for
    params: list[ZeroParameter] = field(default_factory=list)  # what a call gathers; [] if all persistent
    ids: tuple[int, ...] = ()
    leaf: "LeafUnit | None" = None
    by_grads: bool = False  # its calls are closed by its parameters' gradients (cached with ``params``)
    read_late: bool = False  # a parameter of it was read after its backward closed: never by_grads again
    grads_in: int = -1  # the step (`ModuleHooks._backwards_ended`) of its last call closed by the gradients
    awaiting: list["_Call"] = field(default_factory=list)  # BACKWARD_OPEN calls closed by the gradients
    arrived: set[int] = field(default_factory=set)  # id(param) of gradients accumulated since they opened


# The members the hook path tests, as module globals: on Python 3.11 reading a member through its
# class costs about 50 ns and a global about 5; a module call reads some 25 of them.
_IDLE, _FORWARD, _BACKWARD = StepPhase.IDLE, StepPhase.FORWARD, StepPhase.BACKWARD
_OPEN, _JOINED, _FORWARD_DONE = CallState.OPEN, CallState.JOINED, CallState.FORWARD_DONE
_BACKWARD_OPEN, _BACKWARD_DONE = CallState.BACKWARD_OPEN, CallState.BACKWARD_DONE
_AFTER_OPEN = (_BACKWARD_OPEN, _BACKWARD_DONE)
_PRE_FORWARD, _POST_FORWARD = EventKind.PRE_FORWARD, EventKind.POST_FORWARD
_PRE_BACKWARD, _POST_BACKWARD = EventKind.PRE_BACKWARD, EventKind.POST_BACKWARD


@dataclass(eq=False, slots=True)
class _Call:
    """One forward call of a module; carries what its backward must gather and release.

    A call is also the hook that opens its backward (`ModuleHooks._pre_backward`): one object per
    module call where a ``functools.partial`` of a bound method makes three (partial, method, args
    tuple). They live from forward to backward, so they count toward the cyclic GC's threshold,
    which they pushed over once per step at threshold 0 (78 modules)."""

    hooks: ModuleHooks
    record: _ModuleRecord
    params: list[ZeroParameter]
    ids: tuple[int, ...] | None = None  # sorted ids of params; None: recompute (params changed)
    state: CallState = CallState.OPEN
    by_grads: bool = False  # its post-backward comes from its parameters' gradients, not `_PostBackward`
    ended_in: int = -1  # the step (`ModuleHooks._steps_ended`) its backward last opened or ended in

    def __call__(self, grads: Any) -> None:
        self.hooks._pre_backward(self, grads)


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, hooks: "ModuleHooks", *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.call = call
        ctx.hooks = hooks
        # as they are, not detached: torch then refuses an in-place write of the module on its input, loudly
        # and before it writes (probe 37N); detached, the write reached the caller's tensor while its autograd
        # history did not follow, and a residual (s(h) + h) got silently wrong gradients (review 37R4)
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        outside_dispatch_modes(ctx.hooks._post_backward, ctx.call)
        return (None, None) + grads

    @staticmethod
    def once(call: _Call, hooks: "ModuleHooks", tensors: list[torch.Tensor]) -> Any:
        """`apply`, a tensor given several times (``mha(h, h, h)``) wrapped once: the module sees one object
        (MultiheadAttention's packed path tests ``query is key``; a checkpoint's recompute differed, probe 37A)."""
        unique = {id(t): t for t in tensors}
        if len(unique) == len(tensors):
            return _PostBackward.apply(call, hooks, *tensors)
        by_id = dict(zip(unique, _PostBackward.apply(call, hooks, *unique.values())))
        return [by_id[id(t)] for t in tensors]


class ModuleHooks:
    """Installs and owns every hook zero3 puts on a model; `remove` takes them all off again."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise refuse_copy(self.root)

    def __init__(self, ctx: RuntimeContext) -> None:
        assert ctx.reducer is not None, "hooks need a context with a gradient reducer"
        self.ctx = ctx
        self.coordinator = ctx.coordinator
        self.reducer = ctx.reducer
        self.step = StepLifecycle(ctx, self._close_calls)  # the phase, and the one end of a step
        self.stack: list[_Call] = []
        self._handles: list[Any] = []
        self._records: dict[int, _ModuleRecord] = {}
        self._queued_tasks: set[int] = set()
        self._enclosing = EnclosingEnd(self.ensure_final_callback)  # a step's end a nested backward hands on
        self._forward_node: Any = None  # the autograd node the step's forward ran in (checkpoint_scopes.py)
        self._removed = False  # remove() ran: a pre-backward hook left on an old autograd node refuses
        opt = ctx.optimizer
        self._fp16 = opt if opt is not None and opt.scaler is not None else None  # its gradients must be scaled
        self._announced: set[tuple[int, int]] = set()
        self.root: nn.Module | None = None
        self._leaves: list[LeafUnit] = []
        self._leaf_of: dict[int, LeafUnit] = {}  # id(param) -> the leaf it belongs to
        self._in_leaf: dict[int, _ModuleRecord] = {}  # id(module) inside a leaf -> the leaf's record
        self._owner: dict[int, _ModuleRecord] = {}  # id(param) -> the one hooked module that owns it
        self._awaiting: set[_ModuleRecord] = set()  # records with calls waiting for their gradients
        self._forward_t0 = 0.0  # when the running root forward began
        self._opened_step = False  # the running root forward opened its step ([Note: a no_grad forward inside a step])
        self._joined_inference = False  # a no_grad root forward joined the open step
        self._grad_forward = False  # a module forward with grad on ran in the open step (the join's condition)
        self._resident_calls = 0  # root calls open in a resident decode forward ([Note: resident decode forwards])
        self._claim = ctx.claim  # the thread running a call of the engine ([Note: one thread])
        self._forward_token: tuple | None = None  # the claim the running root forward took
        self._steps_ended = 0  # ends of step so far ([Note: a second backward])
        self._backwards_ended = 0  # ends of step after a backward, or aborted ([Note: post-backward from the gradients])
        self._submodule_hooks = SubmoduleHooks()
        self._frozen = FrozenAtInstall(())  # trainable.py [Note: unfreezing after initialize]
        self._buffers: ModuleBuffers | None = None  # broadcast_buffers: rank 0's before forwards (buffers.py)
        self._late_reads: LateReads | None = None  # late_read.py, made by install (the context holds it weakly)

    # -- install / remove -----------------------------------------------------------------------
    def install(self, model: nn.Module) -> None:
        self.root = model
        names = self.ctx.config.training.leaf_modules
        outside = reached_outside_leaves(model, names)  # a module also reached there gets hooks (probe 25C)
        for name, m in model.named_modules():
            if id(m) in self._in_leaf and id(m) not in outside:
                watch_reads(m, self)  # part of a leaf only: no hooks, but reads of its parameters from
                continue               # another module's forward are seen (probe 26A)
            if m is not model and not m._parameters and not external_parameters(m) and not is_leaf(m, names):
                continue  # nothing to gather: no hooks (a parameter it reads is its caller's, found by ParamDict)
            self._hook(name, m)
        holders: dict[int, int] = {}  # id(param) -> how many modules hold it as their own (hooked or not)
        for m in model.modules():
            self._handles.append(m.register_load_state_dict_pre_hook(  # where a load starts, and at the root
                functools.partial(refuse_partitioned_load, root=m is model)))
            if any(isinstance(p, ZeroParameter) for p in dict.values(m._parameters)):  # loaded into shards
                self._handles += load_hooks(self.ctx, m)  # (kept-gathered ones), never assigned over
            for p in dict.values(m._parameters):
                if p is not None:
                    holders[id(p)] = holders.get(id(p), 0) + 1
        self._owner = {id(p): rec for rec in self._records.values() if rec.leaf is None
                       for p in dict.values(rec.module._parameters) if p is not None and holders[id(p)] == 1}
        self._frozen = FrozenAtInstall(p for p in model.parameters() if isinstance(p, ZeroParameter))
        if self.ctx.config.training.broadcast_buffers:
            self._buffers = ModuleBuffers(self.ctx.comm, model)
        seen: set[int] = set()
        for p in model.parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            # A weak reference: tensor hooks live in C++, where the garbage collector cannot see a
            # cycle through them, and a bound method would keep the engine alive forever.
            self._handles.append(LastGradHook(p, functools.partial(_weakly, weakref.ref(self), ModuleHooks._on_grad)))
        self._late_reads = LateReads(self.step, self.coordinator, self.stack, self.ctx.store.placement.step_in_backward,
                                     functools.partial(_weakly, weakref.ref(self), ModuleHooks._owner_read_late))
        self.ctx.late_read = weak_late_read(self._late_reads)
        self.ctx.external_added = functools.partial(_weakly, weakref.ref(self), ModuleHooks.external_added)

    def _hook(self, name: str, m: nn.Module) -> None:
        rec = _ModuleRecord(module=m, name=name)
        if is_leaf(m, self.ctx.config.training.leaf_modules):
            self._in_leaf.update((id(d), rec) for d in m.modules() if d is not m)
            trainable = sorted({id(p): p for p in m.parameters() if p.requires_grad}.values(),
                               key=lambda p: p._zero.id)
            rec.leaf = LeafUnit(params=trainable)  # type: ignore[arg-type]
            self._leaves.append(rec.leaf)
            for p in trainable:
                self._leaf_of[id(p)] = rec.leaf
        self._records[id(m)] = rec
        pre, post = functools.partial(self._pre_forward, rec), functools.partial(self._post_forward, rec)
        if m is self.root:  # [Note: one thread]
            pre, post = functools.partial(root_pre, self, pre), functools.partial(root_post, self, post)
            self._handles.append(m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
            self._handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
        else:
            self._submodule_hooks.add(m, pre, post)
        self._handles.append(m.register_state_dict_post_hook(copy_gathered_state))
        watch_reads(m, self)

    def external_added(self, module: nn.Module) -> None:
        """``register_external_parameter(module, ...)`` after install: a module without hooks gets them, a
        leaf holding it gathers the parameter; `ZeroStateError` for a module outside the engine's model."""
        rec = self._records.get(id(module)) or self._in_leaf.get(id(module))
        if rec is not None:
            rec.key = (-1, -1, -1)  # its calls collect their parameters again
            return
        name = next((n for n, m in self.root.named_modules() if m is module), None) if self.root else None
        if name is None:
            raise ZeroStateError(f"register_external_parameter: the {type(module).__name__} given is not part of "
                                 "the engine's model, so no hook of it would gather the parameter")
        self._hook(name, module)

    def generation_ended(self) -> None:
        """Generation mode ended: the submodules' hooks are back on."""
        self._submodule_hooks.resume()

    def remove(self) -> None:
        """Take every hook off (autograd nodes' hooks, without handles, refuse); a running step aborts."""
        self._removed = True
        self.ctx.late_read = self.ctx.external_added = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._submodule_hooks.remove()
        for m in self.root.modules() if self.root is not None else ():
            unwatch_reads(m, self)
        self._records.clear()
        self.step.close()

    # -- the step phase --------------------------------------------------------------------------
    @property
    def phase(self) -> StepPhase:
        return self.step.phase

    def _close_calls(self, aborted: bool, phase: StepPhase) -> None:
        """The hooks' part of the end of a step (`StepLifecycle`): forget the open calls and queued
        graph tasks; at the end of a backward, reduce the leaf modules not reduced yet."""
        self._steps_ended += 1
        self._joined_inference = self._grad_forward = False
        self._enclosing.settle()
        self._forward_node = None
        after_backward = aborted or phase is StepPhase.BACKWARD  # not a no_grad forward's end: a graph may wait
        if after_backward:
            self._backwards_ended += 1
        self.stack.clear()
        self._queued_tasks.clear()  # autograd skips the final callbacks of a backward that raised
        for rec in self._awaiting:
            rec.awaiting.clear()
            rec.arrived.clear()
        self._awaiting.clear()
        for leaf in self._leaves if not aborted and phase is StepPhase.BACKWARD else ():  # in model order
            leaf.end_of_backward(self.reducer)
        for leaf in self._leaves if after_backward else ():  # a no_grad forward's end keeps the counts
            leaf.reset()                                    # of the calls whose backward is to come

    # -- forward --------------------------------------------------------------------------------
    def _params_of(self, rec: _ModuleRecord) -> list[ZeroParameter]:
        """The params a call of this module gathers (own + external), cached per module. A module whose
        params are all persistent gathers nothing: it records no events and gets no backward hooks,
        which makes small always-gathered modules nearly free."""
        external = rec.module.__dict__.get("_external_params", ())
        m = rec.module  # a backward hook of its own may read its parameters after their gradients: not by_grads
        key = (len(m._parameters), len(external), len(m._backward_hooks) + len(m._backward_pre_hooks))
        if key != rec.key:
            params = self._collect(rec)
            rec.params = [] if all(p._zero.persistent for p in params) else params
            rec.ids = tuple(sorted({p._zero.id for p in rec.params}))
            rec.by_grads = rec.leaf is None and not rec.read_late and not external and not key[2] and \
                all(self._owner.get(id(p)) is rec for p in rec.params)
            rec.key = key
        return rec.params

    def _collect(self, rec: _ModuleRecord) -> list[ZeroParameter]:
        out: list[ZeroParameter] = []
        leaf = rec.leaf is not None
        own = rec.module.named_parameters() if leaf else dict.items(rec.module._parameters)
        for name, p in own:
            if p is None:
                continue
            if not isinstance(p, ZeroParameter):  # added since, or functional_call's plain tensor
                raise unpartitioned_refusal(name, rec.name, p)
            if not any(q is p for q in out):
                out.append(p)
        for d in rec.module.modules() if leaf else (rec.module,):  # a leaf's calls gather its modules' too
            for p in external_parameters(d):
                if isinstance(p, ZeroParameter) and not any(q is p for q in out):
                    out.append(p)
        return out

    def _pre_forward(self, rec: _ModuleRecord, module: nn.Module, args: tuple, kwargs: dict | None = None) -> Any:
        if dispatch_modes():  # a selective checkpoint's (checkpoint_scopes.py [Note: zero3's tensor work under ...])
            return outside_dispatch_modes(self._pre_forward, rec, module, args, kwargs)
        if eval_frame_callback() not in EAGER:  # under torch.compile (refusals.py)
            refuse_compiled_call()
        if kwargs is None or (torch._C._get_tracing_state() is not None and any(  # probe 37X; kwargs None: a hook
                isinstance(p, ZeroParameter) and not p._zero.persistent for p in module._parameters.values())):
            raise swapped_or_traced_refusal(rec.name, kwargs is None)  # torch.ao copied onto a module it swapped in
        if self._resident_calls:  # [Note: resident decode forwards]
            if rec.module is self.root:
                self._resident_calls += 1
            return None
        if self.step.phase is _BACKWARD and torch._C._current_graph_task_id() < 0:  # [Note: a backward that raised]
            self.step.abort(RuntimeError("the model's last backward raised"), "backward")
        begins = rec.module is self.root and not self.stack  # a forward of the model begins
        if begins:  # the only place the hooks can be off
            if self.coordinator.generation_resident and self.step.phase is _IDLE and not torch.is_grad_enabled():
                self.coordinator.wait_in_flight()
                self._resident_calls = 1
                self._submodule_hooks.suspend()
                return None
            self._submodule_hooks.resume()
            self.coordinator.forward_boundary(True)
            self._forward_t0 = time.perf_counter()
            self._opened_step = self.step.phase is _IDLE
        if self.step.phase is _IDLE:  # once per step, not per module
            self.ctx.require_states(f"a forward of {rec.name or 'the model'}",
                                    self.ctx.forward_needs(torch.is_grad_enabled()))
            if self._frozen.params and torch.is_grad_enabled():
                self._frozen.check()
            self._forward_node = torch._C._current_autograd_node() if begins else None  # a recompute: None
            self.step.enter(_FORWARD)
        if begins and self._buffers is not None:  # every forward of the model, as DDP
            self._buffers.before_forward(torch.is_grad_enabled())
        if rec.leaf is not None and torch.is_grad_enabled():  # calls with a backward to come
            if self.step.phase is _FORWARD:
                rec.leaf.calls += 1
            else:  # a recompute (activation checkpointing): reduced at this backward's end, as one whose
                rec.leaf.reopened = True  # backward opened after a reset (probe 25A: a persistent one's never opens)
                rec.leaf.flushed = False  # [Note: a leaf called inside and outside a checkpoint]
        params = self._params_of(rec)
        if params and transform_level() is not None:
            refuse_transform(rec.name)
        call = _Call(self, rec, params, rec.ids, _OPEN if params else _JOINED)  # the record's list, copied on change
        self.stack.append(call)
        if params:
            self.coordinator.event(_PRE_FORWARD, rec.name, params, rec.ids)
            if torch.is_grad_enabled():
                if rec.by_grads and _all_trainable(params):  # [Note: post-backward from the gradients]
                    self._grad_forward = True  # a backward reaches it ([Note: a no_grad forward inside a step])
                    if rec.grads_in != self._backwards_ended:  # its first call of the step
                        rec.grads_in = self._backwards_ended
                        call.by_grads = True
                        return None
                    wrapped = _wrap_inputs(call, self, args, kwargs)
                    call.by_grads = wrapped is None  # no input needs grad: only the gradients tell
                    return wrapped
                wrapped = _wrap_inputs(call, self, args, kwargs)
                if wrapped is not None or any(p.requires_grad for p in params):  # a backward may reach it (a
                    self._grad_forward = True  # frozen embedding's call on token ids does not: review 42R2)
                return wrapped
        return None

    def _post_forward(self, rec: _ModuleRecord, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if dispatch_modes():  # as in `_pre_forward`
            return outside_dispatch_modes(self._post_forward, rec, module, args, kwargs, output)
        if self._resident_calls:
            if rec.module is self.root:
                self._resident_calls -= 1
            return None
        if output is None and rec.module is self.root and self.step.phase is not _IDLE:
            exc = sys.exc_info()[1]
            if exc is not None and not isinstance(exc, STOP_RECOMPUTATION):  # always_call runs us while the
                self.step.abort(exc, "forward")  # root's forward raises: abort the step
                return None
        call = self._pop(rec)
        if call is None:  # the pre-hook raised (always_call runs us anyway): nothing to close
            return None
        if rec.module is self.root and not self.stack:
            self.ctx.metrics.forward_seconds += time.perf_counter() - self._forward_t0
            self.coordinator.forward_boundary(False)
        grad = torch.is_grad_enabled()
        result = None
        if call.params:  # before the release below ([Note: module outputs])
            result, seen_all = prepare_output(output, call.params, call if grad else None)
            if result is output:
                result = None
            else:
                output = result
            if not seen_all:
                self._keep_for_step(call, output)
            if call.state is _OPEN:
                self.coordinator.event(_POST_FORWARD, rec.name, call.params, call.ids)
            else:  # JOINED: only auto-detected external params, pinned mid-forward
                self.coordinator.leave_visit(call.params)
            call.state = _FORWARD_DONE
        if rec.module is self.root and not self.stack and self.step.phase is _FORWARD \
                and not CHECKPOINT_FORWARD.get() and (not grad or _frozen(self.ctx.params, args, kwargs, output)):
            if self._opened_step or self._joined_inference or not self._grad_forward:  # an inference forward is
                self.step.end(inference=True)  # a whole step, so is a frozen model's in grad mode, but the
            else:  # first inside a training step ([Note: a no_grad forward inside a step])
                self._joined_inference = True
        return result

    def _keep_for_step(self, call: _Call, output: Any) -> None:
        """The output may hide a tensor a backward enters through unseen: keep the call's parameters
        gathered until the step ends ([Note: module outputs])."""
        self.coordinator.keep_for_step(call.params)
        key = (id(call.record.module), -1)
        if key not in self._announced:
            self._announced.add(key)
            logger.info("zero3: the output of %r (a %s) holds an object zero3 cannot look into, which may hide "
                        "tensors whose backward needs its parameters; they stay gathered until the step ends "
                        "(tensors in tuples, lists, dicts or dataclasses let them go earlier)",
                        call.record.name or "the model", type(output).__name__)

    def _pop(self, rec: _ModuleRecord) -> _Call | None:
        stack = self.stack
        if stack and stack[-1].record is rec:  # the usual case: the innermost call returns
            return stack.pop()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].record is rec:
                call = stack.pop(i)
                if i != len(stack):  # an inner call raised and never reached its post-hook
                    del stack[i:]
                return call
        return None

    def _on_access(self, p: PartitionedParameter) -> None:
        """A partitioned param was read through ``module._parameters`` while not gathered."""
        if dispatch_modes():  # as in `_pre_forward`
            return outside_dispatch_modes(self._on_access, p)
        if not self.stack:
            return  # outside any forward: computing with it raises a clear error
        call = self.stack[-1]
        if not any(q is p for q in call.params):
            # Its own gradients no longer tell when this call's backward is done (the new parameter's
            # node may run later): the call keeps its parameters until the step ends; later calls are
            # wrapped in `_PostBackward` (the record's cache sees the external parameter).
            call.by_grads = False
            register_external_parameter(call.record.module, p)
            call.params = [*call.params, p]  # the record's list stays as it is
            call.ids = None
            key = (id(call.record.module), p._zero.id)
            if key not in self._announced:
                self._announced.add(key)
                logger.info("zero3: %s is used in the forward of %r; registered as an external parameter",
                            p._zero.name, call.record.name)
            self.coordinator.join_visit(p)
        else:
            self.coordinator.fetch([p])

    # -- backward -------------------------------------------------------------------------------
    def _pre_backward(self, call: _Call, grads: Any) -> None:
        if dispatch_modes():  # as in `_pre_forward` (checkpoint_scopes.py, probe 34H)
            return outside_dispatch_modes(self._pre_backward, call, grads)
        if self.step.phase is not _BACKWARD:  # the hook path: no call when nothing changes
            if self._removed:
                raise removed_refusal(call.record.name)
            if self._fp16 is not None and self._fp16.unscaled:  # refused before the phase: nothing is dropped
                _refuse_unscaled(self, None, True)
            self.step.enter(_BACKWARD)
        self.ensure_final_callback()
        state = call.state  # a call opened or closed in an earlier step (`ended_in`) opens again
        if state is _FORWARD_DONE or (state in _AFTER_OPEN and call.ended_in != self._steps_ended):
            if torch.is_grad_enabled() and any(p._zero.user_pins == 0 for p in call.params):
                self.step.abort(exc := create_graph_refusal(call.record.name), "backward")
                raise exc
            leaf = call.record.leaf
            if leaf is not None and (state is not _FORWARD_DONE or leaf.calls == 0):
                leaf.reopened = True  # [Note: a second backward]: its unit is reduced at this backward's end
            call.state, call.ended_in = _BACKWARD_OPEN, self._steps_ended
            if call.by_grads:
                rec = call.record
                self._awaiting.add(rec)
                rec.awaiting.append(call)
            self.coordinator.event(_PRE_BACKWARD, call.record.name, call.params, call.ids)
        return None

    def _post_backward(self, call: _Call) -> None:
        if call.state is _BACKWARD_OPEN and self.step.phase is _BACKWARD:
            call.state = _BACKWARD_DONE
            call.ended_in = self._steps_ended
            self.coordinator.event(_POST_BACKWARD, call.record.name, call.params, call.ids)
            leaf = call.record.leaf
            if leaf is not None and leaf.calls == 1 and not leaf.reopened:
                # Its only call's backward is done, so its parameters' gradients are accumulated (autograd
                # runs AccumulateGrad nodes first once they are ready).
                leaf.flush(self.reducer)
            self.reducer.module_done()

    def _close_by_gradients(self, rec: _ModuleRecord) -> None:
        """Every parameter of ``rec`` has its gradient (`_on_grad` counts them in ``rec.arrived``): the
        backward of its open calls is done ([Note: post-backward from the gradients])."""
        calls = list(rec.awaiting)
        rec.awaiting.clear()
        rec.arrived.clear()
        self._awaiting.discard(rec)
        for call in calls:
            self._post_backward(call)

    def _on_grad(self, p: torch.Tensor) -> None:
        if dispatch_modes():  # as in `_pre_backward`
            return outside_dispatch_modes(self._on_grad, p)
        if self.step.phase is not _BACKWARD:
            self.step.enter(_BACKWARD)
        fp16, theirs = self._fp16, RUNNING_BACKWARD.scale  # the factor this gradient carries (None: no engine's)
        if fp16 is not None and (theirs is None or fp16.unscaled):
            _refuse_unscaled(self, p, fp16.unscaled)
        self.ensure_final_callback()
        grad = take_grad_slot(p)
        if grad is not None:
            if theirs is not None and theirs != (ours := 1.0 if fp16 is None else fp16.grad_scale):
                grad = grad * (ours / theirs)  # precision.py [Note: a backward that crosses engines]
            leaf = self._leaf_of.get(id(p)) if self._leaf_of else None
            if leaf is None or leaf.flushed or not (leaf.calls or leaf.reopened):  # [Note: a leaf's gradient
                self.reducer.add(p, grad)  # type: ignore[arg-type]               # from outside it]
            else:  # a second gradient before the flush: its call's nested (checkpointed) backward
                leaf.grads[id(p)] = grad if (had := leaf.grads.get(id(p))) is None else had + grad
        rec = self._owner.get(id(p))
        if rec is not None and rec.awaiting:
            arrived = rec.arrived
            arrived.add(id(p))
            if len(arrived) >= len(rec.params):
                self._close_by_gradients(rec)

    def _owner_read_late(self, p: PartitionedParameter) -> None:
        rec = self._owner.get(id(p))
        if rec is not None and not rec.read_late:  # its later calls are closed by `_PostBackward`
            rec.read_late = True
            rec.key = (-1, -1, -1)

    def ensure_final_callback(self) -> None:
        task = torch._C._current_graph_task_id()
        if task in self._queued_tasks:
            return
        self._queued_tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(outside_dispatch_modes, self._end_graph_task, task))

    def _end_graph_task(self, task: int) -> None:
        if task not in self._queued_tasks:
            return  # a callback of a backward from before the last end of step
        self._queued_tasks.discard(task)
        if not self._queued_tasks and self.step.phase is _BACKWARD and not self._enclosing.defer(self._forward_node):
            self.step.end()
        else:
            self.reducer.finish()  # this graph task's gradient shards are complete


def _wrap_inputs(call: _Call, hooks: ModuleHooks, args: tuple, kwargs: dict) -> Any:
    """The forward pre-hook's result: (args, kwargs) with the tensor inputs that need grad passed through
    `_PostBackward` (once: a tensor given several times stays one object); None where none needs grad."""
    if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:  # the most common case
        return ((_PostBackward.apply(call, hooks, args[0])[0],), kwargs) if args[0].requires_grad else None
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common case, without pytree
        idx = [i for i, a in enumerate(args) if a.requires_grad]
        if not idx:
            return None
        wrapped = _PostBackward.once(call, hooks, [args[i] for i in idx])
        out = list(args)
        for i, t in zip(idx, wrapped):
            out[i] = t
        return tuple(out), kwargs
    flat, spec = pytree.tree_flatten((args, kwargs))
    idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return None
    wrapped = _PostBackward.once(call, hooks, [flat[i] for i in idx])
    for i, t in zip(idx, wrapped):
        flat[i] = t
    return pytree.tree_unflatten(flat, spec)


def _frozen(params: list, args: tuple, kwargs: dict, output: Any) -> bool:
    """No parameter trains, no input needs grad and no output tensor does: no backward can reach this
    forward, so it ends its step or, as a no_grad one would, joins a training step ([Note: a no_grad
    forward inside a step]). A DINO teacher run without no_grad kept one step open for good, its
    record growing (probe 37H). An output's objects pytree does not open are taken as holding none: with
    no trainable parameter and no input needing grad, nothing made inside can need it (review 37R3)."""
    if any(p.requires_grad for p in params):
        return False
    if all(p._zero.persistent for p in params):  # nothing to gather or reduce for a backward (input gradients)
        return True
    return not any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs, output)))


def _refuse_unscaled(hooks: ModuleHooks, p: torch.Tensor | None, clipped: bool) -> None:
    """A gradient of an fp16 engine's model arrived unscaled (or after its window was unscaled)."""
    drop_grad_slots(hooks.ctx.params)  # what autograd accumulated already: nothing of it is reduced
    hooks.step.abort(exc := unscaled_backward_refusal(p, clipped), "backward")
    raise exc


def _weakly(ref: "weakref.ref[ModuleHooks]", method: Callable[["ModuleHooks", Any], None], arg: Any) -> None:
    """``method(hooks, arg)`` while the hooks live: tensor hooks and the context hold this, never them."""
    hooks = ref()
    if hooks is not None:
        method(hooks, arg)


def _all_trainable(params: list[ZeroParameter]) -> bool:
    for p in params:
        if not p.requires_grad:
            return False
    return True
