"""metadata.json's checksum, recorded in the rank files it describes (format.py [Note: checkpoint format]).

[Note: metadata checksum]
metadata.json records every rank file's size and sha256, so nothing in metadata.json can hold its
own checksum, and a sidecar file could be edited or deleted with it. Instead every rank file's
safetensors header carries ``zero3_metadata_sha256``: the sha256 of metadata.json's exact bytes.
The writer puts a placeholder of 64 zeros there (`UNSTAMPED`); after rank 0 writes metadata.json it
overwrites the placeholder in place (`stamp`, same length, so no offset moves) in every rank file,
before the tag is published. The sha256 a file's metadata entry records is that of the file as
written, with the placeholder: `file_sha256` hashes a file with its stamp read as the placeholder.

So an edited metadata.json (a hyperparameter, ``global_steps``, a renamed key) no longer matches
the stamp of any rank file, and a file from another save does not match the metadata; both raise
CheckpointCorruptError. A checksum is not a signature: whoever rewrites metadata.json and restamps
every rank file on purpose is not stopped. Format version 1 (zero3 before the checksum) has no
stamp; such checkpoints load with a warning, and a stamp is verified whatever version the metadata
claims, so editing the version to 1 does not skip the check.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..errors import CheckpointCorruptError

STAMP_KEY = "zero3_metadata_sha256"
UNSTAMPED = "0" * 64
_CHUNK = 8 << 20


def metadata_digest(raw: bytes) -> str:
    """The checksum of metadata.json's exact bytes."""
    return hashlib.sha256(raw).hexdigest()


def _stamp_offset(path: Path) -> int | None:
    """The byte offset of the stamp's 64 hex digits in ``path`` (None: the file has no stamp)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = fh.read(min(n, 100 << 20))
    at = header.find(f'"{STAMP_KEY}":"'.encode())
    if at < 0:
        return None
    return 8 + at + len(STAMP_KEY) + 4


def stamp(path: Path, digest: str) -> None:
    """Write ``digest`` over the placeholder in ``path``'s header, in place, and fsync."""
    offset = _stamp_offset(path)
    if offset is None:
        raise CheckpointCorruptError(f"{path}: no {STAMP_KEY} placeholder in the header to record the metadata checksum")
    with open(path, "r+b") as fh:
        fh.seek(offset)
        fh.write(digest.encode())
        fh.flush()
        os.fsync(fh.fileno())


def file_sha256(path: Path) -> str:
    """The sha256 of ``path`` with its stamp (if any) read as the placeholder: what the writer hashed."""
    offset = _stamp_offset(path)
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        if offset is not None:
            head = bytearray(fh.read(offset + len(UNSTAMPED)))
            head[offset:] = UNSTAMPED.encode()
            h.update(head)
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_stamp(path: Path, stamped: str | None, digest: str, metadata_path: Path, version: int) -> None:
    """Raise CheckpointCorruptError unless rank file ``path``'s stamp ``stamped`` is ``digest``, the
    checksum of ``metadata_path``; a file without a stamp is accepted only in a version 1 checkpoint."""
    if stamped == digest:
        return
    if stamped is None and version == 1:
        return
    if stamped is None or stamped == UNSTAMPED:
        raise CheckpointCorruptError(
            f"{metadata_path}: rank file {path.name} carries no checksum of the metadata (the save did not finish, "
            "or the file comes from another checkpoint); load an earlier checkpoint")
    raise CheckpointCorruptError(
        f"{metadata_path}: sha256 {digest[:16]}... does not match the checksum {stamped[:16]}... recorded in "
        f"{path.name}: metadata.json was edited or corrupted after the save, or the rank files come from another "
        "save. Restore the metadata.json saved with these rank files (or load an earlier checkpoint); "
        "to change a hyperparameter or the step, load the checkpoint and set it in the engine instead")


__all__ = ["STAMP_KEY", "UNSTAMPED", "check_stamp", "file_sha256", "metadata_digest", "stamp"]
