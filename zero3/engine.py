"""`zero3.initialize` and the `Engine`: the public facade over one model's `RuntimeContext`.

The engine holds the context (runtime/context.py), the hooks (runtime/hooks.py) and the last step's
metrics; it sequences a micro-batch's end (`Engine.step`) and forwards everything else to the part
of the runtime that owns the work.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .activation import checkpointing
from .checkpoint.hf_save import save_pretrained
from .checkpoint.load import load_checkpoint
from .checkpoint.save import save_checkpoint
from .checkpoint.sixteen_bit import save_16bit_model, sixteen_bit_state_dict
from .comm.agreement import agree_on_config
from .comm.communicator import Communicator, Kind, Tag
from .comm.tags import OPTIMIZER_STEP
from .comm.process_group import ensure_default_group, group_of_mesh
from .config import ZeroConfig, resolve_config
from .checkpoint.live_state_dict import consolidated_state_dict
from .runtime.context import RuntimeContext, build_context, context_of
from .runtime.coordinator import ParamCoordinator
from .errors import ZeroCommunicationError, ZeroConfigError, ZeroDivergenceError, ZeroStateError
from .optim import foreign as foreign_optimizers
from .optim import routed_step
from .optim.routed_clip import route_clip
from .runtime.gathered import external_parameters
from .runtime.hooks import ModuleHooks
from .runtime.deepspeed_engine import DeepSpeedEngineNames
from .runtime.hf_resize import route_resize
from .runtime.parametrize_routes import route_parametrizations, route_pruning
from .runtime.refusals import refuse_copy
from .metrics import StepMetrics
from .comm.model_parallel import check_mpu, data_parallel_group
from .offload.policy import PlacementPolicy
from .offload.swapfile import check_swap_directories
from .optim.grad_norm import clip_shards
from .partition.param import ZeroParameter, raw_data
from .optim.precision import LossScaler
from .runtime.step import StepPhase
from .runtime.engine_calls import (abort_forward, check_lr_kwargs, end_forward_without_backward, begin_forward,
                                   end_micro_batch, in_memory, offload_engine_states, require_gradients, require_hooks,
                                   zero_grad_window)
from .runtime.generation_mode import generation_mode
from .runtime.thread_claim import BACKWARD, claiming

logger = logging.getLogger(__name__)



class Engine(DeepSpeedEngineNames):
    """A partitioned model with its hooks, gradient reducer and sharded optimizer.

    Use ``loss = engine(x); engine.backward(loss); engine.step()``, or the plain loop ``loss = model(x);
    loss.backward(); optimizer.step()`` (not under fp16, whose loss scale ``engine.backward`` applies).
    With ``gradient_accumulation_steps = N``, ``engine.step()`` after every micro-batch steps every N-th.
    """

    def __init__(self, model: nn.Module, optimizer: Any, config: ZeroConfig, group: Any,
                 communicator: Communicator | None = None, model_parameters: Any = None,
                 lr_scheduler: Any = None, mpu: Any = None) -> None:
        self.context: RuntimeContext = build_context(model, optimizer, config, group, communicator, model_parameters,
                                                     lr_scheduler, mpu)
        self.hooks = ModuleHooks(self.context)
        self.hooks.install(model)
        self.last_step_metrics = StepMetrics()
        routed_step.route(self.optimizer, self)  # a plain loop's optimizer.step() is this engine's step
        route_clip(self.context, clip_grad_norm_)  # torch's clip over its param_groups: the global norm

    # -- what the context holds, by name -----------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        assert self.context.module is not None
        return self.context.module

    @property
    def config(self) -> ZeroConfig:
        return self.context.config

    @property
    def params(self) -> list[ZeroParameter]:
        return self.context.params

    @property
    def group(self) -> Any:
        return self.context.group

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def comm(self) -> Communicator:
        return self.context.comm

    @property
    def coordinator(self) -> ParamCoordinator:
        return self.context.coordinator

    @property
    def metrics(self) -> StepMetrics:
        return self.context.metrics

    @property
    def sharded_optimizer(self) -> Any:
        """The `PartitionedOptimizer` (fp32 masters, loss scaling, clipping around the user's one)."""
        return self.context.optimizer

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The user's ``torch.optim`` optimizer, re-pointed at the shards (None without one)."""
        return self.context.optimizer.optimizer if self.context.optimizer is not None else None

    @property
    def loss_scaler(self) -> LossScaler | None:
        return self.context.optimizer.scaler if self.context.optimizer is not None else None

    @property
    def lr_scheduler(self) -> Any:
        """The learning-rate scheduler ``step()`` steps (from ``lr_scheduler=`` or the config), or None."""
        return self.context.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        """None hands the scheduler back (DeepSpeed's attribute: Lightning sets it and steps its own)."""
        routed_step.release_scheduler(self.context, scheduler)

    @property
    def device(self) -> torch.device:
        """Where the model computes: the device of its (gathered) parameters."""
        return raw_data(self.params[0]).device if self.params else torch.device("cpu")

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer param group."""
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def was_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (an fp16 overflow on some rank)."""
        return self.context.optimizer.overflow if self.context.optimizer is not None else False

    def gradient_accumulation_steps(self) -> int:
        return self.config.training.gradient_accumulation_steps

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def parameters(self, recurse: bool = True) -> Any:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.named_parameters(*args, **kwargs)

    @property
    def global_steps(self) -> int:
        return self.context.global_steps

    @property
    def micro_steps(self) -> int:
        return self.context.micro_steps

    # -- training API ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        begin_forward(self)
        try:
            return self.module(*args, **kwargs)
        except BaseException as exc:
            abort_forward(self, exc)
            raise

    @claiming(BACKWARD)
    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True, **kwargs: Any) -> torch.Tensor:
        """``loss.backward(**kwargs)``; with fp16, of the loss times the current loss scale (in fp32).
        Returns what DeepSpeed's does: the loss over ``gradient_accumulation_steps``, as the gradients
        are divided (``scale_wrt_gas=False``: they are not, and the loss is returned as given).

        Raises:
            ZeroConfigError: the engine has no optimizer (DeepSpeed asserts the same): its gradients
                would never be used. Without one the engine is for forward and generation.
        """
        require_hooks(self, "engine.backward()")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"engine.backward(loss): loss must be the tensor the forward computed, got "
                            f"{type(loss).__name__}: {loss!r:.80}")
        if self.context.optimizer is None:
            raise ZeroConfigError("engine.backward(): must provide optimizer during init in order to use backward (pass "
                                  "optimizer= to initialize or add an 'optimizer' section to the config); without one "
                                  "the engine is for forward and generation only")
        n = self.gradient_accumulation_steps()
        scaled = self.context.optimizer.scale_loss(loss if scale_wrt_gas or n == 1 else loss * n)
        try:
            with self.context.optimizer.scaling():  # fp16: the gradients of this backward carry the scale
                scaled.backward(**kwargs)
        except BaseException as exc:
            self.hooks.step.abort(exc, "backward")
            raise
        return loss / n if scale_wrt_gas and n > 1 else loss

    @claiming("engine.step()")
    def step(self, lr_kwargs: dict[str, Any] | None = None) -> bool:
        """End a micro-batch; at an accumulation boundary, step the optimizer on the shards (and the
        lr scheduler, with ``lr_kwargs`` as keywords: DeepSpeed's argument).

        At the boundary (every call when ``gradient_accumulation_steps`` is 1): fp16 gradients are
        unscaled and checked for overflow on every rank, ``gradient_clipping`` is applied, the
        optimizer steps (on fp32 masters under mixed precision, copied back to the parameter
        shards), gradients are zeroed (without an optimizer too) and persistent parameters re-gathered.
        Gradients set through ``safe_set_full_grad``/``safe_set_local_grad`` on every rank are stepped on
        without a backward, as torch's step uses an assigned ``p.grad``.

        Returns:
            True if the optimizer stepped; False between boundaries, without an optimizer, or when
            an fp16 overflow on some rank made every rank skip the step (``engine.skipped_steps``).

        Raises:
            ZeroStateError: with an optimizer and a trainable parameter, no gradient reached the model since
                the last ``engine.step()``: no backward reduced one (none ran, or one over the inputs alone) and
                none was set on every rank (`require_gradients`; nothing changes then: no step, no
                ``global_steps`` or schedule advance; DeepSpeed's engine checks nothing and its optimizer finds
                no gradients). Without one, ``step()`` after an inference forward is fine.
        """
        require_hooks(self, "engine.step()")
        check_lr_kwargs(self, lr_kwargs)
        ctx = self.context
        ctx.step_applied = False  # until it steps (a step that raises applied nothing)
        ctx.require_states("engine.step()")
        require_gradients(self)
        if self.hooks.phase is not StepPhase.IDLE:
            self.hooks.step.end()
        else:
            ctx.finish_gradients()
        boundary = ctx.step_ends_window()
        stepped, error = False, None
        if boundary and ctx.optimizer is not None:
            # Nothing changes a shard before every rank is here and every collective so far checked out.
            ctx.comm.agree(Tag(Kind.AGREE, f"{OPTIMIZER_STEP} {ctx.global_steps}"))
            ctx.take_persistent_writes()  # runtime/persistent.py: in-place writes since the last gather
            t0 = time.perf_counter()
            try:
                stepped = ctx.optimizer.step_shards()
            except ZeroStateError as exc:  # fp16's minimum loss scale: the step skipped on every rank, its
                if not ctx.optimizer.overflow:  # gradients dropped; the window still ends (probe 36I)
                    raise
                error = exc
            except BaseException as exc:  # the optimizer's own (a step hook's): the shards may have stepped, so the
                if not isinstance(exc, (ZeroCommunicationError, ZeroDivergenceError)):  # copies of the persistent
                    ctx.coordinator.refresh_persistent()  # ones follow them (probe 36M); not after a failed group
                raise
            if stepped and ctx.lr_scheduler_step is not None:
                try:
                    ctx.lr_scheduler_step(**(lr_kwargs or {}))
                except BaseException as exc:  # noqa: BLE001 - the shards stepped: the step ends as one, then raises
                    error = exc  # (probe 36M: the persistent parameters' copies kept the old weights; 36R3: Ctrl-C)
            if self.config.training.wall_clock_breakdown and torch.cuda.is_available() and self.device.type == "cuda":
                torch.cuda.synchronize()
            ctx.metrics.optimizer_seconds += time.perf_counter() - t0
        end_micro_batch(self, boundary, stepped)
        if error is not None:
            raise error
        return stepped

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``engine.step()`` steps the optimizer (its micro-batch ends a window)."""
        return self.context.step_ends_window(warn=False)

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's override of where windows end (RL trainers' varying micro-batch counts): while set, ``step()``
        steps exactly when it is True, whatever ``gradient_accumulation_steps`` says; None restores that."""
        if is_boundary is not None and is_boundary not in (True, False):
            raise ZeroConfigError(f"engine.set_gradient_accumulation_boundary(is_boundary={is_boundary!r:.60}): "
                                  "must be True, False or None (back to gradient_accumulation_steps)")
        self.context.boundary_override = None if is_boundary is None else bool(is_boundary)

    def _backward_ran(self) -> bool:
        """Whether a backward reached the model's trainable parameters since the last ``step()``: one is
        running, or one reduced a gradient into the shards (a backward whose hooks ran but that gave no
        parameter a gradient, ``torch.autograd.grad`` over the inputs, did not)."""
        reducer = self.context.reducer
        return self.hooks.phase is StepPhase.BACKWARD or (reducer is not None and reducer.landed > 0)

    def no_sync(self) -> Any:
        """DDP's switch for skipping the gradient reduction of a micro-batch: refused, as DeepSpeed
        refuses it under ZeRO-3 (the full gradients would have to stay until the window ends)."""
        raise ZeroConfigError(
            "engine.no_sync(): zero3 reduces each micro-batch's gradients into shards as its backward goes; "
            "skipping that would keep every full gradient until the window ends, which sharding exists to "
            "avoid. Drop the no_sync(): a backward per micro-batch and one step at the end accumulate in "
            "the shards to DDP's gradients (or set gradient_accumulation_steps and call engine.step() after "
            "every micro-batch: it steps at the window's end)")

    # -- DeepSpeed's engine names that reach past the engine's state (the others: runtime/deepspeed_engine.py)
    @property
    def global_rank(self) -> int:
        """This process's rank in the whole world (``engine.rank`` is its data-parallel rank)."""
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else self.rank

    @claiming("engine.save_16bit_model()")
    def save_16bit_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write the consolidated model, each parameter in its own (16-bit under bf16/fp16) dtype, as a
        ``torch.save`` state dict at ``save_dir/save_filename``. A collective: every rank takes part in
        the gathers, the engine group's rank 0 writes, and every rank returns (True) once it is there."""
        return save_16bit_model(self, os.path.join(os.fspath(save_dir), save_filename), exclude_frozen_parameters)

    @claiming("a 16-bit state dict")
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """DeepSpeed's name, as Accelerate and the Hugging Face Trainer call it: the state dict
        `save_16bit_model` writes, on the engine group's rank 0; None on the other ranks (a collective)."""
        state = sixteen_bit_state_dict(self, exclude_frozen_parameters)
        return state if self.rank == 0 else None


    def __iter__(self) -> Iterator[Any]:
        raise TypeError("zero3.initialize returns the engine alone, not a tuple; for DeepSpeed's 4-tuple "
                        "(engine, optimizer, dataloader, lr_scheduler) use zero3.deepspeed.initialize")

    def __reduce_ex__(self, protocol: Any) -> Any:  # copy.deepcopy, pickle (probe 36H: torch's TypeError on the
        raise refuse_copy(self.module)  # process group, where the model's copy names what works)

    def __copy__(self) -> "Engine":  # copy.copy: another handle on the same engine, as before (review 36R2)
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        return other

    def generation(self) -> contextlib.AbstractContextManager["Engine"]:
        """Generation mode for decode loops (RL rollouts, evaluation): gathered weights stay gathered
        across the repeated forwards, within the live cap (``max_live_parameters`` or ``max_live_bytes``):
        while the decode cycle is learnt, what does not fit is released most recently used first;
        then a planned resident part stays and the rest is gathered in buckets along the cycle
        (planning/generation.py), instead of every weight being gathered again for every token; everything is released on exit. Enter it between steps, on every rank. Entered again inside
        itself (an evaluation helper called during a rollout), the inner block joins the outer mode:
        only the outermost exit ends it (`zero3.runtime.generation_mode`)."""
        return generation_mode(self)

    # -- the phase memory manager (zero3/offload/states.py) --------------------------------------------
    @claiming("engine.offload_states()")
    def offload_states(self, include: Any = None, device: str = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False, *, nvme_path: str | None = None) -> int:
        """Move model states out of memory between phases (training and generation), DeepSpeed's name.

        Each storage behind the states is copied out and resized to 0 bytes, so every tensor, view and
        optimizer-state key stays valid; `reload_states` copies the bytes back in place, and training
        goes on exactly as before. Until then what needs an offloaded kind raises ``ZeroStateError``
        naming what to reload (offload/states.py). Call it between steps.

        Args:
            include: a subset of ``{"lp_params", "hp_params", "optim_states", "lp_grads"}`` (None: all):
                parameter shards and the gathered persistent parameters; fp32 masters (when separate
                from the shards); optimizer state; gradient shards (when a backward left some).
                DeepSpeed's ``contiguous_grad_buffer`` is taken and names nothing to move here.
            device: ``"nvme"`` (a swap file under ``nvme_path``, default the config's
                ``offload_param`` or ``offload_optimizer`` ``nvme_path``) or ``"cpu"`` (host memory;
                storages already in CPU memory stay, as there is nothing to free).
            pin_memory: pin the host copies (``device="cpu"``, with CUDA).
            non_blocking: return once the copies are started (their memory is freed as each
                finishes); a later ``reload_states`` waits for them.
            nvme_path: the directory for ``device="nvme"`` (zero3's addition to DeepSpeed's signature).

        Returns:
            The bytes moved.

        Raises:
            ZeroStateError: called during a step, inside ``GatheredParameters`` or ``generation()``,
                or while states are already offloaded.
            ZeroConfigError: an unknown kind or device, or no ``nvme_path`` for ``device="nvme"``.
        """
        require_hooks(self, "engine.offload_states()")
        if self.hooks.phase is not StepPhase.IDLE or self.coordinator.in_step:
            raise ZeroStateError("engine.offload_states() must be called between steps (after engine.step() or an "
                                 "inference forward that was a step of its own), not inside a forward or backward")
        return offload_engine_states(self, include, device, pin_memory, non_blocking, nvme_path)

    @claiming("engine.reload_states()")
    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what `offload_states` moved, in place (a no-op when nothing is offloaded).
        ``non_blocking``: return once the copies are started; whatever needs the states next waits."""
        if self.context.offloaded is not None:
            self.context.offloaded.reload(non_blocking)

    def zero_grad(self) -> None:
        """Drop the gradients of a window's first micro-batch; keep a window's between its micro-batches
        (as DeepSpeed's engine does); refuse after a later micro-batch's backward (engine_calls.py)."""
        zero_grad_window(self)

    def remove_hooks(self) -> None:
        """Take every hook off (a step in the middle ends aborted); parameters stay partitioned until
        gathered. States moved out by `offload_states` are brought back first, so the shards a later
        engine adopts are in memory. Refused after a backward that completed and stepped the optimizer
        (the step in backward), before `step`: the weights would stay stepped and the step uncounted
        (one that raised part-way is aborted as any step is)."""
        if not self.context.attached:
            return  # removed before: the model may have a new engine now, whose hooks stay
        opt = self.context.optimizer
        if opt is not None and opt.stepped_in_backward():
            self.context.require_between_steps("engine.remove_hooks()")
        if opt is not None and opt.left_half_stepped():
            logger.warning("zero3: engine.remove_hooks() on parameters part-way through a step in backward that was "
                           "aborted in place; a new engine over them trains on from that half step: load the last "
                           "checkpoint first (review 31RD)")
        self.reload_states()
        self.hooks.remove()
        foreign_optimizers.release(self.module)
        self.context.coordinator.persistent_params.unmark()
        self.module.__dict__.pop("_zero3_context", None)

    # -- state of one parameter, for accessors and checkpoints ----------------------------------
    def master_shard(self, p: ZeroParameter) -> torch.Tensor:
        """The tensor the optimizer steps on for ``p`` (this rank's padded 1-D shard, full precision).

        Where masters are separate (bf16/fp16, or the optimizer offloaded while the shards are not) it
        is the fp32 master: a view into its group's flat buffer (zero3/optim/optimizer.py [Note: flat
        master buffers]), or a tensor of its own with ``offload_optimizer="nvme"``; otherwise, and
        for a frozen parameter, the shard. After writing into it, call `refresh_from_masters`.
        """
        in_memory(self, "engine.master_shard(p)", ("lp_params", "hp_params"), [p._zero.train_tensor])
        return p._zero.train_tensor

    def refresh_from_masters(self) -> None:
        """The master shards were written (checkpoint load, accessors): cast them into the parameter
        shards and re-gather the persistent parameters. A collective when persistent params exist."""
        self.context.require_states("engine.refresh_from_masters()", ("lp_params", "hp_params"))
        self.context.refresh_from_masters()

    def optimizer_state(self, p: ZeroParameter) -> dict[str, torch.Tensor]:
        """This rank's optimizer state for ``p`` (e.g. ``exp_avg``), keyed as torch.optim keys it."""
        state = self.context.optimizer_state(p)
        in_memory(self, "engine.optimizer_state(p)", ("optim_states",), state.values())
        return state

    # -- checkpoints (zero3/checkpoint/: save.py, load.py, live_state_dict.py, hf_save.py) ------
    @claiming("engine.save_checkpoint()")
    def save_checkpoint(self, save_dir: Any, tag: str | int | None = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False, **kwargs: Any) -> str:
        """Write a sharded checkpoint (a collective), with the engine's lr scheduler unless another is
        given; DeepSpeed's argument order. See `zero3.checkpoint.save.save_checkpoint`."""
        kwargs.setdefault("lr_scheduler", self.lr_scheduler)
        return save_checkpoint(self.context, save_dir, tag, client_state, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)

    @claiming("engine.load_checkpoint()")
    def load_checkpoint(self, load_dir: Any, tag: str | int | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None, **kwargs: Any) -> tuple[str | None, Any]:
        """Load a checkpoint saved at any world size (a collective); returns ``(path, client_state)``.
        The engine's lr scheduler is restored too unless another is given; DeepSpeed's argument order. See
        `zero3.checkpoint.load.load_checkpoint` (and `end_forward_without_backward`).
        """
        end_forward_without_backward(self, "load_checkpoint")
        kwargs.setdefault("lr_scheduler", self.lr_scheduler)
        return load_checkpoint(self.context, load_dir, tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                               custom_load_fn=custom_load_fn, **kwargs)

    @claiming("engine.consolidated_state_dict()")
    def consolidated_state_dict(self, rank0_only: bool = True, **kwargs: Any) -> dict[str, Any]:
        """The full fp32 state dict, module by module, with the modules' extra state (a collective); see
        `zero3.consolidate`."""
        return consolidated_state_dict(self.context, rank0_only, **kwargs)

    @claiming("engine.save_pretrained()")
    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> Any:
        """A Hugging Face ``save_pretrained`` directory written one tensor at a time (a collective);
        see `zero3.checkpoint.hf_save.save_pretrained`."""
        return save_pretrained(self, save_directory, **kwargs)

    # -- introspection --------------------------------------------------------------------------
    @claiming("engine.memory_report()")
    def memory_report(self) -> dict[str, int]:
        """Bytes of model state this rank holds, against the full (unpartitioned) model's; the keys
        are described at `zero3.runtime.context.RuntimeContext.memory_report`."""
        return self.context.memory_report()

    # -- explain and export (the coordinator's trace and schedule) -------------------------------
    def explain(self, target: Any = None) -> list[str]:
        """Why each parameter was gathered, prefetched, kept or released in the last planned step.

        ``target`` is a parameter, a module, a parameter or module name, ``"budget"`` (what
        ``memory_budget`` chose and why), or None (everything, the budget's choice first).
        Steps that fell back to on-demand fetching (no trace yet, or a divergence) say so.
        """
        return self.coordinator.explain(_explain_target(self, target))

    def export_trace(self, path: str) -> None:
        """Write the last step's trace: ``.json`` (replayable by ``python -m zero3.plan``), ``.graphml``
        or ``.dot`` (the module graph)."""
        self.coordinator.export_trace(path)


