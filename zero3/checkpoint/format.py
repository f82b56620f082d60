"""The sharded checkpoint format: file names, the metadata's version, the encoding of small state in
it, and the errors a reader raises. Saving (save.py), reading at any world size (reader.py) and
loading into an engine (load.py) all follow it; it imports nothing of the runtime.

[Note: checkpoint format]
A checkpoint is a directory ``SAVE_DIR/TAG/``, and ``SAVE_DIR/latest`` names the newest tag:

    metadata.json                           format version, world size, step, config, optimizer
                                            groups, scheduler, RNG, client state, and for every
                                            parameter the flat range [start, end) each file holds
    rank_00000-of-00002.safetensors         what rank 0 owns
    rank_00001-of-00002.safetensors         what rank 1 owns

Every rank file's header records the sha256 of metadata.json (integrity.py [Note: metadata checksum]).
The rank files are plain safetensors files (``safetensors.safe_open`` reads them). zero3 writes and
reads them itself (safetensors.py), so the package is not required. For a parameter ``name``, rank r's file holds
only the *real* (unpadded) flat range that r owns (`sharding.shard_range`):
- ``param/name``: that range of the tensor the optimizer steps on (``ZeroParam.train_tensor``: the
  fp32 master where masters are separate, else the shard; a frozen parameter's shard);
- ``optim/name/key``: the same range of every per-element optimizer state (Adam's moments);
- ``optim/name/key`` whole, in every file, for state that is not per-element (Adam's 0-d ``step``);
- ``buffer/name``: module buffers, in rank 0's file only.
Empty ranges are not stored. A reader at any world size computes, from the ranges in the metadata,
which element ranges of which files make up its new shard, and reads only those bytes.

With model parallelism (an engine given an ``mpu`` whose model-parallel group has m > 1 ranks, see
comm/model_parallel.py) each model-parallel rank's data-parallel group writes the layout above into a
sub-directory of its own, and the tag directory says how many there are:

    model_parallel.json                     {"format", "model_parallel_world_size": m}
    mp_rank_00/metadata.json, rank_*.safetensors
    mp_rank_01/...

Each sub-directory is a complete checkpoint of that rank's tensor-parallel slices, loadable at any
data-parallel size; the model-parallel size must stay the same (zero3 cannot re-split a slice).
"""

from __future__ import annotations

import argparse
import base64
import io
import dataclasses
import os
from typing import Any

import numpy as np
import torch

from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from ..partition.views import byte_view
from .safetensors import dtype_name, parse_dtype

FORMAT_NAME = "zero3-checkpoint"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Version 2: every rank file records metadata.json's sha256 (integrity.py [Note: metadata checksum]);
version 1 (without it) is still read, with a warning."""
METADATA_FILE = "metadata.json"
MODEL_PARALLEL_FILE = "model_parallel.json"
LATEST_FILE = "latest"


def model_parallel_dir(rank: int) -> str:
    """The sub-directory of a tag that holds model-parallel rank ``rank``'s files."""
    return f"mp_rank_{rank:02d}"


def rank_file_name(rank: int, world_size: int) -> str:
    """The file rank ``rank`` of ``world_size`` writes."""
    return f"rank_{rank:05d}-of-{world_size:05d}.safetensors"


def check_tag(tag: str | int) -> str:
    """``tag``, if it is a plain directory name a checkpoint may have (an int is taken as its
    digits, as DeepSpeed takes ``str(tag)``); else ValueError."""
    if isinstance(tag, int) and not isinstance(tag, bool):
        tag = str(tag)
    if not isinstance(tag, str) or not tag or tag in (".", "..") or tag.startswith(".") or "/" in tag \
            or os.sep in tag or tag == LATEST_FILE:
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name, not starting with '.' "
                         f"and not {LATEST_FILE!r}")
    return tag


@dataclasses.dataclass(frozen=True)
class ParamMeta:
    """One parameter's entry of the metadata, parsed: which flat range [start, end) each rank file
    holds (``ranges``) and how each optimizer state key is stored (``state``: its ``kind``, dtype, ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    master_dtype: torch.dtype
    numel: int
    aliases: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]  # per file
    state: dict[str, dict[str, Any]]
    requires_grad: bool | None = None  # None: saved before zero3 recorded it (2026-12-06)


# -- JSON for small state (hyperparameters, scheduler, client state, RNG) --------------------------
_MARKERS = ("__tensor__", "__tuple__", "__items__", "__dtype__", "__bytes__", "__bytesio__", "__ndarray__",
            "__npscalar__", "__namespace__")


def to_json(obj: Any, where: str = "value") -> Any:
    """Encode tensors, tuples, dtypes, bytes, ``io.BytesIO`` (older Transformer Engine's extra state),
    numeric numpy arrays and scalars, ``argparse.Namespace`` (what Megatron-DeepSpeed puts in
    ``client_state``) and non-string-keyed dicts so `from_json` restores them."""
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in "biufc":  # Megatron's np_rng_state, counters
        a = np.ascontiguousarray(obj).reshape(np.shape(obj))  # a 0-d array stays 0-d
        data = {"dtype": a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}
        return {"__ndarray__" if isinstance(obj, np.ndarray) else "__npscalar__": data}  # np.float64 is a float too
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, io.BytesIO):
        return {"__bytesio__": base64.b64encode(obj.getvalue()).decode()}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        return {"__tensor__": {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                               "data": base64.b64encode(bytes(byte_view(t.reshape(-1)))).decode()}}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": dtype_name(obj)}
    if isinstance(obj, argparse.Namespace):  # Megatron-DeepSpeed saves its args in client_state
        return {"__namespace__": to_json(vars(obj), f"{where}.args")}
    if isinstance(obj, tuple):
        return {"__tuple__": [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in _MARKERS for k in obj):
            return {k: to_json(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {"__items__": [[to_json(k, where), to_json(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(f"{where}: cannot store a {type(obj).__name__} in a checkpoint; use tensors, numbers, "
                    "strings, bytes, io.BytesIO, numeric numpy arrays, argparse.Namespace, None, lists, tuples and dicts")


def from_json(obj: Any) -> Any:
    """The value `to_json` encoded."""
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
        if key == "__bytes__":
            return base64.b64decode(value)
        if key == "__bytesio__":
            return io.BytesIO(base64.b64decode(value))  # at position 0, as a fresh buffer
        if key in ("__ndarray__", "__npscalar__"):
            a = np.frombuffer(base64.b64decode(value["data"]), dtype=np.dtype(value["dtype"])).reshape(value["shape"])
            return a.copy() if key == "__ndarray__" else a[()]
        if key == "__namespace__":
            return argparse.Namespace(**from_json(value))
    return {k: from_json(v) for k, v in obj.items()}


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "LATEST_FILE",
    "METADATA_FILE",
    "MODEL_PARALLEL_FILE",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointVersionError",
    "ParamMeta",
    "check_tag",
    "from_json",
    "model_parallel_dir",
    "rank_file_name",
    "to_json",
]
