"""Loading a sharded checkpoint into a live engine, at any world size: each rank reads the element
ranges it now owns (format.py [Note: checkpoint format]).

A load validates everything before it changes a single parameter: the metadata and its format
version; that the names and shapes of the model's parameters and buffers, and the keys of its
modules' extra state (`extra_state_modules`), match; that every file is
present, with its size; that each file's sha256 matches (rank ``r`` hashes files ``r, r + world, ...``
in a streaming pass, so together the ranks read the checkpoint once); and that each needed tensor
is in its file's header. The ranks exchange their errors in one object exchange (checkpoint/exchange.py), so
every rank raises the same error and none hangs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ZeroConfigError, ZeroStateError
from ..partition.param import ZeroParameter
from ..partition.state import ParamStatus
from .exchange import exchange
from .foreign import check_not_foreign, foreign_below, weight_files, weight_files_error
from .format import (LATEST_FILE, METADATA_FILE, MODEL_PARALLEL_FILE, CheckpointError, CheckpointMismatchError,
                     CheckpointNotFoundError, from_json)
from .layout import extra_state_modules, is_sharded_state, model_entries, optimizer_groups
from .reader import CheckpointReader
from .rng_state import restore_rng_state
from .safetensors import parse_dtype

if TYPE_CHECKING:
    from ..optim.optimizer import PartitionedOptimizer
    from ..runtime.context import RuntimeContext

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _LoadPlan:
    load_optimizer: bool
    replicated_file: int
    extra_state: dict[str, tuple[torch.nn.Module, Any]]  # key -> (module, value for its set_extra_state)
    stateless: set[str] = dataclasses.field(default_factory=set)  # in no param group: their saved state is dropped
    needed: dict[int, list[tuple[str, int, torch.dtype]]] = dataclasses.field(default_factory=dict)

    def need(self, j: int, key: str, numel: int, dtype: torch.dtype) -> None:
        self.needed.setdefault(j, []).append((key, numel, dtype))


def _plan_load(ctx: RuntimeContext, reader: CheckpointReader, load_optimizer_states: bool) -> _LoadPlan:
    names = {p._zero.name: p for p in ctx.params}
    problems = []
    missing = [n for n in names if n not in reader.params]
    unexpected = [n for n in reader.params if n not in names]
    if missing:
        problems.append(f"parameters missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        problems.append(f"parameters not in the model: {', '.join(unexpected)}")
    for n, p in names.items():
        if n in reader.params and reader.params[n].shape != tuple(p._zero.shape):
            problems.append(f"{n}: shape {list(reader.params[n].shape)} in the checkpoint, "
                            f"{list(p._zero.shape)} in the model")
    layout, buffers = model_entries(ctx)
    param_keys = {row[0] for row in layout if row[1] == "param"}
    for k, b in buffers.items():
        if k not in reader.buffers:
            problems.append(f"buffer missing from the checkpoint: {k}")
        elif reader.buffers[k][0] != tuple(b.shape):
            problems.append(f"buffer {k}: shape {list(reader.buffers[k][0])} in the checkpoint, {list(b.shape)} "
                            "in the model")
    # (zero3 before 2026-12-03 also wrote each persistent parameter as a buffer: its param/ entry is read)
    extra_buffers = [k for k in reader.buffers if k not in buffers and k not in param_keys]
    if extra_buffers:
        problems.append(f"buffers not in the model: {', '.join(extra_buffers)}")
    saved_extra = reader.meta.get("extra_state")  # none before 2026-12-05: no extra state is loaded
    settable = extra_state_modules(ctx.module, "set_extra_state") if saved_extra is not None else {}
    if saved_extra is not None:
        missing_extra = [k for k in settable if k not in saved_extra]
        unexpected_extra = [k for k in saved_extra if k not in settable]
        if missing_extra:
            problems.append(f"extra state missing from the checkpoint: {', '.join(missing_extra)}")
        if unexpected_extra:
            problems.append("extra state of no module of the model that defines set_extra_state: "
                            + ", ".join(unexpected_extra))
    if problems:
        raise CheckpointMismatchError(f"{reader.metadata_path}: checkpoint of another model: " + "; ".join(problems)
                                      + ". Load it into the model it was saved from, or load matching weights "
                                      "with zero3.pretrained.load_state_dict(..., strict=False)")
    opt_meta = reader.meta.get("optimizer")
    load_opt = load_optimizer_states and ctx.optimizer is not None
    if load_opt:
        if opt_meta is None:
            raise CheckpointMismatchError(f"{reader.metadata_path}: the checkpoint has no optimizer state (it was "
                                          "saved without an optimizer); pass load_optimizer_states=False")
        assert ctx.optimizer is not None
        ours = optimizer_groups(ctx.optimizer)
        if opt_meta["class"] != ctx.optimizer.class_name:
            raise CheckpointMismatchError(
                f"{reader.metadata_path}: optimizer {opt_meta['class']} in the checkpoint, "
                f"{ctx.optimizer.class_name} in the engine; pass load_optimizer_states=False to load weights only")
        theirs = opt_meta["param_groups"]
        frozen = _frozen_either(ctx, reader, theirs, ours)
        if _group_names(theirs, frozen) != _group_names(ours, frozen):
            unrecorded = any(pm.requires_grad is None for pm in reader.params.values())
            raise CheckpointMismatchError(
                f"{reader.metadata_path}: optimizer param groups differ: checkpoint "
                f"{[len(g['params']) for g in theirs]} params per group, engine {[len(g['params']) for g in ours]} "
                f"(first difference: {_first_group_difference(theirs, ours, frozen)}; frozen parameters that "
                f"one run's groups leave out (bf16/fp16, or the optimizer offloaded while the shards are not) are not "
                f"compared{_UNRECORDED if unrecorded else ''})"
                "; build the optimizer's groups as at the save, or pass load_optimizer_states=False to load the "
                "weights alone")
    same_world = reader.world_size == ctx.world_size
    slots = {n for g in ctx.optimizer.group_param_names() for n in g} if load_opt and ctx.optimizer else set()
    plan = _LoadPlan(load_optimizer=load_opt, replicated_file=ctx.rank if same_world else 0,
                     extra_state={k: (m, from_json(saved_extra[k]["value"])) for k, (_, m) in settable.items()},
                     stateless={n for n in names if n not in slots})
    dropped = sorted(n for n in plan.stateless if load_opt and reader.params[n].state)
    if dropped and ctx.rank == 0:
        logger.info("zero3::checkpoint %s: the saved optimizer state of %s is dropped (frozen in this run, so in no "
                    "param group)", reader.path, ", ".join(dropped))
    for n, p in names.items():
        pm = reader.params[n]
        start, end = p._zero.shard_range()
        with_state = load_opt and n not in plan.stateless
        sharded = [k for k, v in pm.state.items() if v["kind"] == "sharded"] if with_state else []
        for j, _, s, e in reader.flat_sources(pm, start, end):
            plan.need(j, f"param/{n}", pm.ranges[j][1] - pm.ranges[j][0], pm.master_dtype)
            for k in sharded:
                plan.need(j, f"optim/{n}/{k}", pm.ranges[j][1] - pm.ranges[j][0], parse_dtype(pm.state[k]["dtype"]))
        if with_state:
            for k, v in pm.state.items():
                if v["kind"] == "replicated":
                    numel = 1
                    for d in v["shape"]:
                        numel *= d
                    plan.need(plan.replicated_file, f"optim/{n}/{k}", numel, parse_dtype(v["dtype"]))
    for k, (shape, dtype) in reader.buffers.items():
        numel = 1
        for d in shape:
            numel *= d
        plan.need(0, f"buffer/{k}", numel, dtype)
    ctx.coordinator.refresh_persistent(gather=False)  # what engine.generation() kept goes (gathered anew after)
    gathered = [p._zero.name for p in ctx.params
                if p._zero.status is not ParamStatus.NOT_AVAILABLE and not p._zero.persistent]
    if gathered:
        raise ZeroStateError(f"load_checkpoint while parameters are gathered ({', '.join(gathered[:5])}); call it "
                             "between steps, outside forward/backward and GatheredParameters (engine.load_checkpoint "
                             "ends a step whose forward's backward did not run)")
    return plan


_UNRECORDED = (", but this checkpoint, saved before 2026-12-06, does not record which were frozen at the save: "
               "under bf16/fp16 a parameter frozen then is in none of its groups")


def _frozen_either(ctx: RuntimeContext, reader: CheckpointReader, theirs: list[dict[str, Any]],
                   ours: list[dict[str, Any]]) -> set[str]:
    """The parameters frozen in this run or at the save that one side's param groups leave out. Where
    masters are separate (bf16/fp16), a parameter frozen at `initialize` is in no param group
    (docs/mixed_precision.md "Frozen parameters"), so a run with another frozen set has other groups
    than the user built; the groups are compared without these (such a parameter has no optimizer
    state to match). Under fp32 a frozen parameter stays in its group on both sides and is compared
    (review 33RC: one moved to another group was taken silently, where torch refuses it)."""
    frozen = {p._zero.name for p in ctx.params if not p.requires_grad}
    frozen |= {n for n, pm in reader.params.items() if pm.requires_grad is False}
    in_theirs = {n for g in theirs for n in g["params"]}
    in_ours = {n for g in ours for n in g["params"]}
    return {n for n in frozen if n not in in_theirs or n not in in_ours}


def _group_names(groups: list[dict[str, Any]], frozen: set[str]) -> list[list[str]]:
    return [[n for n in g["params"] if n not in frozen] for g in groups]


def _first_group_difference(theirs: list[dict[str, Any]], ours: list[dict[str, Any]], frozen: set[str]) -> str:
    for i in range(max(len(theirs), len(ours))):
        a = set(theirs[i]["params"]) - frozen if i < len(theirs) else set()
        b = set(ours[i]["params"]) - frozen if i < len(ours) else set()
        if a != b:
            return f"group {i}: only in the checkpoint {sorted(a - b)[:3]}, only in the engine {sorted(b - a)[:3]}"
    return "parameter order within a group"


def load_checkpoint(ctx: RuntimeContext, load_dir: str | os.PathLike[str], tag: str | int | None = None, *,
                    lr_scheduler: Any = None, load_optimizer_states: bool = True, verify: bool = True,
                    load_module_strict: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, Any]:
    """Load a checkpoint written by `save_checkpoint` at any world size into the engine of ``ctx``.

    A collective. At the saving world size the result is bit-for-bit what was saved; at another, each
    rank reads only the element ranges it now owns (weights and optimizer moments). Everything is
    validated first, on every rank, and nothing changes if anything is wrong.

    Args:
        ctx: the runtime context of the engine to load into (the same model; any world size).
        load_dir: the directory given to `save_checkpoint`.
        tag: which checkpoint; default: the one ``load_dir/latest`` names.
        lr_scheduler: if given, its state is restored from the checkpoint.
        load_optimizer_states: False loads the weights, buffers, extra state, step counters, loss
            scaler and scheduler, not the optimizer state (its groups' lr included) or the RNG states (a warm
            start keeps its own seed).
        verify: check every file's sha256 (one streaming read of the checkpoint, split across ranks);
            sizes are always checked.
        load_module_strict, load_lr_scheduler_states, load_module_only, custom_load_fn: DeepSpeed's.
            ``load_lr_scheduler_states=False`` leaves the scheduler as it is; ``load_module_only``
            loads the weights, buffers and modules' extra state alone (no optimizer or scheduler state,
            counters, loss scaler or RNG). ``load_module_strict`` must stay True (every parameter is
            loaded by name) and ``custom_load_fn`` None: refused otherwise.

    Returns:
        ``(path of the loaded checkpoint, client_state)``; ``client_state`` is ``{}`` when none was
        saved, as DeepSpeed returns it. The accumulation window restarts: the next ``engine.step()``
        that steps is ``gradient_accumulation_steps`` micro-batches away (the saved micro-batch count
        is rounded up to a window's end under this run's accumulation steps).

    Raises:
        CheckpointNotFoundError, CheckpointCorruptError, CheckpointVersionError, CheckpointMismatchError
        (all ``ValueError``), on every rank, naming the file and the problem; CheckpointError for another
        framework's checkpoint, or (without ``tag``) a directory of weight files and no checkpoint.
        ZeroStateError: called while parameters are gathered.
    """
    if load_module_strict is not True or custom_load_fn is not None:
        raise ZeroConfigError(f"load_checkpoint(load_module_strict={load_module_strict!r}, custom_load_fn="
                              f"{custom_load_fn!r}) is not supported: zero3 loads every parameter by name, into the "
                              "model the checkpoint was saved from; for a part of a model load its consolidated "
                              "state dict with zero3.pretrained.load_state_dict(strict=False)")
    if load_module_only:
        load_optimizer_states = False
    if load_module_only or not load_lr_scheduler_states:
        lr_scheduler = None
    if tag is None and _nothing_saved_yet(ctx, load_dir):
        return None, None
    reader: CheckpointReader | None = None
    plan: _LoadPlan | None = None
    error: BaseException | None = None
    scheduler_before: dict | None = None
    mp = ctx.model_parallel
    try:
        ctx.require_states("load_checkpoint", ("lp_params", "hp_params", "optim_states"))
        ctx.require_between_steps("load_checkpoint")
        reader = CheckpointReader(load_dir, tag, None if mp is None else mp.rank)
        if reader.model_parallel_world_size != (1 if mp is None else mp.world_size):
            raise CheckpointMismatchError(
                f"{reader.path}: saved by {reader.model_parallel_world_size} model-parallel ranks, loaded by "
                f"{1 if mp is None else mp.world_size}; zero3 cannot re-split tensor-parallel slices (any "
                "data-parallel size works)")
        plan = _plan_load(ctx, reader, load_optimizer_states)
        reader.check_files(range(ctx.rank, reader.world_size, ctx.world_size) if verify else ())
        for j, keys in plan.needed.items():
            for key, numel, dtype in keys:
                reader.check_entry(j, key, numel, dtype)
        scheduler_before = _load_scheduler(lr_scheduler, reader)
    except Exception as exc:  # noqa: BLE001 - agreed across ranks below
        error = exc
    try:
        exchange(ctx, None, error, "load_checkpoint validation")
    except BaseException:
        if scheduler_before is not None:
            lr_scheduler.load_state_dict(scheduler_before)  # another rank's check failed: as it was
        if reader is not None:
            reader.close()
        raise
    assert reader is not None and plan is not None
    with reader, torch.no_grad():
        _apply(ctx, reader, plan, not load_module_only)
    if load_optimizer_states and ctx.optimizer is not None and ctx.optimizer.backward_step is not None:
        ctx.optimizer.backward_step.recovered()  # a step in backward aborted in place is behind us
    logger.info("zero3::checkpoint loaded %s (saved by %d ranks) on rank %d of %d", reader.path,
                reader.world_size, ctx.rank, ctx.world_size)
    client_state = from_json(reader.meta.get("client_state"))
    return str(reader.path), {} if client_state is None else client_state


def _load_scheduler(lr_scheduler: Any, reader: CheckpointReader) -> dict | None:
    """Load the saved scheduler state first, before anything else changes, and return the state it had
    (None when nothing was loaded). Probe 35F: a scheduler of another kind (a SequentialLR over a saved
    CosineAnnealingLR) raised torch's bare KeyError after the weights, optimizer state and counters were
    written; refused now naming both, with everything as it was."""
    if lr_scheduler is None:
        return None
    if reader.meta.get("lr_scheduler") is None:
        logger.warning("zero3::checkpoint %s holds no scheduler state; the scheduler is unchanged", reader.path)
        return None
    before = lr_scheduler.state_dict()
    try:
        lr_scheduler.load_state_dict(from_json(reader.meta["lr_scheduler"]))
    except Exception as exc:  # noqa: BLE001 - any failure of torch's load: named, nothing else changed
        try:
            lr_scheduler.load_state_dict(before)
        except Exception:  # noqa: BLE001 - the error below is what matters
            pass
        raise CheckpointMismatchError(
            f"{reader.path}: the saved scheduler state does not load into this engine's "
            f"{type(lr_scheduler).__name__} ({type(exc).__name__}: {exc}): it was saved by another kind of "
            "scheduler. Build the scheduler it was saved with, or load with load_lr_scheduler_states=False; "
            "nothing was loaded") from None
    return before


def _apply(ctx: RuntimeContext, reader: CheckpointReader, plan: _LoadPlan, training_state: bool) -> None:
    meta = reader.meta
    on_device = ctx.optimizer.steps_on_device() if plan.load_optimizer and ctx.optimizer is not None else set()
    for p in ctx.params:
        with ctx.resident([p], write=True):  # one parameter at a time; written back when its home is NVMe
            z = p._zero
            pm = reader.params[z.name]
            start, end = z.shard_range()
            n = max(end - start, 0)
            master = p._zero.train_tensor
            master[n:].zero_()
            reader.read_flat(pm, f"param/{z.name}", start, start + n, master[:n])
            if master is not z.shard:
                z.shard.copy_(master)
            if master.grad is not None:
                master.grad = None
            if plan.load_optimizer and z.name not in plan.stateless:
                assert ctx.optimizer is not None
                _load_state(ctx.optimizer, reader, plan, p, start, n, id(master) in on_device)
    _, buffers = model_entries(ctx)
    for k, b in buffers.items():
        reader.read(0, f"buffer/{k}", 0, b)
    for module, value in plan.extra_state.values():
        module.set_extra_state(value)
    for p in ctx.params:
        p._zero.train_tensor.grad = None
    if ctx.optimizer is not None:
        ctx.optimizer.drop_grads()
    ctx.window_backwards = 0
    with torch._C.DisableTorchFunctionSubclass():  # the values changed in place: a backward of a graph built
        torch.autograd.graph.increment_version(list(ctx.params))  # before raises, as torch's after a load does
    ctx.coordinator.refresh_persistent()
    if not training_state:  # load_module_only: the weights alone
        return
    ctx.global_steps = int(meta["global_steps"])
    saved = meta.get("global_samples")  # none before 12-06: counted from the steps at today's batch
    ctx.global_samples = int(saved) if saved is not None else ctx.global_steps * ctx.samples_per_step()
    if meta.get("micro_steps") is not None:  # a window starts at the next micro-batch (DeepSpeed's counts restart)
        n = ctx.config.training.gradient_accumulation_steps
        ctx.micro_steps = -(-int(meta["micro_steps"]) // n) * n
    ctx.window_micro = 0
    if ctx.optimizer is not None and meta.get("skipped_steps") is not None:  # none before 12-05
        ctx.optimizer.skipped_steps = int(meta["skipped_steps"])  # a count, as global_steps (DeepSpeed keeps it)
    if plan.load_optimizer:
        assert ctx.optimizer is not None
        ctx.optimizer.load_group_hyperparameters(
            [{k: from_json(v) for k, v in saved.items() if k != "params"} for saved in meta["optimizer"]["param_groups"]])
        ctx.optimizer.load_plain_states(from_json(meta["optimizer"].get("plain_states", [])))  # none before 12-05
    scaler = ctx.optimizer.scaler if ctx.optimizer is not None else None
    if scaler is not None and hasattr(scaler, "load_state_dict") and meta.get("loss_scaler") is not None:
        scaler.load_state_dict(from_json(meta["loss_scaler"]))
    if not plan.load_optimizer:
        logger.info("zero3::checkpoint loaded without its optimizer state: RNG states are not restored")
    elif reader.world_size == ctx.world_size:
        restore_rng_state(from_json(meta["rng"][ctx.rank]))
    else:
        logger.info("zero3::checkpoint saved by %d ranks, loaded on %d: RNG states are not restored",
                    reader.world_size, ctx.world_size)


def _nothing_saved_yet(ctx: RuntimeContext, load_dir: str | os.PathLike[str]) -> bool:
    """No checkpoint at all in ``load_dir`` (no ``latest``, no saved tag; or no such directory) on every
    rank: the first launch of an auto-resume script (``path, state = engine.load_checkpoint(dir)``
    before any save). DeepSpeed logs it and returns ``(None, None)``; so does zero3, after the ranks
    agree (one small exchange). Saved tags without ``latest`` still raise (the reader names those it
    finds): DeepSpeed would start from scratch beside them. Ranks that see different files raise
    together; a path that is not a directory is left to the reader's error. A directory holding another
    framework's checkpoint (torch DCP, DeepSpeed), or weight files and no checkpoint (``model.safetensors``,
    ``*.pt``: `weight_files`), raises on every rank, naming them (foreign.py)."""
    root = os.fspath(load_dir)
    missing, error = False, None
    try:
        check_not_foreign(root, None)
    except CheckpointError as exc:
        error = exc
    try:  # a save interrupted before it published (``.TAG.partial``) saved nothing; ``.TAG.old`` may be recovered
        missing = not os.path.exists(root) or os.path.isdir(root) and not os.path.isfile(
            os.path.join(root, LATEST_FILE)) and not any(
            os.path.isfile(os.path.join(root, d, f)) for d in os.listdir(root) if not d.endswith(".partial")
            for f in (METADATA_FILE, MODEL_PARALLEL_FILE))
        weights = weight_files(root) if missing else []
        if weights:  # a directory of weights is not "no checkpoint yet" (probe 38C: an auto-resume trained anew)
            missing, error = False, error or weight_files_error(root, weights)
    except OSError as exc:  # agreed below: a rank that cannot read the directory fails every rank
        error = error or exc
    seen = [m for items in exchange(ctx, missing, error, "load_checkpoint: latest") for m in items]
    if all(seen):
        logger.warning("zero3::checkpoint %s holds no checkpoint yet (no %s file, no saved tag)%s; nothing was "
                       "loaded, and load_checkpoint returns (None, None) as DeepSpeed's does", load_dir, LATEST_FILE,
                       foreign_below(root))
        return True
    if any(seen):
        raise CheckpointNotFoundError(f"{os.path.join(root, LATEST_FILE)}: no checkpoint there on {sum(seen)} of "
                                      f"{len(seen)} ranks, one on the others (a directory not shared by every node?); "
                                      "nothing was loaded")
    return False


def _load_state(optimizer: PartitionedOptimizer, reader: CheckpointReader, plan: _LoadPlan, p: ZeroParameter,
                start: int, n: int, on_device: bool) -> None:
    """Read ``p``'s optimizer state from the checkpoint into the tensors it has (when their shapes
    fit) or new ones, and make that its whole state. ``on_device``: its group keeps the 0-d state on
    the parameter's device (`PartitionedOptimizer.steps_on_device`)."""
    master = p._zero.train_tensor
    pm = reader.params[p._zero.name]
    old = optimizer.shard_state(p)
    new: dict[str, Any] = {}
    for key, info in pm.state.items():
        skey = f"optim/{pm.name}/{key}"
        if info["kind"] == "value":
            new[key] = from_json(info["value"])
            continue
        dtype = parse_dtype(info["dtype"])
        cur = old.get(key)
        if info["kind"] == "sharded":  # into the engine's own state (its dtype; on NVMe, its swap region's size);
            # new: floating state in the master's dtype, as torch's load_state_dict casts it (saved under another
            # precision config, the saved dtype would not fit the masters the step updates)
            fresh = master.dtype if dtype.is_floating_point else dtype
            t = cur if is_sharded_state(cur, master) else torch.zeros(master.numel(), dtype=fresh, device=master.device)
            t[n:].zero_()
            reader.read_flat(pm, skey, start, start + n, t[:n])
        else:
            shape = tuple(info["shape"])
            if isinstance(cur, torch.Tensor) and tuple(cur.shape) == shape:
                t = cur
            else:
                t = torch.empty(shape, dtype=dtype, device=master.device if on_device or shape else "cpu")
            reader.read(plan.replicated_file, skey, 0, t)
        new[key] = t
    optimizer.load_shard_state(p, new)


__all__ = ["load_checkpoint"]
