"""Sharded checkpoints: every rank saves what it owns; any world size loads them.

[Note: checkpoint format]
A checkpoint is a directory ``SAVE_DIR/TAG/``, and ``SAVE_DIR/latest`` names the newest tag:

    metadata.json                           format version, world size, step, config, optimizer
                                            groups, scheduler, RNG, client state, and for every
                                            parameter the flat range [start, end) each file holds
    rank_00000-of-00002.safetensors         what rank 0 owns
    rank_00001-of-00002.safetensors         what rank 1 owns

The rank files are plain safetensors files (``safetensors.safe_open`` reads them). This module writes
and reads them itself, so the package is not required. For a parameter ``name``, rank r's file holds
only the *real* (unpadded) flat range that r owns (`sharding.shard_range`):
- ``param/name``: that range of the full-precision master weights (``ctx.master_shard``);
- ``optim/name/key``: the same range of every per-element optimizer state (Adam's moments);
- ``optim/name/key`` whole, in every file, for state that is not per-element (Adam's 0-d ``step``);
- ``buffer/name``: module buffers, in rank 0's file only.
Empty ranges are not stored. A reader at any world size computes, from the ranges in the metadata,
which element ranges of which files make up its new shard, and reads only those bytes.

With model parallelism (an engine given an ``mpu`` whose model-parallel group has m > 1 ranks, see
model_parallel.py) each model-parallel rank's data-parallel group writes the layout above into a
sub-directory of its own, and the tag directory says how many there are:

    model_parallel.json                     {"format", "model_parallel_world_size": m}
    mp_rank_00/metadata.json, rank_*.safetensors
    mp_rank_01/...

Each sub-directory is a complete checkpoint of that rank's tensor-parallel slices, loadable at any
data-parallel size; the model-parallel size must stay the same (zero3 cannot re-split a slice).

A save is atomic. Ranks write into ``SAVE_DIR/.TAG.partial/``: each file under a ``.tmp`` name, then
fsync and rename. Rank 0 then writes metadata.json, which records every file's size and sha256,
renames the directory to ``TAG``, and only then replaces ``latest`` (tmp, fsync, rename). A crash or
``kill -9`` at any point leaves the previous ``latest`` checkpoint intact, and the next save removes
the partial directory.

A load validates everything before it changes a single parameter: the metadata and its format
version; that the names and shapes of the model's parameters and buffers match; that every file is
present, with its size; that each file's sha256 matches (rank ``r`` hashes files ``r, r + world, ...``
in a streaming pass, so together the ranks read the checkpoint once); and that each needed tensor
is in its file's header. The ranks exchange their errors with one ``all_gather_object``, so every
rank raises the same error and none hangs.
"""

from __future__ import annotations

import base64
import builtins
import dataclasses
import json
import logging
import os
import random
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..partition.views import byte_view
from .safetensors import (
    SafetensorsHeader,
    SafetensorsWriter,
    atomic_write_bytes,
    dtype_name,
    fsync_dir,
    parse_dtype,
    read_safetensors_header,
    read_tensor_range,
    sha256_file,
)
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    ZeroDivergenceError,
    ZeroStateError,
)
from ..activation.checkpointing import get_cuda_rng_tracker
from ..comm.communicator import Kind, Tag
from ..runtime.context import RuntimeContext
from ..partition.param import ZeroParameter
from ..partition.state import ParamStatus

logger = logging.getLogger(__name__)

FORMAT_NAME = "zero3-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
MODEL_PARALLEL_FILE = "model_parallel.json"
LATEST_FILE = "latest"


def model_parallel_dir(rank: int) -> str:
    """The sub-directory of a tag that holds model-parallel rank ``rank``'s files."""
    return f"mp_rank_{rank:02d}"