def _explain_target(engine: Engine, target: Any) -> tuple[str, Any]:
    """What ``engine.explain(target)`` asks about, as the coordinator names it: a module stands for its
    parameters and its submodules', wherever their decisions were taken (probe 38I: the actions at a
    block's own hooks said nothing of its leaves'), a parameter for itself under any of its names (a
    tied one's second name was "no parameter")."""
    if target is None:
        return ("all", None)
    if isinstance(target, ZeroParameter):
        return ("param", target._zero.id)
    modules = dict(engine.module.named_modules())
    if isinstance(target, str):
        for name, p in engine.module.named_parameters(remove_duplicate=False):
            if name == target and isinstance(p, ZeroParameter):
                return ("param", p._zero.id)
        if target not in modules:
            if target == "budget":
                return ("budget", None)
            raise ZeroConfigError(f"explain(): no parameter or module named {target!r}")
        target = modules[target]
    if isinstance(target, nn.Module):
        if not any(m is target for m in modules.values()):
            raise ZeroConfigError("explain(): that module is not part of this engine's model")
        owned = [*target.parameters(), *(q for m in target.modules() for q in external_parameters(m))]
        return ("params", frozenset(p._zero.id for p in owned if isinstance(p, ZeroParameter)))
    raise ZeroConfigError(f"explain() takes a parameter, module, name or None, got {type(target).__name__}")


