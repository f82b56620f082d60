"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` over zero3's checkpoints: the fp32 weights of a
sharded checkpoint, offline, with no model code and no process group (zero3's own form:
`zero3.checkpoint.consolidate`, ``python -m zero3.consolidate``).

``checkpoint_dir`` is the directory given to ``engine.save_checkpoint``, holding the tag folders and
``latest``, as in DeepSpeed. The values are the fp32 masters of the trained parameters; frozen
parameters (which have none) and buffers come in their own dtype, as DeepSpeed's script gives them.
``exclude_frozen_parameters`` and ``lazy_mode`` are refused when set: zero3's checkpoint does not
record which parameters were frozen (a fp32 run's frozen and trained ones look alike), and it builds
the tensors one at a time, not lazily.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from ...checkpoint.consolidate import SUFFIXES, consolidate, consolidate_to_dir, load_consolidated, parse_shard_size
from ...partition.param import ZeroParameter

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]


def _refuse(exclude_frozen_parameters: Any, lazy_mode: Any = False) -> None:
    if exclude_frozen_parameters is not False:
        raise ValueError(f"exclude_frozen_parameters={exclude_frozen_parameters!r}: a zero3 checkpoint does not record "
                         "which parameters were frozen, so it cannot leave them out; only False is allowed (drop "
                         "their keys from the returned state dict yourself)")
    if lazy_mode is not False:
        raise ValueError(f"lazy_mode={lazy_mode!r}: zero3 builds each full tensor once, from the rank files; only "
                         "False is allowed (python -m zero3.consolidate streams one tensor at a time to a file)")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, Any]:
    """The full state dict of the checkpoint ``tag`` (default: the one ``latest`` names) in memory, on
    the CPU: ``model.load_state_dict`` of the model the engine trained takes it."""
    _refuse(exclude_frozen_parameters, lazy_mode)
    return load_consolidated(checkpoint_dir, tag=tag)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[Path]:
    """Write the checkpoint's fp32 state dict. ``output_dir`` a directory (DeepSpeed's signature since
    0.14): ``pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``), or, above
    ``max_shard_size`` (bytes, or ``"5GB"``-style), numbered shards and an index json, in Hugging
    Face's layout. A path ending in ``.bin``, ``.pt``, ``.pth`` or ``.safetensors`` (the older
    ``output_file`` signature, which Lightning documents) gets one file, the suffix choosing the format.
    Returns the files written."""
    _refuse(exclude_frozen_parameters)
    if not isinstance(safe_serialization, bool):
        raise ValueError(f"safe_serialization must be True or False, got {safe_serialization!r}")
    if Path(output_dir).suffix.lower() in SUFFIXES:
        return [consolidate(checkpoint_dir, output_dir, tag=tag)]
    limit = parse_shard_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size!r}")
    return consolidate_to_dir(checkpoint_dir, output_dir, max_shard_size=limit, safetensors=safe_serialization,
                              tag=tag)


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 state dict into ``model`` (a plain model, not one zero3 partitions),
    moved to the CPU first as DeepSpeed's does, with ``strict=False``; returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_state_dict_from_zero_checkpoint: model must be an nn.Module, got {type(model).__name__}")
    if any(isinstance(p, ZeroParameter) for p in model.parameters()):
        raise ValueError("load_state_dict_from_zero_checkpoint: the model's parameters are partitioned by zero3 "
                         "(built under zero3.Init or given to zero3.initialize); load into it with "
                         "engine.load_checkpoint(checkpoint_dir) or zero3.pretrained.load_state_dict(model, state_dict)")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model