def exchange(ctx: RuntimeContext, payload: Any, error: BaseException | None, what: str) -> list[list[Any]]:
    """All-gather ``payload`` over every rank of the run; every rank raises if any rank had an ``error``
    (see `Communicator.agree_on_errors`).

    Returns one list per model-parallel rank, each holding that rank's data-parallel group's payloads
    in data-parallel rank order (one list without model parallelism). The exchange runs over the
    data-parallel group, then over the model-parallel group carrying those lists, so every rank ends
    with every rank's payload and error and all of them decide alike.
    """
    mp = ctx.model_parallel
    try:
        items = ctx.comm.agree_on_errors(payload, error, Tag(Kind.OBJECTS, what))
    except Exception as exc:  # noqa: BLE001 - the model-parallel peers must learn of it too
        if mp is None:
            raise
        items, error = [], exc
    if mp is None:
        return [items]
    return mp.comm.agree_on_errors(items, error, Tag(Kind.OBJECTS, what + " (model-parallel)"))


def _torch_optimizer(ctx: RuntimeContext) -> torch.optim.Optimizer:
    assert ctx.optimizer is not None
    return ctx.optimizer.optimizer


# -- JSON for small state (hyperparameters, scheduler, client state, RNG) --------------------------
_MARKERS = ("__tensor__", "__tuple__", "__items__", "__dtype__")


def to_json(obj: Any, where: str = "value") -> Any:
    """Encode tensors, tuples, dtypes and non-string-keyed dicts so `from_json` restores them."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        return {"__tensor__": {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                               "data": base64.b64encode(bytes(byte_view(t.reshape(-1)))).decode()}}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": dtype_name(obj)}
    if isinstance(obj, tuple):
        return {"__tuple__": [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in _MARKERS for k in obj):
            return {k: to_json(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {"__items__": [[to_json(k, where), to_json(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(f"{where}: cannot store a {type(obj).__name__} in a checkpoint; use tensors, numbers, "
                    "strings, None, lists, tuples and dicts")


def from_json(obj: Any) -> Any:
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (key, value), = obj.items()
        if key == "__tensor__":
            dtype = parse_dtype(value["dtype"])
            out = torch.empty(value["shape"], dtype=dtype)
            byte_view(out.reshape(-1))[:] = base64.b64decode(value["data"])
            return out
        if key == "__tuple__":
            return tuple(from_json(v) for v in value)
        if key == "__items__":
            return {_hashable(from_json(k)): from_json(v) for k, v in value}
        if key == "__dtype__":
            return parse_dtype(value)
    return {k: from_json(v) for k, v in obj.items()}


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "rng_tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "rng_tracker" in state:
        get_cuda_rng_tracker().set_states(state["rng_tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


# -- the model's state, as the checkpoint sees it ---------------------------------------------------
def _check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not tag or tag in (".", "..") or tag.startswith(".") or "/" in tag \
            or os.sep in tag or tag == LATEST_FILE:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name, not starting with '.' "
                         f"and not {LATEST_FILE!r}")
    return tag


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank_{rank:05d}-of-{world_size:05d}.safetensors"


def _model_entries(ctx: RuntimeContext) -> tuple[list[list[str]], dict[str, torch.Tensor]]:
    """(state_dict layout, buffers): layout rows are [key, "param", canonical name] or [key, "buffer", key]."""
    canonical = {id(p): p._zero.name for p in ctx.params}
    layout: list[list[str]] = []
    buffers: dict[str, torch.Tensor] = {}
    for key, value in ctx.module.state_dict(keep_vars=True).items():
        if isinstance(value, ZeroParameter) and id(value) in canonical:
            layout.append([key, "param", canonical[id(value)]])
        elif isinstance(value, torch.Tensor):
            layout.append([key, "buffer", key])
            buffers[key] = value.detach()
    return layout, buffers


def _is_sharded_state(v: Any, master: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == master.numel()


def _optimizer_groups(ctx: RuntimeContext) -> list[dict[str, Any]]:
    """Each param group's hyperparameters, with the names of its parameters instead of tensors."""
    assert ctx.optimizer is not None
    names = {id(p._zero.train_tensor): p._zero.name for p in ctx.params}
    groups = []
    for i, g in enumerate(_torch_optimizer(ctx).param_groups):
        hyper = {k: to_json(v, f"optimizer.param_groups[{i}][{k!r}]") for k, v in g.items() if k != "params"}
        hyper["params"] = [names.get(id(t), f"<unnamed {tuple(t.shape)}>") for t in g["params"]]
        groups.append(hyper)
    return groups


