"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` over zero3's checkpoints: the fp32 weights of a
sharded checkpoint, offline, with no model code and no process group (zero3's own form:
`zero3.checkpoint.consolidate`, ``python -m zero3.consolidate``).

    python -m zero3.deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization]
        [--max_shard_size 5GB] [-t TAG] [--exclude_frozen_parameters]

``checkpoint_dir`` is the directory given to ``engine.save_checkpoint``, holding the tag folders and
``latest``, as in DeepSpeed. The values are the fp32 masters of the trained parameters; frozen
parameters (which have none) and buffers come in their own dtype, as DeepSpeed's script gives them.
``exclude_frozen_parameters`` leaves out the parameters whose ``requires_grad`` was False at the save,
as DeepSpeed's (a checkpoint saved before zero3 recorded it is refused). ``lazy_mode`` is refused:
zero3 builds each tensor once. zero3's own keyword ``model_parallel_rank`` picks the slices of a
checkpoint saved with model parallelism.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from torch import nn

from ...checkpoint.consolidate import (SUFFIXES, consolidate, consolidate_to_dir, load_consolidated,
                                       parse_shard_size)
from ...partition.param import ZeroParameter

__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]


def _exclude_frozen(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"exclude_frozen_parameters must be True or False, got {value!r}")
    return value


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False, lazy_mode: bool = False, *,
                                             model_parallel_rank: int | None = None) -> dict[str, Any]:
    """The full state dict of the checkpoint ``tag`` (default: the one ``latest`` names) in memory, on
    the CPU: ``model.load_state_dict`` of the model the engine trained takes it."""
    if lazy_mode is not False:
        raise ValueError(f"lazy_mode={lazy_mode!r}: zero3 builds each full tensor once, from the rank files; only "
                         "False is allowed (python -m zero3.consolidate streams one tensor at a time to a file)")
    return load_consolidated(checkpoint_dir, tag=tag, model_parallel_rank=model_parallel_rank,
                             exclude_frozen=_exclude_frozen(exclude_frozen_parameters))


