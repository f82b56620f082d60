"""Recognising another framework's checkpoint directory (torch's distributed checkpoint, DeepSpeed's
ZeRO files), so that a load refuses it by name instead of reading it as an empty or broken zero3
checkpoint (an auto-resume script would train on from scratch), and says how its weights load.

A plain look at file names, no reads: every rank that calls it sees the same answer on a shared
directory; the callers agree on the outcome across ranks.
"""

from __future__ import annotations

import os
from pathlib import Path

from .format import LATEST_FILE, METADATA_FILE, CheckpointError

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
    deepspeed = [n for n in names if n.endswith(("_model_states.pt", "optim_states.pt")) or n.startswith("zero_pp_rank_")]
    return (_DEEPSPEED, deepspeed[:3]) if deepspeed else None


def check_not_foreign(load_dir: str | os.PathLike[str], tag: str | None) -> None:
    """Raise `CheckpointError` when ``load_dir`` (or the tag it is asked for, or the one its ``latest``
    names) holds a torch DCP or DeepSpeed checkpoint, naming the format and the conversion that loads it."""
    root = Path(load_dir)
    candidates = [root / tag] if tag is not None else [root]
    if tag is None:
        try:
            named = (root / LATEST_FILE).read_text().strip()
        except (OSError, UnicodeDecodeError):
            named = ""
        if named and os.sep not in named and named not in (".", ".."):
            candidates.append(root / named)
    for directory in candidates:
        found = _format_of(directory)
        if found is None:
            continue
        what, files = found
        if what == _DCP:
            how = ("convert it with torch.distributed.checkpoint.format_utils.dcp_to_torch_save(dir, 'full.pt') and "
                   "load the model's state dict from it with zero3.pretrained.load_state_dict(engine, "
                   "torch.load('full.pt')['model']) (the key its state dict was saved under)")
        else:
            how = ("convert it with the zero_to_fp32.py DeepSpeed saved in its checkpoint directory (DeepSpeed's, not "
                   "zero3.deepspeed.utils.zero_to_fp32, which reads zero3 checkpoints) and load the state dict it "
                   "writes with zero3.pretrained.load_state_dict(engine, path)")
        raise CheckpointError(
            f"{directory}: {what} ({', '.join(files)}), not a zero3 one: load_checkpoint and zero3.consolidate read "
            f"only what zero3's save_checkpoint writes. For its weights, {how}; for its optimizer state see "
            "docs/api.md. Nothing was loaded")


__all__ = ["check_not_foreign"]