# -- save ---------------------------------------------------------------------------------------------
def save_checkpoint(ctx: RuntimeContext, save_dir: str | os.PathLike[str], tag: str | None = None,
                    client_state: Any = None, *, lr_scheduler: Any = None) -> str:
    """Write a sharded checkpoint of the engine whose context is ``ctx`` to ``save_dir/tag`` and point ``save_dir/latest`` at it.

    A collective: call it on every rank, between steps. Each rank writes only the real elements it owns
    of the fp32 master weights and optimizer state; see the module [Note: checkpoint format].

    Args:
        ctx: the engine's runtime context (``engine.context``).
        save_dir: directory holding the tags and ``latest`` (shared by all ranks).
        tag: sub-directory name; default ``global_step{ctx.global_steps}``. An existing tag is replaced.
        client_state: anything made of tensors, numbers, strings, lists, tuples and dicts; returned by
            `load_checkpoint`.
        lr_scheduler: a ``torch.optim.lr_scheduler`` whose ``state_dict()`` is saved with it.

    Returns:
        The path of the checkpoint directory.

    Raises:
        ValueError: an invalid tag, or ranks passed different tags.
        TypeError: ``client_state`` or the scheduler state holds an object that cannot be stored.
        OSError: writing failed (on any rank: every rank raises).
    """
    tag = _check_tag(tag if tag is not None else f"global_step{ctx.global_steps}")
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
        if rank == 0:
            shared["client_state"] = to_json(client_state, "client_state")
            sched = lr_scheduler.state_dict() if lr_scheduler is not None else None
            shared["lr_scheduler"] = to_json(sched, "lr_scheduler.state_dict()")
            scaler = ctx.optimizer.scaler if ctx.optimizer is not None else None
            scaler_state = scaler.state_dict() if scaler is not None and hasattr(scaler, "state_dict") else None
            shared["loss_scaler"] = to_json(scaler_state, "loss_scaler.state_dict()")
        if leader:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".*.partial"):  # left by an interrupted save
                shutil.rmtree(stale, ignore_errors=True)
            staging.mkdir()
    except Exception as exc:  # noqa: BLE001 - agreed across ranks below
        error = exc
    tags = [t for group_tags in exchange(ctx, tag, error, "save_checkpoint (tag)") for t in group_tags]
    if len(set(tags)) > 1:
        raise ValueError(f"save_checkpoint got different tags on different ranks: {tags}; pass the same tag "
                         "(or none) on every rank")

    info: dict[str, Any] = {}
    writer: SafetensorsWriter | None = None
    try:  # 2. every rank writes its own file
        layout, buffers = _model_entries(ctx)
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
                                                            "rank": str(rank), "world_size": str(world)})
        for p in ctx.params:  # one parameter's state in memory at a time (read in when it lives on NVMe)
            with ctx.resident([p]):
                for key, t, k in _param_pieces(ctx, p)[3]:
                    writer.write(key, t[:k] if k is not None else t)
        for (key, _, _), t in zip(specs[len(specs) - len(tensors):], tensors):
            writer.write(key, t)
        size, digest = writer.close()
        info = {"file": fname, "rank": rank, "bytes": size, "sha256": digest, "ranges": ranges,
                "rng": to_json(_rng_state(), "rng")}
        if rank == 0:
            info["states"] = states
            info["layout"] = layout
            info["buffers"] = {k: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)} for k, b in buffers.items()}
    except Exception as exc:  # noqa: BLE001
        if writer is not None:
            writer.abort()
        error = exc
    infos = exchange(ctx, info, error, "save_checkpoint (rank files)")[mp.rank if mp is not None else 0]

    try:  # 3. rank 0 writes the metadata (of its model-parallel rank's files)
        if rank == 0:
            meta = _build_metadata(ctx, tag, infos, shared)
            atomic_write_bytes(files_dir / METADATA_FILE, json.dumps(meta, indent=1).encode())
            fsync_dir(files_dir)
    except Exception as exc:  # noqa: BLE001
        error = exc
    if mp is not None:  # every model-parallel rank's metadata is written before the tag is published
        exchange(ctx, None, error, "save_checkpoint (metadata)")
    try:  # 4. the leader publishes the directory, then moves `latest`
        if leader and error is None:
            if mp is not None:
                atomic_write_bytes(staging / MODEL_PARALLEL_FILE, json.dumps(
                    {"format": FORMAT_NAME, "model_parallel_world_size": mp.world_size}).encode())
            fsync_dir(staging)
            _publish(root, staging, tag)
    except Exception as exc:  # noqa: BLE001
        error = exc
    exchange(ctx, None, error, "save_checkpoint (publish)")
    logger.info("zero3::checkpoint saved %s (rank %d of %d)", root / tag, rank, world)
    return str(root / tag)


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
    for key, v in ctx.optimizer_state(p).items():
        skey = f"optim/{z.name}/{key}"
        if _is_sharded_state(v, master):
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
            "optimizer_state": first["states"][i],
        })
    optimizer = None
    if ctx.optimizer is not None:
        optimizer = {"class": type(_torch_optimizer(ctx)).__name__, "param_groups": _optimizer_groups(ctx)}
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
        "global_steps": ctx.global_steps, "micro_steps": ctx.micro_steps,
        "config": {k: _json_or_repr(v) for k, v in ctx.config.to_dict().items()},  # informational
        "files": [{"file": info["file"], "rank": info["rank"], "bytes": info["bytes"], "sha256": info["sha256"]}
                  for info in infos],
        "params": params, "buffers": first["buffers"], "state_dict": first["layout"], "optimizer": optimizer,
        "lr_scheduler": shared["lr_scheduler"], "loss_scaler": shared["loss_scaler"],
        "rng": [info["rng"] for info in infos], "client_state": shared["client_state"],
    }