def _outside_inference_mode(initialize_fn: Callable[..., Engine]) -> Callable[..., Engine]:
    """``initialize`` under ``torch.inference_mode()`` (an eval-first script) makes its shards and masters
    outside it, so that training afterwards can update them; unless the model's parameters are
    inference tensors themselves (built in it too: an evaluation-only script), which stays in it."""

    @functools.wraps(initialize_fn)
    def wrapper(model: nn.Module | None = None, *args: Any, **kwargs: Any) -> Engine:
        keep = torch.is_inference_mode_enabled() and isinstance(model, nn.Module) and any(
            _is_inference(p) for p in model.parameters())
        with torch.inference_mode(keep):
            return initialize_fn(model, *args, **kwargs)

    return wrapper


def _is_inference(p: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return p.is_inference()


def _announce_idle_without_optimizer(config: ZeroConfig) -> None:
    """Say which of ``config``'s settings act through an optimizer and so do nothing in an engine
    without one (probe 34G: accepted silently; DeepSpeed's inference configs carry them, so INFO)."""
    idle = [f"{name}={value!r}" for name, value, default in (
        ("offload_optimizer", config.offload.offload_optimizer, "none"),
        ("offload_optimizer_step_in_backward", config.offload.offload_optimizer_step_in_backward, False),
        ("gradient_clipping", config.training.gradient_clipping, 0.0),
        ("fp16 loss_scale", config.precision.loss_scale if config.precision.dtype == "fp16" else 0.0, 0.0))
        if value != default]
    if idle:
        logger.info("zero3.initialize without an optimizer: %s act through the optimizer and do nothing in this "
                    "engine, whose step() steps none", ", ".join(idle))


@_outside_inference_mode
def initialize(model: nn.Module | None = None, optimizer: Any = None, config: Any = None, group: Any = None, *,
               model_parameters: Any = None, lr_scheduler: Any = None, mpu: Any = None,
               communicator: Communicator | None = None) -> Engine:
    """Partition ``model`` (if it was not built under `zero3.Init`), hook it, shard ``optimizer``.

    DeepSpeed's keyword names work with their meaning (``zero3.deepspeed.initialize`` also returns
    DeepSpeed's 4-tuple).

    Args:
        model: the model; its parameters are partitioned in place.
        optimizer: a ``torch.optim.Optimizer`` over ``model.parameters()``, a callable taking param
            groups of shards (or, with ``model_parameters``, those parameters) and returning one, or
            None: then the config's ``optimizer`` section builds one, or there is none (inference).
        config: `ZeroConfig`, dict (ours or DeepSpeed's), JSON path or None.
        group: data-parallel process group (default: ``mpu``'s, else the world).
        model_parameters: the parameters (or param-group dicts) the config's optimizer is built over.
        lr_scheduler: a scheduler over ``optimizer``, or a callable taking the optimizer (a class too); or None, for
            the config's ``scheduler`` section. ``engine.step()`` steps it after each optimizer step.
        mpu: a Megatron-style model-parallel unit: its ``get_data_parallel_group()`` is the group
            parameters are partitioned over; its tensor (or model) parallel group is counted in
            gradient clipping and gives checkpoints one set of files per model-parallel rank
            (docs/activation_checkpointing.md).
        communicator: the `Communicator` every collective goes through (default: one over
            ``group``); tests pass a recording or fake one.

    A config with an ``activation_checkpointing`` section configures ``zero3.checkpointing`` with it
    (and ``mpu``) unless ``zero3.checkpointing.configure`` was called before by the user, whose settings then
    stand (an earlier ``initialize``'s section is replaced).

    Raises:
        ZeroStateError: the model was already initialised.
        ZeroConfigError: invalid config (on any rank: every rank raises, naming it), configs that
            differ between ranks (naming each key), an optimizer both given and configured, the model
            built under Init with another group, or ``WORLD_SIZE`` > 1 without a process group and
            without the environment to make one (``MASTER_ADDR``/``MASTER_PORT``).

    With no process group and a launcher's ``WORLD_SIZE`` > 1, the default group is made from the
    environment first (`zero3.init_distributed`).
    """
    if model is None:
        raise ZeroConfigError("zero3.initialize needs model=")
    if not isinstance(model, nn.Module):
        raise TypeError(f"zero3.initialize: model must be a torch.nn.Module, got {type(model).__name__}: {model!r:.80}")
    ensure_default_group("zero3.initialize")
    group = group_of_mesh(group, "zero3.initialize")
    if group is None and mpu is not None:
        group = data_parallel_group(mpu)
    if mpu is not None:  # over every rank, before a collective over its data-parallel group (probe 35A: ranks
        check_mpu(mpu, group)  # with other groups met in the config's agreement and raised ValueError unpacking)
    # A config that is bad on one rank only still takes part in the agreement, so every rank raises:
    # whatever it raised (a reader's bug too), never a peer's closed connection or a timeout (probe 38D F6).
    resolved, error = None, None
    try:
        resolved = resolve_config(config)
        check_swap_directories(PlacementPolicy.from_config(resolved).swap_directories())  # every rank raises then
    except ZeroConfigError as exc:
        error = exc
    except Exception as exc:
        error = ZeroConfigError(f"reading or checking the config raised {type(exc).__name__}: {exc}")
        error.__cause__ = exc
    agree_on_config(group, resolved, error, "zero3.initialize")
    assert resolved is not None
    config = resolved
    if config.training.scheduler is not None and optimizer is None and config.training.optimizer is None:
        raise ZeroConfigError("zero3.initialize got a 'scheduler' section but no optimizer (nor an 'optimizer' "
                              "section): a schedule needs an optimizer to set the lr of")
    if optimizer is None and config.training.optimizer is None:
        _announce_idle_without_optimizer(config)
    engine = Engine(model, optimizer, config, group, communicator, model_parameters, lr_scheduler, mpu)
    foreign_optimizers.install()  # an optimizer over the parameters themselves steps nothing: refused
    route_parametrizations()  # a parametrization registered after it: refused (its module has no hooks)
    route_pruning()  # pruning a partitioned parameter: refused before torch moves it
    route_resize()  # HF's resize_token_embeddings after it: refused before transformers changes anything
    foreign_optimizers.manage(engine.module)  # ... and one over a plain parameter of this model drifts: refused
    if config.activation_checkpointing is not None:
        if checkpointing.configured_by_user():
            logger.info("zero3: activation checkpointing was configured before initialize; its settings stand "
                        "(%s), not the config's section", checkpointing.current_config())
        else:  # an earlier initialize's section is replaced (it was kept, silently: probe 23D)
            checkpointing.configure_for_engine(mpu, config, engine.context.metrics)
    return engine


def _clip_context(target: Any) -> RuntimeContext:
    """The engine `clip_grad_norm_` clips: of an engine or model, or of parameters (torch's habit,
    ``model.parameters()``) that include every trainable parameter of one engine. A part of them
    (a single tensor, a layer's) is refused: the clip is by the norm over all of the engine's."""
    if isinstance(target, (Engine, nn.Module)) or not isinstance(target, (torch.Tensor, Iterable)):
        ctx = context_of(target, "clip_grad_norm_")
        if not ctx.attached:
            raise ZeroStateError("clip_grad_norm_ of an engine whose hooks were removed (engine.remove_hooks()): it "
                                 "no longer reduces gradients; nothing was clipped")
        return ctx
    params = [target] if isinstance(target, torch.Tensor) else list(target)
    ctxs = {id(p._zero.ctx): p._zero.ctx for p in params if isinstance(p, ZeroParameter)}
    ctx = next(iter(ctxs.values())) if len(ctxs) == 1 else None
    if ctx is None or ctx.module is None or not all(isinstance(p, ZeroParameter) for p in params):
        raise ZeroStateError("clip_grad_norm_ got parameters that are not all zero3 parameters of one engine: "
                             "pass the engine or the model given to zero3.initialize")
    if not ctx.attached:
        raise ZeroStateError("clip_grad_norm_ of the parameters of an engine whose hooks were removed "
                             "(engine.remove_hooks()): it no longer reduces gradients; nothing was clipped")
    trainable = {id(p) for p in ctx.params if p.requires_grad}
    given = trainable & {id(p) for p in params}
    if len(given) < len(trainable):
        raise ZeroStateError(
            f"zero3.clip_grad_norm_ clips by the global norm over every gradient of the engine, and got {len(given)} "
            f"of its {len(trainable)} trainable parameters: pass the engine, the model or model.parameters() "
            "(clipping a part of them is not supported); nothing was clipped")
    return ctx


def _check_clip_args(max_norm: Any, norm_type: Any) -> float:
    """``norm_type`` as a float, once both are checked (torch takes either unchecked: a negative
    ``max_norm`` flips every gradient, 0 zeroes them, NaN fills them with NaN)."""
    number = isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)
    if not (number and math.isfinite(max_norm) and max_norm > 0):
        raise ZeroConfigError(f"clip_grad_norm_: max_norm must be a finite number > 0, got {max_norm!r}")
    if norm_type == "inf":
        return math.inf
    if not (isinstance(norm_type, (int, float)) and not isinstance(norm_type, bool) and norm_type > 0):
        raise ZeroConfigError(f"clip_grad_norm_: norm_type must be a number > 0 or inf, got {norm_type!r}")
    return float(norm_type)


