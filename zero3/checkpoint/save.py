"""Saving a sharded checkpoint: every rank writes what it owns (format.py [Note: checkpoint format]).

A save is atomic. Ranks write into ``SAVE_DIR/.TAG.partial/``: each file under a ``.tmp`` name, then
fsync and rename. Rank 0 then writes metadata.json, which records every file's size and sha256,
records metadata.json's own sha256 in every rank file (integrity.py [Note: metadata checksum]), renames the directory to ``TAG``, and only then replaces ``latest`` (tmp, fsync, rename). A crash or
``kill -9`` at any point leaves the previous ``latest`` checkpoint intact, and the next save removes
the partial directory.

"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .exchange import exchange
from .integrity import STAMP_KEY, UNSTAMPED, metadata_digest, stamp
from .format import FORMAT_NAME, FORMAT_VERSION, LATEST_FILE, METADATA_FILE, MODEL_PARALLEL_FILE, check_tag, \
    model_parallel_dir, rank_file_name, to_json
from .layout import extra_state_modules, is_sharded_state, model_entries, optimizer_groups
from .rng_state import capture_rng_state
from .safetensors import SafetensorsWriter, atomic_write_bytes, dtype_name, fsync_dir
from ..errors import ZeroConfigError

if TYPE_CHECKING:
    from ..runtime.context import RuntimeContext

logger = logging.getLogger(__name__)


def save_checkpoint(ctx: RuntimeContext, save_dir: str | os.PathLike[str], tag: str | int | None = None,
                    client_state: Any = None, *, lr_scheduler: Any = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> str:
    """Write a sharded checkpoint of the engine whose context is ``ctx`` to ``save_dir/tag`` and point ``save_dir/latest`` at it.

    A collective: call it on every rank, between steps. Each rank writes only the real elements it owns
    of the fp32 master weights and optimizer state; see the module [Note: checkpoint format].

    Args:
        ctx: the engine's runtime context (``engine.context``).
        save_dir: directory holding the tags and ``latest`` (shared by all ranks).
        tag: sub-directory name; default ``global_step{ctx.global_steps}``. An existing tag is replaced.
        client_state: anything made of tensors, numbers, strings, bytes, io.BytesIO, lists, tuples and dicts; returned by
            `load_checkpoint`.
        lr_scheduler: a ``torch.optim.lr_scheduler`` whose ``state_dict()`` is saved with it.
        save_latest: point ``save_dir/latest`` at it (DeepSpeed's argument; False leaves ``latest`` as it was).
        exclude_frozen_parameters: DeepSpeed's argument; only False: a zero3 checkpoint holds every
            parameter, so that it loads at any world size into the model it came from.

    Returns:
        The path of the checkpoint directory.

    Raises:
        ValueError: an invalid tag, or ranks passed different tags.
        TypeError: ``client_state``, the scheduler state or a module's extra state (``get_extra_state()``,
            rank 0's is saved) holds an object that cannot be stored.
        OSError: writing failed (on any rank: every rank raises).
    """
    if exclude_frozen_parameters:
        raise ZeroConfigError("save_checkpoint(exclude_frozen_parameters=True) is not supported: a zero3 checkpoint "
                              "holds every parameter (frozen ones are a small part of its bytes: no optimizer state); "
                              "leave it False, or use engine.save_16bit_model(..., exclude_frozen_parameters=True) "
                              "for weights alone")
    tag = check_tag(tag if tag is not None else f"global_step{ctx.global_steps}")
    _warn_mid_window(ctx)
    root = Path(save_dir)
    staging = root / f".{tag}.partial"
    world, rank = ctx.world_size, ctx.rank
    mp = ctx.model_parallel
    leader = rank == 0 and (mp is None or mp.rank == 0)  # prepares and publishes the tag directory
    files_dir = staging / model_parallel_dir(mp.rank) if mp is not None else staging
    shared: dict[str, Any] = {}
    error: BaseException | None = None
    try:  # 1. the leader prepares the staging directory; rank 0 encodes what only it writes
        ctx.require_states("save_checkpoint", ("lp_params", "hp_params", "optim_states"))
        ctx.require_between_steps("save_checkpoint")
        ctx.take_persistent_writes()  # in-place writes to kept-gathered parameters are saved
        if rank == 0:
            shared["client_state"] = to_json(client_state, "client_state")
            sched = lr_scheduler.state_dict() if lr_scheduler is not None else None
            shared["lr_scheduler"] = to_json(sched, "lr_scheduler.state_dict()")
            scaler = ctx.optimizer.scaler if ctx.optimizer is not None else None
            scaler_state = scaler.state_dict() if scaler is not None and hasattr(scaler, "state_dict") else None
            shared["loss_scaler"] = to_json(scaler_state, "loss_scaler.state_dict()")
            shared["extra_state"] = {key: {"after": before, "value": to_json(m.get_extra_state(),
                                                                             f"extra state {key!r}")}
                                     for key, (before, m) in extra_state_modules(ctx.module).items()}
        if leader:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".*.partial"):  # left by an interrupted save
                shutil.rmtree(stale, ignore_errors=True)
            staging.mkdir()
    except Exception as exc:  # noqa: BLE001 - agreed across ranks below
        error = exc
    tags = [t for group_tags in _agree(ctx, tag, error, "save_checkpoint (tag)", leader, staging) for t in group_tags]
    if len(set(tags)) > 1:
        if leader:
            shutil.rmtree(staging, ignore_errors=True)
        raise ValueError(f"save_checkpoint got different tags on different ranks: {tags}; pass the same tag "
                         "(or none) on every rank")

    info: dict[str, Any] = {}
    writer: SafetensorsWriter | None = None
    try:  # 2. every rank writes its own file
        layout, buffers = model_entries(ctx)
        specs: list[tuple[str, torch.dtype, Sequence[int]]] = []
        tensors: list[torch.Tensor] = []
        ranges, states = [], []
        for p in ctx.params:  # the layout first: shapes and dtypes only, nothing is read yet
            start, n, kinds, pieces = _param_pieces(ctx, p)
            ranges.append([start, start + n])
            states.append(kinds)
            specs += [(key, t.dtype, (k,) if k is not None else tuple(t.shape)) for key, t, k in pieces]
        if rank == 0:
            for key, b in buffers.items():
                specs.append((f"buffer/{key}", b.dtype, tuple(b.shape)))
                tensors.append(b)
        fname = rank_file_name(rank, world)
        files_dir.mkdir(exist_ok=True)
        writer = SafetensorsWriter(files_dir / fname, specs, {"format": "pt", "zero3": FORMAT_NAME,
                                                            "rank": str(rank), "world_size": str(world),
                                                            STAMP_KEY: UNSTAMPED})
        for p in ctx.params:  # one parameter's state in memory at a time (read in when it lives on NVMe)
            with ctx.resident([p]):
                for key, t, k in _param_pieces(ctx, p)[3]:
                    writer.write(key, t[:k] if k is not None else t)
        for (key, _, _), t in zip(specs[len(specs) - len(tensors):], tensors):
            writer.write(key, t)
        size, digest = writer.close()
        info = {"file": fname, "rank": rank, "bytes": size, "sha256": digest, "ranges": ranges,
                "rng": to_json(capture_rng_state(), "rng")}
        if rank == 0:
            info["states"] = states
            info["layout"] = layout
            info["buffers"] = {k: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)} for k, b in buffers.items()}
    except Exception as exc:  # noqa: BLE001
        if writer is not None:
            writer.abort()
        error = exc
    infos = _agree(ctx, info, error, "save_checkpoint (rank files)", leader, staging)[mp.rank if mp is not None else 0]

    try:  # 3. rank 0 writes the metadata (of its model-parallel rank's files)
        if rank == 0:
            raw = json.dumps(_build_metadata(ctx, tag, infos, shared), indent=1).encode()
            atomic_write_bytes(files_dir / METADATA_FILE, raw)
            digest = metadata_digest(raw)
            for info in infos:  # [Note: metadata checksum]
                stamp(files_dir / info["file"], digest)
            fsync_dir(files_dir)
    except Exception as exc:  # noqa: BLE001
        error = exc
    if mp is not None:  # every model-parallel rank's metadata is written before the tag is published
        _agree(ctx, None, error, "save_checkpoint (metadata)", leader, staging)
    try:  # 4. the leader publishes the directory, then moves `latest`
        if leader and error is None:
            if mp is not None:
                atomic_write_bytes(staging / MODEL_PARALLEL_FILE, json.dumps(
                    {"format": FORMAT_NAME, "model_parallel_world_size": mp.world_size}).encode())
            fsync_dir(staging)
            _publish(root, staging, tag, save_latest)
    except Exception as exc:  # noqa: BLE001
        error = exc
    _agree(ctx, None, error, "save_checkpoint (publish)", leader, staging)
    logger.info("zero3::checkpoint saved %s (rank %d of %d)", root / tag, rank, world)
    return str(root / tag)


def _agree(ctx: RuntimeContext, payload: Any, error: BaseException | None, what: str, leader: bool,
           staging: Path) -> list[Any]:
    """`exchange`, and when it raises (an error on any rank) the leader removes the staging directory:
    every rank is past its writes then (it stayed until the next save, review 31RB/31RD)."""
    try:
        return exchange(ctx, payload, error, what)
    except BaseException:
        if leader:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _param_pieces(ctx: RuntimeContext, p: Any) -> tuple[int, int, dict[str, Any],
                                                         list[tuple[str, torch.Tensor, int | None]]]:
    """(first owned element, owned count, optimizer-state kinds, what to write) of ``p`` on this
    rank; each piece is (key, tensor, the leading elements of it to write or None for all). Reads
    no data (which may be on NVMe until ``ctx.resident``)."""
    z = p._zero
    start, end = z.shard_range()
    n = max(end - start, 0)
    master = z.train_tensor
    pieces: list[tuple[str, torch.Tensor, int | None]] = [(f"param/{z.name}", master, n)] if n else []
    kinds: dict[str, Any] = {}
    state = ctx.optimizer.shard_state(p) if ctx.optimizer is not None else {}
    for key, v in state.items():
        skey = f"optim/{z.name}/{key}"
        if is_sharded_state(v, master):
            kinds[key] = {"kind": "sharded", "dtype": dtype_name(v.dtype)}
            if n:
                pieces.append((skey, v, n))
        elif isinstance(v, torch.Tensor):
            kinds[key] = {"kind": "replicated", "dtype": dtype_name(v.dtype), "shape": list(v.shape)}
            pieces.append((skey, v, None))
        else:
            kinds[key] = {"kind": "value", "value": to_json(v, f"optimizer state {key!r} of {z.name}")}
    return start, n, kinds, pieces


def _build_metadata(ctx: RuntimeContext, tag: str, infos: list[dict[str, Any]], shared: dict[str, Any]) -> dict[str, Any]:
    first = infos[0]
    aliases: dict[str, list[str]] = {}
    for key, kind, name in first["layout"]:
        if kind == "param" and key != name:
            aliases.setdefault(name, []).append(key)
    params = []
    for i, p in enumerate(ctx.params):
        z = p._zero
        params.append({
            "name": z.name, "shape": list(z.shape), "dtype": dtype_name(z.dtype),
            "master_dtype": dtype_name(p._zero.train_tensor.dtype), "numel": z.numel,
            "aliases": aliases.get(z.name, []), "ranges": [info["ranges"][i] for info in infos],
            "optimizer_state": first["states"][i], "requires_grad": bool(p.requires_grad),
        })
    optimizer = None
    if ctx.optimizer is not None:
        optimizer = {"class": ctx.optimizer.class_name, "param_groups": optimizer_groups(ctx.optimizer),
                     "plain_states": to_json(ctx.optimizer.plain_states(), "the state of a tensor added with "
                                             "optimizer.add_param_group")}
    try:
        from importlib.metadata import version
        zero3_version = version("zero3")
    except Exception:  # noqa: BLE001 - informational only
        zero3_version = "unknown"
    return {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "zero3_version": zero3_version,
        "torch_version": torch.__version__, "tag": tag, "world_size": ctx.world_size,
        "model_parallel": None if ctx.model_parallel is None else
        {"rank": ctx.model_parallel.rank, "world_size": ctx.model_parallel.world_size},
        "global_steps": ctx.global_steps, "micro_steps": ctx.micro_steps, "global_samples": ctx.global_samples,
        "skipped_steps": ctx.optimizer.skipped_steps if ctx.optimizer is not None else 0,
        "config": {k: _json_or_repr(v) for k, v in ctx.config.to_dict().items()},  # informational
        "files": [{"file": info["file"], "rank": info["rank"], "bytes": info["bytes"], "sha256": info["sha256"]}
                  for info in infos],
        "params": params, "buffers": first["buffers"], "state_dict": first["layout"], "optimizer": optimizer,
        "lr_scheduler": shared["lr_scheduler"], "loss_scaler": shared["loss_scaler"],
        "rng": [info["rng"] for info in infos], "client_state": shared["client_state"],
        "extra_state": shared["extra_state"],
    }


def _json_or_repr(value: Any) -> Any:
    try:
        return to_json(value)
    except TypeError:
        return repr(value)


def _warn_mid_window(ctx: RuntimeContext) -> None:
    if ctx.window_backwards and ctx.rank == 0:
        logger.warning("zero3::checkpoint saved after %d backward(s) of an open accumulation window: the gradients "
                       "accumulated so far are not saved, and a run resumed from it starts a new window",
                       ctx.window_backwards)


def _publish(root: Path, staging: Path, tag: str, save_latest: bool) -> None:
    """Move the staged tag into place, then ``latest``. A failure on the way puts back what was there (a
    failed ``latest`` write had left the new tag published, and a tag saved again replaced, while every
    rank raised; review 31RE)."""
    final = root / tag
    old = root / f".{tag}.old"
    had = final.exists()
    if had:
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(staging, final)
        fsync_dir(root)
        if save_latest:
            atomic_write_bytes(root / LATEST_FILE, tag.encode())  # DeepSpeed's form: the tag alone
    except BaseException:
        try:  # best effort: the error raised is the publish's (a load also finds ``.TAG.old``)
            if final.exists() and not staging.exists():
                os.replace(final, staging)  # removed by the caller with the staging directory
            if had and not final.exists():
                os.replace(old, final)
        except OSError:
            pass
        raise
    shutil.rmtree(old, ignore_errors=True)


__all__ = ["save_checkpoint"]