_NEW_ARGS = ("max_shard_size", "safe_serialization", "tag", "exclude_frozen_parameters")
_OLD_ARGS = ("tag", "exclude_frozen_parameters")
"""The arguments after the output, by position: DeepSpeed's since 0.14 (a directory), and before it (a
file): ``(checkpoint_dir, output_file, tag=None, exclude_frozen_parameters=False)``."""


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str] | None = None, *args: Any,
                                               output_file: str | os.PathLike[str] | None = None,
                                               model_parallel_rank: int | None = None, **kwargs: Any) -> list[Path]:
    """Write the checkpoint's fp32 state dict, with either of DeepSpeed's signatures:
    ``(checkpoint_dir, output_dir, max_shard_size="5GB", safe_serialization=False, tag=None,
    exclude_frozen_parameters=False)`` (since 0.14): into the directory, ``pytorch_model.bin``
    (``model.safetensors`` with ``safe_serialization``), or above ``max_shard_size`` (bytes, or
    ``"5GB"``-style) numbered files and an index json, in Hugging Face's layout (a weight file already
    there that from_pretrained would load first is refused; this format's index and numbered files are
    replaced, all at the end); ``(checkpoint_dir, output_file, tag=None, exclude_frozen_parameters=False)``
    (before): one file, its suffix (``.bin``, ``.pt``, ``.pth``, ``.safetensors``) choosing the format,
    taken for a path with one of those suffixes or ``output_file=``. The arguments after the output
    are read by position as the signature the output picks (review 28Z4: DeepSpeed 0.13's fourth
    argument is ``exclude_frozen_parameters``). Returns the files written."""
    if (output_dir is None) == (output_file is None):
        raise TypeError("convert_zero_checkpoint_to_fp32_state_dict: give output_dir (a directory) or output_file "
                        "(a .bin/.pt/.pth/.safetensors path), one of them")
    target = Path(output_file if output_file is not None else output_dir)  # type: ignore[arg-type]
    one_file = output_file is not None or target.suffix.lower() in SUFFIXES
    order = _OLD_ARGS if one_file else _NEW_ARGS
    if len(args) > len(order):
        raise TypeError(f"convert_zero_checkpoint_to_fp32_state_dict: after the output {'file' if one_file else 'directory'} "
                        f"it takes {', '.join(order)} by position, got {len(args)} arguments")
    given = dict(zip(order, args))
    for key, value in kwargs.items():
        if key not in _NEW_ARGS:
            raise TypeError(f"convert_zero_checkpoint_to_fp32_state_dict got an unexpected keyword argument {key!r}")
        if key in given:
            raise TypeError(f"convert_zero_checkpoint_to_fp32_state_dict got multiple values for argument {key!r}")
        given[key] = value
    tag, safe = given.get("tag"), given.get("safe_serialization", False)
    if not isinstance(safe, bool):
        raise ValueError(f"safe_serialization must be True or False, got {safe!r}")
    exclude = _exclude_frozen(given.get("exclude_frozen_parameters", False))
    if one_file:
        if target.suffix.lower() not in SUFFIXES:
            raise ValueError(f"output_file {str(target)!r}: end it in .bin, .pt, .pth or .safetensors")
        size = given.get("max_shard_size")
        if size is not None and size != "5GB" and not (isinstance(size, (int, str)) and not isinstance(size, bool)
                                                       and parse_shard_size(size) == 5 * 10**9):
            raise ValueError(f"max_shard_size={given['max_shard_size']!r} with the output file {str(target)!r}: a file "
                             "is written whole; give a directory to shard")
        if safe and target.suffix.lower() != ".safetensors":
            raise ValueError(f"safe_serialization=True with the output file {str(target)!r}: the suffix picks the "
                             "format; end it in .safetensors")
        return [consolidate(checkpoint_dir, target, tag=tag, model_parallel_rank=model_parallel_rank,
                            exclude_frozen=exclude)]
    size = given.get("max_shard_size", "5GB")
    try:
        limit = parse_shard_size("5GB" if size is None else size)
    except ValueError as exc:
        raise ValueError(f"{exc} (after the output directory {str(target)!r}, the third argument is max_shard_size; "
                         "for one file, DeepSpeed's older (checkpoint_dir, output_file, tag), end the path in .bin, "
                         ".pt, .pth or .safetensors)") from None
    if limit <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return consolidate_to_dir(checkpoint_dir, target, max_shard_size=limit, safetensors=safe, tag=tag,
                              model_parallel_rank=model_parallel_rank, exclude_frozen=exclude)


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None, *, model_parallel_rank: int | None = None) -> nn.Module:
    """Load the checkpoint's fp32 state dict into ``model`` (a plain model, not one zero3 partitions),
    moved to the CPU first as DeepSpeed's does, with ``strict=False``; returns ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_state_dict_from_zero_checkpoint: model must be an nn.Module, got {type(model).__name__}")
    if any(isinstance(p, ZeroParameter) for p in model.parameters()):
        raise ValueError("load_state_dict_from_zero_checkpoint: the model's parameters are partitioned by zero3 "
                         "(built under zero3.Init or given to zero3.initialize); load into it with "
                         "engine.load_checkpoint(checkpoint_dir) or zero3.pretrained.load_state_dict(model, state_dict)")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, model_parallel_rank=model_parallel_rank)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def main(argv: list[str] | None = None) -> int:
    """DeepSpeed's script's command line: ``CHECKPOINT_DIR OUTPUT_DIR`` and its flags."""
    parser = argparse.ArgumentParser(prog="python -m zero3.deepspeed.utils.zero_to_fp32",
                                     description="Write the fp32 state dict of a zero3 checkpoint, as DeepSpeed's "
                                                 "zero_to_fp32.py does for its own.")
    parser.add_argument("checkpoint_dir", help="the directory given to engine.save_checkpoint (holding 'latest')")
    parser.add_argument("output_dir", help="a directory (Hugging Face's layout), or a .bin/.pt/.safetensors file")
    parser.add_argument("--max_shard_size", default="5GB", help="the largest file, e.g. 5GB (a directory only)")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors (a directory only)")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out the parameters whose requires_grad was False")
    parser.add_argument("--model_parallel_rank", type=int, default=None,
                        help="a checkpoint saved with model parallelism: write this model-parallel rank's slices")
    args = parser.parse_args(argv)
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters, model_parallel_rank=args.model_parallel_rank)
    except (ValueError, OSError) as exc:  # zero3's checkpoint errors are ValueErrors
        sys.stderr.write(f"python -m zero3.deepspeed.utils.zero_to_fp32: error: {exc}\n")
        return 1
    for path in written:
        sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