def _json_or_repr(value: Any) -> Any:
    try:
        return to_json(value)
    except TypeError:
        return repr(value)


def _publish(root: Path, staging: Path, tag: str) -> None:
    final = root / tag
    old = root / f".{tag}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(root)
    atomic_write_bytes(root / LATEST_FILE, (tag + "\n").encode())
    shutil.rmtree(old, ignore_errors=True)


# -- reading ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ParamMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    master_dtype: torch.dtype
    numel: int
    aliases: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]  # per file
    state: dict[str, dict[str, Any]]


class CheckpointReader:
    """One checkpoint tag: its metadata, and reads of any element range of any saved tensor.

    Opening it reads and checks only the metadata; `check_files` checks the rank files. Reads open each
    file once and read just the requested bytes. A checkpoint saved with model parallelism holds one
    such set per model-parallel rank: ``model_parallel_rank`` says which one to read.

    Raises:
        CheckpointNotFoundError / CheckpointCorruptError / CheckpointVersionError: see the messages.
        CheckpointMismatchError: ``model_parallel_rank`` is missing for a model-parallel checkpoint, out
            of its range, or given for a checkpoint saved without model parallelism.
    """

    def __init__(self, ckpt_dir: str | os.PathLike[str], tag: str | None = None,
                 model_parallel_rank: int | None = None) -> None:
        self.root = Path(ckpt_dir)
        if not self.root.is_dir():
            raise CheckpointNotFoundError(f"{self.root}: checkpoint directory does not exist")
        if tag is None:
            latest = self.root / LATEST_FILE
            if not latest.is_file():
                tags = sorted(d.name for d in self.root.iterdir() if (d / METADATA_FILE).is_file())
                raise CheckpointNotFoundError(f"{latest}: missing, so the newest checkpoint is unknown; pass tag= "
                                              f"(tags with metadata here: {tags or 'none'})")
            tag = latest.read_text().strip()
        self.tag = tag
        self.path = self.root / tag
        old = self.root / f".{tag}.old"
        if not self.path.is_dir() and ((old / METADATA_FILE).is_file() or (old / MODEL_PARALLEL_FILE).is_file()):
            logger.warning("zero3::checkpoint %s is missing; using %s (a save of the same tag was interrupted)",
                           self.path, old)
            self.path = old
        self.model_parallel_world_size = self._model_parallel(model_parallel_rank)
        if self.model_parallel_world_size > 1:
            assert model_parallel_rank is not None
            self.path = self.path / model_parallel_dir(model_parallel_rank)
        self.metadata_path = self.path / METADATA_FILE
        if not self.metadata_path.is_file():
            raise CheckpointNotFoundError(f"{self.metadata_path}: missing (no checkpoint {tag!r} in {self.root})")
        try:
            meta = json.loads(self.metadata_path.read_bytes())
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(f"{self.metadata_path}: not valid JSON ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
            raise CheckpointCorruptError(f"{self.metadata_path}: not zero3 checkpoint metadata "
                                         f"(format {meta.get('format') if isinstance(meta, dict) else None!r})")
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointVersionError(
                f"{self.metadata_path}: checkpoint format version {version!r} is not supported; this zero3 reads "
                f"version {FORMAT_VERSION}. Use the zero3 release that wrote it (or a newer one) to consolidate it")
        try:
            self.meta = meta
            self.world_size = int(meta["world_size"])
            self.files = [self.path / f["file"] for f in meta["files"]]
            self.params = {pm["name"]: ParamMeta(
                name=pm["name"], shape=tuple(pm["shape"]), dtype=parse_dtype(pm["dtype"]),
                master_dtype=parse_dtype(pm["master_dtype"]), numel=int(pm["numel"]),
                aliases=tuple(pm["aliases"]), ranges=tuple((int(a), int(b)) for a, b in pm["ranges"]),
                state=dict(pm["optimizer_state"])) for pm in meta["params"]}
            self.buffers = {k: (tuple(v["shape"]), parse_dtype(v["dtype"])) for k, v in meta["buffers"].items()}
            self.layout = [tuple(row) for row in meta["state_dict"]]
            for pm in self.params.values():
                if len(pm.ranges) != len(self.files):
                    raise ValueError(f"{pm.name} has {len(pm.ranges)} ranges for {len(self.files)} files")
                covered = sum(b - a for a, b in pm.ranges)
                if covered != pm.numel:
                    raise ValueError(f"the ranges of {pm.name} cover {covered} of {pm.numel} elements")
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{self.metadata_path}: malformed metadata ({exc!r})") from None
        if len(self.files) != self.world_size:
            raise CheckpointCorruptError(f"{self.metadata_path}: lists {len(self.files)} files for world size "
                                         f"{self.world_size}")
        self._headers: dict[int, SafetensorsHeader] = {}
        self._handles: dict[int, BinaryIO] = {}

    def _model_parallel(self, rank: int | None) -> int:
        """The model-parallel size the checkpoint was saved with (1: without), checked against ``rank``."""
        path = self.path / MODEL_PARALLEL_FILE
        if not path.is_file():
            if rank is not None:
                raise CheckpointMismatchError(
                    f"{self.path}: saved without model parallelism (no {MODEL_PARALLEL_FILE}), but model-parallel "
                    f"rank {rank} was asked for; load it into an engine without an mpu (or a model-parallel group "
                    "of one rank)")
            return 1
        try:
            world = int(json.loads(path.read_bytes())["model_parallel_world_size"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CheckpointCorruptError(f"{path}: malformed ({exc!r})") from None
        if rank is None:
            raise CheckpointMismatchError(
                f"{self.path}: saved by {world} model-parallel ranks, one directory each; load it with an mpu of "
                f"model-parallel size {world}, or pass model_parallel_rank= (python -m zero3.consolidate "
                "--model-parallel-rank R) to read one rank's slices")
        if not 0 <= rank < world:
            raise CheckpointMismatchError(f"{self.path}: saved by {world} model-parallel ranks; model-parallel rank "
                                          f"{rank} is not one of them")
        return world

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles.clear()

    def check_files(self, hash_files: Iterable[int] = ()) -> None:
        """Every rank file exists with the recorded size; files in ``hash_files`` also match their sha256."""
        for f, path in zip(self.meta["files"], self.files):
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise CheckpointNotFoundError(
                    f"{path}: rank file missing (checkpoint {self.tag!r} was saved by {self.world_size} ranks; "
                    "copy every rank_*.safetensors file with metadata.json)") from None
            if size != f["bytes"]:
                raise CheckpointCorruptError(f"{path}: {size} bytes, but the metadata records {f['bytes']} "
                                             "(truncated or overwritten)")
        for j in hash_files:
            expected = self.meta["files"][j]["sha256"]
            digest = sha256_file(self.files[j])
            if digest != expected:
                raise CheckpointCorruptError(f"{self.files[j]}: sha256 {digest[:16]}... does not match the metadata "
                                             f"({expected[:16]}...): the file is corrupted")

    def header(self, j: int) -> SafetensorsHeader:
        if j not in self._headers:
            self._headers[j] = read_safetensors_header(self.files[j])
        return self._headers[j]

    def check_entry(self, j: int, key: str, numel: int, dtype: torch.dtype) -> None:
        entry = self.header(j).entries.get(key)
        if entry is None or entry.numel != numel or entry.dtype != dtype:
            found = "missing" if entry is None else f"{entry.numel} x {dtype_name(entry.dtype)}"
            raise CheckpointCorruptError(f"{self.files[j]}: tensor {key!r} should hold {numel} x {dtype_name(dtype)} "
                                         f"elements, found {found}: the file does not belong to this metadata")

    def read(self, j: int, key: str, elem_offset: int, dest: torch.Tensor) -> None:
        fh = self._handles.get(j)
        if fh is None:
            fh = self._handles[j] = open(self.files[j], "rb", buffering=0)  # noqa: SIM115 - closed in close()
        read_tensor_range(fh, self.header(j), key, elem_offset, dest)

    def flat_sources(self, pm: ParamMeta, lo: int, hi: int) -> Iterator[tuple[int, int, int, int]]:
        """(file, offset in that file's piece, start, end) for each piece of global range [lo, hi)."""
        for j, (a, b) in enumerate(pm.ranges):
            s, e = max(lo, a), min(hi, b)
            if s < e:
                yield j, s - a, s, e

    def read_flat(self, pm: ParamMeta, key: str, lo: int, hi: int, dest: torch.Tensor) -> None:
        """Read global elements [lo, hi) of ``key`` (``param/..`` or a sharded ``optim/..``) into ``dest``."""
        for j, off, s, e in self.flat_sources(pm, lo, hi):
            self.read(j, key, off, dest[s - lo: e - lo])


# -- load ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _LoadPlan:
    load_optimizer: bool
    replicated_file: int
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
    _, buffers = _model_entries(ctx)
    for k, b in buffers.items():
        if k not in reader.buffers:
            problems.append(f"buffer missing from the checkpoint: {k}")
        elif reader.buffers[k][0] != tuple(b.shape):
            problems.append(f"buffer {k}: shape {list(reader.buffers[k][0])} in the checkpoint, {list(b.shape)} "
                            "in the model")
    extra_buffers = [k for k in reader.buffers if k not in buffers]
    if extra_buffers:
        problems.append(f"buffers not in the model: {', '.join(extra_buffers)}")
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
        ours = _optimizer_groups(ctx)
        if opt_meta["class"] != type(_torch_optimizer(ctx)).__name__:
            raise CheckpointMismatchError(
                f"{reader.metadata_path}: optimizer {opt_meta['class']} in the checkpoint, "
                f"{type(_torch_optimizer(ctx)).__name__} in the engine; pass load_optimizer_states=False to load weights only")
        theirs = opt_meta["param_groups"]
        if [g["params"] for g in theirs] != [g["params"] for g in ours]:
            raise CheckpointMismatchError(
                f"{reader.metadata_path}: optimizer param groups differ: checkpoint "
                f"{[len(g['params']) for g in theirs]} params per group, engine {[len(g['params']) for g in ours]} "
                f"(first difference: {_first_group_difference(theirs, ours)})")
    same_world = reader.world_size == ctx.world_size
    plan = _LoadPlan(load_optimizer=load_opt, replicated_file=ctx.rank if same_world else 0)
    for n, p in names.items():
        pm = reader.params[n]
        start, end = p._zero.shard_range()
        sharded = [k for k, v in pm.state.items() if v["kind"] == "sharded"] if load_opt else []
        for j, _, s, e in reader.flat_sources(pm, start, end):
            plan.need(j, f"param/{n}", pm.ranges[j][1] - pm.ranges[j][0], pm.master_dtype)
            for k in sharded:
                plan.need(j, f"optim/{n}/{k}", pm.ranges[j][1] - pm.ranges[j][0], parse_dtype(pm.state[k]["dtype"]))
        if load_opt:
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
    gathered = [p._zero.name for p in ctx.params
                if p._zero.status is not ParamStatus.NOT_AVAILABLE and not p._zero.persistent]
    if gathered:
        raise ZeroStateError(f"load_checkpoint while parameters are gathered ({', '.join(gathered[:5])}); call it "
                             "between steps, outside forward/backward and GatheredParameters")
    return plan


def _first_group_difference(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> str:
    for i in range(max(len(theirs), len(ours))):
        a = set(theirs[i]["params"]) if i < len(theirs) else set()
        b = set(ours[i]["params"]) if i < len(ours) else set()
        if a != b:
            return (f"group {i}: only in the checkpoint {sorted(a - b)[:3]}, only in the engine {sorted(b - a)[:3]}")
    return "parameter order within a group"


def load_checkpoint(ctx: RuntimeContext, load_dir: str | os.PathLike[str], tag: str | None = None, *,
                    lr_scheduler: Any = None, load_optimizer_states: bool = True,
                    verify: bool = True) -> tuple[str, Any]:
    """Load a checkpoint written by `save_checkpoint` at any world size into the engine of ``ctx``.

    A collective. At the saving world size the result is bit-for-bit what was saved; at another, each
    rank reads only the element ranges it now owns (weights and optimizer moments). Everything is
    validated first, on every rank, and nothing changes if anything is wrong.

    Args:
        ctx: the runtime context of the engine to load into (the same model; any world size).
        load_dir: the directory given to `save_checkpoint`.
        tag: which checkpoint; default: the one ``load_dir/latest`` names.
        lr_scheduler: if given, its state is restored from the checkpoint.
        load_optimizer_states: False loads only the weights (and buffers, step counter).
        verify: check every file's sha256 (one streaming read of the checkpoint, split across ranks);
            sizes are always checked.

    Returns:
        ``(path of the loaded checkpoint, client_state)``.

    Raises:
        CheckpointNotFoundError, CheckpointCorruptError, CheckpointVersionError, CheckpointMismatchError
        (all ``ValueError``), on every rank, naming the file and the problem.
        ZeroStateError: called while parameters are gathered.
    """
    reader: CheckpointReader | None = None
    plan: _LoadPlan | None = None
    error: BaseException | None = None
    mp = ctx.model_parallel
    try:
        ctx.require_states("load_checkpoint", ("lp_params", "hp_params", "optim_states"))
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
    except Exception as exc:  # noqa: BLE001 - agreed across ranks below
        error = exc
    try:
        exchange(ctx, None, error, "load_checkpoint validation")
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    assert reader is not None and plan is not None
    with reader, torch.no_grad():
        _apply(ctx, reader, plan, lr_scheduler)
    logger.info("zero3::checkpoint loaded %s (saved by %d ranks) on rank %d of %d", reader.path,
                reader.world_size, ctx.rank, ctx.world_size)
    return str(reader.path), from_json(reader.meta.get("client_state"))


def _apply(ctx: RuntimeContext, reader: CheckpointReader, plan: _LoadPlan, lr_scheduler: Any) -> None:
    meta = reader.meta
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
            if plan.load_optimizer:
                assert ctx.optimizer is not None
                _load_state(ctx, reader, plan, pm, master, start, n)
    _, buffers = _model_entries(ctx)
    for k, b in buffers.items():
        reader.read(0, f"buffer/{k}", 0, b)
    for p in ctx.params:
        p._zero.train_tensor.grad = None
    if ctx.optimizer is not None:
        ctx.optimizer.zero_grad()
    ctx.coordinator.refresh_persistent()
    ctx.global_steps = int(meta["global_steps"])
    if meta.get("micro_steps") is not None:
        ctx.micro_steps = int(meta["micro_steps"])
    if plan.load_optimizer:
        assert ctx.optimizer is not None
        for group, saved in zip(_torch_optimizer(ctx).param_groups, meta["optimizer"]["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    group[k] = from_json(v)
    if lr_scheduler is not None:
        if meta.get("lr_scheduler") is None:
            logger.warning("zero3::checkpoint %s holds no scheduler state; the scheduler is unchanged", reader.path)
        else:
            lr_scheduler.load_state_dict(from_json(meta["lr_scheduler"]))
    scaler = ctx.optimizer.scaler if ctx.optimizer is not None else None
    if scaler is not None and hasattr(scaler, "load_state_dict") and meta.get("loss_scaler") is not None:
        scaler.load_state_dict(from_json(meta["loss_scaler"]))
    if reader.world_size == ctx.world_size:
        _set_rng_state(from_json(meta["rng"][ctx.rank]))
    else:
        logger.info("zero3::checkpoint saved by %d ranks, loaded on %d: RNG states are not restored",
                    reader.world_size, ctx.world_size)


def _load_state(ctx: RuntimeContext, reader: CheckpointReader, plan: _LoadPlan, pm: ParamMeta,
                master: torch.Tensor, start: int, n: int) -> None:
    assert ctx.optimizer is not None
    old = _torch_optimizer(ctx).state.get(master, {})
    group = next((g for g in _torch_optimizer(ctx).param_groups if any(t is master for t in g["params"])), {})
    on_device = bool(group.get("capturable") or group.get("fused"))
    new: dict[str, Any] = {}
    for key, info in pm.state.items():
        skey = f"optim/{pm.name}/{key}"
        if info["kind"] == "value":
            new[key] = from_json(info["value"])
            continue
        dtype = parse_dtype(info["dtype"])
        cur = old.get(key)
        if info["kind"] == "sharded":
            t = cur if _is_sharded_state(cur, master) else torch.zeros(master.numel(), dtype=dtype,
                                                                       device=master.device)
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
    if new:
        _torch_optimizer(ctx).state[master] = new
    else:
        _torch_optimizer(ctx).state.pop(master, None)


__all__ = [
    "FORMAT_VERSION",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReader",
    "CheckpointVersionError",
    "SafetensorsWriter",
    "load_checkpoint",
    "read_safetensors_header",
    "save_checkpoint",
]