def clip_grad_norm_(engine_or_model: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradient shards by the global norm over all ranks; returns that norm.

    Equals ``torch.nn.utils.clip_grad_norm_`` on the full (unpartitioned) model's gradients. The norm
    is computed in fp32 over the gradient shards the optimizer steps with (fp32 master gradients
    under mixed precision); with fp16 the gradients are unscaled first (once per step), so the norm
    and ``max_norm`` are in true gradient units and an overflow shows as an inf/nan norm (the step
    is then skipped). A collective: call it on every rank, after the last backward of an
    accumulation window and before ``engine.step()``.

    Raises:
        ZeroConfigError: ``max_norm`` is not a finite number > 0, or ``norm_type`` not a number > 0
            (``inf`` or ``"inf"`` included): nothing is clipped.
        ZeroStateError: not an engine or initialised model; or called before the last micro-batch
            of a ``gradient_accumulation_steps`` window.
    """
    norm_type = _check_clip_args(max_norm, norm_type)
    ctx = _clip_context(engine_or_model)
    with ctx.claim.held("zero3.clip_grad_norm_"):  # a collective: one call of the engine at a time (review 38R1)
        return _clip(ctx, max_norm, norm_type)


def _clip(ctx: RuntimeContext, max_norm: float, norm_type: float) -> torch.Tensor:
    """`clip_grad_norm_` of the engine of ``ctx``, checked arguments."""
    ctx.require_states("clip_grad_norm_", ("lp_grads",))
    ctx.finish_gradients()
    if not ctx.window_ends():
        raise ZeroStateError(
            f"clip_grad_norm_ called after {ctx.window_position()}: the gradients are not complete yet. Clip "
            "only when engine.is_gradient_accumulation_boundary(), or set gradient_clipping "
            "in the config and let engine.step() clip")
    if ctx.optimizer is not None:
        return ctx.optimizer.clip_grad_norm(max_norm, norm_type)
    grads = ctx.grads_with_kind()
    device = grads[0][0].device if grads else torch.device("cpu")
    return clip_shards(grads, max_norm, norm_type, ctx.comm, device, ctx.model_parallel)
