"""Recognising another framework's checkpoint directory (torch's distributed checkpoint, DeepSpeed's
ZeRO files), so that a load refuses it by name instead of reading it as an empty or broken zero3
checkpoint (an auto-resume script would train on from scratch), and says how its weights load.

A plain look at file names, no reads: every rank that calls it sees the same answer on a shared
directory; the callers agree on the outcome across ranks.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .format import LATEST_FILE, METADATA_FILE, CheckpointError, check_tag

_DCP = "a torch.distributed.checkpoint (DCP) checkpoint, as FSDP2 or dcp.save write it"
_DEEPSPEED = "a DeepSpeed ZeRO checkpoint"


def _format_of(directory: Path) -> tuple[str, list[str]] | None:
    """(which foreign format ``directory`` holds, the file names that say so), or None."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:  # not a directory, or unreadable: the caller's own checks say so
        return None
    if METADATA_FILE in names:  # zero3's own, whatever lies beside it
        return None
    distcp = [n for n in names if n.endswith(".distcp")]
    if ".metadata" in names and distcp:
        return _DCP, [".metadata", *distcp[:2]]
    deepspeed = [n for n in names
                 if n.endswith(("_model_states.pt", "optim_states.pt")) or n.startswith("zero_pp_rank_")]
    return (_DEEPSPEED, deepspeed[:3]) if deepspeed else None


def check_not_foreign(load_dir: str | os.PathLike[str], tag: str | None) -> None:
    """Raise `CheckpointError` when the checkpoint asked for (``tag``, else the one ``load_dir``'s
    ``latest`` names, else ``load_dir`` itself) is a torch DCP or DeepSpeed checkpoint, naming the
    format and the conversion that loads it."""
    root = Path(load_dir)
    if tag is None:
        # with a ``latest`` only the tag it names counts: a DCP save or stray files beside zero3's
        # tags are not the checkpoint asked for (review 32RC: a valid zero3 checkpoint was refused)
        try:
            tag = check_tag((root / LATEST_FILE).read_text().strip())
        except (OSError, UnicodeDecodeError, ValueError):  # none, or one naming no tag: the reader says so
            tag = None
    for directory in [root / tag] if tag is not None else [root]:
        found = _format_of(directory)
        if found is None:
            continue
        what, files = found
        if what == _DCP:
            how = ("convert it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save(dir, 'full.pt') and "
                   "load the model's state dict from it with zero3.pretrained.load_state_dict(engine, "
                   "torch.load('full.pt')[key]), key being the one its model's state dict was saved under ('model' in "
                   "torch's get_state_dict idiom; none when the model's keys were saved at the top)")
        else:
            how = ("convert it with the zero_to_fp32.py DeepSpeed saved in its checkpoint directory (DeepSpeed's, not "
                   "zero3.deepspeed.utils.zero_to_fp32, which reads zero3 checkpoints) and load the state dict it "
                   "writes with zero3.pretrained.load_state_dict(engine, path)")
        raise CheckpointError(
            f"{directory}: {what} ({', '.join(files)}), not a zero3 one: load_checkpoint and zero3.consolidate read "
            f"only what zero3's save_checkpoint writes. For its weights, {how}; for its optimizer state see "
            "docs/api.md. Nothing was loaded")


_WEIGHT_NAMES = ("model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_SHARD = re.compile(r"pytorch_model-\d+-of-\d+\.bin")


def weight_files(directory: str | os.PathLike[str]) -> list[str]:
    """The weight files directly in ``directory``, by the names weights go by (``*.safetensors``,
    ``pytorch_model.bin``, its shards and the two indexes: what ``save_pretrained``,
    ``save_16bit_model``'s default and ``zero_to_fp32`` write), sorted; ``[]`` when there are none or
    it cannot be listed. Any other ``.pt``, ``.pth`` or ``.bin`` is not taken for one: a run directory
    holds the Trainer's ``training_args.bin``, a tokenizer's or a dataset's ``.bin``, the user's
    ``optimizer.pt`` (review 38R3: those were refused at a first launch)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    return [n for n in names if (n in _WEIGHT_NAMES or n.endswith(".safetensors") or _SHARD.fullmatch(n))
            and os.path.isfile(os.path.join(directory, n))]


def weight_files_error(directory: str | os.PathLike[str], files: list[str]) -> CheckpointError:
    """The refusal of a directory that holds no zero3 checkpoint but weight files (`weight_files`):
    "no checkpoint yet" there would let an auto-resume script train from scratch (probe 38C)."""
    more = f" and {len(files) - 4} more" if len(files) > 4 else ""
    return CheckpointError(
        f"{directory}: holds no zero3 checkpoint (no {LATEST_FILE}, no saved tag) but weight files "
        f"({', '.join(files[:4])}{more}): load_checkpoint reads only what save_checkpoint writes, and does not "
        "return (None, None) for a directory of weights, which an auto-resume script would take for a first "
        "launch. A state dict file (.safetensors or its index, pytorch_model.bin) loads with "
        "zero3.pretrained.load_state_dict(engine, path); a Hugging Face directory with zero3.from_pretrained. "
        "To resume from a zero3 checkpoint, pass the directory save_checkpoint wrote. Nothing was loaded")


def foreign_below(load_dir: str | os.PathLike[str]) -> str:
    """A sentence naming the foreign checkpoints one level below ``load_dir`` (``ckpt/step-10/.metadata``,
    FSDP2's and torchtitan's layout; DeepSpeed's ``global_step3`` without ``latest``), or ``""``: said
    when a load finds no zero3 checkpoint there, so a resume that starts over says what it passed by."""
    try:
        subdirs = sorted(d for d in os.listdir(load_dir) if os.path.isdir(os.path.join(load_dir, d)))
    except OSError:
        return ""
    found = [(d, f[0]) for d in subdirs for f in [_format_of(Path(load_dir) / d)] if f is not None]
    if not found:
        return ""
    more = f" (and {len(found) - 1} more such directories)" if len(found) > 1 else ""
    return (f"; in {found[0][0]}/ it holds {found[0][1]}{more}, which zero3 does not read (docs/checkpoints.md: "
            "how to convert one)")


__all__ = ["check_not_foreign", "foreign_below", "weight_files", "weight_files_error"]
